"""Time per matrix grid point on vLLM-CPU, split into server start, replay (the forced + free
requests) and capture (waiting for the plugin's rows to land in the store, and the offline
comparison with the reference point's rows), plus the server stop; and the same matrix on a local
Ray cluster (``--executor ray``, issue 20): what Ray adds per point, and the projected wall time of
a 243-point hypercube on 8 nodes of 8 GPUs.

    python benchmarks/matrix.py [--cases 4] [--tokens 32] [--out DIR] [--executors local,ray]

Runs a three-point matrix (``--dtype`` bfloat16 = the reference, float32, and a named point with
``--block-size 32``) of the tiny Qwen3 (tensorverse/rig/models.py) over a small tool-call corpus, with the test rig's CPU
environment, once per executor (fresh results each time: no cache), and prints one JSON object on
its last line. The Ray run starts a local two-CPU cluster (its start is timed apart, ``ray_init_s``)
and asks for both CPUs per point, so its points run one at a time, as the local ones do.

``ray_overhead_s`` (per point) = ((Ray wall - the points' own run time) - (local wall - the points'
own run time)) / points: the wall time Ray adds beyond the same work done here, with each run's
own server start/replay/stop times taken out (they vary by tens of seconds with the machine's
load, which would swamp the difference of the two walls). ``ray_in_task_overhead_s``: inside the
task, the time not spent in the point's own run (scheduling the board call, unpacking the corpus,
imports). ``projected_243_points_h``: see :func:`project`.
"""

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
sys.path.insert(0, str(ROOT))  # this checkout

from benchmarks._targets import finish  # noqa: E402
from tensorverse.matrix.grid import run_matrix  # noqa: E402
from tensorverse.matrix.spec import parse_spec  # noqa: E402
from tensorverse.testing.matrix_specs import base_spec, make_corpus  # noqa: E402


def breakdown(rep: dict, results: Path) -> dict:
    """Per point: start, replay (less the rows wait), capture, stop, total."""
    points = {}
    for p in rep["points"]:
        t = p["timings"]
        if p["status"] != "ok":
            points[p["name"]] = {"status": p["status"], "start_s": t.get("start_s")}
            continue
        # runs overlap (cases in flight), so the rows wait is apportioned: the share of the runs'
        # own time spent waiting for rows, applied to the replay's wall time
        idx = json.loads((results / "runs" / p["key"] / "index.json").read_text())
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
    return points


def project(n_points: int, nodes: int, gpus_per_node: int, gpus_per_point: int, *, ref_s: float,
            point_s: float, overhead_s: float, compare_s: float, init_s: float) -> dict:
    """Wall time of ``n_points`` on ``nodes`` x ``gpus_per_node`` GPUs: the reference point alone
    first (its free output is every other point's basis), then the other points in waves of
    ``slots`` = nodes x gpus_per_node / gpus_per_point tasks at once, each wave as long as one
    point (start + replay + stop, plus Ray's per-point overhead), then the driver's comparison of
    every point with the reference (sequential, per-point ``compare_s``), plus Ray's start."""
    slots = max(1, nodes * gpus_per_node // gpus_per_point)
    waves = -(-(n_points - 1) // slots)
    wall = init_s + (ref_s + overhead_s) + waves * (point_s + overhead_s) + n_points * compare_s
    return {"points": n_points, "nodes": nodes, "gpus_per_node": gpus_per_node, "gpus_per_point": gpus_per_point,
            "slots": slots, "waves": waves, "wall_s": round(wall, 1), "wall_h": round(wall / 3600, 3),
            "model": "init + (ref + o) + ceil((N-1)/slots) * (point + o) + N * compare"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", help="keep the results here (default: a temporary directory)")
    ap.add_argument("--executors", default="local,ray", help="local, ray or both (default local,ray)")
    a = ap.parse_args()
    executors = [e.strip() for e in a.executors.split(",") if e.strip()]
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="tv-bench-matrix-"))
    for e in executors:
        if (root / f"results-{e}").exists():
            shutil.rmtree(root / f"results-{e}")  # measure real runs, never the cache
    root.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(root / "corpus", n_cases=a.cases, n_tokens=a.tokens)
    spec = parse_spec(base_spec(axes={"--dtype": ["bfloat16", "float32"]},
                                points=[{"name": "block-size=32", "settings": {"--block-size": 32}}]))
    runs: dict[str, dict] = {}
    for e in executors:
        ex, init_s = None, 0.0
        if e == "ray":
            from tensorverse.cluster.options import ExecutorOptions
            from tensorverse.matrix.executor import make_executor

            t0 = time.monotonic()
            ex = make_executor(ExecutorOptions(name="ray", ray_address="local", cpus_per_point=2))
            init_s = time.monotonic() - t0
        results = root / f"results-{e}"
        t0 = time.monotonic()
        try:
            rep = run_matrix(spec, str(corpus), results, progress=True, executor=ex)
        finally:
            if ex is not None:
                ex.close()
        wall = time.monotonic() - t0
        pts = breakdown(rep, results)
        own = sum(float(p["timings"].get("total_s") or 0) for p in rep["points"])
        runs[e] = {"wall_s": round(wall, 3), "points_own_s": round(own, 3), "init_s": round(init_s, 3),
                   "points": pts, "report": rep, "results": results}
    out = {"benchmark": "matrix", "cases": a.cases, "tokens": a.tokens,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()}}
    if "local" in runs:
        r = runs["local"]
        ok = [v for v in r["points"].values() if v["status"] == "ok"]
        out["points"] = r["points"]
        out["mean_per_point"] = {k: round(sum(v[k] or 0 for v in ok) / len(ok), 3)
                                 for k in ("start_s", "replay_s", "capture_s", "stop_s", "total_s")} if ok else {}
        out["wall_s"] = r["wall_s"]
        out["runs_bytes_on_disk"] = sum(f.stat().st_blocks * 512 for f in (r["results"] / "runs").rglob("*")
                                        if f.is_file() and "store" in f.parts)
    if "ray" in runs:
        r = runs["ray"]
        n = len(r["report"]["points"])
        placements = []
        for p in r["report"]["points"]:
            rec = json.loads((r["results"] / "runs" / p["key"] / "run.json").read_text())
            pl = rec.get("placement") or {}
            placements.append({"point": p["name"], "host": pl.get("host"), "attempt": pl.get("attempt"),
                               "in_task_overhead_s": round(float(pl.get("task_s") or 0)
                                                           - float((rec.get("timings") or {}).get("total_s") or 0), 3)})
        ray = {"wall_s": r["wall_s"], "ray_init_s": r["init_s"], "points_own_s": r["points_own_s"],
               "points": r["points"], "placements": placements,
               "ray_in_task_overhead_s": round(sum(x["in_task_overhead_s"] for x in placements) / n, 3)}
        if "local" in runs:
            lo = runs["local"]
            ray["ray_overhead_s"] = round(((r["wall_s"] - r["points_own_s"]) - (lo["wall_s"] - lo["points_own_s"])) / n, 3)
            ray["wall_ratio_ray_vs_local"] = round(r["wall_s"] / lo["wall_s"], 3)
            same = all(a_["summary"] == b_.get("summary") for a_, b_ in
                       zip(lo["report"]["points"], r["report"]["points"]))
            ray["same_summaries_as_local"] = same
        ok = [p for p in r["report"]["points"] if p["status"] == "ok"]
        ref = next(p for p in ok if p["reference"])
        others = [p for p in ok if not p["reference"]]
        point_s = sum(p["timings"]["total_s"] for p in others) / len(others)
        compare_s = sum(p["timings"].get("compare_s") or 0 for p in ok) / len(ok)
        o = max(0.0, ray.get("ray_overhead_s", ray["ray_in_task_overhead_s"]))
        proj = project(243, 8, 8, 1, ref_s=ref["timings"]["total_s"], point_s=point_s, overhead_s=o,
                       compare_s=compare_s, init_s=r["init_s"])
        ray["projection"] = proj
        out["ray"] = ray
        out["ray_overhead_s"] = ray.get("ray_overhead_s")
        out["projected_243_points_h"] = proj["wall_h"]
        out["projected_243_points_one_host_h"] = round((243 * (point_s + compare_s)) / 3600, 3)
    if "local" in runs and "ray" in runs:
        out["local_wall_s"], out["ray_wall_s"] = runs["local"]["wall_s"], runs["ray"]["wall_s"]
    if not a.out:
        shutil.rmtree(root, ignore_errors=True)
    return finish("matrix", out)


if __name__ == "__main__":
    sys.exit(main())
