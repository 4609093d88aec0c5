"""Helpers of the exporter tests (imported by conftest.py and the tests): a whole proxy pipeline
on fakes (no vLLM, seconds to run), required binaries, free ports.

``Pipeline``: a proxy (FakeVLLM primary, serving ``/v1/completions`` with token ids and top-k)
with three fake shadows that capture full rows into the proxy's store: ``cand`` (another
runtime: many flips), ``fp8-kv`` (a milder one) and ``secondary`` (the noise floor). Agents'
turns go through the proxy; the real shadow runner, comparisons and metrics run behind it.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tensorverse.proxy.loop import LoopThread
from tensorverse.store.records import Comparison

ROOT = Path(__file__).resolve().parents[2]


def need_tool(name: str) -> str:
    """The path of a required binary; a missing one FAILS the test (CI must install it)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not installed: apt-get install -y prometheus (Debian) provides "
                    f"promtool and prometheus; these tests need it", pytrace=False)
    return path


class Pipeline:
    """The running proxy and its fakes; ``send(n)`` sends n turns and waits until everything
    (records, shadow runs, comparisons, metrics) has settled."""

    def __init__(self, loop: LoopThread, tmp: Path, **config: Any) -> None:
        from tensorverse.testing.fake_vllm import FakeVLLM

        from tensorverse.config import parse_config
        from tensorverse.proxy.server import Proxy
        from tensorverse.store import Store

        self.loop = loop
        self.store = Store.open(tmp / "store", durable=False)
        self.fakes = [
            FakeVLLM(vocab=64),  # the primary
            FakeVLLM(vocab=64, store=self.store, perturb=3.0),
            FakeVLLM(vocab=64, store=self.store, perturb=1.0, perturb_seed=3),
            FakeVLLM(vocab=64, store=self.store, perturb=0.4, perturb_seed=7),
        ]
        for f in self.fakes:
            loop.run(f.start())
        prim, cand, fp8, sec = self.fakes
        data = {
            "proxy": {"listen": "127.0.0.1:0"},
            "admin": {"listen": "127.0.0.1:0"},
            "primary": {"url": prim.url},
            "store": {"path": str(tmp / "store"), "durable": False},
            "shadows": [
                {"name": "cand", "url": cand.url, "capture": "full"},
                {"name": "fp8-kv", "url": fp8.url, "capture": "full"},
                {"name": "secondary", "url": sec.url, "capture": "full", "role": "secondary"},
            ],
            **config,
        }
        self.config = parse_config(data)
        self.proxy = Proxy(self.config, store=self.store)
        loop.run(self.proxy.start())
        self.url = f"http://127.0.0.1:{self.proxy.port}"
        self.admin_url = f"http://127.0.0.1:{self.proxy.admin_port}"
        self.sent = 0

    def send(self, n: int = 3, *, max_tokens: int = 12) -> None:
        import httpx

        with httpx.Client(timeout=60) as c:
            for _ in range(n):
                i = self.sent
                self.sent += 1
                r = c.post(self.url + "/v1/completions", json={
                    "model": "fake-model", "prompt": [5, 6, 7 + i % 40, 8 + i // 40], "max_tokens": max_tokens,
                    "temperature": 0})
                assert r.status_code == 200, r.text
        self.settle()

    def settle(self, timeout: float = 60.0) -> None:
        p = self.proxy
        self.loop.run(p.core.drain(timeout))
        self.loop.run(p.tee.drain(timeout))
        self.loop.run(p.core.drain(timeout))
        self.store.submit(lambda txn: None).result(timeout)

    def scrape(self) -> str:
        import httpx

        return httpx.get(self.admin_url + "/metrics", timeout=30).text

    def close(self) -> None:
        self.loop.run(self.proxy.close())
        for f in self.fakes:
            self.loop.run(f.close())
        self.store.close()


def store_comparisons(store: Any) -> list[Comparison]:
    """Every stored comparison (the typed records), session by session."""
    out = []
    for s in store.iter_sessions():
        for t in store.iter_turns(s.id):
            for r in store.iter_runs(t.id):
                out.extend(store.iter_comparisons(r.id))
    return out


# --------------------------------------------------------------------------- PromQL names

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
    "unless", "atan2", "inf", "nan", "start", "end",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression refers to (Grafana variables allowed).

    Drops string literals, ``{...}`` matchers, ``[...]`` ranges, Grafana ``$variables``, the label
    lists of ``by``/``without``/``on``/``ignoring``/``group_left``/``group_right``, function names
    (an identifier followed by ``(``) and numbers; what is left are metric names."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\$\{[^}]*\}|\$\w+", "1", s)
    s = re.sub(r"\{[^{}]*\}", "", s)
    s = re.sub(r"\[[^\[\]]*\]", "", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)
    s = re.sub(r"(?<![\w:.])\d+(?:\.\d+)?(?:e[+-]?\d+)?(?![\w:])", " ", s, flags=re.I)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        name = m.group(0)
        rest = s[m.end():].lstrip()
        if rest.startswith("(") or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def rule_groups(path: Path) -> list[dict]:
    import yaml

    return yaml.safe_load(path.read_text())["groups"]


def recording_names(path: Path) -> set[str]:
    return {r["record"] for g in rule_groups(path) for r in g["rules"] if "record" in r}
