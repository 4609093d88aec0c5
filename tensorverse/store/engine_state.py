"""What the engine's batch looked like when a logits row was computed: the row's *engine state*.

Batch composition changes numerics on GPUs (split-KV attention, batch-size-dependent GEMM tiling),
so every captured row carries what the capture plugin could see of its step. The plugin runs
inside vLLM as a logits processor; each of vLLM's two processor interfaces shows it different
things (docs/capture.md, "Engine state"), and what an interface does not show is stored as
``-1`` (unknown), never guessed.

A state is a few integers, packed in 32 bytes (little-endian)::

    offset  size  field
    0       1     layout version (1)
    1       1     runner: 1 = V1 logits-processor interface, 2 = Model Runner V2
    2       2     reserved (0)
    4       4     batch_size      requests in this step's batch (int32)
    8       8     step            engine steps the processor had seen, counted from 1 (int64)
    16      4     row             this request's row in the step's logits tensor (int32)
    20      4     joined          requests that joined the batch since the previous step (int32)
    24      4     context_tokens  tokens visible to attention over the whole batch (int32, V2)
    28      4     prefill_reqs    requests of the batch still prefilling (int32, V2)

It travels in capture frames (:mod:`tensorverse.capture.frames`) and is stored next to the row
(database ``row_engine`` of :mod:`tensorverse.store.schema`, from store format 3).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["EngineState", "ENGINE_STATE_SIZE", "RUNNER_V1", "RUNNER_V2", "UNKNOWN",
           "EngineStateError", "FIELDS"]

LAYOUT_VERSION = 1
RUNNER_V1 = 1
RUNNER_V2 = 2
UNKNOWN = -1
_S = struct.Struct("<BBHiqiiii")
ENGINE_STATE_SIZE = _S.size  # 32
#: the fields readers show and export, in order
FIELDS = ("runner", "step", "batch_size", "row", "joined", "context_tokens", "prefill_reqs")


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

    def pack(self) -> bytes:
        return _S.pack(LAYOUT_VERSION, self.runner, 0, self.batch_size, self.step, self.row,
                       self.joined, self.context_tokens, self.prefill_reqs)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "EngineState":
        if len(raw) != ENGINE_STATE_SIZE:
            raise EngineStateError(f"engine state of {len(raw)} bytes (expected {ENGINE_STATE_SIZE})")
        version, runner, _res, batch, step, row, joined, ctx, prefill = _S.unpack(raw)
        if version != LAYOUT_VERSION:
            raise EngineStateError(f"engine state layout {version} (this reader knows {LAYOUT_VERSION})")
        return cls(runner=runner, step=step, batch_size=batch, row=row, joined=joined,
                   context_tokens=ctx, prefill_reqs=prefill)

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
