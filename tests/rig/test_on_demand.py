"""The on-demand rig's bookkeeping (``rig.servers.OnDemandRig``), with stand-in servers: which
server starts when, the capture sink each gets, and the cap on servers running at once. The
real servers are exercised by tests/capture/test_quant_capture_vllm.py."""

from __future__ import annotations

import pytest

import tensorverse.rig.servers as rs


class FakeServer:
    def __init__(self, name, extra_args):
        self.name, self.extra_args, self.extra_env = name, extra_args, {}
        self.starts = self.stops = 0
        self._running = False

    def start(self):
        self.starts += 1
        self._running = True

    def wait_ready(self, timeout):
        if "--kv-cache-dtype" in self.extra_args and self.extra_args[-1] == "broken":
            raise rs.RigError("exited")

    def stop(self, grace=8.0):
        self.stops += 1
        self._running = False

    def running(self):
        return self._running

    # stop_many's protocol
    def _terminate(self):
        self._running = False

    def _reap(self, deadline):
        self.stops += 1


@pytest.fixture
def pool(tmp_path, monkeypatch):
    made = []

    def make_servers(specs, **kw):
        out = [FakeServer(sp.name, sp.extra_args) for sp in specs]
        made.extend(out)
        return out

    monkeypatch.setattr(rs, "make_servers", make_servers)
    p = rs.OnDemandRig(tmp_path, max_live=2)
    p.made = made
    return p


def test_quant_servers_are_the_primary_config_plus_one_setting():
    q = rs.QUANT_SERVERS
    assert q["fp8_kv"].extra_args == ("--kv-cache-dtype", "fp8")
    assert all(s.dtype == "bfloat16" and s.model == "tiny-a" for s in q.values())
    assert q["bf16"].extra_args == q["bf16_b"].extra_args == ()
    pool = rs.OnDemandRig("/nonexistent")
    assert pool.spec("fp8_kv") is q["fp8_kv"]
    with pytest.raises(rs.RigError):
        pool.get("fp4")  # an unknown name starts nothing


def test_started_on_first_ask_with_its_own_store_and_reused(pool, tmp_path):
    assert pool.made == [] and pool.running() == []
    s = pool.get("fp8_kv")
    assert s.starts == 1 and s.store == tmp_path / "fp8_kv" / "store"
    assert s.extra_env["TENSORVERSE_CAPTURE_SINK"] == f"dir:{tmp_path / 'fp8_kv' / 'store'}"
    assert pool.get("fp8_kv") is s and s.starts == 1 and pool.starts == 1


def test_at_most_max_live_the_least_recently_used_stops(pool):
    a, b = pool.get("bf16"), pool.get("bf16_b")
    pool.get("bf16")  # a is now the most recently used
    c = pool.get("fp8_kv")
    assert pool.running() == ["bf16", "fp8_kv"] and b.stops == 1 and not b.running() and a.running()
    again = pool.get("bf16_b")  # asked again: the same server object, started again
    assert again is b and b.starts == 2 and pool.running() == ["fp8_kv", "bf16_b"] and a.stops == 1
    pool.close()
    assert pool.running() == [] and not c.running() and not b.running()


def test_a_server_that_fails_to_start_is_stopped_and_not_counted(pool, monkeypatch):
    monkeypatch.setitem(pool.specs, "bad", rs.ServerSpec("bad", "tiny-a", "bfloat16",
                                                               ("--kv-cache-dtype", "broken")))
    with pytest.raises(rs.RigError):
        pool.get("bad")
    assert pool.running() == [] and pool.servers["bad"].stops == 1


def test_a_server_that_exited_is_started_again_once(pool):
    s = pool.get("fp8_kv")
    s._running = False  # the process died
    assert pool.get("fp8_kv") is s and s.starts == 2 and pool.running() == ["fp8_kv"]


def test_fp8_kv_cache_needs_avx512_or_amx():
    from tensorverse.rig.servers import cpu_has_fp8_kv_cache

    amd = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert cpu_has_fp8_kv_cache(amd) is False
    assert cpu_has_fp8_kv_cache(amd.replace("avx2", "avx2 avx512f avx512bw")) is True
    assert cpu_has_fp8_kv_cache(amd.replace("avx2", "avx2 amx_tile")) is True
    assert cpu_has_fp8_kv_cache("") is False


def test_with_an_http_sink_every_server_ships_its_rows_there_and_has_no_store(tmp_path, monkeypatch):
    made = []

    def make_servers(specs, **kw):
        out = [FakeServer(sp.name, sp.extra_args) for sp in specs]
        for s, sp in zip(out, specs):
            s.extra_env.update(sp.env)
        made.extend(out)
        return out

    monkeypatch.setattr(rs, "make_servers", make_servers)
    pool = rs.OnDemandRig(tmp_path, specs=rs.CAPTURE_SERVERS, sink=("http://127.0.0.1:9/ingest", "tok"))
    bf16, fp32 = pool.get("bf16"), pool.get("fp32")
    for s in (bf16, fp32):
        assert s.extra_env["TENSORVERSE_CAPTURE_SINK"] == "http://127.0.0.1:9/ingest"
        assert s.extra_env["TENSORVERSE_CAPTURE_TOKEN"] == "tok" and not hasattr(s, "store")
    assert fp32.extra_env["TENSORVERSE_CAPTURE_REDUCE"] == "device" and "TENSORVERSE_CAPTURE_REDUCE" not in bf16.extra_env
    assert pool.get("bf16") is bf16 and pool.starts == 2
    with pytest.raises(rs.RigError):
        pool.get("fp8_kv")  # not one of this rig's servers


class SlowServer(FakeServer):
    """Ready ``delay`` seconds after the wait starts (or refuses to start)."""

    def __init__(self, name, delay, fails=False):
        super().__init__(name, ())
        self.delay, self.fails = delay, fails

    def wait_ready(self, timeout):
        import time

        time.sleep(self.delay)
        if self.fails:
            raise rs.RigError(f"{self.name}: exited")


def test_start_many_reports_each_server_as_it_becomes_ready_and_the_wait_meanwhile():
    a, b = SlowServer("a", 0.6), SlowServer("b", 0.05)
    ready, waits = [], []
    assert rs.start_many([a, b], on_ready=ready.append, on_wait=lambda p, el: waits.append(([s.name for s in p], el)),
                         note_every_s=0.2) == [a, b]
    assert ready == [b, a] and a.starts == b.starts == 1 and a.stops == b.stops == 0
    assert waits and all(names == ["a"] and el > 0 for names, el in waits)  # b was ready by then


def test_start_many_stops_every_server_when_one_fails_and_reports_no_failed_one_ready():
    ok, bad = SlowServer("ok", 0.0), SlowServer("bad", 0.05, fails=True)
    ready = []
    with pytest.raises(rs.RigError):
        rs.start_many([ok, bad], on_ready=ready.append)
    assert ready == [ok] and ok.stops == 1 and bad.stops == 1
