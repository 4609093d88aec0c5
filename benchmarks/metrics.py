"""What the Prometheus metrics cost: updates per compared token, and a /metrics scrape.

    python benchmarks/metrics.py [--quick]

us_per_token  time of `Metrics.observe_comparisons` on a turn's stored comparisons (5 shadow
              backends, forced against the primary and the secondary + free; 512-token outputs,
              KL at every position, flips in several regions), minus the same loop without
              metrics, divided by the tokens compared. Target: under 2 µs.
scrape_ms     `GET /metrics` rendering (prometheus_client text) with 5 backends, every histogram
              populated, the proxy's counters and a real store's gauges; median of many.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import generate_latest

from benchmarks._targets import finish

from tensorverse.config import parse_config
from tensorverse.exporters.metrics import REGIONS, Metrics
from tensorverse.store.records import Comparison, ForcedComparison, FreeComparison, Run

BACKENDS = ["flashinfer", "fp8-kv", "nvfp4", "tp2", "secondary"]


def config():
    return parse_config({"primary": {"url": "http://p:1"}, "shadows": [
        {"name": b, "url": f"http://{b}:1", **({"role": "secondary"} if b == "secondary" else {})}
        for b in BACKENDS]})


def turn_results(rng: np.random.Generator, n: int) -> list[Comparison]:
    out = []
    regions = [REGIONS[i % 5] for i in range(n)]
    for b in BACKENDS:
        role = "secondary" if b == "secondary" else "shadow"
        refs = ["primary"] + ([] if role == "secondary" else ["secondary"])
        for rr in refs:
            kl = np.abs(rng.standard_normal(n)) * 10 ** rng.uniform(-6, 0, n)
            flips = sorted(rng.choice(n, size=int(rng.integers(0, 12)), replace=False).tolist())
            by_region: dict[str, int] = {}
            for f in flips:
                by_region[regions[f]] = by_region.get(regions[f], 0) + 1
            out.append(ForcedComparison(run_id=f"{b}-f", ref_run_id=rr, backend=b, role=role, ref_role=rr, n=n,
                                        flips=flips, first_flip=flips[0] if flips else None,
                                        summary={"n": n, "flips": len(flips), "flips_by_region": by_region},
                                        metrics={"kl": kl.tolist()}, noise={"verdict": "within noise"}))
        pos = int(rng.integers(0, n))
        out.append(FreeComparison(run_id=f"{b}-r", ref_run_id="primary", backend=b, role=role, ref_role="primary",
                                  diverged=True, common_prefix=pos, first_flip=pos, verdict="match",
                                  ref_tool_calls=1, cand_tool_calls=1, region="tool_args"))
    return out


def tokens_of(results: list[Comparison]) -> int:
    return sum((r.n or 0) if isinstance(r, ForcedComparison) else (r.common_prefix or 0) + 1 for r in results)


def bench_updates(turns: int, n: int) -> float:
    rng = np.random.default_rng(0)
    data = [turn_results(rng, n) for _ in range(turns)]
    tokens = sum(tokens_of(t) for t in data)
    m = Metrics.from_config(config())

    def baseline() -> float:
        t0 = time.perf_counter()
        for t in data:
            for _r in t:  # what the tee does without metrics: nothing per result
                pass
        return time.perf_counter() - t0

    def with_metrics() -> float:
        t0 = time.perf_counter()
        for t in data:
            m.observe_comparisons(t)
        return time.perf_counter() - t0

    with_metrics()  # warm-up
    base = min(baseline() for _ in range(3))
    best = min(with_metrics() for _ in range(3))
    return max(0.0, best - base) / tokens * 1e6


def bench_scrape(reps: int) -> float:
    from tensorverse.store import Store

    rng = np.random.default_rng(1)
    m = Metrics.from_config(config())
    for _ in range(20):
        m.observe_comparisons(turn_results(rng, 256))
    for b in BACKENDS:
        for mode in ("forced", "free"):
            m.observe_runs([Run(id=f"{b}-{mode}", turn_id="t", backend=b, mode=mode, status="ok",
                                timings={"total_s": 0.5})])
    for i in range(200):
        m.observe_request("ok", added_latency_s=1e-4 * (1 + i % 50), endpoint="chat.completions")
    stats = {"proxy": {"requests": 1000, "turns": 900}, "recorder": {"recorded": 900},
             "shadow": {"queued": 900, "dropped_queue_full": 3, "skipped": {"no_tools": 5}, "queue_depth": 2,
                        "queue_size": 256, "backend": {b: {"ok": 800, "failed": 1, "timed_out": 2} for b in BACKENDS}},
             "ingest": {"rows": 10**6, "bytes": 10**10, "plugins": {"rows_captured": 10**6}},
             "sessions": {"created": 300, "tracked_sessions": 100}}
    with tempfile.TemporaryDirectory() as d:
        store = Store.open(Path(d) / "store", durable=False)
        try:
            reg = m.registry(lambda: stats, store)
            text = generate_latest(reg)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                generate_latest(reg)
                times.append(time.perf_counter() - t0)
        finally:
            store.close()
    lines = text.count(b"\n")
    print(f"/metrics: {len(text)} bytes, {lines} lines", file=sys.stderr)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    turns, reps = (20, 30) if args.quick else (200, 200)
    us = bench_updates(turns, 512)
    ms = bench_scrape(reps)
    print(f"metric updates: {us:.3f} us per compared token (target < 2); scrape: {ms:.2f} ms", file=sys.stderr)
    return finish("metrics", {"us_per_token": round(us, 4), "scrape_ms": round(ms, 3), "backends": len(BACKENDS),
                              "tokens_per_comparison": 512})


if __name__ == "__main__":
    sys.exit(main())
