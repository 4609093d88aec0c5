"""Process-wide state of the capture plugin: the on/off switch, the one tap, stats, the rank check.

Environment variables (read on the vLLM server; the frontend and the engine processes inherit
the same environment):

``TENSORVERSE_CAPTURE``
    ``0`` / ``off`` / ``false`` / ``no`` makes the installed plugin inert: no request is captured
    or forced, ``tv_*`` keys are ignored (not rejected), ``apply`` is never on the greedy path
    (the processor declares itself argmax-invariant so vLLM skips it for greedy batches). Use it
    for A/B benchmarks of the plugin's cost. Default: on.
``TENSORVERSE_CAPTURE_ENGINE_STATE``
    ``0`` / ``off``: captured rows carry no engine state (batch size, step, ...; see
    docs/capture.md, "Engine state"); the processors then keep no per-step counters. For the
    A/B measurement of its cost (``benchmarks/attribution.py``). Default: on.
``TENSORVERSE_CAPTURE_SINK``, ``TENSORVERSE_CAPTURE_TOKEN``, ``TENSORVERSE_CAPTURE_TIMEOUT``
    See :mod:`tensorverse.capture.sink`. Without a sink, requests with ``tv_capture`` are
    rejected (HTTP 400); ``tv_force`` alone still works.
``TENSORVERSE_CAPTURE_MAX_ROWS``
    Host row buffers in flight per process (pending + queued for encoding; default 256,
    ~600 KB each at a 151,936 vocabulary, allocated on demand). When all are busy, rows are
    dropped and counted, never waited for.
``TENSORVERSE_CAPTURE_LEVEL``
    zstd level of the codec (default 1).
``TENSORVERSE_CAPTURE_NICE``
    How much to lower the encoder thread's CPU priority (Linux, per thread; default 19, the
    lowest priority; 0 keeps the engine's). Encoding then runs mostly when the engine waits, so
    capture costs the engine little CPU; rows wait in the buffer pool meanwhile.
``TENSORVERSE_CAPTURE_DEFER_MS``
    While captured rows keep arriving less than this many milliseconds apart (a request being
    decoded), the encoder thread only queues them and encodes when they pause, i.e. between
    requests, or as soon as half the buffer pool is queued (default 50; 0 encodes at once).
    Trades a little latency until rows are stored for decode speed during capture.
``TENSORVERSE_CAPTURE_REDUCE``
    Where a row that a request asked to reduce (``tv_compact``) is reduced. ``host`` (the
    default): the whole row is copied to a host buffer and reduced on the encoder thread.
    ``device``: the row stays on the engine's device; each step's such rows are reduced there in
    one batch (top-k, log-sum-exp) and only the small results cross to the host, the whole row
    only when it is evidence. Not yet run on a GPU (``benchmarks/capture_cuda.py`` is the check;
    docs/capture.md, "Where rows are reduced"), hence off by default. Other values: ``host``.
``TENSORVERSE_CAPTURE_DEVICE_ROWS``
    With ``device``: rows held on the device at once (default 64, ~600 KB each at a 151,936
    vocabulary in float32); past it a row takes the host path (counted: ``device_overflow``).

The tap and its encoder thread are created on the first captured row, in the process that runs
the model (never in the API frontend, never at import).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any, Mapping

from tensorverse.capture.sink import ENV_SINK, sink_from_env
from tensorverse.capture.tap import Tap, log_once

__all__ = ["ENV_ENABLE", "ENV_ENGINE_STATE", "engine_state_enabled", "ENV_MAX_ROWS", "ENV_LEVEL", "ENV_NICE", "ENV_DEFER_MS", "ENV_REDUCE",
           "ENV_DEVICE_ROWS", "reduce_on_device", "enabled",
           "sink_configured", "get_tap", "stats", "close", "is_capture_rank", "note_error",
           "parallel_layout"]

log = logging.getLogger("tensorverse.capture")

ENV_ENABLE = "TENSORVERSE_CAPTURE"
ENV_ENGINE_STATE = "TENSORVERSE_CAPTURE_ENGINE_STATE"
ENV_MAX_ROWS = "TENSORVERSE_CAPTURE_MAX_ROWS"
ENV_LEVEL = "TENSORVERSE_CAPTURE_LEVEL"
ENV_NICE = "TENSORVERSE_CAPTURE_NICE"
ENV_DEFER_MS = "TENSORVERSE_CAPTURE_DEFER_MS"
ENV_REDUCE = "TENSORVERSE_CAPTURE_REDUCE"
ENV_DEVICE_ROWS = "TENSORVERSE_CAPTURE_DEVICE_ROWS"

DEFAULT_NICE = 19
DEFAULT_DEFER_MS = 50

_OFF = {"0", "off", "false", "no", "disable", "disabled"}

_lock = threading.Lock()
_tap: Tap | None = None
_adapter_errors = 0


def enabled(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return (env.get(ENV_ENABLE) or "1").strip().lower() not in _OFF


def engine_state_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether captured rows carry the step's engine state (``TENSORVERSE_CAPTURE_ENGINE_STATE``)."""
    env = os.environ if env is None else env
    return (env.get(ENV_ENGINE_STATE) or "1").strip().lower() not in _OFF


def sink_configured(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return bool((env.get(ENV_SINK) or "").strip())


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        log_once("env:" + name, "%s=%r is not an integer; using %d", name, os.environ.get(name), default)
        return default


def reduce_on_device(env: Mapping[str, str] | None = None) -> bool:
    """Whether rows are reduced on the engine's device (``TENSORVERSE_CAPTURE_REDUCE=device``)."""
    env = os.environ if env is None else env
    value = (env.get(ENV_REDUCE) or "host").strip().lower()
    if value not in ("host", "device"):
        log_once("env:" + ENV_REDUCE, "%s=%r is neither host nor device; using host", ENV_REDUCE, value)
    return value == "device"


def get_tap() -> Tap:
    """The process's tap (created on first use, with the sink from the environment)."""
    global _tap
    tap = _tap
    if tap is not None:
        return tap
    with _lock:
        if _tap is None:
            try:
                sink = sink_from_env()
            except Exception as e:  # noqa: BLE001 - a bad sink spec must not break vLLM
                log_once("sink-env", "bad %s: %s; captured rows will be dropped", ENV_SINK, e)
                sink = None
            _tap = Tap(sink, max_rows=_int_env(ENV_MAX_ROWS, 256), level=_int_env(ENV_LEVEL, 1),
                       nice=_int_env(ENV_NICE, DEFAULT_NICE),
                       defer_s=_int_env(ENV_DEFER_MS, DEFAULT_DEFER_MS) / 1000,
                       reduce_on_device=reduce_on_device(), max_device_rows=_int_env(ENV_DEVICE_ROWS, 64))
            log.info("tensorverse capture: tap started (sink: %s)", getattr(sink, "name", None))
        return _tap


def note_error(where: str, exc: BaseException) -> None:
    """Count an exception caught in an adapter (never raised into vLLM)."""
    global _adapter_errors
    _adapter_errors += 1
    log_once("adapter:" + where, "error in %s", where, exc=exc)


def stats() -> dict[str, Any]:
    """Counters of this process's capture (see :meth:`Tap.stats`), plus ``enabled``."""
    tap = _tap
    out: dict[str, Any] = {"enabled": enabled(), "adapter_errors": _adapter_errors}
    if tap is None:
        out.update(rows_captured=0, rows_encoded=0, rows_shipped=0, rows_dropped=0,
                   rows_forced=0, bytes_encoded=0, bytes_shipped=0, sink_errors=0, errors=0,
                   queue_depth=0)
    else:
        out.update(tap.stats())
        out["errors"] += _adapter_errors
    return out


def flush(timeout: float = 10.0) -> bool:
    tap = _tap
    return True if tap is None else tap.flush(timeout)


def close(timeout: float = 5.0) -> None:
    global _tap
    with _lock:
        tap, _tap = _tap, None
    if tap is not None:
        tap.close(timeout)
        s = tap.stats()
        log.info("tensorverse capture: closed; captured %d, shipped %d, dropped %d, errors %d",
                 s["rows_captured"], s["rows_shipped"], s["rows_dropped"], s["errors"])


atexit.register(close)


def parallel_layout(vllm_config: Any) -> tuple[int, int]:
    """The engine's (tensor-parallel, pipeline-parallel) sizes from its config, -1 for what it
    does not say: recorded in every captured row's engine state."""
    parallel = getattr(vllm_config, "parallel_config", None)
    out = []
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        v = getattr(parallel, name, None)
        out.append(int(v) if isinstance(v, int) and 0 < v < 256 else -1)
    return out[0], out[1]


def is_capture_rank(*, sharded_sampling: bool = False) -> bool:
    """Whether this worker captures rows (forcing is applied on every rank regardless).

    Tensor parallelism: every TP rank runs the sampler on the same full-vocabulary logits and
    feeds its own sampled tokens back, so every rank must apply the forcing mask, but only TP
    rank 0 captures (one copy per request). Pipeline parallelism: only the last stage samples,
    so its TP rank 0 captures. Data parallelism: each engine captures its own requests. With
    Model Runner V2's batch-sharded sampling each TP rank samples a disjoint share of the
    requests, so every rank captures its own rows (``sharded_sampling=True``).
    Outside a vLLM worker (tests) this is True.
    """
    if sharded_sampling:
        return True
    try:
        from vllm.distributed import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return ps.get_tensor_model_parallel_rank() == 0
    except Exception:  # noqa: BLE001
        pass
    return True
