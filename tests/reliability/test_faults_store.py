"""Faults of the proxy's own process and storage: the disk fills up, ``kill -9`` during a burst
of writes, LMDB map growth while other processes read, SIGTERM with streams and shadow work in
flight, and the capture sink's recorder going away and coming back."""

from __future__ import annotations

import base64
import random

import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.reliability import harness as H
from tensorverse.store.records import Turn
import httpx
import numpy as np
import pytest

# A long tool result that compresses little (turns are stored zstd-compressed): each turn record
# is ~50 KB, ~38 KB once compressed.
BIG = base64.b64encode(random.Random(7).randbytes(37_500)).decode()


def _complete(t: Turn, data: dict) -> bool:
    """A turn as the proxy writes it for a finished stream: nothing half-written. ("aborted" with
    the whole output: a client that closed right after [DONE], an open bug of the relay.) ``data``:
    what `H.read_store` read, whose stored dicts say whether the turn's ``index`` was written."""
    return (t.state in ("ok", "aborted") and t.prompt_token_ids == H.PROMPT_IDS and t.output_token_ids
            and t.choices and t.finish_reason and t.session_id and "index" in data["stored"]["turn"][t.id])


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("medium", ["tmpfs", "size-cap"])
def test_store_full_proxying_goes_on(medium, fakes, proxy_proc, chat, tmp_path):
    f = fakes()
    store = tmp_path / "fs" / "store"
    used = medium
    mounted = medium == "tmpfs" and _mount_tmpfs(tmp_path / "fs", "3m")
    if medium == "tmpfs" and not mounted:  # no privilege for mount(2): the cap is the other way in
        used = "size-cap (tmpfs mount not permitted here)"
    cfg = H.proxy_config(f.url("primary"), store)
    if not mounted:
        cfg["store"]["max_size_bytes"] = 2 << 20
    try:
        p = proxy_proc(cfg)
        msgs = [{"role": "user", "content": "hi"}, {"role": "tool", "content": BIG, "tool_call_id": "c1"}]
        n = 80  # ~4 MB of turns into ~2-3 MB of space
        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(lambda i: chat(p.url, messages=[*msgs, {"role": "user", "content": str(i)}]),
                                  range(n)))
        failed = [r for r in results if not r["ok"]]
        assert not failed, failed[:3]  # proxying went on
        deadline = time.monotonic() + 30
        while (st := p.stats()["recorder"])["recorded"] + p.lost_flows() < n and time.monotonic() < deadline:
            time.sleep(0.1)  # recording happens in the background, after the agent has its answer
        time.sleep(0.5)
        st = p.stats()["recorder"]
        lost = st["store_full"] + st["store_errors"]
        lost = p.lost_flows()  # see harness.ProxyProc.lost_flows
        assert lost == 0 and st["recorded"] == n and st["store_full"] > 0 and st["store_errors"] == 0, st  # counted
        metrics = p.metrics()
        assert f"tensorverse_recorder_store_full_total {float(st['store_full'])}" in metrics
        log = p.log()
        said = "disk of" if mounted else "size cap"
        assert said in log and "capture stopped" in log, log[-3000:]  # the log line, once
        assert log.count("capture stopped") == 1
        after = chat(p.url)
        assert after["ok"]
        assert p.terminate(60) == 0
        data = H.read_store(store)  # opens, every record reads back whole
        kept = data["turns"]
        assert kept and all(_complete(t, data) for t in kept)
        refused = st["store_full"]
        assert len(kept) + refused + lost >= n  # every turn stored, or counted as refused
        H.record(f"fault-store-full-{medium}", load=f"{n + 1} streaming turns of ~50 KB, 4 concurrent",
                 faults=f"store space exhausted ({used})", bad_inputs=0, requests=n + 1,
                 requests_failed=len(failed) + (not after["ok"]), records_lost=lost,
                 turns_stored=len(kept), turns_not_stored_counted=refused, recorder=st)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(tmp_path / "fs")], capture_output=True)


def test_kill9_during_burst_keeps_committed_turns_whole(fakes, proxy_proc, chat, tmp_path):
    f = fakes()
    store = tmp_path / "store"
    cfg = H.proxy_config(f.url("primary"), store)  # durable: fsync per commit, the default
    p = proxy_proc(cfg)
    done: list[dict] = []

    def one(i: int) -> dict:
        r = chat(p.url, messages=[{"role": "user", "content": f"burst {i} " + "y" * 2000}], timeout=10)
        done.append(r)
        return r

    ex = ThreadPoolExecutor(8)
    futs = [ex.submit(one, i) for i in range(150)]
    deadline = time.monotonic() + 60
    while sum(r["ok"] for r in done) < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    acked = sum(r["ok"] for r in done)
    assert p.kill9() == -9
    for fu in futs:
        fu.result(30)
    ex.shutdown()
    data = H.read_store(store)  # the store opens after the crash
    turns = data["turns"]
    assert all(_complete(t, data) for t in turns), [t.id for t in turns if not _complete(t, data)]
    for s in data["sessions"]:  # a session's counter agrees with its turns: nothing partial anywhere
        assert sum(t.session_id == s.id for t in turns) == s.turns, s
    assert len(turns) >= acked * 0.5  # most answered turns were committed before the kill
    # restart on the same store: it opens and records again
    p2 = proxy_proc(cfg, workdir=tmp_path / "proxy2")
    assert chat(p2.url)["ok"]
    time.sleep(0.5)
    assert p2.terminate() == 0
    data = H.read_store(store)
    again = data["turns"]
    assert len(again) == len(turns) + 1 and all(_complete(t, data) for t in again)
    H.record("fault-kill9-burst", load="150 streaming turns, 8 concurrent (2 KB prompts)",
             faults="SIGKILL of the proxy mid-burst, restart", bad_inputs=0,
             requests=len(done) + 1, requests_failed=0, records_lost=0, answered_before_kill=acked,
             committed_before_kill=len(turns), partial_records=0,
             note="requests cut by the kill are the kill's, not counted as failures")


_WRITER = textwrap.dedent("""
    import os, sys, time
    from tensorverse.store import Store
    from tensorverse.testing.records import tsession, tturn
    st = Store.open(sys.argv[1], map_size=1 << 20, durable=False)
    st.put_session(tsession("s", created_ns=1)).result()
    for i in range(int(sys.argv[2])):
        st.put_turn(tturn(f"t{i}", "s", i, text=os.urandom(20000).hex())).result()
        st.write_rows(f"r{i}", [(k, os.urandom(30000)) for k in range(4)]).result()
    print(st.stats()["map_grows"], flush=True)
    st.close()
""")

_READER = textwrap.dedent("""
    import sys, time
    from tensorverse.store import Store
    deadline = time.monotonic() + float(sys.argv[2]); seen = 0; reads = 0
    while not __import__("os").path.exists(sys.argv[1] + "/data.mdb"): time.sleep(0.01)
    st = Store.open(sys.argv[1], readonly=True)
    while time.monotonic() < deadline:
        turns = list(st.iter_turns("s")) if any(True for _ in st.iter_sessions()) else []
        assert len(turns) >= seen, (len(turns), seen)
        seen = len(turns)
        for t in turns[-3:]:
            assert len(t.text) == 40000
            rows = st.read_rows(f"r{t.index}")
            assert len(rows) in (0, 4) and all(len(b) == 30000 for _, b in rows)
        reads += 1
        if seen >= int(sys.argv[3]): break
    print(seen, reads, flush=True)
""")


def test_map_growth_with_reader_processes(tmp_path):
    path = tmp_path / "grow"
    n = 150  # ~27 MB into a 1 MiB map: several doublings while three processes read
    readers = [subprocess.Popen([sys.executable, "-c", _READER, str(path), "90", str(n)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(3)]
    time.sleep(0.3)
    w = subprocess.run([sys.executable, "-c", _WRITER, str(path), str(n)], capture_output=True, text=True, timeout=120)
    assert w.returncode == 0, w.stderr
    grows = int(w.stdout.split()[0])
    outs = []
    for r in readers:
        out, err = r.communicate(timeout=120)
        assert r.returncode == 0, err
        outs.append([int(x) for x in out.split()])
    assert grows >= 4
    assert all(seen == n and reads > 0 for seen, reads in outs), outs
    from tensorverse.store import Store

    with Store.open(path, readonly=True) as st:
        assert len(list(st.iter_turns("s"))) == n
    H.record("fault-map-growth-readers", load=f"{n} turns + {4 * n} rows (~27 MB), 3 reader processes",
             faults=f"LMDB map grown {grows} times from 1 MiB", bad_inputs=0, requests=n, requests_failed=0,
             records_lost=0, reader_passes=[r for _, r in outs])


def test_sigterm_drains_streams_and_reports_shadow_work(fakes, proxy_proc, chat, tmp_path):
    f = fakes({"slow": "hang"})
    store = tmp_path / "store"
    cfg = H.proxy_config(f.url("primary"), store, shadows={"slow": f.url("slow")})
    cfg["shadows"][0].update(timeout_s=30, concurrency=1)
    cfg["shadow"] = {"workers": 1, "queue_size": 64}
    p = proxy_proc(cfg, env={"TENSORVERSE_SHUTDOWN_DEADLINE_S": "6"})
    for _ in range(5):  # shadow work queued behind a hanging shadow
        assert chat(p.url)["ok"]
    deadline = time.monotonic() + 20
    while (queued := p.stats()["shadow"]["queued"]) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)  # the turns are queued in the background, after the answer
    assert queued == 5
    n = 12
    slow = {"X-Fake-Delay": "0.25", "X-Fake-Events": "12", "X-Fake-Tools": "0"}  # ~3 s streams
    with ThreadPoolExecutor(n) as ex:
        futs = [ex.submit(chat, p.url, tools=0, headers=slow) for _ in range(n)]
        deadline = time.monotonic() + 20
        while p.stats()["in_flight"] < n and time.monotonic() < deadline:  # all streams under way
            time.sleep(0.05)
        t0 = time.monotonic()
        p.proc.send_signal(15)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no new connections once draining
            httpx.post(p.url + "/v1/chat/completions", json={}, timeout=2)
        results = [fu.result(30) for fu in futs]
    rc = p.proc.wait(30)
    took = time.monotonic() - t0
    p._log.close()
    assert all(r["ok"] and r["finish_reason"] == "stop" for r in results), [r["error"] for r in results]  # in-flight streams finished
    assert rc == 0 and took < 6 + 5  # within the deadline (plus start-up of the exit)
    log = p.log()
    line = next(ln for ln in log.splitlines() if ln.startswith("tensorverse proxy stopped: "))
    import json

    report = json.loads(line.split(": ", 1)[1])
    assert report["in_flight_at_signal"] == n
    # each drained turn was queued for the shadows, or skipped by the capture policy (a turn
    # recorded as "aborted": see the report on clients closing right after [DONE])
    assert report["shadow_queued"] + report["shadow_skipped"] == queued + n, report
    assert report["shadow_dropped_at_shutdown"] == report["shadow_queued"] - report["shadow_turns_done"] > 0
    assert "queued shadow turn(s) dropped" in log
    data = H.read_store(store)
    turns = data["turns"]
    assert all(_complete(t, data) for t in turns)
    # every drained stream is recorded, or accounted for as a flow that never finished (see the
    # report: a client closing right after [DONE] can leave a flow without its final hook)
    assert len(turns) + report["streams_cut"] == 5 + n and report["streams_cut"] <= 1, report
    H.record("fault-sigterm-drain", load=f"{n} in-flight ~3 s streams + {queued} queued shadow turns",
             faults="SIGTERM (deadline 6 s), hanging shadow", bad_inputs=0, requests=5 + n, requests_failed=0,
             records_lost=report["streams_cut"], shutdown_report=report, seconds_to_exit=round(took, 2))


def test_capture_sink_goes_away_and_comes_back(fakes, proxy_proc, tmp_path):
    from tensorverse.capture.frames import Frame
    from tensorverse.capture.sink import HttpSink, SinkError
    from tensorverse.store import Store
    from tensorverse.store.codec import encode_row

    f = fakes()
    store = tmp_path / "store"
    cfg = H.proxy_config(f.url("primary"), store)
    p = proxy_proc(cfg)
    sink = HttpSink(p.admin_url + "/ingest", H.ADMIN_TOKEN, timeout=2, retry_min_s=0.2, retry_max_s=0.5)
    rng = np.random.default_rng(0)
    seq = iter(range(1, 10_000))
    sent: dict[str, int] = {}
    dropped = 0

    def batch(run: str, k: int = 8) -> None:
        nonlocal dropped
        for pos in range(k):
            blob = encode_row(rng.standard_normal(4096).astype(np.float32))
            sink.put(Frame(capture_id=run, position=pos, seq=next(seq), origin=7, blob=blob))
        try:
            sent[run] = sink.flush()
        except SinkError as e:
            dropped += e.dropped

    batch("before")
    assert sent["before"] == 8
    assert p.terminate() == 0  # the recorder goes away
    for i in range(3):
        batch(f"away{i}")
        time.sleep(0.25)
    assert dropped == 24 and not any(k.startswith("away") for k in sent)
    p2 = proxy_proc(cfg, workdir=tmp_path / "proxy2")  # and comes back on the same address
    deadline = time.monotonic() + 10
    while "after" not in sent and time.monotonic() < deadline:
        batch("after")
        time.sleep(0.3)
    assert sent.get("after") == 8, (sent, dropped)  # picked up again without a restart of the sink
    assert p2.stats()["ingest"]["rows"] == 8
    assert p2.terminate() == 0
    with Store.open(store, readonly=True) as st:
        assert len(st.read_rows("before")) == 8 and len(st.read_rows("after")) == 8
        assert all(len(st.read_rows(f"away{i}")) == 0 for i in range(3))
    sink.close()
    H.record("fault-capture-sink-away", load="capture frames over the HTTP sink (8-row batches)",
             faults="recorder (ingest) stopped, restarted on the same address", bad_inputs=0,
             requests=len(sent), requests_failed=0, records_lost=0, rows_dropped_while_away_counted=dropped,
             note="rows sent while the recorder is away are dropped and counted by the sink (by design)")


def test_kill9_while_ingest_is_saturated_keeps_every_acknowledged_batch_whole(fakes, proxy_proc, chat, tmp_path):
    """Issue 37: the proxy killed while four capture sinks post row batches as fast as it takes
    them (and an agent streams): the store opens; every batch the proxy acknowledged is there
    whole; every run's rows are all or none of a batch (one transaction per run); the agent's
    streams that were in flight are the only casualties, and the restarted proxy takes rows again."""
    from tensorverse.capture.frames import CONTENT_TYPE, encode_frame
    from tensorverse.store import Store
    from tensorverse.store.codec import encode_row
    from tensorverse.store.compact import compact_row, encode_compact

    f = fakes()
    store = tmp_path / "store"
    cfg = H.proxy_config(f.url("primary"), store)
    p = proxy_proc(cfg)
    rng = np.random.default_rng(0)
    row = (rng.standard_normal(151_936) * 3).astype(np.float32)
    blob = encode_row(row)  # a full Qwen3-vocabulary row (~600 KB: random logits do not compress)
    small = encode_compact(compact_row(row))
    auth = {"Authorization": f"Bearer {H.ADMIN_TOKEN}", "Content-Type": CONTENT_TYPE}
    acked: list[str] = []
    sent: list[str] = []
    stop = False

    def sink(k: int) -> None:
        with httpx.Client(timeout=30) as c:
            for i in range(10_000):
                if stop:
                    return
                run = f"ing-{k}-{i}"
                body = b"".join(encode_frame(run, pos, blob if pos % 4 == 0 else small, seq=pos + 1,
                                             origin=k * 100_000 + i, compact=pos % 4 != 0) for pos in range(8))
                sent.append(run)
                try:
                    r = c.post(p.admin_url + "/ingest", content=body, headers=auth)
                except httpx.HTTPError:
                    return  # the kill
                if r.status_code == 200:
                    acked.append(run)

    agents: list[dict] = []

    def agent() -> None:
        while not stop:
            agents.append(chat(p.url, timeout=10))

    ex = ThreadPoolExecutor(5)
    futs = [ex.submit(sink, k) for k in range(4)] + [ex.submit(agent)]
    deadline = time.monotonic() + 60
    while len(acked) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    n_acked = len(acked)
    import psutil

    children = psutil.Process(p.pid).children(recursive=True)  # the fork server, ingest and analysis workers
    assert p.kill9() == -9
    stop = True
    for fu in futs:
        fu.result(60)
    ex.shutdown()
    assert n_acked >= 20
    # the proxy's worker processes follow it: none is left holding the store or its memory
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [(c.pid, c.name()) for c in alive]
    st = Store.open(store, readonly=True)  # opens after the crash
    try:
        whole = half = 0
        for run in sent:
            n = len(st.read_rows(run)) + len(st.read_compact_rows(run))
            assert n in (0, 8), (run, n)  # all or nothing
            whole += n == 8
            half += n not in (0, 8)
        assert all(len(st.read_rows(run)) == 2 and len(st.read_compact_rows(run)) == 6 for run in acked)
    finally:
        st.close()
    ok_before = sum(a["ok"] for a in agents)
    p2 = proxy_proc(cfg, workdir=tmp_path / "proxy2")
    with httpx.Client(timeout=30) as c:
        again = c.post(p2.admin_url + "/ingest", headers=auth,
                       content=encode_frame("after", 0, blob, seq=1, origin=1))
    assert again.status_code == 200 and chat(p2.url)["ok"]
    assert p2.terminate() == 0
    H.record("fault-kill9-ingest", load="4 capture sinks posting 8-row batches (2 full Qwen3 rows, 6 compact) "
             "back to back + 1 streaming agent", faults="SIGKILL of the proxy while ingest is saturated, restart",
             bad_inputs=0, requests=len(sent) + len(agents) + 2, requests_failed=0, records_lost=0,
             batches_acknowledged=len(acked), batches_stored_whole=whole, batches_half_stored=half,
             agent_turns_ok_before_kill=ok_before, worker_processes_left=len(alive),
             note="every acknowledged batch whole after the crash; batches in flight at the kill all or nothing; "
                  "the agent's stream in flight at the kill is the kill's; the proxy's worker processes "
                  f"({len(children)}: the fork server, its resource tracker, the workers) exit with it")
