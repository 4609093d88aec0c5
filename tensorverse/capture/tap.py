"""The tap: copy logits rows off the engine thread's hot path, encode and ship them elsewhere.

Independent of vLLM (the adapters in :mod:`~tensorverse.capture.v1` / :mod:`~.v2` call it), so
it is tested on plain tensors.

Engine thread (inside a logits processor's ``apply``)::

    slot = tap.copy_row(logits, row)        # copy before anything modifies the row
    tap.mark_copied([slot])                 # CUDA: one event after this step's copies
    force_tokens(logits, [row], [token])    # now the row may be masked in place
    tap.submit(slot, capture_id, position)  # hand to the encoder thread (never blocks)
    # or tap.release(slot): the row turned out not to be sampled (chunked prefill)

* CPU tensors: a plain copy into a reusable host buffer.
* CUDA tensors: ``non_blocking`` copy into a pinned host buffer, one CUDA event recorded on the
  current stream after the step's copies. Nothing on the engine thread waits for the GPU; the
  encoder thread waits on the event before reading the buffer. Masking after the copy is safe:
  both are queued on the same stream, so the copy reads the row before the mask writes it.

Host buffers come from a bounded pool (``max_rows``, allocated on demand and reused). When none
is free the row is dropped and counted: the engine thread never blocks and never sees an
exception from the tap (everything is caught, counted, and logged once per kind).

Encoder thread: waits for the copy (CUDA), encodes with :func:`tensorverse.store.codec.encode_row`
(or, for a row submitted with an :class:`~tensorverse.capture.optin.EvidenceSpec`, reduces it and
encodes its compact form unless it is evidence: :mod:`tensorverse.capture.reduce`), returns the
buffer to the pool, wraps the blob in a :class:`~tensorverse.capture.frames.Frame`
and gives it to the sink, which ships batches (when 200 ms old, 1024 rows or 8 MiB, or when the
encoder has been idle for ``idle_s``, 50 ms: :mod:`~tensorverse.capture.sink`).

Rows reduced where they live (``reduce_on_device``, off by default: docs/capture.md, "Where rows
are reduced"): a row whose request asked for its compact form (an evidence spec that does not
request it in full) is not copied to the host. ``copy_row`` keeps a device copy of the raw row (a
:class:`DeviceSlot`, at most ``max_device_rows`` at once, else the host path, counted);
``mark_copied`` reduces the step's kept rows in one batch on the device and copies the small
results to the host (CUDA: non-blocking, into pinned memory, one event); the encoder thread
decides each row and copies a row to the host whole only when it is evidence, on its own stream.

Keeping the engine fast (vLLM-CPU): a CPU row is copied with numpy (one memcpy, no intra-op
thread pool). The encoder thread can run at a lower OS priority (``nice``) and defer encoding
while rows keep arriving (``defer_s``): it then encodes between requests, or once half the pool
is queued. Both are off in a bare ``Tap`` and on in the plugin (see
:mod:`~tensorverse.capture.runtime`); measured on a 2-core machine with vLLM-CPU they take the
decode slowdown while capturing every position from ~2x to a few percent.

The encoder thread logs a one-line summary of the counters at most once a minute while rows
flow. Counters (:meth:`Tap.stats`): ``rows_captured`` (handed to the encoder), ``rows_encoded``,
``rows_shipped``, ``rows_dropped`` (= ``dropped_no_buffer`` + ``dropped_sink`` +
``dropped_encode``), ``rows_discarded`` (copied but never sampled: chunked-prefill steps),
``rows_forced``, ``rows_compact`` (sent as their compact form), ``rows_evidence`` (rows with an
evidence spec sent in full, by reason), ``rows_on_device`` (reduced on the device),
``device_rows`` (held there now), ``device_overflow`` (sent by the host path: the device's row
budget was full), ``bytes_encoded``, ``bytes_shipped``, ``sink_errors`` (failed flushes),
``errors`` (internal exceptions), ``queue_depth``, ``buffers``.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from tensorverse.capture.frames import Frame
from tensorverse.capture.optin import EvidenceSpec
from tensorverse.capture.sink import Sink, SinkError
from tensorverse.store.engine_state import EngineState

__all__ = ["Tap", "RowSlot", "DeviceSlot", "StepReduction", "force_tokens", "LogOnce"]

log = logging.getLogger("tensorverse.capture")

Encoder = Callable[[np.ndarray, "str | None"], bytes]


class LogOnce:
    """Log each kind of problem once (with the first exception), count every occurrence."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, kind: str, msg: str, *args: Any, exc: BaseException | None = None) -> None:
        with self._lock:
            if kind in self._seen:
                return
            self._seen.add(kind)
        log.warning("tensorverse capture: " + msg + " (logged once)", *args,
                    exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)


log_once = LogOnce()


def force_tokens(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int]) -> None:
    """Mask ``logits`` in place so row ``rows[i]`` samples ``tokens[i]`` whatever the sampler.

    Every other entry becomes ``-inf`` and the forced token becomes 0.0 (probability 1 after
    softmax, at any temperature, top-k/top-p, min-p or penalty). No host-device sync: values are
    written by ``fill_``/``index_fill_`` with the scalar as a kernel argument (``row[t] = 0.0``
    copies a host scalar to the device, a sync CUDA's debug mode caught on a GPU), and on CUDA the
    index tensors travel with a non-blocking copy from pinned memory.
    """
    if not rows:
        return
    if len(rows) <= 4:
        for r, t in zip(rows, tokens):
            row = logits[r]
            row.fill_(float("-inf"))
            row[t:t + 1].fill_(0.0)
        return
    rt = torch.tensor([list(rows), list(tokens)], dtype=torch.long,
                      pin_memory=logits.device.type == "cuda")
    if logits.device.type != "cpu":
        rt = rt.to(logits.device, non_blocking=True)
    logits.index_fill_(0, rt[0], float("-inf"))
    logits.index_put_((rt[0], rt[1]), torch.zeros((), dtype=logits.dtype, device=logits.device))


class RowSlot:
    """One reusable host buffer holding one row."""

    __slots__ = ("tensor", "array", "codec_dtype", "vocab", "dtype", "pinned", "event", "direct")

    def __init__(self, vocab: int, dtype: torch.dtype, pinned: bool) -> None:
        store_dtype = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
        self.tensor = torch.empty(vocab, dtype=store_dtype, pin_memory=pinned)
        if store_dtype is torch.bfloat16:
            self.array = self.tensor.view(torch.int16).numpy().view(np.uint16)
            self.codec_dtype: str | None = "bfloat16"
        else:
            self.array = self.tensor.numpy()
            self.codec_dtype = None
        self.vocab = vocab
        self.dtype = dtype
        self.pinned = pinned
        self.event: Any = None
        # CPU rows of the buffer's own dtype are copied with numpy (see Tap.copy_row)
        self.direct = not pinned and store_dtype is dtype

    def fits(self, vocab: int, dtype: torch.dtype, pinned: bool) -> bool:
        return self.vocab == vocab and self.dtype == dtype and self.pinned == pinned


#: the store's dtype name of a row kept on its device (rows of other dtypes travel as float32)
_DEVICE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class StepReduction:
    """One step's rows kept on the device, reduced together (:func:`~.reduce.reduce_on_device`):
    the small results in host tensors (pinned on CUDA, filled by non-blocking copies that
    ``event`` follows), read by the encoder thread once the event has completed."""

    __slots__ = ("host", "vocab", "event", "_reduced")

    def __init__(self, host: Any, vocab: int, event: Any) -> None:
        self.host = host  # reduce.OnDevice of host tensors
        self.vocab = vocab
        self.event = event
        self._reduced: Any = None

    def reduced(self) -> Any:
        """The step's :class:`~.reduce.Reduced` (after ``event``; the encoder thread only)."""
        if self._reduced is None:
            from tensorverse.capture.reduce import to_reduced

            self._reduced = to_reduced(self.host, self.vocab)
        return self._reduced


class DeviceSlot:
    """A row kept on the engine's device (``reduce_on_device``) until its step's reduction says
    whether it travels compact or, as evidence, in full (then, and only then, it is copied to
    the host whole). ``row`` is a device copy of the raw row, taken before any masking."""

    __slots__ = ("row", "spec", "step", "i", "event")

    def __init__(self, row: torch.Tensor, spec: EvidenceSpec) -> None:
        self.row: torch.Tensor | None = row
        self.spec = spec
        self.step: StepReduction | None = None  # set by Tap.mark_copied
        self.i = -1  # this row's index in its step's reduction
        self.event: Any = None  # the step's event (CUDA)


class _Stop:
    pass


_STOP = _Stop()


class Tap:
    """See the module docstring.

    ``sink``: where frames go (may be None: rows are then encoded and dropped, counted as
    ``dropped_sink``). ``max_rows``: host buffers in flight (pending + queued). ``level``: zstd
    level. ``encoder``: ``(array, codec_dtype) -> bytes`` (default: the store codec).
    ``nice``: how much to lower the encoder thread's scheduling priority (Linux: per thread,
    inherited by threads it starts, e.g. the store's writer); 0 leaves it alone.
    ``defer_s``: while rows keep arriving less than ``defer_s`` apart (a capture in progress)
    the encoder only queues them and encodes once they pause, so encoding (as much CPU per row
    as a tiny model's decode step, and GIL hand-offs with the engine thread) happens between
    requests rather than during them; from ``high_water`` queued rows (half the pool), or
    half of ``max_device_rows`` held on the device, on it encodes regardless, so a steady
    stream of captures is still drained. 0 (the default): encode at once. ``poll_s``: how
    often the deferring encoder looks at the queue. ``reduce_on_device``, ``max_device_rows``:
    see the module docstring.
    """

    def __init__(self, sink: Sink | None, *, max_rows: int = 256, level: int = 1,
                 encoder: Encoder | None = None, origin: int | None = None,
                 idle_s: float = 0.05, name: str = "tensorverse-capture", nice: int = 0,
                 defer_s: float = 0.0, poll_s: float = 0.01, reduce_on_device: bool = False,
                 max_device_rows: int = 64) -> None:
        self.sink = sink
        self.reduce_on_device = bool(reduce_on_device)
        self.max_device_rows = max(1, int(max_device_rows))
        self._device_rows = 0  # rows held on the device (engine and encoder threads: _device_lock)
        self._device_lock = threading.Lock()
        self._side_stream: Any = None  # CUDA: the encoder thread's stream for evidence copies
        self.nice = int(nice)
        self.defer_s = float(defer_s)
        self.poll_s = max(0.001, float(poll_s))
        self.max_rows = max(1, int(max_rows))
        #: queued rows from which the encoder stops deferring (half the pool)
        self.high_water = max(1, self.max_rows // 2)
        #: rows held on the device from which the encoder stops deferring (half their budget)
        self.device_high_water = max(1, self.max_device_rows // 2)
        self.level = level
        self._encoder = encoder
        self.origin = origin if origin is not None else secrets.randbits(64)
        self.idle_s = idle_s
        self.name = name
        self._free: deque[RowSlot] = deque()
        self._allocated = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self._seq = 0
        # engine-thread counters
        self.rows_captured = 0
        self.dropped_no_buffer = 0
        self.rows_discarded = 0
        self.rows_forced = 0
        self.device_overflow = 0  # rows that took the host path: the device's row budget was full
        self.errors_engine = 0
        # encoder-thread counters
        self.rows_processed = 0
        self.rows_encoded = 0
        self.rows_compact = 0
        self.rows_on_device = 0  # rows reduced on the engine's device (reduce_on_device)
        self.rows_evidence: dict[str, int] = {}
        self.rows_shipped = 0
        self.dropped_sink = 0
        self.dropped_encode = 0
        self.bytes_encoded = 0
        self.bytes_shipped = 0
        self.sink_errors = 0
        self.errors_encoder = 0
        self.last_sink_error: str | None = None
        self.log_every_s = 60.0
        self._logged_at = time.monotonic()
        self._logged_captured = 0
        if sink is not None:
            sink.stats_provider = self.wire_stats

    # -- engine thread ---------------------------------------------------------------------
    def _acquire(self, vocab: int, dtype: torch.dtype, pinned: bool) -> RowSlot | None:
        free = self._free
        while free:
            try:
                slot = free.pop()
            except IndexError:
                break
            if slot.fits(vocab, dtype, pinned):
                return slot
            self._allocated -= 1  # shape changed (another model?): let it go
        if self._allocated >= self.max_rows:
            return None
        self._allocated += 1
        try:
            return RowSlot(vocab, dtype, pinned)
        except Exception:
            self._allocated -= 1
            raise

    def copy_row(self, logits: torch.Tensor, row: int, slot: RowSlot | DeviceSlot | None = None,
                 evidence: EvidenceSpec | None = None) -> RowSlot | DeviceSlot | None:
        """Copy ``logits[row]`` into a host buffer (``slot`` if given and it fits, else a free
        one). Returns the slot, or None when no buffer is free (counted) or the copy failed.

        With ``reduce_on_device`` and an ``evidence`` spec that does not ask for the row in full,
        the row is kept on its device instead (a :class:`DeviceSlot`), to be reduced with its
        step's other rows by :meth:`mark_copied`; when ``max_device_rows`` are already held it
        takes the host path (counted in ``device_overflow``)."""
        try:
            if self._closed:
                return None
            if self.reduce_on_device and evidence is not None and not evidence.requested:
                old, slot = slot, None  # given back by _keep_on_device, once, whatever happens next
                kept = self._keep_on_device(logits, row, evidence, old)
                if kept is not None:
                    return kept
            dev = logits.device.type
            pinned = dev == "cuda"
            vocab = logits.shape[-1]
            host = slot if isinstance(slot, RowSlot) and slot.fits(vocab, logits.dtype, pinned) else None
            if host is None:
                old, slot = slot, None
                self.release(old)  # a buffer of another shape, or a row that was kept on the device
                slot = host = self._acquire(vocab, logits.dtype, pinned)
                if host is None:
                    self.dropped_no_buffer += 1
                    return None
            host.event = None
            if dev == "cpu":
                src = logits[row]
                if host.direct and src.is_contiguous():
                    # numpy, not torch: one single-threaded memcpy that releases the GIL.
                    # torch's copy_ of a 600 KB row goes through the intra-op thread pool and
                    # costs milliseconds when the cores are busy (measured 5-17 ms vs 50 us
                    # with 2 OpenMP threads on a loaded 2-core machine).
                    if host.codec_dtype is None:
                        np.copyto(host.array, src.numpy())
                    else:
                        np.copyto(host.array, src.view(torch.int16).numpy().view(np.uint16))
                else:
                    host.tensor.copy_(src)
            elif pinned:
                host.tensor.copy_(logits[row], non_blocking=True)
            else:  # other accelerators: a blocking copy is correct, if slower
                log_once("sync-copy", "device %s: using a blocking copy", dev)
                host.tensor.copy_(logits[row])
            return host
        except Exception as e:  # noqa: BLE001 - never raise into vLLM
            self.errors_engine += 1
            log_once("copy", "copying a logits row failed", exc=e)
            if slot is not None:
                self.release(slot)
            return None

    def _keep_on_device(self, logits: torch.Tensor, row: int, spec: EvidenceSpec,
                        slot: RowSlot | DeviceSlot | None) -> DeviceSlot | None:
        """A device copy of the raw row (queued on the engine's stream before any masking, no
        sync), or None when the device's row budget is full. A passed ``slot`` (the same
        position computed again) is given back first."""
        self.release(slot)
        with self._device_lock:
            if self._device_rows >= self.max_device_rows:
                self.device_overflow += 1
                return None
            self._device_rows += 1
        try:
            return DeviceSlot(logits[row].clone(), spec)
        except Exception:
            with self._device_lock:
                self._device_rows -= 1
            raise

    def mark_copied(self, slots: Iterable[RowSlot | DeviceSlot | None]) -> None:
        """After this step's copies: on CUDA, record one event the encoder will wait on; rows
        kept on the device are reduced together (:meth:`_reduce_step`)."""
        on_device: list[DeviceSlot] = []
        try:
            ev = None
            for s in slots:
                if isinstance(s, DeviceSlot):
                    on_device.append(s)
                    continue
                if s is None or not s.pinned:
                    continue
                if ev is None:
                    ev = torch.cuda.Event()
                    ev.record()
                s.event = ev
        except Exception as e:  # noqa: BLE001
            self.errors_engine += 1
            log_once("event", "recording a CUDA event failed", exc=e)
        if on_device:
            try:
                self._reduce_step(on_device)
            except Exception as e:  # noqa: BLE001 - the encoder reduces them one by one instead
                self.errors_engine += 1
                log_once("reduce-step", "reducing a step's rows on the device failed", exc=e)

    def _reduce_step(self, slots: list[DeviceSlot]) -> None:
        """Reduce the step's device rows in one batch on their device; copy the small results
        to the host (CUDA: non-blocking into pinned memory, then one event); nothing waits."""
        from tensorverse.capture.reduce import OnDevice, reduce_on_device

        rows = [s.row for s in slots if s.row is not None]
        if len(rows) != len(slots):
            return  # a slot was given back meanwhile: the encoder reduces the others itself
        batch = torch.stack(rows)
        red = reduce_on_device(batch, max(s.spec.k for s in slots))
        ev = None
        if batch.device.type == "cuda":
            host = OnDevice(*(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in red))
            for h, t in zip(host, red):
                h.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        else:  # the host itself, or another accelerator (a blocking copy: correct, if slower)
            host = OnDevice(*(t.cpu() for t in red))
        step = StepReduction(host, batch.shape[-1], ev)
        for i, s in enumerate(slots):
            s.step, s.i, s.event = step, i, ev

    def submit(self, slot: RowSlot | DeviceSlot, capture_id: str, position: int,
               engine: tuple[int, ...] | None = None, evidence: EvidenceSpec | None = None) -> None:
        """Hand a copied row to the encoder thread. Never blocks. ``engine``: the step's engine
        state as the tuple of :class:`~tensorverse.store.engine_state.EngineState`'s fields
        (runner, step, batch_size, row, joined, context_tokens, prefill_reqs, tp, pp), built into a
        record on the encoder thread, or None. ``evidence``: reduce the row at the source and send
        its compact form unless it is evidence (None: send it in full)."""
        try:
            if self._closed:
                self.release(slot)
                return
            self._ensure_thread()
            self._seq += 1
            self.rows_captured += 1
            self._q.put((slot, capture_id, position, self._seq, engine, evidence))
        except Exception as e:  # noqa: BLE001
            self.errors_engine += 1
            log_once("submit", "handing a row to the encoder failed", exc=e)
            self.release(slot)  # the row is lost, its buffer is not

    def release(self, slot: RowSlot | DeviceSlot | None, *, discarded: bool = False) -> None:
        """Give a buffer back without shipping it."""
        if slot is None:
            return
        if discarded:
            self.rows_discarded += 1
        slot.event = None
        if isinstance(slot, DeviceSlot):
            if slot.row is not None:  # given back once: its device memory goes to the allocator
                slot.row = None
                slot.step = None
                with self._device_lock:
                    self._device_rows -= 1
            return
        self._free.append(slot)

    def capture(self, logits: torch.Tensor, items: Iterable[tuple]) -> int:
        """Copy and submit ``(row, capture_id, position)``, ``(row, capture_id, position,
        engine)`` or ``(row, capture_id, position, engine, evidence)`` items at once; return rows
        taken."""
        taken = []
        for item in items:
            slot = self.copy_row(logits, item[0], evidence=item[4] if len(item) > 4 else None)
            if slot is not None:
                taken.append((slot, item))
        self.mark_copied(s for s, _ in taken)
        for slot, item in taken:
            self.submit(slot, item[1], item[2], item[3] if len(item) > 3 else None,
                        item[4] if len(item) > 4 else None)
        return len(taken)

    # -- encoder thread --------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is not None:
            return
        with self._start_lock:
            if self._thread is None:
                t = threading.Thread(target=self._run, name=self.name, daemon=True)
                t.start()
                self._thread = t

    def _encode(self, arr: np.ndarray, codec_dtype: str | None) -> bytes:
        if self._encoder is None:
            from tensorverse.store.codec import encode_row

            level = self.level
            self._encoder = lambda a, d: encode_row(a, level=level, dtype=d)
        return self._encoder(arr, codec_dtype)

    def _flush_sink(self) -> None:
        sink = self.sink
        if sink is None or not sink.pending():
            return
        nbytes = sink.pending_bytes()
        try:
            shipped = sink.flush()
            self.rows_shipped += shipped
            self.bytes_shipped += nbytes
        except SinkError as e:
            self.sink_errors += 1
            self.dropped_sink += e.dropped
            self.last_sink_error = str(e)
            log_once("sink:" + type(e.__cause__).__name__, "sink failed, %d rows dropped: %s",
                     e.dropped, e)
        except Exception as e:  # noqa: BLE001
            self.sink_errors += 1
            self.errors_encoder += 1
            self.last_sink_error = f"{type(e).__name__}: {e}"
            log_once("sink-bug", "sink raised unexpectedly", exc=e)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._logged_at < self.log_every_s or self.rows_captured == self._logged_captured:
            return
        self._logged_at = now
        self._logged_captured = self.rows_captured
        s = self.stats()
        log.info("tensorverse capture: captured %d, shipped %d (%.1f MB), dropped %d "
                 "(no buffer %d, sink %d, encode %d), sink errors %d, errors %d",
                 s["rows_captured"], s["rows_shipped"], s["bytes_shipped"] / 1e6, s["rows_dropped"],
                 s["dropped_no_buffer"], s["dropped_sink"], s["dropped_encode"], s["sink_errors"],
                 s["errors"])

    def _lower_priority(self) -> None:
        """Make the encoder thread (only it: Linux priorities are per thread) yield the CPU to
        the engine. Encoding a row costs about as much CPU as decoding a token of a tiny model;
        at normal priority it takes its share of the cores from the engine's threads; niced it
        runs mostly when they wait, and catches up between requests (rows wait in the bounded
        buffer pool meanwhile; when it is full they are dropped and counted, as always)."""
        if self.nice <= 0 or not hasattr(os, "setpriority"):
            return
        try:
            tid = threading.get_native_id()
            cur = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, cur + self.nice))
        except Exception as e:  # noqa: BLE001 - a courtesy, never fatal
            log_once("nice", "could not lower the encoder thread's priority: %s", e)

    def _run(self) -> None:
        self._lower_priority()
        q = self._q
        pending: deque = deque()  # rows taken off the queue, not yet encoded
        last_row_at = 0.0
        while True:
            if pending:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    item = None
                if item is None:
                    if (len(pending) < self.high_water and self._device_rows < self.device_high_water
                            and time.monotonic() - last_row_at < self.defer_s):
                        time.sleep(self.poll_s)  # rows still arriving: stay out of the way
                        continue
                    self._process(pending.popleft())
                    if self.sink is not None and self.sink.should_flush():
                        self._flush_sink()
                    self._maybe_log()
                    continue
            else:
                try:
                    item = q.get(timeout=self.idle_s)
                except queue.Empty:
                    self._flush_sink()
                    self._maybe_log()
                    continue
            if item is _STOP or isinstance(item, threading.Event):
                while pending:  # a flush or stop covers every row submitted before it
                    self._process(pending.popleft())
                self._flush_sink()
                if isinstance(item, threading.Event):
                    item.set()
                    continue
                return
            pending.append(item)
            last_row_at = time.monotonic()

    def _reduce(self, slot: RowSlot, spec: EvidenceSpec) -> bytes | None:
        """The row's compact blob, or None when it is evidence (then it is sent in full)."""
        from tensorverse.capture.reduce import decide, reduce_rows
        from tensorverse.store.codec import row_checksum
        from tensorverse.store.compact import encode_compact

        dtype = slot.codec_dtype or str(slot.array.dtype)
        d = decide(reduce_rows(slot.tensor, spec.k), 0, spec, dtype=dtype,
                   fingerprint=row_checksum(slot.array, dtype=slot.codec_dtype))
        if d.compact is None:  # sent in full, for a reason (`reduce.Decision`)
            self._count_evidence(d.reason)
            return None
        return encode_compact(d.compact)

    def _count_evidence(self, reason: str | None) -> None:
        """One more row sent in full, under its reason."""
        key = str(reason)
        self.rows_evidence[key] = self.rows_evidence.get(key, 0) + 1

    def _from_device(self, slot: DeviceSlot) -> tuple[bytes, bool]:
        """A row kept on the device: its compact blob, or (evidence) the full row, copied to the
        host now and encoded. Its compact form carries fingerprint 0: the full row's crc32 is
        never computed at the source (the store reads the fingerprint nowhere)."""
        from tensorverse.capture.reduce import decide, reduce_rows
        from tensorverse.store.compact import encode_compact

        row, spec = slot.row, slot.spec
        assert row is not None  # a slot is processed once, then given back
        if slot.step is not None:
            r, i = slot.step.reduced(), slot.i
        else:  # its step was never reduced (mark_copied failed or was not called)
            if row.device.type == "cuda":
                torch.cuda.synchronize(row.device)  # the copy was queued on the engine's stream
            r, i = reduce_rows(row, spec.k), 0
        d = decide(r, i, spec, dtype=_DEVICE_DTYPES.get(row.dtype, "float32"), fingerprint=0)
        self.rows_on_device += 1
        if d.compact is not None:
            return encode_compact(d.compact), True
        self._count_evidence(d.reason)
        arr, codec_dtype = self._to_host(row)
        return self._encode(arr, codec_dtype), False

    def _to_host(self, row: torch.Tensor) -> tuple[np.ndarray, str | None]:
        """A device row (kept by ``reduce_on_device``) copied to the host whole, as the codec
        takes it. CUDA: on the encoder thread's own stream, after the step's event (the row's
        copy came before it), so the engine's stream never waits for it."""
        if row.dtype not in _DEVICE_DTYPES:
            row = row.float()
        if row.device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=row.device)
            with torch.cuda.stream(self._side_stream):
                host = row.to("cpu")
        else:
            host = row.cpu()
        if host.dtype is torch.bfloat16:
            return host.view(torch.int16).numpy().view(np.uint16), "bfloat16"
        return host.numpy(), None

    def _process(self, item: tuple) -> None:
        """Encode one queued row, return its buffer, and hand the frame to the sink."""
        slot, cid, pos, seq, engine, evidence = item
        blob = None
        compact = False
        try:
            if slot.event is not None:
                slot.event.synchronize()
            if isinstance(slot, DeviceSlot):
                blob, compact = self._from_device(slot)
            elif evidence is not None:
                blob = self._reduce(slot, evidence)
                compact = blob is not None
            if blob is None:
                blob = self._encode(slot.array, slot.codec_dtype)
        except Exception as e:  # noqa: BLE001
            self.errors_encoder += 1
            self.dropped_encode += 1
            log_once("encode", "encoding a row failed", exc=e)
        finally:
            self.release(slot)
            self.rows_processed += 1
        if blob is None:
            return
        self.rows_encoded += 1
        self.rows_compact += compact
        self.bytes_encoded += len(blob)
        if self.sink is None:
            self.dropped_sink += 1
            log_once("no-sink", "no sink configured (TENSORVERSE_CAPTURE_SINK): rows dropped")
            return
        try:
            self.sink.put(Frame(cid, pos, seq, self.origin, blob,
                                EngineState(*engine) if engine is not None else None, compact))
        except Exception as e:  # noqa: BLE001
            self.errors_encoder += 1
            self.dropped_sink += 1
            log_once("sink-put", "sink refused a frame", exc=e)

    # -- control ---------------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every row submitted so far is encoded and its batch shipped (or dropped)."""
        t = self._thread
        if t is None:
            return True
        ev = threading.Event()
        self._q.put(ev)
        deadline = time.monotonic() + timeout
        while not ev.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if not t.is_alive() or time.monotonic() >= deadline:
                return False  # an encoder that died never answers: no point waiting it out
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Ship what is queued (up to ``timeout``), stop the thread, close the sink."""
        if self._closed:
            return
        self._closed = True
        t = self._thread
        if t is not None:
            self._q.put(_STOP)
            t.join(timeout)
        if self.sink is not None and (t is None or not t.is_alive()):
            try:
                self.sink.close()
            except Exception:  # noqa: BLE001
                pass

    def wire_stats(self) -> dict[str, Any]:
        """The counters sent to the recorder with each HTTP batch."""
        s = self.stats()
        keep = ("rows_captured", "rows_shipped", "rows_dropped", "dropped_no_buffer",
                "dropped_sink", "dropped_encode", "rows_discarded", "rows_forced",
                "rows_compact", "rows_on_device", "device_overflow", "sink_errors", "errors", "queue_depth")
        out = {k: s[k] for k in keep}
        out["origin"] = self.origin
        return out

    def stats(self) -> dict[str, Any]:
        dropped = self.dropped_no_buffer + self.dropped_sink + self.dropped_encode
        return {
            "rows_captured": self.rows_captured,
            "rows_encoded": self.rows_encoded,
            "rows_shipped": self.rows_shipped,
            "rows_dropped": dropped,
            "dropped_no_buffer": self.dropped_no_buffer,
            "dropped_sink": self.dropped_sink,
            "dropped_encode": self.dropped_encode,
            "rows_discarded": self.rows_discarded,
            "rows_forced": self.rows_forced,
            "rows_compact": self.rows_compact,
            "rows_on_device": self.rows_on_device,
            "device_rows": self._device_rows,
            "device_overflow": self.device_overflow,
            "rows_evidence": dict(self.rows_evidence),
            "bytes_encoded": self.bytes_encoded,
            "bytes_shipped": self.bytes_shipped,
            "sink_errors": self.sink_errors,
            "last_sink_error": self.last_sink_error,
            "errors": self.errors_engine + self.errors_encoder,
            "queue_depth": max(0, self.rows_captured - self.rows_processed),
            "buffers": self._allocated,
            "max_rows": self.max_rows,
            "sink": getattr(self.sink, "name", None),
            "time": time.time(),
        }
