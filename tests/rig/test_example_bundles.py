"""The bundles made on this project's machines (examples/rig-bundles/) pass the checker against the
shipped corpus, and say what was measured there: on the Xeon that recorded the corpus the
reference reproduces its tokens, the noise point never flips, and FP8 KV-cache flips more than
fp32; on both AMD EPYCs, tensor parallelism flips a tool-call argument that TP1 keeps, and on the
one with AVX-512 TP2's second start flips exactly the same positions (the layout's, not noise)."""

from __future__ import annotations

from pathlib import Path

from tensorverse.bundle.check import check_bundle
from tensorverse.rig.suite import known_corpora

DIR = Path(__file__).resolve().parents[2] / "examples" / "rig-bundles"


def test_example_bundles_are_accepted_and_consistent():
    corpora = known_corpora()
    full = check_bundle(str(DIR / "xeon-avx512-full.tvbundle"), corpora)
    dtypes = check_bundle(str(DIR / "xeon-avx512-dtypes.tvbundle"), corpora)
    assert full.ran == ["bf16", "bf16_noise", "fp32", "fp16", "fp8_kv_e4m3", "fp8_kv_e5m2", "fp8_weights", "threads_2"]
    assert dtypes.ran == ["bf16", "fp32", "fp16"]
    assert full.rig["id"] != dtypes.rig["id"]
    s = full.summaries
    assert s["bf16"]["flips"] == 0 and s["bf16_noise"]["flips"] == 0 and s["bf16_noise"]["kl_max"] == 0.0
    assert s["fp8_kv_e5m2"]["flips"] > s["fp8_kv_e4m3"]["flips"] > s["fp32"]["flips"] > 0
    # one work directory: the settings both ran are the same rows
    for name in ("bf16", "fp32", "fp16"):
        assert [r for r in full.positions if r["setting"] == name] == \
               [r for r in dtypes.positions if r["setting"] == name]


def test_the_amd_bundle_shows_tp2_flipping_a_tool_argument_that_tp1_keeps():
    from tensorverse.hypercube.merge import merge_bundles
    from tensorverse.hypercube.site import site_data
    from tensorverse.hypercube.stats import marginals

    amd = check_bundle(str(DIR / "amd-epyc-avx2-cpu-v2.tvbundle"), known_corpora())
    assert amd.manifest["suite"]["name"] == "cpu-v2"
    assert amd.ran == ["bf16", "bf16_noise", "fp32", "fp16", "fp8_weights", "threads_2", "tp2"]

    def flips(name):
        return {(r["case"], r["position"]) for r in amd.positions if r["setting"] == name and r["flip"]}

    # TP1 (the reference and its second start) against the corpus: one tie, recorded on a Xeon
    assert flips("bf16") == flips("bf16_noise") == {("demo-05-mac-owner", 22)}
    # TP2 adds the description argument of demo-07's tool call, position 43 (a near tie)
    assert flips("tp2") - flips("bf16") == {("demo-07-set-description", 43)}
    free = {(r["setting"], r["case"]): r for r in amd.free}
    assert free[("tp2", "demo-07-set-description")]["verdict"] == "value_mismatch"
    assert free[("bf16", "demo-07-set-description")]["diverged"] is False
    status = {s["name"]: s for s in amd.manifest["settings"]}
    assert status["pp2"]["status"] == status["fp8_kv_e4m3"]["status"] == "refused"
    # the hypercube site carries the parallel axis
    cube = merge_bundles([amd])
    data = site_data(cube, marginals(cube))
    assert "parallel" in cube.axes and {m["setting"]: m["axis"] for m in data["marginals"]}["tp2"] == "parallel"


def test_the_avx512_amd_bundle_shows_tp2_flips_are_the_layouts_not_noise():
    amd = check_bundle(str(DIR / "amd-epyc-avx512-cpu-v3.tvbundle"), known_corpora())
    assert amd.manifest["suite"]["name"] == "cpu-v3"
    assert amd.ran == ["bf16", "bf16_noise", "fp32", "fp16", "fp8_kv_e4m3", "fp8_kv_e5m2", "fp8_weights", "threads_2",
                       "tp2", "tp2_noise"]

    def flips(name):
        return {(r["case"], r["position"]) for r in amd.positions if r["setting"] == name and r["flip"]}

    # this machine reproduces every recorded token at TP1, on both starts
    assert flips("bf16") == flips("bf16_noise") == set()
    # TP2 flips the description argument of demo-07's tool call (a near tie) and an exact tie of
    # demo-05, and TP2 started again flips exactly those: tensor parallelism's own order of sums
    assert flips("tp2") == flips("tp2_noise") == {("demo-07-set-description", 43), ("demo-05-mac-owner", 22)}
    free = {(r["setting"], r["case"]): r for r in amd.free}
    assert free[("tp2", "demo-07-set-description")]["verdict"] == "value_mismatch"
    assert free[("tp2_noise", "demo-07-set-description")]["verdict"] == "value_mismatch"
    assert free[("bf16", "demo-07-set-description")]["diverged"] is False
    s = amd.summaries
    assert s["tp2"]["kl_mean"] == s["tp2_noise"]["kl_mean"] > 0
    # FP8 KV cache runs here (AVX-512): e5m2 flips the most, as on the Xeon
    assert s["fp8_kv_e5m2"]["flips"] > s["fp8_kv_e4m3"]["flips"] > 0 and s["threads_2"]["flips"] == 0
    status = {x["name"]: x["status"] for x in amd.manifest["settings"]}
    assert status["pp2"] == "refused"
