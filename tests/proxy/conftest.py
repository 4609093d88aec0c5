"""Fixtures for the proxy tests: an event loop in a thread (servers run there, clients in the
test's thread), the fake vLLM upstream, and a factory of configured proxies."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest


from tensorverse.config import parse_config
from tensorverse.testing.fake_upstream import FakeUpstream
from tensorverse.proxy.loop import LoopThread, new_event_loop
from tensorverse.proxy.server import Proxy
from tensorverse.store.records import Turn


@pytest.fixture
def loop():
    # the proxy's own loop (uvloop); TENSORVERSE_TEST_ASYNCIO_LOOP=1: asyncio's
    asyncio_loop = bool(os.environ.get("TENSORVERSE_TEST_ASYNCIO_LOOP"))
    lt = LoopThread("proxy-test-loop", asyncio.new_event_loop if asyncio_loop else new_event_loop)
    yield lt
    lt.stop()


@pytest.fixture
def fake(loop):
    f = loop.run(FakeUpstream().start())
    yield f
    loop.run(f.close())


def config(upstream: str, store_path: str, **sections: Any):
    data: dict[str, Any] = {
        "proxy": {"listen": "127.0.0.1:0"},
        "admin": {"listen": "127.0.0.1:0"},
        "primary": {"url": upstream},
        "store": {"path": store_path, "durable": False},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_config(data)


@pytest.fixture
def make_proxy(loop, tmp_path):
    """make_proxy(upstream_url, runner=None, tee_backends=None, store=True, prepare=None, **config
    sections); `prepare(store)` writes to the store before the proxy starts (its background passes
    then never see a half-written session)."""
    made: list[tuple[Proxy, Any]] = []

    def make(upstream: str, *, runner: Any = None, tee_backends: Any = None, store: bool = True,
             prepare: Any = None, **sections: Any) -> Proxy:
        from tensorverse.store import Store

        path = tmp_path / f"store{len(made)}"
        cfg = config(upstream, str(path), **sections)
        st = Store.open(path, durable=False) if store else False
        if prepare is not None:
            prepare(st)
        p = Proxy(cfg, store=st, runner=runner, tee_backends=tee_backends)
        loop.run(p.start())
        p.url = f"http://127.0.0.1:{p.port}"  # type: ignore[attr-defined]
        p.admin_url = f"http://127.0.0.1:{p.admin_port}"  # type: ignore[attr-defined]
        made.append((p, st))
        return p

    yield make
    for p, st in made:
        loop.run(p.close())
        if st:
            st.close()


def _settle(loop: Any, proxy: Any, timeout: float = 10.0) -> None:
    """Wait for the proxy's background hooks, the shadow queue and the store writer."""
    wait = timeout + 10  # the loop's own wait outlasts the drain's (its default of 120 s cut
    loop.run(proxy.core.drain(timeout), wait)  # a 900 s settle of turnstone's shadow work short)
    loop.run(proxy.tee.drain(timeout), wait)
    loop.run(proxy.core.drain(timeout), wait)
    if proxy.store is not None:
        proxy.store.submit(lambda txn: None).result(timeout)


def _turns(proxy: Any) -> list[Turn]:
    out = []
    for s in proxy.store.iter_sessions():
        out.extend(proxy.store.iter_turns(s.id))
    return out


@pytest.fixture
def settle(loop):
    """settle(proxy): wait for background hooks, the shadow queue and the store writer."""
    return lambda proxy, timeout=10.0: _settle(loop, proxy, timeout)


@pytest.fixture
def turns():
    """turns(proxy): every recorded turn, session by session."""
    return _turns
