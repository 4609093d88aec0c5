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
    assert rs.quant_server("fp8_kv") is q["fp8_kv"]
    with pytest.raises(rs.RigError, match="known: bf16"):
        rs.quant_server("fp4")


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
    monkeypatch.setitem(rs.QUANT_SERVERS, "bad", rs.ServerSpec("bad", "tiny-a", "bfloat16",
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
