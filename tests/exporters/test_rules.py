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


Moments = tuple[float, float, float, float, float, float]  # per minute: turns, x, n, x^2, x*n, n^2


def _interval_rule_test(cases: list[tuple[str, Moments]], noise: Moments) -> str:
    """A promtool unit test whose expected intervals come from the analysis package
    (`intervals.cluster_robust` of each candidate's runtime-class flip rate,
    `cluster_robust_difference` of its excess over the noise floor): the PromQL and the Python
    agree. Counters grow by a constant per minute; the 1h window at 90m holds exactly 60 steps.
    promtool compares values exactly, so both sides are rounded to 1e-9 the same way
    (Prometheus's ``round(v, 1e-9)`` is ``floor(v * (1 / 1e-9) + 0.5) / (1 / 1e-9)``)."""
    import math

    from tensorverse.analysis.intervals import ClusterMoments, cluster_robust, cluster_robust_difference

    def r9(v: float) -> float:
        inv = 1 / 1e-9
        return math.floor(v * inv + 0.5) / inv

    lab = 'job="tensorverse",instance="p1",mode="forced",ref_role="primary"'

    def series(backend: str, role: str, cls: str, m: Moments) -> str:
        b = f'{lab},backend="{backend}",role="{role}"'
        t, x, n, xx, xn, nn = m
        return f"""      - series: 'tensorverse_comparisons_total{{{b},outcome="ok"}}'
        values: '0+{t!r}x100'
      - series: 'tensorverse_compared_tokens_total{{{b}}}'
        values: '0+{n!r}x100'
      - series: 'tensorverse_compared_tokens_squared_total{{{b}}}'
        values: '0+{nn!r}x100'
      - series: 'tensorverse_flips_total{{{b},region="content",class="{cls}"}}'
        values: '0+{x!r}x100'
      - series: 'tensorverse_flips_squared_total{{{b},class="{cls}"}}'
        values: '0+{xx!r}x100'
      - series: 'tensorverse_flips_times_tokens_total{{{b},class="{cls}"}}'
        values: '0+{xn!r}x100'"""

    def hour(m: Moments) -> ClusterMoments:
        return ClusterMoments(*(60 * v for v in m))

    inputs = [series("secondary", "secondary", "noise", noise)]
    expect: dict[str, list[str]] = {k: [] for k in ("runtime_flip_rate_low", "runtime_flip_rate_high",
                                                   "excess_flip_rate_low", "excess_flip_rate_high")}
    for name, m in cases:
        inputs.append(series(name, "shadow", "runtime", m))
        rate, excess = cluster_robust(hour(m)), cluster_robust_difference(hour(m), hour(noise))
        out = f'backend="{name}",role="shadow",mode="forced",ref_role="primary"'
        for rule, v in (("runtime_flip_rate_low", rate.low), ("runtime_flip_rate_high", rate.high),
                        ("excess_flip_rate_low", excess.low), ("excess_flip_rate_high", excess.high)):
            expect[rule].append(f"""          - labels: '{{{out}}}'
            value: {r9(v)!r}""")
    nl = "\n"
    tests = "".join(f"""      - expr: round(tensorverse:{rule}:ratio_rate1h{{role="shadow"}}, 1e-9)
        eval_time: 90m
        exp_samples:
{nl.join(samples)}
""" for rule, samples in expect.items())
    return f"""rule_files:
  - {RULES}
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
{nl.join(inputs)}
    promql_expr_test:
{tests}"""


@pytest.mark.prometheus
def test_promql_flip_rate_intervals_equal_the_analysis_ones(tmp_path):
    """The recording rules' turn-clustered intervals (runtime rate, excess over the floor) are
    `intervals.cluster_robust` of the same turns: many turns, few flips; one flip in one turn of
    three; no flip; every position flipped in every turn (no spread)."""
    cases = [("big", (100, 300, 6000, 4500, 36000, 450000)),  # 20 turns of 120 tokens with 15 flips, 80 of 45
             ("even", (50, 50, 5000, 100, 5000, 500000)),  # 25 of 50 turns of 100 tokens flip twice
             ("small", (3, 1, 30, 1, 12, 306)),  # turns of 12, 9 and 9 tokens, one flip in the first
             ("none", (4, 0, 40, 0, 0, 400)), ("all", (2, 14, 14, 98, 98, 98))]  # all: two turns of 7, all flipped
    path = tmp_path / "interval_test.yml"
    path.write_text(_interval_rule_test(cases, (60, 60, 6000, 180, 6000, 600000)))
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
        assert re.search(r"_low:ratio_rate1h", expr) and "wilson" not in expr, (name, expr)
        assert "tensorverse:flip_rate" not in expr and "flips_total" not in expr, (name, expr)
        assert re.search(r"turns:sum_increase1h >= 20", expr), (name, expr)  # an hour of 20 turns at least
