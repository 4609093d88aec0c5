"""A recording hop: an HTTP relay that keeps every exchange byte for byte (request body,
response body as the bytes arrived), for the fidelity checks of `tests/proxy/test_turnstone_vllm.py`.
Put one between the agent and the proxy and one between the proxy and the server: what the two
hops saw of the same exchange differs only by what the proxy documents it injects and strips."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from tensorverse.proxy.upstream import UPSTREAM_KEEPALIVE_S
from tensorverse.testing.serve import serve

HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class Exchange:
    method: str
    path: str
    request_headers: dict[str, str]
    request: bytes
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response: bytes = b""
    client_left: bool = False  # the client closed before the hop's end of the body


class RecordingHop:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        ex = Exchange(request.method, request.path_qs, dict(request.headers), body)
        self.exchanges.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        assert self._session is not None
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers=headers, allow_redirects=False) as up:
            ex.status = up.status
            ex.response_headers = dict(up.headers)
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP | {"content-encoding"}})
            await resp.prepare(request)
            chunks = []
            try:
                async for chunk in up.content.iter_any():
                    chunks.append(chunk)
                    await resp.write(chunk)
                await resp.write_eof()
            except ConnectionError:  # the client went away once it had what it wanted ([DONE])
                ex.client_left = True
            finally:
                ex.response = b"".join(chunks)
            return resp

    async def start(self) -> "RecordingHop":
        # idle connections closed before vLLM closes them (see UPSTREAM_KEEPALIVE_S): aiohttp's own
        # 15 s let the hop write a request into a connection vLLM was closing (a CI run's 500)
        connector = aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              skip_auto_headers=("Accept-Encoding", "User-Agent"),
                                              timeout=aiohttp.ClientTimeout(total=None, sock_read=900))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner, self.port = await serve(app, access_log=None)
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
