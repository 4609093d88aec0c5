"""The capture plugin inside a real vLLM-CPU server (the installed entry point loads it).

The capture rig's bf16 server of the tiny Qwen3 (``capture_rig``, shared with the shadow-runner
and turnstone tests; it prefills at most 1,024 tokens a step, so a longer prompt is prefilled in
chunks) ships its rows over HTTP (``TENSORVERSE_CAPTURE_SINK=http://...``, the
sink the recorder uses in production) to a small ingest endpoint of this test process
(``tests/capture/_receiver.Recorder``) on the rig's sink address, which one test stops and starts
again under the running server. The ``dir:`` sink inside vLLM is the on-demand rig's
(``tests/capture/test_quant_capture_vllm.py``). A second, identical server with the plugin
switched off is the A/B test's other side.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

import openai  # noqa: E402  (the rig installs vllm and openai)


from tensorverse.rig.models import build_model  # noqa: E402
from tensorverse.rig.servers import CAPTURE_PREFILL_CHUNK, VLLMServer  # noqa: E402

from tensorverse.store.codec import decode_row  # noqa: E402
from tests.capture._receiver import Recorder  # noqa: E402

MODEL = "tiny-a"
IM_START, IM_END, NL = 151644, 151645, 198
PROMPT = [IM_START, 872, NL, 9707, 11, 1246, 525, 498, 30, IM_END, NL, IM_START, 77091, NL]
# The API's logprobs are vLLM's float32 log-softmax of the row, so against the exact (float64)
# log-softmax they carry float32's rounding of a 151,936-term log-sum-exp: 1.2e-5 nats measured on
# an AVX2 CPU (8-lane sums), under 1e-5 on AVX-512 ones. TOL bounds that rounding; the exactness
# of the rows is what TOL32 asserts: the same float32 op on the captured row gives the API's value.
TOL = 5e-5
TOL32 = 1e-6


@pytest.fixture(scope="module")
def server(capture_rig, tmp_path_factory):
    s = capture_rig.get("bf16")
    s.token = capture_rig.token
    s.rec = Recorder(port=capture_rig.sink_port, token=s.token)  # the restart test replaces it
    s.tmp = tmp_path_factory.mktemp("capture")
    s.client = openai.OpenAI(base_url=s.url, api_key="none", timeout=300)
    try:
        yield s
    finally:
        s.rec.stop()  # the address is free for the next test that serves it


def complete(server, prompt, max_tokens, xargs=None, **kw):
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    if xargs is not None:
        extra["vllm_xargs"] = xargs
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, logprobs=5, extra_body=extra, **kw)
    c = r.model_dump()["choices"][0]
    return c["token_ids"], c["logprobs"]


def frames(rec, cid, n, timeout=60.0):
    """The frames of ``cid`` that ``rec`` received, by position, once ``n`` have arrived."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [f for f in rec.frames() if f.capture_id == cid]
        if len(got) >= n:
            break
        time.sleep(0.2)
    return sorted((f for f in rec.frames() if f.capture_id == cid), key=lambda f: f.position)


def rows(server, cid, n, timeout=60.0):
    """The captured rows of ``cid`` (position -> float32 row), once all ``n`` have arrived."""
    got = frames(server.rec, cid, n, timeout)
    assert len(got) == n, f"{cid}: {len(got)} rows arrived, expected {n}"
    assert not any(f.compact for f in got)  # asked for in full: every row travels whole
    return {f.position: decode_row(f.blob) for f in got}


def log_softmax(row):
    x = row.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def log_softmax_f32(row):
    """What vLLM computes for the API (``logits.log_softmax(-1, dtype=float32)``)."""
    import torch

    return torch.from_numpy(row).log_softmax(-1, dtype=torch.float32).numpy()


def check_matches_api(row_map, tokens, logprobs):
    """Same argmax as the emitted token, and the API's top-k and sampled logprobs equal the
    log-softmax of the captured row (float64: within TOL; float32 as vLLM does it: within TOL32)."""
    assert sorted(row_map) == list(range(len(tokens)))
    worst64 = worst32 = 0.0
    for i, tok in enumerate(tokens):
        row = row_map[i]
        assert row.dtype == np.float32 and row.shape == (151936,)
        top = np.flatnonzero(row == row.max())
        assert tok in top, f"position {i}: emitted {tok}, row argmax {top}"
        lp64, lp32 = log_softmax(row), log_softmax_f32(row)
        api_top = logprobs["top_logprobs"][i]
        assert len(api_top) >= 5
        pairs = {int(k.split(":")[1]): v for k, v in api_top.items()}
        assert tok not in pairs or pairs[tok] == logprobs["token_logprobs"][i]
        pairs[tok] = logprobs["token_logprobs"][i]
        for t, v in pairs.items():
            worst64 = max(worst64, abs(lp64[t] - v))
            worst32 = max(worst32, abs(float(lp32[t]) - v))
        top_api = sorted(pairs.values(), reverse=True)[:5]
        assert np.allclose(top_api, np.sort(lp64)[::-1][:5], atol=TOL, rtol=0)
    assert worst64 <= TOL, worst64
    assert worst32 <= TOL32, worst32
    print(f"[capture] {len(tokens)} rows: max |logprob - API| {worst64:.1e} (float64), "
          f"{worst32:.1e} (float32)")
    return worst64


def test_rows_reproduce_the_api_logprobs(server):
    tokens, lps = complete(server, PROMPT, 12, {"tv_capture": "free-1"})
    assert len(tokens) == 12
    check_matches_api(rows(server, "free-1", 12), tokens, lps)


def test_chunked_prefill_of_a_long_prompt(server):
    prompt = (PROMPT[:-3] + [9707, 11, 1246, 525, 498, 30, NL] * 700 + PROMPT[-3:])[:4500]
    assert len(prompt) > 4 * CAPTURE_PREFILL_CHUNK  # prefilled in five chunks
    tokens, lps = complete(server, prompt, 6, {"tv_capture": "long-1"})
    check_matches_api(rows(server, "long-1", 6), tokens, lps)


def test_forced_mode_emits_the_forced_ids_and_rows_follow_the_tokens(server):
    free, _ = complete(server, PROMPT, 8, {"tv_capture": "free-f"})
    free_rows = rows(server, "free-f", 8)
    k = 3
    order = np.argsort(-free_rows[k].astype(np.float64), kind="stable")
    alt = int(next(t for t in order if t != free[k]))
    forced = free[:k] + [alt, 9707, IM_END, 1246, 525, IM_END, 30]  # EOS inside: must not stop
    assert forced != free[: len(forced)]
    tokens, lps = _forced(server, forced, "forced-f")
    assert tokens == forced
    frows = rows(server, "forced-f", len(forced))
    # Same tokens so far -> same rows, bit for bit (positions 0..k see tokens free[:k]).
    for p in range(k + 1):
        assert frows[p].view(np.uint32).tobytes() == free_rows[p].view(np.uint32).tobytes(), p
    # After the forced token differs, the rows are the shadow's own, conditioned on it.
    assert not np.array_equal(frows[k + 1], free_rows[k + 1])
    # The API still reports the raw logprob of each forced token (before the mask).
    for i, t in enumerate(forced):
        assert abs(log_softmax(frows[i])[t] - lps["token_logprobs"][i]) <= TOL
        assert abs(float(log_softmax_f32(frows[i])[t]) - lps["token_logprobs"][i]) <= TOL32


def _forced(server, forced, cid):
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True,
             "ignore_eos": True, "vllm_xargs": {"tv_capture": cid, "tv_force": forced}}
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=len(forced),
                                         temperature=0, logprobs=5, extra_body=extra)
    c = r.model_dump()["choices"][0]
    return c["token_ids"], c["logprobs"]


def test_forced_at_high_temperature(server):
    forced = [9707, 11, 1246, 525, 498]
    extra = {"return_token_ids": True, "ignore_eos": True, "vllm_xargs": {"tv_force": forced}}
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                         temperature=1.5, top_p=0.9, seed=3, extra_body=extra)
    assert r.model_dump()["choices"][0]["token_ids"] == forced


def test_repeated_captures_are_bit_identical(server):
    a, _ = complete(server, PROMPT[:9], 10, {"tv_capture": "rep-a"})
    b, _ = complete(server, PROMPT[:9], 10, {"tv_capture": "rep-b"})
    assert a == b
    ra, rb = rows(server, "rep-a", 10), rows(server, "rep-b", 10)
    for p in range(10):
        assert ra[p].view(np.uint32).tobytes() == rb[p].view(np.uint32).tobytes(), p


def test_positions_subset(server):
    tokens, _ = complete(server, PROMPT, 10, {"tv_capture": "every-3", "tv_positions": "every:3"})
    got = rows(server, "every-3", 4)
    assert sorted(got) == [0, 3, 6, 9]


def test_request_without_opt_in_is_untouched(server):
    with_cap = complete(server, PROMPT[2:], 10, {"tv_capture": "optin-1"})
    rows(server, "optin-1", 10)
    before = len(server.rec.frames())
    plain = complete(server, PROMPT[2:], 10)
    other = complete(server, PROMPT[2:], 10, {"unrelated_key": "x"})
    assert plain == with_cap == other  # same tokens and logprobs
    time.sleep(1.5)
    assert len(server.rec.frames()) == before  # nothing shipped


def test_concurrent_requests_each_get_their_own_rows(server):
    prompts = [PROMPT[i:] for i in range(4)]
    lengths = [5, 9, 7, 11]  # finish at different steps: the batch condenses and reorders
    results = {}

    def go(i):
        results[i] = complete(server, prompts[i], lengths[i], {"tv_capture": f"conc-{i}"})

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        tokens, lps = results[i]
        check_matches_api(rows(server, f"conc-{i}", lengths[i]), tokens, lps)


def test_switched_off_server_is_plain_vllm(server):
    """A/B: TENSORVERSE_CAPTURE=0 on an identical server. Plain requests give bit-identical
    results on both; the off server ignores tv_* keys (no 400, no forcing, no rows)."""
    off = VLLMServer("capture-off", build_model(MODEL), "bfloat16", served_model_name=MODEL,
                     extra_args=server.extra_args, max_model_len=server.max_model_len,
                     env={"TENSORVERSE_CAPTURE": "0",
                          "TENSORVERSE_CAPTURE_SINK": f"dir:{server.tmp / 'off'}"})
    off.start()
    try:
        off.wait_ready()
        off.client = openai.OpenAI(base_url=off.url, api_key="none", timeout=300)
        on_plain = complete(server, PROMPT[1:], 8)
        on_capture = complete(server, PROMPT[1:], 8, {"tv_capture": "ab-on"})
        off_plain = complete(off, PROMPT[1:], 8)
        assert on_plain == off_plain == on_capture
        forced = [9707, 11, 1246, 525, 498, 30, 9707, 11]
        off_forced = complete(off, PROMPT[1:], 8, {"tv_capture": "ab-off", "tv_force": forced})
        assert off_forced == off_plain  # ignored
        assert not (server.tmp / "off").exists()  # no sink was ever opened
    finally:
        off.stop()


def test_bad_opt_ins_are_http_400(server):
    bad = [
        ({"tv_capture": "x", "tv_force": "1,zz"}, {}),
        ({"tv_capture": "x"}, {"logit_bias": {"5": 1.0}}),
        ({"tv_positions": "every:2"}, {}),
    ]
    for xargs, kw in bad:
        with pytest.raises(openai.BadRequestError):
            server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                             extra_body={"vllm_xargs": xargs, **kw})


def test_http_sink_from_inside_vllm_survives_the_recorder_restarting(server):
    """Rows travel as frames to an ingest endpoint (Bearer token); the recorder going away
    costs the rows of that moment (dropped and counted), and it is picked up again when back."""
    import json

    from tensorverse.capture.sink import STATS_HEADER

    rec = server.rec
    tokens, lps = complete(server, PROMPT, 6, {"tv_capture": "http-1"})
    fs = frames(rec, "http-1", 6)
    assert [f.position for f in fs] == list(range(6))
    check_matches_api({f.position: decode_row(f.blob) for f in fs}, tokens, lps)
    assert len({f.origin for f in fs}) == 1 and len({f.seq for f in fs}) == 6
    assert all(h["Authorization"] == f"Bearer {server.token}" for h in rec.headers)
    dropped_before = json.loads(rec.headers[-1][STATS_HEADER])["dropped_sink"]

    rec.stop()  # the recorder goes away
    complete(server, PROMPT, 4, {"tv_capture": "http-2"})
    time.sleep(1.5)  # the failed flush, then the back-off (0.5 s) runs out
    server.rec = rec2 = Recorder(port=rec.port, token=server.token)
    tokens, lps = complete(server, PROMPT[1:], 5, {"tv_capture": "http-3"})
    fs = frames(rec2, "http-3", 5)
    assert [f.position for f in fs] == list(range(5))
    check_matches_api({f.position: decode_row(f.blob) for f in fs}, tokens, lps)
    assert not [f for f in rec2.frames() if f.capture_id == "http-2"]
    counters = json.loads(rec2.headers[-1][STATS_HEADER])
    assert counters["dropped_sink"] - dropped_before == 4 and counters["sink_errors"] >= 1
    assert counters["rows_shipped"] >= 6  # counted before the batch it travels with
