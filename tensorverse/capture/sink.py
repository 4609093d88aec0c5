"""Where captured rows go: the recorder's ingest endpoint (HTTP) or a local store directory.

Sinks are used by one thread only (the tap's encoder thread): ``put`` buffers a frame,
``flush`` ships the buffer. A failed flush drops the buffered rows and raises
:class:`SinkError` carrying how many were dropped; the tap counts them and carries on. Nothing
is retried beyond one immediate reconnect on a stale keep-alive connection; after a failure the
sink backs off (0.5 s doubling to 10 s, rows arriving meanwhile are dropped) and then tries the
connection again, so a recorder that goes away and comes back is picked up without a restart.

Configured by environment variables on the vLLM server (never by a request):

``TENSORVERSE_CAPTURE_SINK``
    ``http://HOST:PORT/PATH`` (or ``https://``): POST batches of frames
    (:mod:`tensorverse.capture.frames`, ``Content-Type: application/vnd.tensorverse.frames``).
    ``dir:/path/to/store``: write rows straight into a local Tensorverse store (LMDB).
    Each HTTP batch also carries the capturing process's counters as JSON in the
    ``X-Tensorverse-Capture-Stats`` header (``origin``, ``rows_captured``, ``rows_dropped``,
    ``dropped_no_buffer``, ``dropped_sink``, ``sink_errors``, ``errors``, ...).
``TENSORVERSE_CAPTURE_TOKEN``
    Bearer token for the HTTP sink (``Authorization: Bearer <token>``). Never logged.
``TENSORVERSE_CAPTURE_TIMEOUT``
    Seconds for the HTTP connect/read timeout (default 5).
``TENSORVERSE_CAPTURE_LINGER_MS``
    While rows keep arriving, the longest a batch waits for more before it ships (default 200;
    a batch also ships at 1,024 rows or 8 MiB, and the tap ships what it holds once no row has
    arrived for 50 ms). Every batch costs the recorder a request and a durable commit whatever
    its size: on the production-load benchmark a batch cost the proxy about 1.2 CPU-ms, and
    200 ms batches gave about a quarter more shadowed tokens per proxy core than 50 ms ones
    (``benchmarks/RESULTS.md``). The price is that, under load, rows reach the store up to
    this much later (shadow analysis waits for them; the agent never does).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import time
import urllib.parse
from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Mapping

from tensorverse.capture.frames import CONTENT_TYPE, Frame, encode_frame

if TYPE_CHECKING:
    from tensorverse.store import Store

__all__ = ["Sink", "SinkError", "HttpSink", "StoreSink", "MemorySink", "sink_from_env",
           "ENV_SINK", "ENV_TOKEN", "ENV_TIMEOUT", "ENV_LINGER", "DEFAULT_LINGER_MS", "STATS_HEADER"]

log = logging.getLogger("tensorverse.capture")

ENV_SINK = "TENSORVERSE_CAPTURE_SINK"
ENV_TOKEN = "TENSORVERSE_CAPTURE_TOKEN"
ENV_TIMEOUT = "TENSORVERSE_CAPTURE_TIMEOUT"
ENV_LINGER = "TENSORVERSE_CAPTURE_LINGER_MS"
DEFAULT_LINGER_MS = 200
#: JSON counters of the capturing process (origin, rows_captured, rows_dropped, ...) sent with
#: every HTTP batch, so the recorder can export drops it would otherwise never see.
STATS_HEADER = "X-Tensorverse-Capture-Stats"


class SinkError(RuntimeError):
    """A flush failed; ``dropped`` rows were lost."""

    def __init__(self, message: str, dropped: int = 0) -> None:
        super().__init__(message)
        self.dropped = dropped


class Sink:
    """Base class: buffering, batch thresholds and back-off after failures."""

    name = "sink"
    #: set by the tap: counters the HTTP sink reports to the recorder with every batch
    stats_provider: Callable[[], dict] | None = None

    def __init__(self, *, max_batch_bytes: int = 8 << 20, max_batch_frames: int = 1024,
                 linger_s: float = DEFAULT_LINGER_MS / 1000, retry_min_s: float = 0.5, retry_max_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_batch_bytes = max_batch_bytes
        self.max_batch_frames = max_batch_frames
        self.linger_s = linger_s
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self._clock = clock
        self._buf: list[Frame] = []
        self._buf_bytes = 0
        self._first_at = 0.0
        self._failures = 0
        self._retry_at = 0.0

    # -- buffering -------------------------------------------------------------------------
    def put(self, frame: Frame) -> None:
        if not self._buf:
            self._first_at = self._clock()
        self._buf.append(frame)
        self._buf_bytes += len(frame.blob)

    def pending(self) -> int:
        return len(self._buf)

    def pending_bytes(self) -> int:
        return self._buf_bytes

    def should_flush(self) -> bool:
        return bool(self._buf) and (
            len(self._buf) >= self.max_batch_frames
            or self._buf_bytes >= self.max_batch_bytes
            or self._clock() - self._first_at >= self.linger_s
        )

    def flush(self) -> int:
        """Ship the buffer; return the number of rows shipped or raise :class:`SinkError`."""
        if not self._buf:
            return 0
        frames, self._buf, self._buf_bytes = self._buf, [], 0
        now = self._clock()
        if now < self._retry_at:
            raise SinkError(f"{self.name} unavailable; next try in {self._retry_at - now:.1f} s",
                            dropped=len(frames))
        try:
            self._ship(frames)
        except Exception as e:
            self._failures += 1
            delay = min(self.retry_max_s, self.retry_min_s * 2 ** (self._failures - 1))
            self._retry_at = now + delay
            self._reset()
            msg = e.args[0] if isinstance(e, SinkError) and e.args else f"{type(e).__name__}: {e}"
            raise SinkError(f"{self.name}: {msg}", dropped=len(frames)) from e
        self._failures = 0
        self._retry_at = 0.0
        return len(frames)

    # -- subclass hooks --------------------------------------------------------------------
    def _ship(self, frames: list[Frame]) -> None:
        raise NotImplementedError

    def _reset(self) -> None:
        """Forget connections after a failure (the next flush reconnects)."""

    def close(self) -> None:
        self._reset()


class MemorySink(Sink):
    """Keeps frames in a list (tests, in-process use)."""

    name = "memory"

    def __init__(self, fail: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.frames: list[Frame] = []
        self.fail = fail
        self.batches = 0

    def _ship(self, frames: list[Frame]) -> None:
        if self.fail:
            raise ConnectionError("memory sink set to fail")
        self.frames.extend(frames)
        self.batches += 1


class HttpSink(Sink):
    """POSTs batches of frames to the recorder's ingest URL over one keep-alive connection."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 5.0, **kw) -> None:
        super().__init__(**kw)
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"capture sink URL must be http(s)://host[:port]/path, got {url!r}")
        self.url = url
        self.name = f"http sink {u.scheme}://{u.hostname}:{u.port or ''}{u.path}"
        self._scheme = u.scheme
        self._host = u.hostname
        self._port = u.port
        self._path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        self._token = token
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout)

    def _ship(self, frames: list[Frame]) -> None:
        body = b"".join(encode_frame(f.capture_id, f.position, f.blob, seq=f.seq, origin=f.origin,
                                     engine=f.engine, compact=f.compact) for f in frames)
        headers = {
            "Content-Type": CONTENT_TYPE,
            "Content-Length": str(len(body)),
            "X-Tensorverse-Frames": str(len(frames)),
        }
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if self.stats_provider is not None:
            try:
                headers[STATS_HEADER] = json.dumps(self.stats_provider(), separators=(",", ":"))
            except Exception:  # noqa: BLE001 - stats are a courtesy
                pass
        for attempt in (0, 1):
            reused = self._conn is not None
            conn = self._conn or self._connect()
            self._conn = conn
            try:
                conn.request("POST", self._path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                    http.client.CannotSendRequest, http.client.BadStatusLine):
                self._reset()
                if reused and attempt == 0:
                    continue  # the server closed an idle keep-alive connection: reconnect once
                raise
            except (OSError, http.client.HTTPException):
                self._reset()
                raise
            if resp.will_close:
                self._reset()
            if not 200 <= resp.status < 300:
                snippet = data[:200].decode("utf-8", "replace")
                raise SinkError(f"HTTP {resp.status} {resp.reason}: {snippet}")
            return

    def _reset(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001
                pass
            self._conn = None


class StoreSink(Sink):
    """Writes rows into a local Tensorverse store: one ``write_rows`` transaction per capture id
    per flush, waited for (so a slow disk slows the encoder thread, not vLLM)."""

    def __init__(self, path: "str | os.PathLike | Store", *, timeout: float = 30.0, **kw) -> None:
        kw.setdefault("linger_s", 0.2)
        super().__init__(**kw)
        from tensorverse.store import Store

        # an open store is borrowed (an in-process engine writing into its caller's store): never closed here
        self._borrowed: Store | None = path if isinstance(path, Store) else None
        self.path = os.fspath(path.path if isinstance(path, Store) else path)
        self.name = f"store sink dir:{self.path}"
        self.timeout = timeout
        self._store: Store | None = self._borrowed

    def _ship(self, frames: list[Frame]) -> None:
        if self._store is None:
            from tensorverse.store import Store

            self._store = Store.open(self.path)
        by_run: dict[str, list[tuple]] = defaultdict(list)
        for f in frames:
            by_run[f.capture_id].append((f.position, f.blob, f.engine, f.compact))
        futures = [self._store.write_rows(run_id, rows) for run_id, rows in by_run.items()]
        for fut in futures:
            fut.result(timeout=self.timeout)

    def _reset(self) -> None:
        store, self._store = self._store, self._borrowed
        if store is not None and store is not self._borrowed:
            try:
                store.close()
            except Exception:  # noqa: BLE001
                pass


def _linger_s(value: str | None) -> float:
    """``TENSORVERSE_CAPTURE_LINGER_MS`` in seconds (unset or empty: the default)."""
    if value is None or not value.strip():
        return DEFAULT_LINGER_MS / 1000
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"{ENV_LINGER}={value!r}: expected milliseconds, e.g. 200") from None
    if not (math.isfinite(ms) and ms >= 0):
        raise ValueError(f"{ENV_LINGER}={value!r}: expected a finite number of milliseconds >= 0")
    return ms / 1000


def sink_from_env(env: Mapping[str, str] | None = None) -> Sink | None:
    """The sink named by ``TENSORVERSE_CAPTURE_SINK``, or None when it is unset."""
    env = os.environ if env is None else env
    spec = (env.get(ENV_SINK) or "").strip()
    if not spec:
        return None
    linger_s = _linger_s(env.get(ENV_LINGER))
    if spec.startswith(("http://", "https://")):
        timeout = float(env.get(ENV_TIMEOUT) or 5.0)
        return HttpSink(spec, env.get(ENV_TOKEN) or None, timeout=timeout, linger_s=linger_s)
    if spec.startswith("dir:"):
        path = spec[4:]
        if not path:
            raise ValueError(f"{ENV_SINK}=dir: needs a path")
        return StoreSink(os.path.expanduser(path), linger_s=linger_s)
    raise ValueError(f"{ENV_SINK}={spec!r}: expected http(s)://host:port/path or dir:/path/to/store")

