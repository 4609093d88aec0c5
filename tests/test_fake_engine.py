"""The fake engine's ``agree_base`` rows: a shadow of :class:`FakeUpstream`'s primary at Qwen3's
vocabulary, which the production-load benchmark runs behind the real proxy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tensorverse.testing.fake_engine import FakeEngine, _bf16, _Req

QWEN3_VOCAB = 151_936


def _req(prompt: list[int], out: list[int]) -> _Req:
    return _Req(prompt=prompt, max_tokens=1, opt=None, logprobs=0, done=None, out=list(out))  # type: ignore[arg-type]


def test_agree_rows_are_bfloat16_with_exact_float64_log_sum_exp_and_top_logprobs():
    e = FakeEngine(vocab=QWEN3_VOCAB, agree_base=1000, runtime=3, flip_rate=0.25)
    for n in range(12):
        x, w, r, shift = e._agree(_req([7, 8, 9], list(range(n))))
        lse, tops = e._agree_logprobs(x, w, r, shift, 20)
        assert np.array_equal(x, _bf16(x))  # every logit a bfloat16 value
        x64 = x.astype(np.float64)
        m = x64.max()
        ref_lse = m + np.log(np.exp(x64 - m).sum())
        assert abs(lse - ref_lse) <= 1e-12 * abs(ref_lse)
        order = sorted(range(QWEN3_VOCAB), key=lambda t: (-x64[t], t))[:20]
        assert [t for t, _ in tops] == order
        assert [lp for _, lp in tops] == pytest.approx([x64[t] - ref_lse for t in order], abs=1e-12)
        assert {w, r} == set(order[:2]) and w == 1000 + n
        assert e.top_logprobs([7, 8, 9], list(range(n)), 20) == tops  # what a fake primary records


def test_agree_engine_follows_the_primary_and_flips_only_where_its_runtime_says():
    """runtime 0 decodes the primary's tokens (base + position) exactly; another runtime departs
    at about ``flip_rate`` of positions, always to the seeded runner-up of a near tie."""
    async def main():
        async with FakeEngine(vocab=QWEN3_VOCAB, agree_base=1000, step_s=0.0) as same, \
                FakeEngine(vocab=QWEN3_VOCAB, agree_base=1000, step_s=0.0, runtime=1) as other:
            import aiohttp

            async with aiohttp.ClientSession() as s:
                outs = []
                for e in (same, other):
                    async with s.post(e.url + "/completions", json={"prompt": [1, 2, 3], "max_tokens": 1000,
                                                                    "logprobs": 2}) as r:
                        outs.append((await r.json())["choices"][0])
                return outs

    same, other = asyncio.run(main())
    want = [1000 + i for i in range(1000)]
    assert same["token_ids"] == want
    diff = [i for i, (a, b) in enumerate(zip(other["token_ids"], want)) if a != b]
    assert 5 <= len(diff) <= 40  # flip_rate 0.02 of 1,000 positions, seeded
    first = diff[0]
    top = other["logprobs"]["top_logprobs"][first]
    assert list(top)[0] == f"token_id:{other['token_ids'][first]}"  # the flipped token was the argmax
    assert f"token_id:{want[first]}" in top  # and the primary's token the runner-up
    assert 0 < list(top.values())[0] - top[f"token_id:{want[first]}"] <= 0.0625 + 1e-9  # one bfloat16 step


def test_agree_engine_speaks_the_primarys_dictionary():
    """``/detokenize`` gives FakeUpstream's text of its output ids (``"t<i> "``) and ``/tokenize``
    renders any chat request to the prompt the fake primary serves: the runner's template check
    and tool-call pieces work against it as against vLLM."""
    async def main():
        import aiohttp

        async with FakeEngine(vocab=QWEN3_VOCAB, agree_base=1000, prompt_ids=[7, 8, 9]) as e, \
                aiohttp.ClientSession() as s:
            root = e.url[: -len("/v1")]
            async with s.post(root + "/detokenize", json={"tokens": [1000, 1003, 5]}) as r:
                text = (await r.json())["prompt"]
            async with s.post(root + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
                chat = (await r.json())["tokens"]
            async with s.post(root + "/tokenize", json={"prompt": "ab"}) as r:
                plain = (await r.json())["tokens"]
            return text, chat, plain

    assert asyncio.run(main()) == ("t0 t3 <5>", [7, 8, 9], [97, 98])
