"""The session's vLLM servers (``rig``, ``rig_extra``, ``capture_rig``) stop after the last test that uses them,
not at the end of the session (``tests/conftest.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import tests.conftest as suite


def _item(nodeid: str, *fixtures: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, fixturenames=("request", *fixtures))


def test_the_last_user_of_each_session_server_is_the_last_item_that_uses_it():
    items = [_item("a::t1", "rig"), _item("b::t1", "rig_extra", "shadowed"), _item("b::t2", "rig"),
             _item("c::t1"), _item("d::t1", "rig_extra")]
    assert suite.last_users(items) == {"rig": "b::t2", "rig_extra": "d::t1"}
    assert suite.last_users([_item("x::t", "store")]) == {}


class _Pool:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def _teardown(item) -> None:
    gen = suite.pytest_runtest_teardown(item, None)
    next(gen)  # the item's own teardown runs here
    try:
        next(gen)
    except StopIteration:
        pass


def test_the_on_demand_servers_stop_after_their_last_user_and_not_before(monkeypatch):
    pool = _Pool()
    monkeypatch.setattr(suite, "_active_extra", pool)
    monkeypatch.setattr(suite, "_last_user", {"rig_extra": "b::t2"})
    _teardown(_item("b::t1", "rig_extra"))
    assert pool.closed == 0
    _teardown(_item("b::t2", "rig_extra"))
    assert pool.closed == 1
    _teardown(_item("c::t1"))
    assert pool.closed == 1


def test_the_capture_rigs_users_run_first_and_together_then_the_other_server_modules():
    """``server_order``: the modules that use ``capture_rig`` first, one after another (its
    servers are up for them only), then the other server modules, then the rest; each module's
    items together and in their order."""
    plugin, quant = "tests/capture/test_plugin_vllm.py", "tests/capture/test_quant_capture_vllm.py"
    shadow, fast = "tests/shadow/test_shadow_capture_vllm.py", "tests/analysis/test_flips.py"
    items = [_item(f"{fast}::a"), _item(f"{plugin}::a", "capture_rig"), _item(f"{plugin}::b", "server"),
             _item(f"{quant}::a", "rig_extra"), _item(f"{fast}::b"), _item(f"{shadow}::a"),
             _item(f"{shadow}::b", "pair", "capture_rig")]
    order = [it.nodeid for it in suite.server_order(items)]
    assert order == [f"{plugin}::a", f"{plugin}::b", f"{shadow}::a", f"{shadow}::b", f"{quant}::a",
                     f"{fast}::a", f"{fast}::b"]
    assert suite.last_users(suite.server_order(items))["capture_rig"] == f"{shadow}::b"
