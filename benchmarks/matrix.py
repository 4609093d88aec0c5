"""Time per matrix grid point on vLLM-CPU, split into server start, replay (the forced + free
requests) and capture (waiting for the plugin's rows to land in the store, and the offline
comparison with the reference point's rows), plus the server stop.

    python benchmarks/matrix.py [--cases 4] [--tokens 32] [--out DIR]

Runs a two-point matrix (``--dtype`` bfloat16 = the reference, float32) of the tiny Qwen3
(tensorverse/rig/models.py) over a small tool-call corpus, with the test rig's CPU environment, and
prints one JSON object on its last line."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "matrix"))

from matrix_support import base_spec, make_corpus  # noqa: E402
from tensorverse.matrix.grid import run_matrix  # noqa: E402
from tensorverse.matrix.spec import parse_spec  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", help="keep the results here (default: a temporary directory)")
    a = ap.parse_args()
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="tv-bench-matrix-"))
    if (root / "results").exists():
        shutil.rmtree(root / "results")  # measure real runs, never the cache
    root.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(root / "corpus", n_cases=a.cases, n_tokens=a.tokens)
    spec = parse_spec(base_spec(axes={"--dtype": ["bfloat16", "float32"]}))
    t0 = time.monotonic()
    rep = run_matrix(spec, str(corpus), root / "results", progress=True)
    wall = time.monotonic() - t0
    points = {}
    for p in rep["points"]:
        t = p["timings"]
        if p["status"] != "ok":
            points[p["name"]] = {"status": p["status"], "start_s": t.get("start_s")}
            continue
        # runs overlap (cases in flight), so the rows wait is apportioned: the share of the runs'
        # own time spent waiting for rows, applied to the replay's wall time
        idx = json.loads((root / "results" / "runs" / p["key"] / "index.json").read_text())
        runs = [e for per in idx["cases"].values() for ent in per.values() for e in ent.values()]
        run_s = sum(float((e.get("timings") or {}).get("total_s") or 0) for e in runs)
        wait_s = sum(float((e.get("timings") or {}).get("rows_wait_s") or 0) for e in runs)
        share = wait_s / run_s if run_s else 0.0
        rows_wall = (t.get("replay_s") or 0.0) * share
        capture = rows_wall + (t.get("compare_s") or 0.0)
        points[p["name"]] = {
            "status": p["status"], "start_s": t.get("start_s"),
            "replay_s": round((t.get("replay_s") or 0.0) - rows_wall, 3),
            "rows_wait_share": round(share, 4), "rows_wait_wall_s": round(rows_wall, 3),
            "compare_s": t.get("compare_s"),
            "capture_s": round(capture, 3), "stop_s": t.get("stop_s"), "total_s": t.get("total_s"),
            "positions": (p.get("summary") or {}).get("positions"), "flips": (p.get("summary") or {}).get("flips"),
        }
    ok = [v for v in points.values() if v["status"] == "ok"]
    mean = {k: round(sum(v[k] or 0 for v in ok) / len(ok), 3) for k in ("start_s", "replay_s", "capture_s", "stop_s", "total_s")} if ok else {}
    store_bytes = sum(f.stat().st_blocks * 512 for f in (root / "results" / "runs").rglob("*") if f.is_file() and "store" in f.parts)
    out = {"benchmark": "matrix", "cases": a.cases, "tokens": a.tokens, "points": points,
           "mean_per_point": mean, "wall_s": round(wall, 3), "runs_bytes_on_disk": store_bytes,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load": os.getloadavg()}}
    if not a.out:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
