"""deploy/prometheus/rules.yml: promtool check + unit tests, and what the rules refer to.

promtool comes with Debian's `prometheus` package (apt-get install -y prometheus); without it
these tests fail (they never skip)."""

from __future__ import annotations

import re
import subprocess

import pytest
from exporters_support import ROOT, need_tool, promql_metric_names, recording_names, rule_groups  # type: ignore[import-not-found]

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
