"""Benchmark: how long the relay's event loop stalls while the proxy analyses shadowed turns.

    python benchmarks/relay_loop_lag.py            # ~1-2 min on 2 cores
    python benchmarks/relay_loop_lag.py --quick    # fewer, shorter turns (or TENSORVERSE_BENCH_QUICK=1)

The proxy relays every agent stream on one asyncio loop. Whatever else runs in its process with
the GIL held delays that loop, and so every stream in flight. Comparing a shadowed turn (decoding
its rows, the per-position metrics: `tensorverse.shadow.compare`) is the heaviest such work at
Qwen3's vocabulary, and so is planning a turn's compaction (every row decoded for its top-k).
This benchmark stores shadowed turns (`tensorverse.testing.shadow_workload`: 151,936-entry rows
of realistic entropy, three shadows each forced and free). Then, on one asyncio loop, a probe
sleeps 1 ms over and over and records how late each wake-up is (the loop's lag), while the same
turns are analysed one after the other, in each phase:

* ``compare_thread``: the comparisons in a thread of the loop's process (``[shadow]
  analysis_workers = 0``, how the proxy ran them before);
* ``compare_workers``: in one worker process (`tensorverse.shadow.analysis_workers`, the
  default); the results come back to the loop's process, as the proxy stores them from there;
* ``compact_thread`` and ``compact_workers``: the compaction of every turn planned (its rows
  read, compacted and re-encoded, nothing committed) by the retention keeper's thread, or by a
  worker the keeper's thread waits on;
* ``ingest_thread`` and ``ingest_worker``: the proxy's real ``/ingest`` (`tensorverse.proxy.ingest`,
  an aiohttp app on the probe's loop) taking batches of 8 full Qwen3 rows (~4 MB) posted by
  another process, as a capture sink is, with each body parsed, checked and written in a thread of
  the loop's process by its store's writer thread (``[admin] ingest_process = false``) or, as by
  default now, in the ingest worker process (the loop's process reads the body and writes it to
  the worker's pipe); ``ingest_read_only``: the same bodies read and answered, nothing parsed or
  stored, the floor of any design where the proxy's process takes the body;
  ``ingest_evidence_thread`` and ``ingest_evidence_worker``: the same two ways with the bodies the
  taps send with evidence at the source (18 compact rows and one full row, ~0.2 MB), 15 times as
  many; each ingest phase also reports the loop's process's CPU per batch;
* ``idle``: the probe alone, the machine's own floor.

Figures: the probe's lag p50/p99/max in milliseconds for each phase; each phase's wall time per
turn; ``*_p99_over_idle`` (a workers phase's p99 lag over the idle floor's); ``results_identical``
and ``plans_identical`` (both modes return the same comparisons and the same compaction plans).
Neither mode commits anything, so both do the same work in the same order. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._logits import QWEN3_VOCAB, SOURCE, synthetic_rows
from benchmarks._targets import finish
from tensorverse.shadow.compare import compare_turn, put_comparisons
from tensorverse.shadow.analysis_workers import AnalysisWorkers
from tensorverse.store import Store
from tensorverse.store.compaction import EvidencePolicy, compact_store
from tensorverse.testing.shadow_workload import prepare_turn, store_turn

PROBE_S = 0.001

# The capture sink's side of the ingest phases, built before "go": batches of 8 full rows, or
# (evidence) of 18 compact rows and one full row, as the taps send them with evidence at the source.
_POSTER = """
import sys
import httpx
sys.path.insert(0, ".")
from benchmarks._logits import synthetic_rows
from tensorverse.capture.frames import CONTENT_TYPE, encode_frame
from tensorverse.store.codec import encode_row
from tensorverse.store.compact import compact_row, encode_compact
port, tag, n, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
row = synthetic_rows(1, seed=7)[0][0]
blob, small = encode_row(row), encode_compact(compact_row(row, k=20))
if kind == "full":
    bodies = [b"".join(encode_frame(f"ing-{tag}-{i}", p, blob, seq=p + 1, origin=i + 1) for p in range(8))
              for i in range(n)]
else:
    bodies = [b"".join(encode_frame(f"ing-{tag}-{i}", p, small if p < 18 else blob, seq=p + 1, origin=i + 1,
                                    compact=p < 18) for p in range(19)) for i in range(n)]
print("ready", flush=True)
sys.stdin.readline()
ok = 0
with httpx.Client(timeout=60) as c:
    for body in bodies:
        r = c.post(f"http://127.0.0.1:{port}/ingest", content=body,
                   headers={"Authorization": "Bearer t", "Content-Type": CONTENT_TYPE})
        ok += r.status_code == 200
print(ok, flush=True)
"""


def _stats(lags: list[float]) -> dict[str, float]:
    a = np.asarray(lags) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 3), "p99_ms": round(float(np.percentile(a, 99)), 3),
            "max_ms": round(float(a.max()), 3), "samples": int(a.size)}


async def _probe(stop: asyncio.Event, lags: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(PROBE_S)
        lags.append(max(0.0, loop.time() - t - PROBE_S))


async def _phase(work: Callable[[], Awaitable[Any]] | None, idle_s: float) -> tuple[dict[str, float], Any, float]:
    stop = asyncio.Event()
    lags: list[float] = []
    probe = asyncio.create_task(_probe(stop, lags))
    await asyncio.sleep(0.2)  # the probe settles
    lags.clear()
    t0 = time.perf_counter()
    out = await work() if work is not None else await asyncio.sleep(idle_s)
    wall = time.perf_counter() - t0
    stop.set()
    await probe
    return _stats(lags), out, wall


def _canon(results: list[list[Any]]) -> bytes:
    # every field (a record that crossed a process boundary no longer omits its defaults)
    return msgspec.json.encode([[msgspec.structs.asdict(c) for c in sorted(r, key=lambda c: (c.run_id, c.ref_run_id))]
                                for r in results], order="sorted")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", default=os.environ.get("TENSORVERSE_BENCH_QUICK") == "1")
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    a = ap.parse_args(argv)
    turns = a.turns or (3 if a.quick else 8)
    tokens = a.tokens or (24 if a.quick else 48)
    tmp = Path(tempfile.mkdtemp(prefix="tv-looplag-"))
    try:
        with Store.open(tmp / "store", durable=False) as store:
            ids = []
            for i in range(turns):
                ref, shadow = synthetic_rows(tokens, seed=100 + i)
                other, _ = synthetic_rows(tokens, seed=900 + i)
                t = prepare_turn(f"turn{i:03d}", f"sess{i:03d}", 0, ref, shadow, other, flip_share=0.02, seed=i,
                                 created_ns=10**18 + i)
                store_turn(store, t, compare=False)
                ids.append(t.turn_id)
            print(f"relay_loop_lag: {turns} turns of {tokens} tokens stored ({QWEN3_VOCAB} vocabulary)",
                  file=sys.stderr, flush=True)
            workers = AnalysisWorkers(store.path, 1)

            async def in_thread() -> list[list[Any]]:
                return [await asyncio.to_thread(compare_turn, store, tid, store_results=False) for tid in ids]

            async def in_workers() -> list[list[Any]]:
                return [await workers.compare(store, tid) for tid in ids]

            policy = EvidencePolicy(after_s=0.0)
            now = 2 * 10**18
            planner = workers.planner(store)

            async def compact_in_thread() -> list:
                return await asyncio.to_thread(compact_store, store, policy, now_ns=now, dry_run=True)

            async def compact_in_workers() -> list:
                return await asyncio.to_thread(compact_store, store, policy, now_ns=now, dry_run=True,
                                               planner=planner)

            from aiohttp import web

            from tensorverse.proxy.admin import make_admin_app
            from tensorverse.proxy.ingest import Ingest, IngestWorker, Stored

            n_batches = 10 if a.quick else 100

            class ReadOnly:  # takes every body, does nothing with it
                restarts = 0

                async def store(self, body: bytes | bytearray) -> Stored:
                    return Stored(200)

                def close(self) -> None:
                    pass

            async def ingest_phase(mode: str, kind: str = "full") -> dict[str, Any]:
                n = n_batches if kind == "full" else 15 * n_batches
                worker: Any = (IngestWorker(store.path, durable=False) if mode == "worker"
                               else ReadOnly() if mode == "read_only" else None)
                ing = Ingest(store, "t", worker=worker)
                if mode == "worker":  # started and warm, as in a running proxy
                    assert (await worker.store(b"")).status == 200
                runner = web.AppRunner(make_admin_app(lambda: {}, ing), access_log=None)
                await runner.setup()
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
                tag = f"{kind}-{mode}"
                # the sink is another process, as the capture plugin is: its work is not the proxy's
                child = subprocess.Popen([sys.executable, "-c", _POSTER, str(port), tag, str(n), kind],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         cwd=str(Path(__file__).resolve().parent.parent))
                assert child.stdout is not None and child.stdin is not None
                assert child.stdout.readline().strip() == "ready"

                def post() -> int:
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    return int(child.stdout.readline())

                try:
                    cpu0 = time.process_time()
                    lag, ok, wall = await _phase(lambda: asyncio.to_thread(post), 0)
                    cpu = time.process_time() - cpu0
                finally:
                    child.wait(30)
                    await runner.cleanup()
                    ing.close()
                # the loop's process's CPU (the probe's own included, the same in every phase)
                return {**lag, "batches_ok": ok, "s_per_batch": round(wall / n, 5),
                        "process_cpu_ms_per_batch": round(1e3 * cpu / n, 3)}

            async def run() -> dict[str, Any]:
                await workers.compare(store, ids[0])  # the worker started and warm, as in a running proxy
                await asyncio.to_thread(compare_turn, store, ids[0], store_results=False)
                out: dict[str, Any] = {}
                c_thread, thread_out, s1 = await _phase(in_thread, 0)
                c_workers, workers_out, s2 = await _phase(in_workers, 0)
                for r in thread_out:  # compared turns, as compaction needs them
                    put_comparisons(store, r)
                k_thread, plans_thread, s3 = await _phase(compact_in_thread, 0)
                k_workers, plans_workers, s4 = await _phase(compact_in_workers, 0)
                ingest_thread = await ingest_phase("thread")
                ingest_worker = await ingest_phase("worker")
                ingest_read_only = await ingest_phase("read_only")
                ev_thread = await ingest_phase("thread", "evidence")
                ev_worker = await ingest_phase("worker", "evidence")
                idle, _, _ = await _phase(None, max(1.0, s1))
                out.update(compare_thread=c_thread, compare_workers=c_workers, compact_thread=k_thread,
                           compact_workers=k_workers, ingest_thread=ingest_thread, ingest_worker=ingest_worker,
                           ingest_read_only=ingest_read_only, ingest_evidence_thread=ev_thread,
                           ingest_evidence_worker=ev_worker,
                           idle=idle)
                out.update({f"{k}_s_per_turn": round(v / turns, 4) for k, v in
                            (("compare_thread", s1), ("compare_workers", s2), ("compact_thread", s3),
                             ("compact_workers", s4))})
                out["results_identical"] = _canon(thread_out) == _canon(workers_out)
                out["plans_identical"] = (plans_thread == plans_workers
                                          and [p.status for p in plans_thread] == ["compacted"] * turns)
                return out

            try:
                res = asyncio.run(run())
            finally:
                workers.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "benchmark": "relay_loop_lag", "turns": turns, "tokens_per_turn": tokens, "vocab": QWEN3_VOCAB,
        "rows": SOURCE, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        **res,
    }
    floor = max(res["idle"]["p99_ms"], 0.05)
    for job in ("compare", "compact"):
        result[f"{job}_p99_over_idle"] = round(res[f"{job}_workers"]["p99_ms"] / floor, 3)
        result[f"{job}_thread_p99_over_idle"] = round(res[f"{job}_thread"]["p99_ms"] / floor, 3)
    result["ingest_p99_over_idle"] = round(res["ingest_worker"]["p99_ms"] / floor, 3)
    result["ingest_thread_p99_over_idle"] = round(res["ingest_thread"]["p99_ms"] / floor, 3)
    result["ingest_read_only_p99_over_idle"] = round(res["ingest_read_only"]["p99_ms"] / floor, 3)
    result["ingest_evidence_p99_over_idle"] = round(res["ingest_evidence_worker"]["p99_ms"] / floor, 3)
    result["ingest_evidence_thread_p99_over_idle"] = round(res["ingest_evidence_thread"]["p99_ms"] / floor, 3)
    return finish("relay_loop_lag", result)


if __name__ == "__main__":
    sys.exit(main())
