"""Same-dictionary check: fingerprints through the API, the verdict and its message, the
chat-template check; plus the Backend dataclass."""

from __future__ import annotations

import asyncio

import pytest
from tensorverse.testing.fake_vllm import FakeVLLM

from tensorverse.shadow import Backend
from tensorverse.shadow.client import BackendClient
from tensorverse.shadow.tokenizer import (
    PROBE_TEXTS,
    SPECIAL_TOKENS,
    check_template,
    fingerprint,
    fingerprint_from_parts,
    same_dictionary,
    template_difference,
)


def fp_of(**kw):
    async def main():
        fake = await FakeVLLM(**kw).start()
        try:
            async with BackendClient(Backend("x", fake.url)) as c:
                return await fingerprint(c)
        finally:
            await fake.close()

    return asyncio.run(main())


def test_fingerprint_through_the_api_is_stable_and_tells_dictionaries_apart():
    a1, a2, b = fp_of(tokenizer="a"), fp_of(tokenizer="a", vocab=64), fp_of(tokenizer="b")
    assert a1["available"] and a1["fingerprint"] == a2["fingerprint"]
    assert len(a1["probes"]) == len(PROBE_TEXTS) and set(a1["special"]) == set(SPECIAL_TOKENS)
    assert a1["special"]["<|im_end|>"] == 61 and a1["vocab_size"] == 64
    assert a1["fingerprint"] == fingerprint_from_parts(a1)
    assert a1["template_fingerprint"] and a1["template"]
    assert b["fingerprint"] != a1["fingerprint"]
    ok, msg = same_dictionary(a1, a2, primary_name="prim", shadow_name="shadow")
    assert ok and "uses prim's dictionary" in msg
    ok, msg = same_dictionary(a1, b, primary_name="prim", shadow_name="other")
    assert not ok
    assert msg.startswith("refused: other does not use prim's dictionary")
    assert "special tokens differ: " in msg and "<|im_end|> is 61 on prim but 57 on other" in msg
    assert "probe texts tokenize differently" in msg and "BOS/EOS" in msg


def test_vocab_size_difference_alone_is_refused():
    a, wide = fp_of(vocab=64), fp_of(vocab=64)
    wide = {**wide, "vocab_size": 128}
    ok, msg = same_dictionary(a, wide)
    assert not ok and "vocabulary size 64 on primary but 128 on shadow" in msg


def test_unavailable_fingerprint_allowed_unless_strict():
    down = {"available": False, "error": "connect: refused"}
    good = {"available": True, "fingerprint": "x"}
    ok, msg = same_dictionary(good, down)
    assert ok and "could not be fingerprinted" in msg and "connect: refused" in msg
    ok, _ = same_dictionary(good, down, strict=True)
    assert not ok
    unreachable = asyncio.run(_fp_unreachable())
    assert unreachable["available"] is False and "connect" in unreachable["error"]


async def _fp_unreachable():
    async with BackendClient(Backend("x", "http://127.0.0.1:9", timeout_s=2)) as c:
        return await fingerprint(c)


def test_template_check():
    assert template_difference([1, 2, 3], [1, 2, 3]) == {"status": "ok", "prompt_tokens": 3}
    d = template_difference([1, 2, 3, 4], [1, 2, 9, 4, 5])
    assert d["status"] == "template_mismatch" and d["first_difference"] == 2
    assert d["primary_ids"] == [3, 4] and d["shadow_ids"] == [9, 4, 5]
    assert template_difference([1, 2], [1, 2, 3])["first_difference"] == 2

    async def main():
        a = await FakeVLLM(template="a").start()
        b = await FakeVLLM(template="b").start()
        try:
            msgs = [{"role": "user", "content": "hi"}]
            ids = a.encode(a.render(msgs, None, True))
            async with BackendClient(Backend("a", a.url)) as ca, BackendClient(Backend("b", b.url)) as cb:
                return (await check_template(ca, {"messages": msgs}, ids),
                        await check_template(cb, {"messages": msgs}, ids),
                        await check_template(ca, None, ids),
                        b.requests)
        finally:
            await a.close()
            await b.close()

    same, other, none, sent = asyncio.run(main())
    assert same["status"] == "ok"
    assert other["status"] == "template_mismatch" and "not as numeric divergence" in other["message"]
    assert none == {"status": "not_chat"}
    body = [b for p, b in sent if p == "/tokenize"][0]
    assert body["messages"] and body["add_generation_prompt"] is True and body["add_special_tokens"] is False


def test_backend_dataclass():
    b = Backend("s1", "http://h:8000/v1/", model="m", api_key="sk-secret", role="secondary")
    assert b.base_url == "http://h:8000" and b.api_url == "http://h:8000/v1"
    assert Backend("s", "http://h:8000").api_url == "http://h:8000/v1"
    assert "sk-secret" not in repr(b)
    info = b.info()
    assert not hasattr(info, "api_key") and info.has_api_key is True and "sk-secret" not in repr(info)
    assert b.http_headers()["Authorization"] == "Bearer sk-secret"
    assert Backend.from_dict({"name": "x", "url": "http://h", "capture": "topk"}).capture == "topk"
    for bad in ({"name": "", "url": "http://h"}, {"name": "x", "url": "h:1"},
                {"name": "x", "url": "http://h", "role": "boss"},
                {"name": "x", "url": "http://h", "capture": "some"},
                {"name": "x", "url": "http://h", "timeout_s": 0},
                {"name": "x", "url": "http://h", "concurrency": 0},
                {"name": "x", "url": "http://h", "colour": "red"}):
        with pytest.raises(ValueError):
            Backend.from_dict(bad)
