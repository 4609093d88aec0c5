"""A real Prometheus (Debian's `prometheus` binary) scrapes a real proxy during an integration run:
the flip-rate recording rule it computes must equal the flip rate counted in the store.

Why the ratio is exact: every series exists at 0 before the first turn (pre-initialised), so
rate()'s extrapolation never reaches past the first sample, and flips and compared tokens are
scraped at the same instants: rate(flips) / rate(tokens) = Δflips / Δtokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from tests.exporters.exporters_support import ROOT, need_tool, store_comparisons  # type: ignore[import-not-found]
from tensorverse.ports import free_port

pytestmark = pytest.mark.prometheus

RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "tensorverse.json"


class Prometheus:
    def __init__(self, tmp, target: str) -> None:
        binary = need_tool("prometheus")
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {RULES}\n"
            "scrape_configs:\n  - job_name: tensorverse\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log = open(tmp / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                pytest.fail("prometheus did not start: " + (tmp / "prometheus.log").read_text()[-2000:])
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def query_error(self, expr: str) -> str | None:
        q = urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
                json.load(r)
            return None
        except urllib.error.HTTPError as e:
            return e.read().decode(errors="replace")

    def wait_for(self, expr: str, check, timeout: float = 45.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            res = self.query(expr)
            if check(res):
                return res
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr}: {res}")
            time.sleep(0.5)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()


@pytest.fixture
def prometheus_for(tmp_path):
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        p = Prometheus(tmp_path, target)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


def _by_backend(res: list[dict]) -> dict[str, float]:
    return {r["metric"]["backend"]: float(r["value"][1]) for r in res}


def test_flip_rate_rule_matches_the_store(make_pipeline, prometheus_for):
    pipe = make_pipeline()
    prom = prometheus_for(pipe.admin_url.removeprefix("http://"))
    # the zero series are scraped before anything happens
    prom.wait_for('count(tensorverse_compared_tokens_total{ref_role="primary"})', lambda r: r and float(r[0]["value"][1]) >= 6)
    prom.wait_for("count_over_time(tensorverse_shadow_queued_total[5m])", lambda r: r and float(r[0]["value"][1]) >= 2)
    pipe.send(6)

    comps = store_comparisons(pipe.store)
    want: dict[tuple[str, str], float] = {}
    for backend in ("cand", "fp8-kv", "secondary"):
        forced = [c for c in comps if c.backend == backend and c.mode == "forced" and c.ref_role == "primary"]
        free = [c for c in comps if c.backend == backend and c.mode == "free"]
        assert len(forced) == len(free) == 6
        want[(backend, "forced")] = sum(len(c.flips) for c in forced) / sum(c.n for c in forced)
        want[(backend, "free")] = sum(bool(c.diverged) for c in free) / \
            sum(c.common_prefix + bool(c.diverged) for c in free)
    total_tokens = sum(c.n for c in comps if c.mode == "forced" and c.ref_role == "primary")

    # Prometheus has scraped the final counters ...
    prom.wait_for('sum(tensorverse_compared_tokens_total{mode="forced", ref_role="primary"})',
                  lambda r: r and float(r[0]["value"][1]) == total_tokens)
    # ... and evaluated the rule on them
    for mode in ("forced", "free"):
        expected = {b: v for (b, m), v in want.items() if m == mode}

        def done(res, expected=expected):
            got = _by_backend(res)
            return set(got) == set(expected) and all(abs(got[b] - v) < 1e-9 for b, v in expected.items())

        res = prom.wait_for(f'tensorverse:flip_rate:ratio_rate5m{{mode="{mode}", ref_role="primary"}}', done)
        assert done(res), (mode, _by_backend(res), expected)

    # the noise floor and the candidates above it
    floor = want[("secondary", "forced")]
    res = prom.wait_for('tensorverse:flip_rate_above_noise_floor:ratio_rate5m{mode="forced"}',
                        lambda r: len(r) == 2)
    got = _by_backend(res)
    assert got["cand"] == pytest.approx(want[("cand", "forced")] - floor, abs=1e-9)
    assert got["fp8-kv"] == pytest.approx(want[("fp8-kv", "forced")] - floor, abs=1e-9)
    assert want[("cand", "forced")] > want[("fp8-kv", "forced")] > floor  # the fakes' perturbations, in order

    # flips by class (issue 19): each class's rate on the live scrape equals the store's
    want_cls: dict[tuple[str, str], float] = {}
    for backend in ("cand", "fp8-kv", "secondary"):
        forced = [c for c in comps if c.backend == backend and c.mode == "forced" and c.ref_role == "primary"]
        n = sum(c.n for c in forced)
        for cls in ("tie", "near_tie", "noise", "parser", "runtime"):
            want_cls[(backend, cls)] = sum(c.flip_classes.count(cls) for c in forced) / n

    def classes_done(res):
        got = {(r["metric"]["backend"], r["metric"]["class"]): float(r["value"][1]) for r in res}
        return all(abs(got.get(k, -1) - v) < 1e-9 for k, v in want_cls.items())

    res = prom.wait_for('sum by (backend, class) (tensorverse:flip_rate_by_class:ratio_rate5m{mode="forced", '
                        'ref_role="primary"})', classes_done)
    assert classes_done(res), (res, want_cls)
    assert want_cls[("secondary", "runtime")] == 0  # the noise floor's flips are never runtime
    # the excess interval's rules evaluate on live data: low <= excess <= high per candidate
    low = _by_backend(prom.wait_for('tensorverse:excess_flip_rate_low:ratio_rate1h{mode="forced"}', lambda r: len(r) == 2))
    mid = _by_backend(prom.wait_for('tensorverse:excess_flip_rate:ratio_rate1h{mode="forced"}', lambda r: len(r) == 2))
    high = _by_backend(prom.wait_for('tensorverse:excess_flip_rate_high:ratio_rate1h{mode="forced"}', lambda r: len(r) == 2))
    assert set(low) == {"cand", "fp8-kv"} and all(low[b] <= mid[b] <= high[b] for b in low)

    # every dashboard expression parses and evaluates on this Prometheus
    dash = json.loads(DASHBOARD.read_text())
    subst = {"${datasource}": "", "$__rate_interval": "1m", "$__range": "5m", "$backend": ".*", "$ref_role": ".*"}
    for p in dash["panels"]:
        for t in p.get("targets") or ():
            expr = t["expr"]
            for k, v in subst.items():
                expr = expr.replace(k, v)
            assert prom.query_error(expr) is None, (p["title"], expr, prom.query_error(expr))
