"""Turn comparisons in worker processes (`tensorverse.shadow.analysis_workers`): the same results
as in the proxy's process, stored by the proxy's writer, and a killed worker costs nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import numpy as np
import pytest

from tensorverse.shadow.compare import compare_turn
from tensorverse.shadow.analysis_workers import AnalysisWorkers
from tensorverse.store import Store
from tensorverse.store.records import Turn
from tensorverse.testing.shadow_workload import prepare_turn, store_turn


def _turn(store, tid, seed):
    rng = np.random.default_rng(seed)
    ref = (rng.standard_normal((24, 512)) * 4).astype(np.float32)
    shadow = ref + rng.standard_normal(ref.shape).astype(np.float32) * 0.01
    other = (rng.standard_normal((24, 512)) * 4).astype(np.float32)
    t = prepare_turn(tid, f"s-{tid}", 0, ref, shadow, other, flip_share=0.2, seed=seed, created_ns=10**18)
    store_turn(store, t, compare=False)
    return t


def _canon(results):
    # every field (a record that crossed a process boundary no longer omits its defaults)
    rows = [msgspec.structs.asdict(r) for r in sorted(results, key=lambda r: (r.run_id, r.ref_run_id))]
    return msgspec.json.encode(rows, order="sorted")


def test_a_worker_compares_a_turn_exactly_as_the_proxy_process_does(store):
    _turn(store, "t1", 1)
    workers = AnalysisWorkers(store.path, 1)
    try:
        got = asyncio.run(workers.compare(store, "t1"))
    finally:
        workers.close()
    want = compare_turn(store, "t1", store_results=False)
    assert len(got) == len(want) >= 6 and _canon(got) == _canon(want)  # three shadows, forced and free
    assert workers.counters == {"compared": 1, "planned": 0, "in_thread": 0, "worker_restarts": 0}
    assert list(store.iter_comparisons("t1.candidate.forced")) == []  # a worker stores nothing


def test_a_killed_worker_costs_no_turn_and_is_replaced(store):
    _turn(store, "t1", 1)
    rng = np.random.default_rng(5)  # a turn long enough to kill its worker mid-comparison
    ref = (rng.standard_normal((128, 30000)) * 4).astype(np.float32)  # ~2 s to compare here
    t2 = prepare_turn("t2", "s-t2", 0, ref, ref + np.float32(0.01), ref[::-1].copy(), flip_share=0.2, seed=2,
                      created_ns=10**18)
    store_turn(store, t2, compare=False)
    workers = AnalysisWorkers(store.path, 1)

    async def go():
        first = await workers.compare(store, "t1")
        pids = list(workers._pool._processes)  # type: ignore[union-attr]
        job = asyncio.ensure_future(workers.compare(store, "t2"))
        await asyncio.sleep(0.3)  # the worker is reading t2's rows
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        second = await job  # its worker died mid-job: compared in this process
        third = await workers.compare(store, "t1")  # a new worker
        return first, second, third

    try:
        first, second, third = asyncio.run(go())
    finally:
        workers.close()
    assert _canon(second) == _canon(compare_turn(store, "t2", store_results=False))
    assert _canon(third) == _canon(first)
    assert workers.counters == {"compared": 3, "planned": 0, "in_thread": 1, "worker_restarts": 1}


def _gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts: it runs nothing and holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_proxy_leaves_no_worker_behind(tmp_path):
    """A pool's worker holds both ends of its job queue and the fork server's liveness pipe, so
    when the process that owns the pool is killed (SIGKILL, the OOM killer) neither sees it: the
    worker (hundreds of MB once it has compared a turn) and the fork server stayed for good. Each
    worker now exits when its owner does."""
    Store.open(tmp_path / "s").close()
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from tensorverse.shadow.analysis_workers import AnalysisWorkers
        w = AnalysisWorkers({str(tmp_path / "s")!r}, 1)
        _, fut = w._submit(os.getpid)
        print(fut.result(), flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    worker = server = 0
    try:
        worker = int(owner.stdout.readline())  # type: ignore[union-attr]
        with open(f"/proc/{worker}/stat") as f:
            server = int(f.read().rsplit(")", 1)[1].split()[1])  # the fork server: the worker's parent
        assert not _gone(worker) and not _gone(server)
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 10
        while not (_gone(worker) and _gone(server)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker) and _gone(server)
    finally:
        owner.kill()
        for pid in (worker, server):
            if pid and not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_proxy_runner_stores_what_its_workers_computed(store):
    from tensorverse.proxy.tee import PackageRunner

    _turn(store, "t1", 1)
    want = compare_turn(store, "t1", store_results=False)
    workers = AnalysisWorkers(store.path, 1)
    runner = PackageRunner(store, [], workers=workers)

    async def go():
        try:
            return await runner.finish(Turn(id="t1"), store)
        finally:
            await runner.close()
            workers.close()

    got = asyncio.run(go())
    assert _canon(got) == _canon(want)
    stored = {(c.run_id, c.ref_run_id): c for r in store.iter_runs("t1") for c in store.iter_comparisons(r.id)}
    assert set(stored) == {(r.run_id, r.ref_run_id) for r in want}
    assert _canon(stored.values()) == _canon(want)


def test_workers_need_at_least_one_process(tmp_path):
    with pytest.raises(ValueError):
        AnalysisWorkers(tmp_path, 0)


def test_a_compaction_planned_in_a_worker_commits_what_the_proxy_would(tmp_path):
    from tensorverse.store.compaction import EvidencePolicy, compact_store, plan_compaction

    policy = EvidencePolicy(after_s=0.0)
    plans = {}
    for name in ("here", "worker"):
        with Store.open(tmp_path / name, durable=False) as st:
            _turn(st, "t1", 1)
            compare_turn(st, "t1")
            plans[name] = plan_compaction(st, "t1", policy, now_ns=10**19)
            workers = AnalysisWorkers(st.path, 1) if name == "worker" else None
            try:
                res = compact_store(st, policy, now_ns=10**19,
                                    planner=workers.planner(st) if workers is not None else None)
            finally:
                if workers is not None:
                    workers.close()
            assert [r.status for r in res] == ["compacted"]
            plans[name + "-record"] = st.compaction("t1")
            plans[name + "-rows"] = {r.id: st.read_rows(r.id) for r in st.iter_runs("t1")}
    assert workers.counters["planned"] == 1 and workers.counters["in_thread"] == 0
    assert plans["here"].changes == plans["worker"].changes and plans["here"].record == plans["worker"].record
    assert plans["here-record"] == plans["worker-record"] and plans["here-rows"] == plans["worker-rows"]
