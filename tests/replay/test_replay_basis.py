"""The basis of a replayed turn (fake vLLM servers): scrubbing changes prompts, so the recorded
output is not the reference's continuation of the scrubbed prompt. The reference must run free on
the scrubbed prompt and every forced run must decode *that* output; the recorded output is only
compared with the reference's (what scrubbing changed). A copy of the reference config then shows
no departure, flip or free divergence at all, however far the recording is from the new prompt."""

from __future__ import annotations

from pathlib import Path

from tensorverse.testing.fake_vllm import FakeVLLM
from tests.replay.test_replay_runner import N, _replay, greedy, make_case  # type: ignore[import-not-found]

from tensorverse.replay.corpus import load_corpus, write_corpus

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]


def _stale_corpus(tmp_path: Path) -> Path:
    """Cases whose recorded outputs are the reference's continuation of *other* prompts (as after
    a scrub: the recording answered the original prompt)."""
    fake = FakeVLLM()
    cases = []
    for i, p in enumerate(PROMPTS):
        case = make_case(fake, f"s{i}", [p])
        stale = greedy(fake, [40 + i, 41, 42])
        assert stale != greedy(fake, p)
        case["turns"][0]["reference"]["output_token_ids"] = stale
        case["turns"][0]["reference"]["text"] = "".join(fake.decode_one(t) for t in stale)
        cases.append(case)
    return write_corpus(tmp_path / "corpus", cases, tokenizer={"fingerprint": None}, name="stale")


def _forced_tokens(fake: FakeVLLM) -> list[list[int]]:
    """The token ids each forced run decoded (the capability probe's one-token force left out)."""
    return [b["vllm_xargs"]["tv_force"] for path, b in fake.requests
            if path == "/v1/completions" and len((b.get("vllm_xargs") or {}).get("tv_force") or ()) > 1]


def test_forced_runs_decode_the_reference_run_on_the_scrubbed_prompt(tmp_path):
    corpus = _stale_corpus(tmp_path)
    fakes = {"ref": FakeVLLM(), "copy": FakeVLLM(), "cand": FakeVLLM(perturb=2.0)}
    res = _replay(corpus, fakes, reference="ref")
    fresh = [greedy(FakeVLLM(), p) for p in PROMPTS]
    for name in fakes:  # every backend (the reference too) was forced through the fresh output
        assert sorted(_forced_tokens(fakes[name])) == sorted(fresh), name
    s = res["summary"]
    # the reference and a copy of its config agree with the basis everywhere ...
    assert s["ref"]["departures"] == 0 and s["copy"]["departures"] == 0
    assert s["copy"]["flips"] == 0 and s["copy"]["positions"] == len(PROMPTS) * N
    assert s["copy"]["diverged"] == 0 and s["copy"]["verdicts"] == {"match": len(PROMPTS)}
    # ... while the reference's own free row says the recording is stale (vs the recorded output)
    assert s["ref"]["diverged"] == len(PROMPTS)
    for c in res["cases"]:
        t = c["turns"][0]
        assert t["basis"]["source"] == "reference" and t["basis"]["backend"] == "ref"
        assert t["basis"]["vs_recorded"]["diverged"] is True
        assert t["backends"]["ref"]["free"]["vs"] == "recorded"
        assert t["backends"]["copy"]["free"]["diverged"] is False
    # a real other runtime still differs from the basis
    assert s["cand"]["flips"] > 0 and s["cand"]["departures"] > 0


def test_the_recorded_output_is_the_basis_when_the_reference_cannot_run(tmp_path):
    corpus = _stale_corpus(tmp_path)
    fakes = {"ref": FakeVLLM(fail_status=500), "cand": FakeVLLM()}
    res = _replay(corpus, fakes, reference="ref", retries=1)
    t = res["cases"][0]["turns"][0]
    assert t["basis"]["source"] == "recorded" and "failed" in t["basis"]["why"]
    recorded = sorted(c["turns"][0]["reference"]["output_token_ids"] for c in load_corpus(corpus).cases)
    assert sorted(_forced_tokens(fakes["cand"])) == recorded
    assert res["summary"]["ref"]["errors"] > 0 and res["summary"]["cand"]["errors"] == 0
