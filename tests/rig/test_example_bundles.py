"""The bundles made on this machine (examples/rig-bundles/) pass the checker against the shipped
corpus, and say what was measured here: the reference reproduces the recorded tokens on the
machine that recorded them, the noise point never flips, and FP8 KV-cache flips more than fp32."""

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
