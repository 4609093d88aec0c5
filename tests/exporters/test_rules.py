"""deploy/prometheus/rules.yml: promtool check + unit tests, and what the rules refer to.

promtool comes with Debian's `prometheus` package (apt-get install -y prometheus); without it
these tests fail (they never skip)."""

from __future__ import annotations

import re
import subprocess

import pytest
from tests.exporters.exporters_support import ROOT, need_tool, promql_metric_names, recording_names, rule_groups  # type: ignore[import-not-found]

from tensorverse.exporters.metrics import exported_names

RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "rules_test.yml"
DOCS = ROOT / "docs" / "metrics.md"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.prometheus
def test_promtool_check_rules():
    r = _run(need_tool("promtool"), "check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@pytest.mark.prometheus
def test_promtool_test_rules():
    r = _run(need_tool("promtool"), "test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_rules_refer_only_to_exported_metrics():
    known = exported_names() | recording_names(RULES) | {"up"}
    for g in rule_groups(RULES):
        for rule in g["rules"]:
            names = promql_metric_names(rule["expr"])
            assert names, rule
            assert names <= known, (rule.get("record") or rule.get("alert"), sorted(names - known))


def test_recording_rules_as_required():
    rec = {r["record"]: r["expr"] for g in rule_groups(RULES) for r in g["rules"] if "record" in r}
    flip = re.sub(r"\s+", " ", rec["tensorverse:flip_rate:ratio_rate5m"])
    assert "sum by (backend, role, mode, ref_role) (rate(tensorverse_flips_total[5m]))" in flip
    assert "/ sum by (backend, role, mode, ref_role) (rate(tensorverse_compared_tokens_total[5m]))" in flip
    for name in ("tensorverse:tool_call_mismatch_rate:ratio_rate5m", "tensorverse:shadow_drop_rate:ratio_rate5m",
                 "tensorverse:flip_rate_above_noise_floor:ratio_rate5m", "tensorverse:noise_floor_flip_rate:ratio_rate5m"):
        assert name in rec
    for name in rec:
        assert re.fullmatch(r"tensorverse:[a-z0-9_]+:[a-z0-9_]+", name), name  # level:metric:operations


def test_alerts_have_for_severity_and_a_runbook_in_the_docs():
    docs = DOCS.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", docs, flags=re.M)}
    alerts = [r for g in rule_groups(RULES) for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 6
    for a in alerts:
        assert re.fullmatch(r"\d+[smh]", a.get("for", "")), a["alert"]
        assert a["labels"]["severity"] in ("critical", "warning", "info")
        ann = a["annotations"]
        assert ann["summary"] and ann["description"]
        url = ann["runbook_url"]
        assert url.startswith("docs/metrics.md#"), url
        assert url.split("#", 1)[1] in anchors, f"{a['alert']}: no heading for {url} in docs/metrics.md"
        assert url.split("#", 1)[1] == a["alert"].lower()


def _excess_rule_test(cases: list[tuple[str, int, int]], noise: tuple[int, int]) -> str:
    """A promtool unit test whose expected excess intervals come from the analysis package
    (scipy's Wilson intervals, Newcombe's hybrid score): the PromQL and the Python agree.
    Counters grow by a constant per minute; the 1h window at 90m holds exactly 60 steps.
    promtool compares values exactly, so both sides are rounded to 1e-9 the same way
    (Prometheus's ``round(v, 1e-9)`` is ``floor(v * (1 / 1e-9) + 0.5) / (1 / 1e-9)``)."""
    import math

    from tensorverse.analysis.attribution import excess_flip_rate

    def r9(v: float) -> float:
        inv = 1 / 1e-9
        return math.floor(v * inv + 0.5) / inv

    lab = 'job="tensorverse",instance="p1",mode="forced",ref_role="primary"'
    series = [f"""      - series: 'tensorverse_compared_tokens_total{{{lab},backend="secondary",role="secondary"}}'
        values: '0+{noise[1]}x100'
      - series: 'tensorverse_flips_total{{{lab},backend="secondary",role="secondary",region="content",class="noise"}}'
        values: '0+{noise[0]}x100'"""]
    low, high = [], []
    for name, x, n in cases:
        series.append(f"""      - series: 'tensorverse_compared_tokens_total{{{lab},backend="{name}",role="shadow"}}'
        values: '0+{n}x100'
      - series: 'tensorverse_flips_total{{{lab},backend="{name}",role="shadow",region="content",class="runtime"}}'
        values: '0+{x}x100'""")
        e = excess_flip_rate(60 * x, 60 * n, 60 * noise[0], 60 * noise[1])
        out = f'backend="{name}",role="shadow",mode="forced",ref_role="primary"'
        low.append(f"""          - labels: '{{{out}}}'
            value: {r9(e.low)!r}""")
        high.append(f"""          - labels: '{{{out}}}'
            value: {r9(e.high)!r}""")
    nl = "\n"
    return f"""rule_files:
  - {RULES}
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
{nl.join(series)}
    promql_expr_test:
      - expr: round(tensorverse:excess_flip_rate_low:ratio_rate1h, 1e-9)
        eval_time: 90m
        exp_samples:
{nl.join(low)}
      - expr: round(tensorverse:excess_flip_rate_high:ratio_rate1h, 1e-9)
        eval_time: 90m
        exp_samples:
{nl.join(high)}
"""


@pytest.mark.prometheus
def test_promql_excess_interval_equals_the_analysis_one(tmp_path):
    cases = [("big", 300, 6000), ("even", 50, 5000), ("small", 1, 3), ("none", 0, 40), ("all", 7, 7)]
    path = tmp_path / "excess_test.yml"
    path.write_text(_excess_rule_test(cases, (60, 6000)))
    r = _run(need_tool("promtool"), "test", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    # and an expectation off by 1e-9 fails (the comparison is not vacuous)
    text = path.read_text()
    first = re.search(r"value: (\S+)", text)
    assert first is not None
    bad_path = tmp_path / "bad_test.yml"
    bad_path.write_text(text[:first.start(1)] + repr(float(first.group(1)) + 1e-9) + text[first.end(1):])
    r = _run(need_tool("promtool"), "test", "rules", str(bad_path))
    assert r.returncode != 0, r.stdout


def test_alerts_on_flips_fire_on_interval_bounds_never_on_raw_rates():
    alerts = {r["alert"]: r["expr"] for g in rule_groups(RULES) for r in g["rules"] if "alert" in r}
    for name in ("TensorverseExcessFlipRate", "TensorverseFlipRateHigh", "TensorverseNoiseFloorHigh"):
        expr = alerts[name]
        assert re.search(r"_(low|wilson_low):", expr), (name, expr)
        assert "tensorverse:flip_rate" not in expr and "flips_total" not in expr, (name, expr)
