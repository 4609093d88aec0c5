"""Benchmark: what evidence chosen at the source saves the proxy, against full capture, same turns.

    python benchmarks/evidence_at_source.py            # ~2-3 min on 2 cores
    python benchmarks/evidence_at_source.py --quick    # 2 turns of 48 tokens (or TENSORVERSE_BENCH_QUICK=1)

The line-up of the issue's measurement (`tensorverse.testing.shadow_workload`: three shadows, each
forced and free, 151,936-entry rows of realistic entropy from `benchmarks/_logits.py`, a candidate
that flips at ``--flip-share`` of the positions). Each turn is prepared twice by the engines' side:
every row encoded in full (``logits = "full"``), and every row reduced as the capture plugin
reduces it with ``tv_compact`` (`tensorverse.capture.reduce`; the proxy's ``tv_full``: the
primary's close calls and the seeded sample, `tensorverse.shadow.evidence`). Then the proxy's side,
timed on this process's CPU clock: the rows and records written through the store's real write
path, the real comparisons, and (full capture only, as the proxy does it later) the turn's
compaction. The engines' side is not timed as the proxy's.

Figures:

* ``wire_bytes_per_shadowed_token`` / ``full_wire_bytes_per_shadowed_token``: row bytes the
  plugins send per primary token (frames' blobs; the 32-byte frame header and the capture id are
  left out of both), and ``wire_ratio`` (target <= 1/50);
* ``proxy_cpu_ms_per_shadowed_token`` (evidence) and ``full_proxy_cpu_ms_per_shadowed_token``
  (writes + comparisons + compaction), and ``shadowed_tokens_per_s_per_core`` (1000 / the
  former): how many shadowed tokens one proxy core keeps up with;
* ``store_bytes_per_shadowed_token`` (evidence, as stored) and ``full_compacted_bytes_per_shadowed_token``;
* ``identical``: every comparison's flips, flip classes, first flip and every free run's
  divergence and tool-call verdict are the same both ways; ``compact_positions``: the forced
  comparisons' positions computed from compact rows;
* ``engine_ms_per_row`` both ways: the engines' CPU per row (reduce and encode vs encode), here
  for information (the plugin runs it on the shadow's host, not in the proxy);
* ``full_rows``: rows the source sent in full, per run kind.

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import scipy.stats  # noqa: F401  (the comparisons import it on first use: a running proxy has it)

from benchmarks._logits import QWEN3_VOCAB, SOURCE, synthetic_rows
from benchmarks._targets import finish
from tensorverse.config import RetentionSection
from tensorverse.shadow.evidence import SourceEvidence
from tensorverse.store import Store
from tensorverse.store.records import Comparison
from tensorverse.store.compaction import compact_store
from tensorverse.testing.shadow_workload import prepare_turn, store_turn

KEYS = ("flips", "flip_classes", "first_flip", "diverged", "flip_class", "verdict")


def _live(store: Store) -> int:
    return sum(v for k, v in store.table_bytes().items() if k in ("rows", "rows_compact"))


def _wire(prep) -> int:
    return sum(len(r[1]) for _, _, blobs in prep.runs.values() for r in blobs)


def _key(c: Comparison) -> tuple:
    return c.turn_id, c.backend, c.mode, c.ref_role


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96, help="tokens per answer")
    ap.add_argument("--flip-share", type=float, default=0.02)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick or os.environ.get("TENSORVERSE_BENCH_QUICK"):
        args.turns, args.tokens = 2, 48
    r = RetentionSection()
    policy = replace(r.evidence_policy(), after_s=0.0)
    evidence = SourceEvidence(k=r.topk, close_nats=r.close_nats, close_share=r.close_share, sample=r.sample,
                              seed=r.seed)
    tmp = Path(tempfile.mkdtemp(prefix="tv-bench-evidence-"))
    cpu = {"full": 0.0, "evidence": 0.0}
    engine = {"full": 0.0, "evidence": 0.0}
    wire = {"full": 0, "evidence": 0}
    comparisons: dict[str, list[Comparison]] = {"full": [], "evidence": []}
    full_rows: dict[str, list[int]] = {}
    tokens = 0
    try:
        stores = {m: Store.open(tmp / m, durable=False) for m in ("full", "evidence")}
        base = time.time_ns() - 3600 * 10**9
        for i in range(args.turns):
            ref, shadow = synthetic_rows(args.tokens, seed=100 + i)
            other, _ = synthetic_rows(args.tokens, seed=900 + i)
            for mode, ev in (("full", None), ("evidence", evidence)):
                t0 = time.process_time()
                prep = prepare_turn(f"turn{i:03d}", f"sess{i:03d}", 0, ref, shadow, other, flip_share=args.flip_share,
                                    seed=i, created_ns=base + i, evidence=ev)
                engine[mode] += time.process_time() - t0
                wire[mode] += _wire(prep)
                if mode == "evidence":
                    for (b, m), (_, _, blobs) in prep.runs.items():
                        f = full_rows.setdefault(f"{b}/{m}", [0, 0])
                        f[0] += sum(1 for x in blobs if not x[3])
                        f[1] += len(blobs)
                t0 = time.process_time()
                turn = store_turn(stores[mode], prep)
                cpu[mode] += time.process_time() - t0
                comparisons[mode].extend(turn.comparisons)
            tokens += args.tokens
            print(f"turn {i + 1}/{args.turns}: both ways written and compared", file=sys.stderr)
        full_before = _live(stores["full"])
        t0 = time.process_time()
        compact_store(stores["full"], policy)
        cpu["full"] += time.process_time() - t0
        full_after = _live(stores["full"])
        ev_bytes = _live(stores["evidence"])
        for s in stores.values():
            s.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    by = {m: {_key(c): c for c in comparisons[m]} for m in comparisons}
    # a field one mode's record does not have (a forced comparison has no 'diverged') reads as None
    identical = set(by["full"]) == set(by["evidence"]) and all(
        getattr(by["evidence"][k], f, None) == getattr(c, f, None) for k, c in by["full"].items() for f in KEYS)
    compact_positions = sum(len(getattr(c, "compact_positions", None) or []) for c in comparisons["evidence"])
    rows = sum(len(blobs) for _, _, blobs in prep.runs.values()) * args.turns
    result = {
        "benchmark": "evidence_at_source",
        "source": SOURCE,
        "vocab": QWEN3_VOCAB,
        "turns": args.turns,
        "tokens_per_turn": args.tokens,
        "shadows": 3,
        "modes": ["forced", "free"],
        "flip_share": args.flip_share,
        "policy": {"k": evidence.k, "close_nats": evidence.close_nats, "close_share": evidence.close_share,
                   "sample": evidence.sample},
        "full_wire_bytes_per_shadowed_token": round(wire["full"] / tokens, 1),
        "wire_bytes_per_shadowed_token": round(wire["evidence"] / tokens, 1),
        "wire_ratio": round(wire["evidence"] / wire["full"], 5),
        "full_proxy_cpu_ms_per_shadowed_token": round(cpu["full"] * 1e3 / tokens, 3),
        "proxy_cpu_ms_per_shadowed_token": round(cpu["evidence"] * 1e3 / tokens, 3),
        "shadowed_tokens_per_s_per_core": round(tokens / cpu["evidence"], 1),
        "full_shadowed_tokens_per_s_per_core": round(tokens / cpu["full"], 1),
        "full_capture_store_bytes_per_shadowed_token": round(full_before / tokens, 1),
        "full_compacted_bytes_per_shadowed_token": round(full_after / tokens, 1),
        "store_bytes_per_shadowed_token": round(ev_bytes / tokens, 1),
        "identical": identical,
        "compact_positions": compact_positions,
        "full_rows": full_rows,
        "engine_ms_per_row": {m: round(engine[m] * 1e3 / rows, 3) for m in engine},
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "load": round(os.getloadavg()[0], 2),
    }
    print(f"wire {result['full_wire_bytes_per_shadowed_token'] / 1024:.0f} -> "
          f"{result['wire_bytes_per_shadowed_token'] / 1024:.1f} KiB/token (x{result['wire_ratio']}); proxy CPU "
          f"{result['full_proxy_cpu_ms_per_shadowed_token']} -> {result['proxy_cpu_ms_per_shadowed_token']} ms/token; "
          f"identical {identical}", file=sys.stderr)
    return finish("evidence_at_source", result)


if __name__ == "__main__":
    sys.exit(main())
