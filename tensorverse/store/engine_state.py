"""What the engine's batch looked like when a logits row was computed: the row's *engine state*.

Batch composition changes numerics on GPUs (split-KV attention, batch-size-dependent GEMM tiling),
so every captured row carries what the capture plugin could see of its step. The plugin runs
inside vLLM as a logits processor; each of vLLM's two processor interfaces shows it different
things (docs/capture.md, "Engine state"), and what an interface does not show is stored as
``-1`` (unknown), never guessed.

A state is a few integers, packed in 32 bytes (little-endian)::

    offset  size  field
    0       1     layout version (2; 1 is read too)
    1       1     runner: 1 = V1 logits-processor interface, 2 = Model Runner V2
    2       1     tp              tensor-parallel size of the engine (uint8; 0 = unknown)
    3       1     pp              pipeline-parallel size of the engine (uint8; 0 = unknown)
    4       4     batch_size      requests in this step's batch (int32)
    8       8     step            engine steps the processor had seen, counted from 1 (int64)
    16      4     row             this request's row in the step's logits tensor (int32)
    20      4     joined          requests that joined the batch since the previous step (int32)
    24      4     context_tokens  tokens visible to attention over the whole batch (int32, V2)
    28      4     prefill_reqs    requests of the batch still prefilling (int32, V2)

Layout 1 (before the parallel layout was recorded) had two reserved zero bytes where ``tp`` and
``pp`` are: it reads as layout 2 with both unknown. The engine's world size is ``tp * pp`` (the
capture plugin runs in one data-parallel engine at a time).

It travels in capture frames (:mod:`tensorverse.capture.frames`) and is stored next to the row
(database ``row_engine`` of :mod:`tensorverse.store.schema`, from store format 3).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["EngineState", "ENGINE_STATE_SIZE", "RUNNER_V1", "RUNNER_V2", "UNKNOWN",
           "EngineStateError", "FIELDS"]

LAYOUT_VERSION = 2
_READS = (1, 2)
RUNNER_V1 = 1
RUNNER_V2 = 2
UNKNOWN = -1
_S = struct.Struct("<BBBBiqiiii")
ENGINE_STATE_SIZE = _S.size  # 32
#: the fields readers show and export, in order
FIELDS = ("runner", "step", "batch_size", "row", "joined", "context_tokens", "prefill_reqs", "tp", "pp")


def _size_byte(n: int) -> int:
    """A parallel size as its byte: 0 for unknown; a size beyond a byte is refused."""
    if n <= 0:
        return 0
    if n > 255:
        raise EngineStateError(f"parallel size {n} does not fit the engine state's byte")
    return n


class EngineStateError(ValueError):
    """Bytes that are not an engine state of a known layout."""


@dataclass(frozen=True, slots=True)
class EngineState:
    """One captured step as the plugin saw it (``-1``: the interface does not show it)."""

    runner: int
    step: int
    batch_size: int
    row: int
    joined: int = UNKNOWN
    context_tokens: int = UNKNOWN
    prefill_reqs: int = UNKNOWN
    tp: int = UNKNOWN  # the engine's tensor-parallel size
    pp: int = UNKNOWN  # its pipeline-parallel size

    def pack(self) -> bytes:
        return _S.pack(LAYOUT_VERSION, self.runner, _size_byte(self.tp), _size_byte(self.pp), self.batch_size,
                       self.step, self.row, self.joined, self.context_tokens, self.prefill_reqs)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "EngineState":
        if len(raw) != ENGINE_STATE_SIZE:
            raise EngineStateError(f"engine state of {len(raw)} bytes (expected {ENGINE_STATE_SIZE})")
        version, runner, tp, pp, batch, step, row, joined, ctx, prefill = _S.unpack(raw)
        if version not in _READS:
            raise EngineStateError(f"engine state layout {version} (this reader knows {_READS})")
        return cls(runner=runner, step=step, batch_size=batch, row=row, joined=joined,
                   context_tokens=ctx, prefill_reqs=prefill, tp=tp or UNKNOWN, pp=pp or UNKNOWN)

    @property
    def runner_name(self) -> str:
        return {RUNNER_V1: "v1", RUNNER_V2: "v2"}.get(self.runner, str(self.runner))

    def as_dict(self) -> dict[str, int | str | None]:
        """Readers' view: unknown fields as None, the runner by name."""
        out: dict[str, int | str | None] = {"runner": self.runner_name}
        for f in FIELDS[1:]:
            v = getattr(self, f)
            out[f] = None if v < 0 else v
        return out
