"""The admin listener: capture ingest (token protected), metrics, stats."""

from __future__ import annotations

import httpx
import pytest

from tensorverse.capture.frames import CONTENT_TYPE, encode_frame


def _frames(capture_id, n, origin=7, seq0=1):
    return b"".join(encode_frame(capture_id, pos, bytes([pos]) * 10, seq=seq0 + pos, origin=origin) for pos in range(n))


def test_ingest_writes_rows(fake, make_proxy, settle):
    proxy = make_proxy(fake.url, admin={"token": "s3cret"})
    auth = {"Authorization": "Bearer s3cret", "Content-Type": CONTENT_TYPE}
    with httpx.Client(timeout=30) as c:
        r = c.post(proxy.admin_url + "/ingest", content=_frames("run-a", 3) + _frames("run-b", 2, seq0=10), headers=auth)
        assert r.status_code == 200 and r.json() == {"rows": 5, "duplicates": 0, "runs": 2}
        again = c.post(proxy.admin_url + "/ingest", content=_frames("run-a", 3), headers=auth)  # a retried batch
        assert again.json() == {"rows": 0, "duplicates": 3, "runs": 0}
    assert proxy.store.read_rows("run-a") == [(i, bytes([i]) * 10) for i in range(3)]
    assert len(proxy.store.read_rows("run-b")) == 2


def test_ingest_rejects_bad_token_and_bad_frames(fake, make_proxy):
    proxy = make_proxy(fake.url, admin={"token": "s3cret", "max_ingest_bytes": 4096})
    with httpx.Client(timeout=30) as c:
        assert c.post(proxy.admin_url + "/ingest", content=_frames("r", 1)).status_code == 401
        assert c.post(proxy.admin_url + "/ingest", content=_frames("r", 1),
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
        good = _frames("r", 2)
        bad = good[:-1] + bytes([good[-1] ^ 1])  # crc mismatch in the 2nd frame
        r = c.post(proxy.admin_url + "/ingest", content=bad, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 400 and r.json()["reason"] == "crc"
        assert c.post(proxy.admin_url + "/ingest", content=b"x" * 5000,
                      headers={"Authorization": "Bearer s3cret"}).status_code == 413
    assert proxy.store.read_rows("r") == []  # all or nothing


def test_ingest_stores_compact_frames_as_compact_rows_and_refuses_garbled_ones(fake, make_proxy, settle):
    import numpy as np

    from tensorverse.store.compact import compact_row, encode_compact

    proxy = make_proxy(fake.url, admin={"token": "s3cret"})
    auth = {"Authorization": "Bearer s3cret", "Content-Type": CONTENT_TYPE}
    blob = encode_compact(compact_row(np.arange(64, dtype=np.float32), k=3))
    body = (encode_frame("run-c", 0, blob, seq=1, origin=9, compact=True)
            + encode_frame("run-c", 1, b"full", seq=2, origin=9))
    with httpx.Client(timeout=30) as c:
        bad = encode_frame("run-c", 5, blob[:-1] + bytes([blob[-1] ^ 1]), seq=3, origin=9, compact=True)
        r = c.post(proxy.admin_url + "/ingest", content=body + bad, headers=auth)
        assert r.status_code == 400 and r.json()["reason"] == "compact"
        r = c.post(proxy.admin_url + "/ingest", content=encode_frame("a\x00b", 0, b"x", seq=9, origin=9), headers=auth)
        assert r.status_code == 400 and r.json()["reason"] == "capture_id"  # an id the store would refuse
        assert proxy.store.read_rows("run-c") == [] and proxy.store.read_compact_rows("run-c") == []
        r = c.post(proxy.admin_url + "/ingest", content=body, headers=auth)
        assert r.status_code == 200 and r.json()["rows"] == 2
        text = c.get(proxy.admin_url + "/metrics").text
    assert proxy.store.read_compact_rows("run-c") == [(0, blob)]
    assert proxy.store.read_rows("run-c") == [(1, b"full")]
    assert "tensorverse_capture_compact_rows_total 1.0" in text


def test_ingest_disabled_without_token(fake, make_proxy):
    proxy = make_proxy(fake.url)
    with httpx.Client(timeout=30) as c:
        assert c.post(proxy.admin_url + "/ingest", content=_frames("r", 1)).status_code == 403


def test_ingest_not_on_the_agent_listener(fake, make_proxy):
    proxy = make_proxy(fake.url, admin={"token": "t"})
    with httpx.Client(timeout=30) as c:
        r = c.post(proxy.url + "/ingest", content=_frames("r", 1), headers={"Authorization": "Bearer t"})
    assert r.status_code == 404  # relayed to the upstream, which has no such path


def test_metrics_and_stats(fake, make_proxy, settle):
    proxy = make_proxy(fake.url)
    with httpx.Client(timeout=30) as c:
        c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": []})
        c.get(proxy.url + "/v1/models")
        settle(proxy)
        m = c.get(proxy.admin_url + "/metrics")
        s = c.get(proxy.admin_url + "/stats").json()
        assert c.get(proxy.admin_url + "/healthz").text == "ok"
    assert m.status_code == 200
    assert "tensorverse_proxy_requests_total 2.0" in m.text
    assert "tensorverse_proxy_turns_total 1.0" in m.text
    assert "tensorverse_recorder_recorded_total 1.0" in m.text
    assert s["proxy"]["requests"] == 2 and s["recorder"]["recorded"] == 1


def test_ingest_stores_engine_states(fake, make_proxy, settle):
    """Frames with an engine state (the plugin's default): stored next to their rows."""
    from tensorverse.store.engine_state import RUNNER_V2, EngineState

    proxy = make_proxy(fake.url, admin={"token": "s3cret"})
    states = [EngineState(RUNNER_V2, 40 + p, 3, p, 0, 900 + p, 1) for p in range(3)]
    body = b"".join(encode_frame("run-e", p, b"row", seq=p + 1, origin=9, engine=states[p]) for p in range(3))
    body += encode_frame("run-e", 3, b"row", seq=4, origin=9)  # one without
    with httpx.Client(timeout=30) as c:
        r = c.post(proxy.admin_url + "/ingest", content=body,
                   headers={"Authorization": "Bearer s3cret", "Content-Type": CONTENT_TYPE})
        assert r.status_code == 200 and r.json()["rows"] == 4
    assert proxy.store.read_engine_states("run-e") == dict(enumerate(states))
    assert len(proxy.store.read_rows("run-e")) == 4


def test_verdict_endpoint_and_gauges(fake, make_proxy):
    """/verdict and the tensorverse_verdict* gauges come from the store, recomputed off the loop."""
    import math
    import time

    from prometheus_client.parser import text_string_to_metric_families

    from tests.exporters.verdict_store import fill_store

    proxy = make_proxy(fake.url, verdict={"refresh_s": 0.2, "tool_call_break_margin": 0.3})
    with httpx.Client(timeout=30) as c:
        first = c.get(proxy.admin_url + "/verdict").json()
        fill_store(proxy.store, turns=40)
        deadline = time.monotonic() + 60
        while True:  # until a refresh has seen every turn (one may have run while they were written)
            v = c.get(proxy.admin_url + "/verdict").json()
            if (len(v["shadows"]) == 3 and all(s["tool_call_turns"] == 40 for s in v["shadows"])) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        m = c.get(proxy.admin_url + "/metrics").text
    assert first["shadows"] == [] or first["computed_ns"] is not None
    assert v["error"] is None and v["tool_call_break_margin"] == 0.3
    by = {s["backend"]: s for s in v["shadows"]}
    assert by["bad"]["decision"] == "regression" and by["good"]["decision"] == "equivalent"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(m) for s in f.samples}
    assert samples[("tensorverse_verdict", (("backend", "bad"), ("decision", "regression"), ("role", "shadow")))] == 1
    assert samples[("tensorverse_verdict", (("backend", "bad"), ("decision", "equivalent"), ("role", "shadow")))] == 0
    low = samples[("tensorverse_verdict_tool_call_break_excess", (("backend", "bad"), ("bound", "low"), ("role", "shadow")))]
    assert low == by["bad"]["tool_call_break_excess"]["low"] > 0
    assert samples[("tensorverse_verdict_tool_call_turns", (("backend", "good"), ("role", "shadow")))] == 40
    assert samples[("tensorverse_verdict_turns_needed", (("backend", "bad"), ("role", "shadow")))] == 0
    age = samples[("tensorverse_verdict_age_seconds", ())]
    assert not math.isnan(age) and age < 20
    assert samples[("tensorverse_verdict_errors", ())] == 0


@pytest.mark.parametrize("in_worker", [True, False], ids=["worker", "proxy"])
def test_a_body_is_stored_whole_or_refused_whole_in_the_worker_and_in_the_proxy(fake, make_proxy, settle, in_worker):
    import os

    proxy = make_proxy(fake.url, admin={"token": "s3cret", "ingest_process": in_worker})
    assert (proxy.ingest.worker is not None) == in_worker
    auth = {"Authorization": "Bearer s3cret", "Content-Type": CONTENT_TYPE}
    blobs = [os.urandom(100_000) for _ in range(4)]
    good = b"".join(encode_frame("big", p, b, seq=p + 1, origin=5) for p, b in enumerate(blobs))
    bad = good[:-1] + bytes([good[-1] ^ 1])  # the last frame's crc
    with httpx.Client(timeout=30) as c:
        r = c.post(proxy.admin_url + "/ingest", content=bad, headers=auth)
        assert r.status_code == 400 and r.json()["reason"] == "crc"
        assert proxy.store.read_rows("big") == []
        r = c.post(proxy.admin_url + "/ingest", content=good, headers=auth)
        assert r.status_code == 200 and r.json() == {"rows": 4, "duplicates": 0, "runs": 1}
        again = c.post(proxy.admin_url + "/ingest", content=good, headers=auth)  # a retried batch
        assert again.json() == {"rows": 0, "duplicates": 4, "runs": 0}
        stats = c.get(proxy.admin_url + "/stats").json()["ingest"]
    assert proxy.store.read_rows("big") == list(enumerate(blobs))
    assert proxy.store.arrivals.knows("big")  # the runner waiting for them is woken either way
    assert {k: stats[k] for k in ("batches", "rows", "duplicates", "rejected", "in_process")} == {
        "batches": 2, "rows": 4, "duplicates": 4, "rejected": 1, "in_process": 0}


def test_rows_the_ingest_worker_commits_wake_the_runner_waiting_for_them(fake, make_proxy):
    """The worker writes in its own process; the proxy announces what it committed, so a shadow
    run waiting for its rows ends on the last one, not on a poll of the store."""
    import asyncio

    proxy = make_proxy(fake.url, admin={"token": "s3cret"})
    auth = {"Authorization": "Bearer s3cret", "Content-Type": CONTENT_TYPE}

    async def wait_and_post():
        waiting = asyncio.ensure_future(proxy.store.arrivals.wait("run-w", {0, 1, 2}, 30.0))
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(proxy.admin_url + "/ingest", content=_frames("run-w", 3), headers=auth)
        t = asyncio.get_running_loop().time()
        got = await waiting
        return r.status_code, got, asyncio.get_running_loop().time() - t

    status, got, waited = asyncio.run(wait_and_post())
    assert status == 200 and got == {0, 1, 2} and waited < 1.0


def test_a_dead_ingest_worker_loses_nothing_its_body_is_stored_in_the_proxy_and_a_new_worker_takes_the_next(
        fake, make_proxy):
    import os
    import signal

    proxy = make_proxy(fake.url, admin={"token": "s3cret"})
    auth = {"Authorization": "Bearer s3cret", "Content-Type": CONTENT_TYPE}
    with httpx.Client(timeout=30) as c:
        assert c.post(proxy.admin_url + "/ingest", content=_frames("a", 2), headers=auth).status_code == 200
        pid = proxy.ingest.worker.pid  # the worker, started by the first body
        os.kill(pid, signal.SIGKILL)
        r = c.post(proxy.admin_url + "/ingest", content=_frames("b", 3, seq0=10), headers=auth)
        assert r.status_code == 200 and r.json()["rows"] == 3
        r = c.post(proxy.admin_url + "/ingest", content=_frames("c", 1, seq0=20), headers=auth)
        assert r.status_code == 200
        stats = c.get(proxy.admin_url + "/stats").json()["ingest"]
        metrics = c.get(proxy.admin_url + "/metrics").text
    assert [len(proxy.store.read_rows(r)) for r in "abc"] == [2, 3, 1]
    assert (stats["in_process"], stats["worker_restarts"], stats["rows"]) == (1, 1, 6)
    assert proxy.ingest.worker.pid not in (None, pid)  # the last body went to a new worker
    assert "tensorverse_capture_ingest_worker_restarts_total 1.0" in metrics


def test_the_dedupe_window_remembers_each_origins_last_frames_and_forgets_older_ones(tmp_path):
    """A batch sent again within its origin's window is counted as duplicates and not stored
    twice; a frame older than the window (8 seqs below the origin's highest here) is taken as new.
    Different origins never clash."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from tensorverse.proxy.ingest import Ingest
    from tensorverse.store import Store

    store = Store.open(tmp_path / "store", durable=False)
    ingest = Ingest(store, "t", dedupe_window=8)
    auth = {"Authorization": "Bearer t", "Content-Type": CONTENT_TYPE}

    async def main():
        app = web.Application()
        app.router.add_post("/ingest", ingest.handle)
        async with TestClient(TestServer(app)) as c:
            async def post(body):
                r = await c.post("/ingest", data=body, headers=auth)
                return await r.json()
            out = [await post(_frames("r", 3, origin=1))]               # seqs 1-3 of origin 1
            out.append(await post(_frames("r", 3, origin=2)))           # the same seqs, origin 2: new
            out.append(await post(_frames("r", 3, origin=2)))           # sent again: duplicates
            out.append(await post(_frames("r", 12, origin=1)))          # 1-3 again, 4-12 new
            out.append(await post(_frames("r", 4, origin=1)))           # 1-4: a window below 12
            out.append(await post(_frames("r", 2, origin=1, seq0=11)))  # 11-12: still in the window
            return out
    try:
        out = asyncio.run(main())
    finally:
        store.close()
    assert [(o["rows"], o["duplicates"]) for o in out] == [(3, 0), (3, 0), (0, 3), (9, 3), (4, 0), (0, 2)]


def test_a_store_full_in_the_ingest_worker_is_a_507_counted_and_makes_the_proxys_store_report_full(tmp_path):
    """The worker's writes are refused at the store's cap: the sink hears 507 (it keeps the batch),
    the rows are counted as dropped, and the proxy's own store says it is full, which starts
    the retention keeper at once."""
    import asyncio
    import os

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from tensorverse.proxy.ingest import Ingest, IngestWorker
    from tensorverse.store import Store

    store = Store.open(tmp_path / "store", durable=False, max_size=1 << 20)
    ingest = Ingest(store, "t", worker=IngestWorker(store.path, max_size=1 << 20, durable=False))
    auth = {"Authorization": "Bearer t", "Content-Type": CONTENT_TYPE}

    async def main():
        app = web.Application(client_max_size=8 << 20)
        app.router.add_post("/ingest", ingest.handle)
        async with TestClient(TestServer(app)) as c:
            statuses = []
            for i in range(8):  # 8 x 256 KB of incompressible rows into a 1 MiB store
                body = b"".join(encode_frame(f"r{i}", p, os.urandom(64_000), seq=4 * i + p + 1, origin=3)
                                for p in range(4))
                statuses.append((await c.post("/ingest", data=body, headers=auth)).status)
            return statuses
    try:
        assert not store.stats()["full"]
        statuses = asyncio.run(main())
        full = store.stats()["full"]
    finally:
        ingest.close()
        store.close()
    assert statuses[0] == 200 and statuses[-1] == 507 and set(statuses) == {200, 507}
    stored = statuses.count(200)
    c = ingest.counters
    assert (c["batches"], c["rows"], c["store_full"], c["rows_dropped_store_full"]) == (
        stored, 4 * stored, 8 - stored, 4 * (8 - stored))
    assert full


def test_a_hung_ingest_worker_is_replaced_and_its_body_stored_in_the_proxy(tmp_path):
    import asyncio
    import os
    import signal

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from tensorverse.proxy.ingest import Ingest, IngestWorker
    from tensorverse.store import Store

    store = Store.open(tmp_path / "store", durable=False)
    worker = IngestWorker(store.path, durable=False, timeout_s=1.0)
    ingest = Ingest(store, "t", worker=worker)
    auth = {"Authorization": "Bearer t", "Content-Type": CONTENT_TYPE}

    async def main():
        app = web.Application()
        app.router.add_post("/ingest", ingest.handle)
        async with TestClient(TestServer(app)) as c:
            first = (await c.post("/ingest", data=_frames("a", 2), headers=auth)).status
            hung = worker.pid
            os.kill(hung, signal.SIGSTOP)  # alive, silent
            second = (await c.post("/ingest", data=_frames("b", 2, seq0=10), headers=auth)).status
            third = (await c.post("/ingest", data=_frames("c", 2, seq0=20), headers=auth)).status
            return first, second, third, hung
    try:
        *statuses, hung = asyncio.run(main())
        rows = [len(store.read_rows(r)) for r in "abc"]
    finally:
        ingest.close()
        store.close()
    assert statuses == [200, 200, 200] and rows == [2, 2, 2]
    assert (ingest.counters["in_process"], worker.restarts) == (1, 1)
    try:  # the hung worker was killed, not left behind (a child of the fork server, which reaps it)
        with open(f"/proc/{hung}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z", "X")


def test_the_plugins_device_counters_reach_stats_and_metrics_summed_over_processes(fake, make_proxy, settle):
    """Each capturing process reports its counters with every batch (the sink's stats header); the
    proxy keeps the last report per process and exports their sum, the device path's included."""
    import json

    from tensorverse.capture.sink import STATS_HEADER

    proxy = make_proxy(fake.url, admin={"token": "s3cret"})
    auth = {"Authorization": "Bearer s3cret", "Content-Type": CONTENT_TYPE}
    reports = [(11, {"rows_captured": 10, "rows_on_device": 6, "device_overflow": 1}),
               (12, {"rows_captured": 5, "rows_on_device": 2, "device_overflow": 0}),
               (11, {"rows_captured": 20, "rows_on_device": 15, "device_overflow": 3})]  # 11's newer report
    with httpx.Client(timeout=30) as c:
        for i, (origin, counters) in enumerate(reports):
            r = c.post(proxy.admin_url + "/ingest", content=_frames(f"dev{i}", 1, origin=origin),
                       headers=auth | {STATS_HEADER: json.dumps({"origin": origin, **counters})})
            assert r.status_code == 200
        settle(proxy)
        plugins = c.get(proxy.admin_url + "/stats").json()["ingest"]["plugins"]
        text = c.get(proxy.admin_url + "/metrics").text
    assert (plugins["rows_captured"], plugins["rows_on_device"], plugins["device_overflow"]) == (25, 17, 3)
    assert "tensorverse_capture_plugin_rows_on_device_total 17.0" in text
    assert "tensorverse_capture_plugin_device_overflow_total 3.0" in text
