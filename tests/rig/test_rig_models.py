"""The rig's model builder without vLLM: the weights' content hash, the checkpoint writer shared
with the demo model, the atomic cache install, and the tiny models' bytes (pinned)."""

from __future__ import annotations

import json

import pytest
import torch

from tensorverse.rig import models as R

# weights_hash of the tiny models as the builder wrote them before the checkpoint writer was
# shared with the demo model (2026-12-02, torch 2.13.0): the refactor must not move a bit.
TINY_A_WEIGHTS = "da0895f07ed4b5b4a04817e02a6c781c2c51a32e04722b2d1c058210091897fb"


def test_weights_hash_names_the_tensors_bit_for_bit(tmp_path):
    from safetensors.torch import load_file, save_file

    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16), "b": torch.ones(3)}
    h = R.weights_hash(a)
    assert len(h) == 64 and h == R.weights_hash(dict(reversed(list(a.items()))))  # order-free
    flipped = a["w"].clone()
    flipped.view(torch.int16)[1, 2] ^= 1  # one mantissa bit
    assert R.weights_hash(a | {"w": flipped}) != h
    assert R.weights_hash(a | {"w": a["w"].reshape(3, 2)}) != h  # same bytes, other shape
    assert R.weights_hash(a | {"b": torch.ones(3, dtype=torch.float64)}) != h  # other dtype
    assert R.weights_hash({"v": a["w"], "b": a["b"]}) != h  # other name
    save_file(a, str(tmp_path / R.WEIGHTS_FILE))
    assert R.file_weights_hash(tmp_path) == R.file_weights_hash(tmp_path / R.WEIGHTS_FILE) == h
    assert R.weights_hash(load_file(str(tmp_path / R.WEIGHTS_FILE))) == h


def test_a_sharded_checkpoint_hashes_as_its_tensors_together(tmp_path):
    """A large checkpoint comes in shards (``model-00001-of-00002.safetensors`` ...): its content
    hash is that of all its tensors, whichever file holds each; a tensor in two files is refused."""
    from safetensors.torch import save_file

    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16), "b": torch.ones(3)}
    save_file({"w": a["w"]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": a["b"]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert R.file_weights_hash(tmp_path) == R.weights_hash(a)
    save_file({"b": a["b"]}, str(tmp_path / "model-extra.safetensors"))
    with pytest.raises(ValueError):
        R.file_weights_hash(tmp_path)
    with pytest.raises(FileNotFoundError):
        R.file_weights_hash(tmp_path / "empty")


def test_tiny_model_bytes_are_pinned(tmp_path):
    d = R.build_into(R.SPECS["tiny-a"], tmp_path)
    assert R.file_weights_hash(d) == TINY_A_WEIGHTS
    meta = json.loads((d / R.SPEC_FILE).read_text())
    assert meta["hash"] == R.spec_hash(R.SPECS["tiny-a"]) and meta["spec"]["name"] == "tiny-a"
    config = json.loads((d / "config.json").read_text())
    assert (config["vocab_size"], config["tie_word_embeddings"], config["architectures"]) == (
        R.QWEN3_VOCAB_SIZE, True, ["Qwen3ForCausalLM"])
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [R._special_ids()["im_end"], R._special_ids()["endoftext"]]
    assert {p.name for p in R._tokenizer_files()} <= {p.name for p in d.iterdir()}


def test_install_atomically_keeps_a_complete_directory_and_replaces_on_request(tmp_path):
    final = tmp_path / "models" / "m-1"
    calls = []

    def write(text):
        def w(tmp):
            calls.append(tmp)
            assert tmp.parent == final.parent and tmp != final and not any(tmp.iterdir())
            (tmp / "weights").write_text(text)
            (tmp / "done").write_text("")
        return w

    assert R.install_atomically(final, "done", write("one")) == final
    assert (final / "weights").read_text() == "one"
    assert R.install_atomically(final, "done", write("two")) == final  # a concurrent builder's result stays
    assert (final / "weights").read_text() == "one"
    R.install_atomically(final, "done", write("three"), replace=True)
    assert (final / "weights").read_text() == "three"
    assert sorted(p.name for p in final.parent.iterdir()) == ["m-1"]  # no temporary left behind

    def broken(tmp):
        (tmp / "weights").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        R.install_atomically(tmp_path / "models" / "m-2", "done", broken)
    assert sorted(p.name for p in final.parent.iterdir()) == ["m-1"]
