"""A small async JSON client for one backend (aiohttp), with typed failures.

Every failure becomes a :class:`BackendError` whose ``kind`` says what happened:
``timeout`` (the backend's ``timeout_s`` elapsed), ``connect`` (refused, DNS, reset), ``http``
(a non-2xx answer; ``status`` and the server's message are kept), ``protocol`` (an answer that is
not the JSON expected). Callers turn those into run records; nothing here retries.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from tensorverse.shadow.backend import Backend

__all__ = ["BackendError", "BackendClient", "error_message"]

_MAX_ERROR_CHARS = 2000


class BackendError(Exception):
    """A request to a backend failed; ``kind`` is timeout, connect, http or protocol."""

    def __init__(self, kind: str, message: str, *, status: int | None = None, path: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.path = path
        self.message = message

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "status": self.status, "path": self.path, "message": self.message}

    def __str__(self) -> str:
        where = f" {self.path}" if self.path else ""
        code = f" HTTP {self.status}" if self.status else ""
        return f"{self.kind}{code}{where}: {self.message}"


def error_message(body: bytes) -> str:
    """The human part of an error body (OpenAI ``{"error": {"message"}}``, FastAPI ``detail``)."""
    text = body[:_MAX_ERROR_CHARS].decode("utf-8", "replace").strip()
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return text or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:_MAX_ERROR_CHARS]
        if isinstance(err, str):
            return err[:_MAX_ERROR_CHARS]
        if data.get("message"):
            return str(data["message"])[:_MAX_ERROR_CHARS]
        if data.get("detail"):
            return str(data["detail"])[:_MAX_ERROR_CHARS]
    return text


class BackendClient:
    """JSON over HTTP to one backend. Pass a shared ``aiohttp.ClientSession`` or let it own one."""

    def __init__(self, backend: Backend, session: aiohttp.ClientSession | None = None) -> None:
        self.backend = backend
        self._session = session
        self._own = session is None

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(json_serialize=lambda o: orjson.dumps(o).decode())
            self._own = True
        return self._session

    async def close(self) -> None:
        if self._own and self._session is not None and not self._session.closed:
            await self._session.close()

    async def __aenter__(self) -> "BackendClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _url(self, path: str, root: bool) -> str:
        return (self.backend.base_url if root else self.backend.api_url) + path

    async def request(self, method: str, path: str, body: Any = None, *, root: bool = False,
                      timeout_s: float | None = None) -> Any:
        """Send one request; return the decoded JSON (or the text for non-JSON 2xx answers)."""
        session = await self._get_session()
        url = self._url(path, root)
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.backend.timeout_s)
        data = None if body is None else orjson.dumps(body)
        try:
            async with session.request(method, url, data=data, headers=self.backend.http_headers(),
                                       timeout=timeout) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise BackendError("http", error_message(raw), status=resp.status, path=path)
                ctype = resp.headers.get("Content-Type", "")
                if "json" not in ctype:
                    return raw.decode("utf-8", "replace")
                try:
                    return orjson.loads(raw)
                except orjson.JSONDecodeError as e:
                    raise BackendError("protocol", f"invalid JSON from the backend: {e}",
                                       status=resp.status, path=path) from None
        except BackendError:
            raise
        except asyncio.TimeoutError:
            raise BackendError("timeout", f"no answer within {timeout.total:g} s", path=path) from None
        except aiohttp.ClientResponseError as e:
            raise BackendError("http", e.message, status=e.status, path=path) from None
        except (aiohttp.ClientError, OSError) as e:
            raise BackendError("connect", f"{type(e).__name__}: {e}", path=path) from None

    async def get(self, path: str, *, root: bool = False, timeout_s: float | None = None) -> Any:
        return await self.request("GET", path, root=root, timeout_s=timeout_s)

    async def post(self, path: str, body: Any, *, root: bool = False,
                   timeout_s: float | None = None) -> Any:
        return await self.request("POST", path, body, root=root, timeout_s=timeout_s)

    async def completions(self, body: dict, *, timeout_s: float | None = None) -> dict:
        out = await self.post("/completions", body, timeout_s=timeout_s)
        if not isinstance(out, dict) or not isinstance(out.get("choices"), list) or not out["choices"]:
            raise BackendError("protocol", "completion answer without choices", path="/completions")
        return out
