"""Benchmark: what a shadowed token costs in the store, captured in full and after compaction.

    python benchmarks/store_growth.py            # ~2-4 min on 2 cores
    python benchmarks/store_growth.py --quick    # 2 turns of 64 tokens (or TENSORVERSE_BENCH_QUICK=1)

The workload (`tensorverse.testing.shadow_workload`) streams shadowed turns through the store's
real write path (codec blobs in LMDB), the real comparisons and the real compaction
(`tensorverse.store.compaction`, the default `[retention]` policy): Qwen3's vocabulary of
151,936, rows of realistic entropy (`benchmarks/_logits.py`: SYNTHETIC, a random LM head rounded
to bf16), three shadows each forced and free (a secondary whose rows are the reference, a twin
bit-identical to it, a candidate flipping at 2 % of the positions whose free run then goes its
own way).

Figures:
* ``full_capture_bytes_per_shadowed_token``: the store's live bytes (every table) per token of
  the primary's answers, with every row captured in full (what the landed tree keeps);
* ``bytes_per_shadowed_token``: the same after compaction (steady state: every turn compacted);
  ``ratio`` is it over the full-capture figure (target <= 1/50);
* ``metrics_identical``: the stored comparisons are byte-identical before and after compaction,
  and every kept position's metrics recomputed from the compacted store (deltas decoded through
  their reference) equal those stored (computed from the full rows), bit for bit;
* ``flip_rows_kept``: the share of flips (forced flips and free divergences) whose rows are
  still full on both sides (target 1.0);
* ``secondary_bytes_ratio``: the bytes of the twin's rows (bit-identical to the reference)
  after compaction over their full-capture bytes (target <= 0.01);
* ``proxy_cpu_ms_per_shadowed_token``: the proxy's CPU time (process) per shadowed token:
  writing the records and the encoded rows, comparing and compacting. The workload's own work
  (the engines' side: flips, top-5s, row encoding; :func:`prepare_turn`) is done before the
  clock starts; ``compact_cpu_ms_per_shadowed_token`` is the compaction's share.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._logits import QWEN3_VOCAB, SOURCE, synthetic_rows
from benchmarks._targets import finish
from tensorverse.analysis.metrics import position_metrics, widen_bf16
from tensorverse.config import RetentionSection
from tensorverse.store import Store
from tensorverse.store.compaction import compact_store
from tensorverse.store.stored_rows import RowCompacted, StoredRows
from tensorverse.testing.shadow_workload import prepare_turn, store_turn


def _live(store: Store) -> int:
    return sum(store.table_bytes().values())


def _comparisons(store: Store, run_ids) -> dict[str, bytes]:
    return {rid: msgspec.json.encode(list(store.iter_comparisons(rid)), order="sorted") for rid in run_ids}


def _run_bytes(store: Store, rid: str) -> int:
    return sum(len(b) for _, b in store.read_rows(rid)) + sum(len(b) for _, b in store.read_compact_rows(rid))


def check_turn(store: Store, turn, src: StoredRows) -> tuple[bool, int, int]:
    """(identical, flips kept on both sides, flips) of one turn: the stored forced comparisons'
    metrics at every position still full on both sides, recomputed from the compacted store."""
    ok = True
    kept = total = 0
    ref_id = turn.run_ids[("secondary", "forced")]
    for backend in ("twin", "candidate"):
        rid = turn.run_ids[(backend, "forced")]
        comp = next(c for c in store.iter_comparisons(rid) if c.ref_run_id == ref_id)
        cols = comp.metrics
        full = []
        for p in range(len(turn.tokens)):
            try:
                r, c = src.row(ref_id, p), src.row(rid, p)
            except RowCompacted:
                continue
            full.append((p, widen_bf16(r), widen_bf16(c)))
        for p in comp.flips:
            total += 1
            kept += any(q == p for q, _, _ in full)
        if full:
            m = position_metrics(np.stack([r for _, r, _ in full]), np.stack([c for _, _, c in full]),
                                 [turn.tokens[p] for p, _, _ in full])
            for name in ("kl", "delta_p", "margin", "entropy"):
                got = getattr(m, name).tolist()
                want = [cols[name][p] for p, _, _ in full]
                ok &= got == want
            ok &= m.rank.tolist() == [cols["rank"][p] for p, _, _ in full]
    free_id = turn.run_ids[("candidate", "free")]
    fc = next(iter(store.iter_comparisons(free_id)))
    if fc.first_flip is not None:
        p = fc.first_flip
        total += 1
        try:
            src.row(free_id, p), src.row(turn.run_ids[("candidate", "forced")], p), src.row(ref_id, p)
            kept += 1
        except RowCompacted:
            pass
    return ok, kept, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=160, help="tokens per answer")
    ap.add_argument("--flip-share", type=float, default=0.02)
    ap.add_argument("--quick", action="store_true", help="2 turns of 64 tokens")
    args = ap.parse_args()
    if args.quick or os.environ.get("TENSORVERSE_BENCH_QUICK"):
        args.turns, args.tokens = 2, 64
    n = args.tokens
    policy = replace(RetentionSection().evidence_policy(), after_s=0.0)
    tmp = Path(tempfile.mkdtemp(prefix="tv-bench-growth-"))
    cpu_write = cpu_compact = 0.0
    try:
        with Store.open(tmp / "store", durable=False) as store:
            turns = []
            base = time.time_ns() - 3600 * 10**9
            for i in range(args.turns):
                ref, shadow = synthetic_rows(n, seed=100 + i)
                other, _ = synthetic_rows(n, seed=900 + i)
                # the engines' side (flips, top-5s, encoded rows) is the workload's, not timed
                prep = prepare_turn(f"turn{i:03d}", f"sess{i // 2:03d}", i % 2, ref, shadow, other,
                                    flip_share=args.flip_share, seed=i, created_ns=base + i)
                t0 = time.process_time()
                turns.append(store_turn(store, prep))
                cpu_write += time.process_time() - t0
                del prep
                print(f"turn {i + 1}/{args.turns} written and compared", file=sys.stderr)
                del ref, shadow, other
            tokens = sum(len(t.tokens) for t in turns)
            all_runs = [rid for t in turns for rid in t.run_ids.values()]
            twin = [t.run_ids[("twin", m)] for t in turns for m in ("forced", "free")]
            full_bytes = _live(store)
            twin_full = sum(_run_bytes(store, r) for r in twin)
            comps_before = _comparisons(store, all_runs)
            t0 = time.process_time()
            results = compact_store(store, policy)
            cpu_compact = time.process_time() - t0
            compacted = [r for r in results if r.status == "compacted"]
            after_bytes = _live(store)
            twin_after = sum(_run_bytes(store, r) for r in twin)
            same_comparisons = _comparisons(store, all_runs) == comps_before
            src = StoredRows(store)
            ok, kept, total = True, 0, 0
            for t in turns:
                a, b, c = check_turn(store, t, src)
                ok &= a
                kept += b
                total += c
        full_tok = full_bytes / tokens
        after_tok = after_bytes / tokens
        result = {
            "benchmark": "store_growth",
            "source": SOURCE,
            "vocab": QWEN3_VOCAB,
            "turns": args.turns,
            "tokens_per_turn": n,
            "shadows": 3,
            "modes": ["forced", "free"],
            "flip_share": args.flip_share,
            "turns_compacted": len(compacted),
            "rows": {"full": sum(r.rows_full for r in compacted), "delta": sum(r.rows_delta for r in compacted),
                     "compact": sum(r.rows_compact for r in compacted)},
            "policy": {"topk": policy.topk, "close_nats": policy.close_nats, "close_share": policy.close_share, "top_kl": policy.top_kl,
                       "sample": policy.sample},
            "full_capture_bytes_per_shadowed_token": round(full_tok, 1),
            "bytes_per_shadowed_token": round(after_tok, 1),
            "ratio": round(after_tok / full_tok, 5),
            "metrics_identical": bool(ok and same_comparisons),
            "flip_rows_kept": round(kept / total, 4) if total else None,
            "flips": total,
            "secondary_bytes_ratio": round(twin_after / twin_full, 5),
            "proxy_cpu_ms_per_shadowed_token": round((cpu_write + cpu_compact) * 1e3 / tokens, 2),
            "compact_cpu_ms_per_shadowed_token": round(cpu_compact * 1e3 / tokens, 2),
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "load": round(os.getloadavg()[0], 2),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"full capture {result['full_capture_bytes_per_shadowed_token'] / 1024:.0f} KiB/token, compacted "
          f"{result['bytes_per_shadowed_token'] / 1024:.1f} KiB/token (x{result['ratio']}); twin x"
          f"{result['secondary_bytes_ratio']}; flips kept {result['flip_rows_kept']}", file=sys.stderr)
    return finish("store_growth", result)


if __name__ == "__main__":
    sys.exit(main())
