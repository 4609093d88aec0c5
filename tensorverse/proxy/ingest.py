"""Capture ingest: the frames a capture sink POSTs to the admin listener's ``/ingest``, stored.

`Ingest.handle` answers the POST (`tensorverse.proxy.admin` routes it): the bearer token, the
size cap and the capturing process's counters (its stats header) are checked on the proxy's
loop, which reads the body. What is done with the frames is `store_frames`, one function:

* every frame is parsed and checked (its crc32, its capture id, a compact row's layout) before
  any is written, so a body is stored whole or refused whole (400);
* a frame already stored (same origin and seq: a retried batch) is skipped
  (`tensorverse.proxy.dedupe`);
* the rows are written one transaction per capture id, and the answer is sent once they are
  committed (507 when the store is full, 500 when it fails: the sink keeps the batch and retries).

``[admin] ingest_process = true`` (the default) runs it in a worker process (`IngestWorker`):
the worker opens the store by its path as a second writer (LMDB serialises writers across
processes; either grows the map and the other adopts it) and keeps the dedupe window. The proxy's
process only reads the body and copies it into a shared memory segment; the worker parses, checks and writes, then
says what it committed, and the proxy announces those rows to its shadow runner
(`tensorverse.store.arrivals`) and counts them. So neither the frames' crc32s nor the copies of
rows into LMDB hold the GIL that relays the agents' streams. A worker that dies (killed, out of
memory) or hangs (no answer in ``timeout_s``, then killed) loses nothing: the body it held is
stored in a thread of the proxy instead (``in_process``; rows it had committed are written again
over the same keys) and the next body starts a new worker (``worker_restarts``). ``false``: in a thread of the proxy, over the proxy's
own store and writer thread.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import mmap
import os
import pickle
import socket
import struct
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from tensorverse.capture.frames import FrameError, parse_frames
from tensorverse.forkserver import worker_context
from tensorverse.proxy.dedupe import SeenFrames
from tensorverse.store import StoreFullError
from tensorverse.store.compact import check_compact
from tensorverse.store.schema import check_id

__all__ = ["Ingest", "IngestWorker", "Stored", "store_frames"]

log = logging.getLogger("tensorverse.proxy.ingest")


@dataclass(frozen=True)
class Stored:
    """What one body's frames did. ``status``: 200 stored, 400 refused (a bad frame: nothing
    written), 507 the store is full, 500 it failed (with 507 and 500, ``rows`` were dropped).
    ``runs``: the rows committed, ``(capture id, full positions, compact positions)``."""

    status: int
    error: str = ""
    reason: str = ""  # with 400: the refused frame's `tensorverse.capture.frames.REASONS` entry
    rows: int = 0
    rows_compact: int = 0
    duplicates: int = 0
    runs: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()


def _checked(body: bytes) -> list:
    frames = parse_frames(body)
    for i, f in enumerate(frames):  # ids the store would refuse are the sender's error
        try:
            check_id(f.capture_id, "capture")
        except ValueError as e:
            raise FrameError(f"frame {i}: {e}", "capture_id") from None
        if f.compact:  # 180 bytes: checked here, so the store holds no garbage
            try:
                check_compact(f.blob, record=f"{f.capture_id}@{f.position}")
            except ValueError as e:
                raise FrameError(f"frame {i}: {e}", "compact") from None
    return frames


def store_frames(store: Any, seen: SeenFrames, body: bytes) -> Stored:
    """Check every frame of ``body``, skip those ``seen`` already, write the rest one transaction
    per capture id and wait for the commits (blocking: a worker process or a thread)."""
    try:
        frames = _checked(body)
    except FrameError as e:
        return Stored(400, str(e), reason=e.reason)
    by_run: dict[str, list[tuple]] = defaultdict(list)
    dup = 0
    fresh: list[tuple[int, int]] = []  # (origin, seq) of the frames to store
    for f in frames:
        if f.seq:
            key = (f.origin, f.seq)
            if key in seen:
                dup += 1
                continue
            fresh.append(key)
        by_run[f.capture_id].append((f.position, f.blob, f.engine, f.compact))
    rows = sum(len(r) for r in by_run.values())
    try:
        futures = [store.write_rows(run_id, r) for run_id, r in by_run.items()]
        for fut in futures:
            fut.result()
    except StoreFullError as e:
        return Stored(507, f"store full: {e}", rows=rows)
    except Exception as e:  # noqa: BLE001
        log.warning("ingest: cannot store rows: %s", e)
        return Stored(500, f"cannot store rows: {type(e).__name__}", rows=rows)
    for origin, seq in fresh:  # remember only what was committed
        seen.add(origin, seq)
    runs = tuple((run_id, tuple(p for p, _, _, c in r if not c), tuple(p for p, _, _, c in r if c))
                 for run_id, r in by_run.items())
    return Stored(200, rows=rows, rows_compact=sum(len(c) for _, _, c in runs), duplicates=dup, runs=runs)


# -- the worker process -----------------------------------------------------------------------


_HEADER = struct.Struct("!Q")  # a message: the length of the body in the shared segment, or of a reply
_MIN_SEGMENT = 1 << 20
_KEEP_SEGMENT = 16 << 20  # a segment grown past this for one big body is let go after it


def _recv_exact(sock: socket.socket, n: int, head: bytes = b"") -> bytes | None:
    buf = bytearray(head)
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def serve_worker(sock: socket.socket, path: str, max_size: int | None, durable: bool, dedupe_window: int) -> None:
    """The ingest worker's loop until the proxy closes its end of the socket: a body's length in
    (with the shared segment's descriptor when the segment is new), its `Stored` out, pickled."""
    from tensorverse.store import Store

    store = Store.open(path, max_size=max_size, durable=durable)
    seen = SeenFrames(dedupe_window)
    segment: mmap.mmap | None = None
    try:
        while True:
            msg, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 1)
            if fds:
                if segment is not None:
                    segment.close()
                segment = mmap.mmap(fds[0], 0)
                os.close(fds[0])
            head = _recv_exact(sock, _HEADER.size, msg) if msg else None
            if head is None or segment is None:
                return
            out = pickle.dumps(store_frames(store, seen, segment[:_HEADER.unpack(head)[0]]))
            sock.sendall(_HEADER.pack(len(out)) + out)
    finally:
        store.close()  # its writer commits what is queued (nothing: every body waited for its commits)


class IngestWorker:
    """One ingest process over the store at ``path``, started at the first body. Bodies go to it
    one at a time through a shared memory segment: the proxy's loop copies the body in (a
    memcpy), sends its length over a socket pair and awaits the pickled `Stored` (no thread hop;
    a pipe or socket had cost two copies through the kernel, about 0.1 ms each per 150 KB)."""

    def __init__(self, path: str, *, max_size: int | None = None, durable: bool = True,
                 dedupe_window: int = 1 << 16, timeout_s: float = 60.0) -> None:
        self.args = (str(path), max_size, durable, dedupe_window)
        self.timeout_s = timeout_s  # for one body's answer (milliseconds when well): past it, hung
        self._lock: asyncio.Lock | None = None  # one body in the worker (and the segment) at a time
        self._proc: Any = None
        self._sock: socket.socket | None = None
        self._segment: mmap.mmap | None = None
        self._segment_fd = -1
        self._segment_sent = False  # the worker has the segment's descriptor
        self._closed = False
        self.restarts = 0

    def _start(self) -> socket.socket:
        ctx = worker_context()
        ours, theirs = socket.socketpair()
        try:
            proc = ctx.Process(target=serve_worker, args=(theirs, *self.args), name="tensorverse-ingest",
                               daemon=True)
            proc.start()
        finally:
            theirs.close()
        ours.setblocking(False)
        self._proc, self._sock, self._segment_sent = proc, ours, False
        return ours

    def _stop(self, timeout: float) -> None:
        proc, sock, self._proc, self._sock = self._proc, self._sock, None, None
        if sock is not None:
            sock.close()  # the worker's recv ends: it closes its store and exits
        if proc is not None:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def _drop_segment(self) -> None:
        if self._segment is not None:
            self._segment.close()
            os.close(self._segment_fd)
        self._segment, self._segment_fd, self._segment_sent = None, -1, False

    def _fill_segment(self, body: bytes | bytearray) -> None:
        if self._segment is None or len(self._segment) < len(body):
            self._drop_segment()
            size = max(_MIN_SEGMENT, 1 << (len(body) - 1).bit_length())
            fd = os.memfd_create("tensorverse-ingest", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            self._segment, self._segment_fd = mmap.mmap(fd, size), fd
        self._segment[:len(body)] = body

    async def store(self, body: bytes | bytearray) -> Stored | None:
        """The worker's `Stored` for ``body``; None when the worker died or hung holding it (the
        next body starts a new one)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        loop = asyncio.get_running_loop()
        async with self._lock:
            if self._closed:
                raise RuntimeError("the ingest worker is closed")
            sock = self._sock if self._sock is not None else await asyncio.to_thread(self._start)
            self._fill_segment(body)
            head = _HEADER.pack(len(body))

            async def exchange() -> bytes | None:
                if not self._segment_sent:  # a few bytes and a descriptor: never blocks
                    socket.send_fds(sock, [head], [self._segment_fd])
                    self._segment_sent = True
                else:
                    await loop.sock_sendall(sock, head)
                size = await _async_recv_exact(loop, sock, _HEADER.size)
                return await _async_recv_exact(loop, sock, _HEADER.unpack(size)[0]) if size is not None else None

            hung = False
            try:
                reply = await asyncio.wait_for(exchange(), self.timeout_s)
            except asyncio.TimeoutError:  # before OSError, of which it is a subclass
                reply, hung = None, True
            except OSError:
                reply = None
            finally:
                if len(self._segment or b"") > _KEEP_SEGMENT:
                    self._drop_segment()
            if reply is not None:
                return pickle.loads(reply)
            log.warning("tensorverse ingest: the ingest worker died or hung; its body is stored in the proxy, "
                        "the next goes to a new worker")
            await asyncio.to_thread(self._stop, 0.0 if hung else 5.0)  # a hung one is killed at once
            self.restarts += 1
            return None

    @property
    def pid(self) -> int | None:
        """The worker's process id (None before the first body)."""
        return self._proc.pid if self._proc is not None else None

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker (no body in flight: the listener has stopped)."""
        self._closed = True
        self._stop(timeout)
        self._drop_segment()


async def _async_recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


# -- the endpoint -----------------------------------------------------------------------------


class Ingest:
    """``POST /ingest``. ``store``: the proxy's store; ``worker``: an `IngestWorker` over the same
    store (None: the frames are stored in a thread of this process)."""

    def __init__(self, store: Any, token: str | None, *, max_bytes: int = 256 << 20,
                 dedupe_window: int = 1 << 16, worker: IngestWorker | None = None) -> None:
        self.store = store
        self.token = token
        self.max_bytes = max_bytes
        self.worker = worker
        # the frames stored lately, per capturing process: a batch sent again is not stored twice
        # (the worker keeps its own; this one serves the bodies stored here)
        self._seen = SeenFrames(dedupe_window)
        self.counters = {"batches": 0, "rows": 0, "duplicates": 0, "rejected": 0, "unauthorized": 0,
                         "store_full": 0, "store_errors": 0, "bytes": 0, "rows_dropped_store_full": 0,
                         "rows_dropped_store_error": 0, "rows_compact": 0, "in_process": 0}
        # the capturing processes' own counters (sink header), latest per origin, for /metrics
        self._plugins: OrderedDict[int, dict[str, int]] = OrderedDict()

    _PLUGIN_KEYS = ("rows_captured", "dropped_no_buffer", "dropped_sink", "dropped_encode", "rows_on_device",
                    "device_overflow")

    def _note_plugin_stats(self, request: web.Request) -> None:
        from tensorverse.capture.sink import STATS_HEADER

        raw = request.headers.get(STATS_HEADER)
        if not raw or len(raw) > 4096:
            return
        try:
            d = orjson.loads(raw)
            origin = int(d["origin"])
            vals = {k: int(d.get(k) or 0) for k in self._PLUGIN_KEYS}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return
        self._plugins[origin] = vals
        self._plugins.move_to_end(origin)
        while len(self._plugins) > 1024:
            self._plugins.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        """The counters, plus ``plugins``: the capture plugins' counters summed over processes,
        and ``worker_restarts``."""
        plugins = {k: sum(p[k] for p in self._plugins.values()) for k in self._PLUGIN_KEYS}
        restarts = self.worker.restarts if self.worker is not None else 0
        return {**self.counters, "worker_restarts": restarts, "plugins": plugins}

    def _authorized(self, request: web.Request) -> bool:
        if not self.token:
            return False
        auth = request.headers.get("Authorization", "")
        scheme, _, value = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())

    @staticmethod
    def _json(status: int, **body: Any) -> web.Response:
        return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")

    async def handle(self, request: web.Request) -> web.Response:
        if not self.token:
            self.counters["unauthorized"] += 1
            return self._json(403, error="ingest is disabled: set [admin] token or token_env")
        if not self._authorized(request):
            self.counters["unauthorized"] += 1
            return self._json(401, error="missing or wrong bearer token")
        self._note_plugin_stats(request)
        if self.store is None:
            return self._json(503, error="no store configured")
        if request.content_length is not None and request.content_length > self.max_bytes:
            self.counters["rejected"] += 1
            return self._json(413, error=f"body over {self.max_bytes} bytes")
        body = bytearray()
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > self.max_bytes:
                self.counters["rejected"] += 1
                return self._json(413, error=f"body over {self.max_bytes} bytes")
        self.counters["bytes"] += len(body)
        out = await self.worker.store(body) if self.worker is not None else None
        if out is None:
            if self.worker is not None:
                self.counters["in_process"] += 1
            out = await asyncio.to_thread(store_frames, self.store, self._seen, bytes(body))
        elif out.status == 200:  # committed by the worker: wake this process's waiters
            for run_id, full, compact in out.runs:
                self.store.arrivals.add(run_id, full, compact)
        elif out.status == 507:  # refused in the worker: the retention keeper must hear of it
            self.store.note_full_elsewhere()
        return self._answer(out)

    def _answer(self, out: Stored) -> web.Response:
        c = self.counters
        if out.status == 400:
            c["rejected"] += 1
        elif out.status == 507:
            c["store_full"] += 1
            c["rows_dropped_store_full"] += out.rows
        elif out.status != 200:
            c["store_errors"] += 1
            c["rows_dropped_store_error"] += out.rows
        if out.status == 400:
            return self._json(400, error=out.error, reason=out.reason)
        if out.status != 200:
            return self._json(out.status, error=out.error)
        c["batches"] += 1
        c["rows"] += out.rows
        c["rows_compact"] += out.rows_compact
        c["duplicates"] += out.duplicates
        return self._json(200, rows=out.rows, duplicates=out.duplicates, runs=len(out.runs))

    def close(self) -> None:
        """Stop the worker (after the listener: no body is in flight)."""
        if self.worker is not None:
            self.worker.close()
