"""The capture tap on a GPU: exact rows, no stream synchronisation on the decode path, overhead.

    python benchmarks/capture_cuda.py [--steps 200]

Needs PyTorch with CUDA (no vLLM: the tap is independent of it). This is the device check of
the capture issue: it cannot run on the project's CPU machines, and exits 2 there saying so.
What it does, on one GPU:

1. Exactness: rows copied by the tap (non_blocking into pinned host buffers, one CUDA event per
   step) and then masked in place for forcing decode to the raw, unmasked values, bit for bit.
2. No synchronisation on the decode path: the engine-side calls (`copy_row`, `mark_copied`,
   `force_tokens`, `submit`) run under `torch.cuda.set_sync_debug_mode("error")`, which raises
   on any implicit device synchronisation.
3. Overhead on a decode-like loop: per step one 151,936-wide LM-head matmul (hidden 4096, bf16)
   for batch 1 and 32, then float32 logits as vLLM hands them to a logits processor; capture of
   every row on vs off, timed with CUDA events over `--steps` steps. The encoder thread encodes
   and drops into a memory sink concurrently, as in production.

The last line is one JSON object: `exact`, `sync_free`, `overhead_ratio_b1`, `overhead_ratio_b32`
(capture on / off step time), `rows_dropped_b32`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorverse.capture.sink import MemorySink
from tensorverse.capture.tap import Tap, force_tokens
from tensorverse.store.codec import decode_row

VOCAB = 151_936
HIDDEN = 4096


def _exactness() -> tuple[bool, bool]:
    sink = MemorySink()
    tap = Tap(sink)
    logits = torch.randn(4, VOCAB, device="cuda", dtype=torch.bfloat16).float()
    raw = logits.cpu()
    sync_free = True
    torch.cuda.set_sync_debug_mode("error")
    try:
        slots = [tap.copy_row(logits, r) for r in range(4)]
        tap.mark_copied(slots)
        force_tokens(logits, [0, 1, 2, 3], [1, 2, 3, 4])
        for r, s in enumerate(slots):
            tap.submit(s, "exact", r)
    except RuntimeError as e:  # an implicit sync on the decode path
        print(f"synchronisation on the decode path: {e}", file=sys.stderr)
        sync_free = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tap.flush(30)
    exact = len(sink.frames) == 4 and all(
        np.array_equal(decode_row(f.blob).view(np.uint32), raw[f.position].numpy().view(np.uint32))
        for f in sink.frames
    )
    tap.close()
    return exact, sync_free


def _step_ms(batch: int, steps: int, capture: bool) -> tuple[float, int]:
    w = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
    tap = Tap(MemorySink(), max_rows=256)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(steps + 10):
        if i == 10:
            start.record()
        logits = (h @ w.T).float()
        if capture:
            slots = [tap.copy_row(logits, r) for r in range(batch)]
            tap.mark_copied(slots)
            for r, s in enumerate(slots):
                if s is not None:
                    tap.submit(s, f"b{batch}", i * batch + r)
        logits.argmax(dim=-1)
    end.record()
    end.synchronize()
    dropped = tap.stats()["rows_dropped"]
    tap.close()
    return start.elapsed_time(end) / steps, dropped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("capture_cuda: no CUDA device here; run this on a GPU machine", file=sys.stderr)
        return 2
    exact, sync_free = _exactness()
    result = {"benchmark": "capture_cuda", "device": torch.cuda.get_device_name(0),
              "exact": exact, "sync_free": sync_free}
    for batch in (1, 32):
        off, _ = _step_ms(batch, args.steps, False)
        on, dropped = _step_ms(batch, args.steps, True)
        result[f"step_ms_off_b{batch}"] = round(off, 4)
        result[f"step_ms_on_b{batch}"] = round(on, 4)
        result[f"overhead_ratio_b{batch}"] = round(on / off, 4)
        result[f"rows_dropped_b{batch}"] = dropped
    print(json.dumps(result))
    return 0 if exact and sync_free else 1


if __name__ == "__main__":
    sys.exit(main())
