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

4. Evidence at the source (`tensorverse/capture/reduce.py`) on the device: `reduce_rows` of a
   64 x 151,936 float32 batch (top-28, float64 log-sum-exp, row minimum), timed with CUDA events
   on the device alone and end to end with the one copy of its small results to the host; and
   exactness: every row's decision and compact form from the GPU reduction equal those from the
   same rows reduced on the CPU (ids and logits bit for bit, log-sum-exp within 1e-13 relative).

5. Rows reduced where they live (`Tap(reduce_on_device=True)`, `TENSORVERSE_CAPTURE_REDUCE=device`,
   off by default until this check has passed on a GPU): rows of every evidence decision
   (compact, flip, close call, ties past the window, non-finite, requested) through the device
   path and through the host path, masked after the copies as the engine does: the same frames
   (compact forms equal but for the fingerprint, which the device path leaves 0; full rows bit
   for bit), and no synchronisation in the engine-side calls; then the decode-like loop of point
   3 at batch 32 with every row asking for its compact form, host path against device path.

The last line is one JSON object: `exact`, `sync_free`, `overhead_ratio_b1`, `overhead_ratio_b32`
(capture on / off step time), `rows_dropped_b32`, `reduce_device_ms_b64`, `reduce_total_ms_b64`,
`reduce_us_per_row`, `reduce_exact`, `device_path_exact`, `device_path_sync_free`,
`evidence_step_ms_host_b32`, `evidence_step_ms_device_b32`, `evidence_rows_dropped_host_b32`,
`evidence_rows_dropped_device_b32`.

The checks run on any device (``_device_path("cpu")``: the test suite runs them on the host,
so that a typo never costs a lent GPU's minutes); only ``main`` requires CUDA.
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
from tensorverse.testing.evidence_rows import FORCED, evidence_rows

VOCAB = 151_936
HIDDEN = 4096


def _exactness() -> tuple[bool, bool]:
    sink = MemorySink()
    tap = Tap(sink, defer_s=60.0)  # the encoder waits for the flush, after the debug window (see _device_path)
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


def _reduction(device: str, steps: int, batch: int = 64) -> dict:
    """Time ``reduce_rows`` on ``device`` for a batch x VOCAB float32 block, and check its
    decisions against the CPU's (see the module docstring, point 4)."""
    import time

    from tensorverse.capture.optin import EvidenceSpec
    from tensorverse.capture.reduce import WINDOW, decide, reduce_rows

    g = torch.Generator().manual_seed(0)
    host = (torch.randn(batch, VOCAB, generator=g) * 3).to(torch.bfloat16).float()
    host[torch.arange(batch), torch.arange(batch) * 7] = 25.0  # a clear top-1 in most rows
    x = host.to(device)
    on_gpu = device == "cuda"
    for _ in range(3):
        reduce_rows(x, 20)
    if on_gpu:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            torch.topk(x, 20 + WINDOW, dim=-1)
            torch.logsumexp(x.double(), dim=-1)
            x.amin(dim=-1)
        end.record()
        end.synchronize()
        device_ms = start.elapsed_time(end) / steps
    else:
        device_ms = None
    t0 = time.perf_counter()
    for _ in range(steps):
        r = reduce_rows(x, 20)
    total_ms = (time.perf_counter() - t0) * 1000 / steps
    ref = reduce_rows(host, 20)
    exact = True
    for i in range(batch):
        spec = EvidenceSpec(20, 0.1, i * 7, False)
        a = decide(r, i, spec, dtype="bfloat16", fingerprint=0)
        b = decide(ref, i, spec, dtype="bfloat16", fingerprint=0)
        if a.reason != b.reason:
            exact = False
        elif a.compact is not None and (a.compact.ids.tolist() != b.compact.ids.tolist()
                                        or a.compact.logits.tobytes() != b.compact.logits.tobytes()
                                        or abs(a.compact.lse - b.compact.lse) > 1e-13 * abs(b.compact.lse)):
            exact = False
    return {f"reduce_device_ms_b{batch}": None if device_ms is None else round(device_ms, 4),
            f"reduce_total_ms_b{batch}": round(total_ms, 4),
            "reduce_us_per_row": round(total_ms * 1000 / batch, 2), "reduce_exact": exact}


def _device_path(device: str, vocab: int = VOCAB) -> tuple[bool, bool]:
    """Point 5's check: (the same frames on both paths, no sync in the device path's engine-side
    calls). The sync check needs CUDA; elsewhere it is True by construction."""
    from tensorverse.store.compact import decode_compact

    def ship(on_device: bool) -> tuple[dict, bool]:
        logits, specs = evidence_rows(vocab, torch.bfloat16, device)
        logits = logits.float()  # as vLLM hands rows to a logits processor
        sink = MemorySink()
        # The sync debug mode is process-wide: the encoder thread's own waits (the event, the
        # evidence rows' copies to the host) must not fall inside the window, so it defers until
        # the flush below (a flush does not wait for the pause).
        tap = Tap(sink, max_rows=16, reduce_on_device=on_device, defer_s=60.0)
        free = True
        cuda = device == "cuda"
        if cuda and on_device:
            torch.cuda.set_sync_debug_mode("error")
        try:
            slots = [tap.copy_row(logits, r, evidence=specs[r]) for r in range(len(specs))]
            tap.mark_copied(slots)
            force_tokens(logits, *FORCED)
            for r, sl in enumerate(slots):
                tap.submit(sl, "ev", r, None, specs[r])
        except RuntimeError as e:
            print(f"synchronisation on the device path: {e}", file=sys.stderr)
            free = False
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        tap.flush(30)
        tap.close()
        return {f.position: f for f in sink.frames}, free

    want, _ = ship(False)
    got, sync_free = ship(True)
    same = sorted(got) == sorted(want) == list(range(7))
    for p in sorted(want):
        if not same:
            break
        a, b = got[p], want[p]
        if a.compact != b.compact:
            same = False
        elif a.compact:
            x, y = decode_compact(a.blob), decode_compact(b.blob)
            same = ((x.vocab, x.dtype, x.k, x.lse, x.fingerprint) == (y.vocab, y.dtype, y.k, y.lse, 0)
                    and x.ids.tolist() == y.ids.tolist() and x.logits.tobytes() == y.logits.tobytes())
        else:
            same = a.blob == b.blob
    return same, sync_free


def _evidence_step_ms(batch: int, steps: int, on_device: bool) -> tuple[float, int]:
    """Point 3's loop with every row asking for its compact form (free decoding, k = 20)."""
    from tensorverse.capture.optin import EvidenceSpec

    w = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
    tap = Tap(MemorySink(), max_rows=256, reduce_on_device=on_device)
    spec = EvidenceSpec(20, 0.1, -1, False)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(steps + 10):
        if i == 10:
            start.record()
        logits = (h @ w.T).float()
        slots = [tap.copy_row(logits, r, evidence=spec) for r in range(batch)]
        tap.mark_copied(slots)
        for r, sl in enumerate(slots):
            if sl is not None:
                tap.submit(sl, f"e{batch}", i * batch + r, None, spec)
        logits.argmax(dim=-1)
    end.record()
    end.synchronize()
    tap.flush(60)
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
    result.update(_reduction("cuda", args.steps))
    result["device_path_exact"], result["device_path_sync_free"] = _device_path("cuda")
    for name, on_device in (("host", False), ("device", True)):
        ms, dropped = _evidence_step_ms(32, args.steps, on_device)
        result[f"evidence_step_ms_{name}_b32"] = round(ms, 4)
        result[f"evidence_rows_dropped_{name}_b32"] = dropped
    print(json.dumps(result))
    ok = exact and sync_free and result["reduce_exact"]
    return 0 if ok and result["device_path_exact"] and result["device_path_sync_free"] else 1


if __name__ == "__main__":
    sys.exit(main())
