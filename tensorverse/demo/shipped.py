"""The shipped demo model: its trained parameters in compact form, and their exact expansion.

The package carries the trained demo model (:mod:`tensorverse.demo.trainer`) as two files in
``tensorverse/demo/data/``:

* ``netops-demo.safetensors.zst``: the trained parameters as the trainer saves them (bfloat16,
  under their ``Qwen3ForCausalLM`` names), with ``model.embed_tokens.weight`` and
  ``lm_head.weight`` holding only the rows of the 655 token ids the corpus uses, in the order of
  the int32 tensor ``compact_vocab``; safetensors, compressed with zstandard.
* ``netops-demo.json``: the manifest. ``content_hash`` is **the demo model's name by content**:
  :func:`tensorverse.rig.models.weights_hash` of the expanded weights, the tensors vLLM loads
  (:func:`content_hash` reads it; nothing else records it). ``training_key`` and ``key_parts``
  say which training made it (spec, trainer version, the sources of ``trainer.py`` and
  ``corpus.py``, the tokenizer files, torch), so :mod:`tensorverse.demo.model` uses it only where
  a training here would have the same inputs; ``training`` is that training's log (steps, loss,
  the held-out evaluation of the trained model and of these bfloat16 parameters); ``file_sha256``
  is the compressed file's checksum.

:func:`expand` turns the compact parameters into the full checkpoint exactly as the trainer
writes it: the trained rows at their ids, every other LM-head row exactly 0 (logit 0), every other
embedding row small noise from ``torch.Generator().manual_seed(spec.seed + 7)``, all bfloat16. The
trainer's own export goes through :func:`expand` too, and the expansion of the shipped file is
checked against ``content_hash`` before it is used.

``python -m tensorverse.demo.model --train --ship`` remakes both files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tensorverse.rig import models as rig_models

DATA_DIR = Path(__file__).resolve().parent / "data"
COMPACT_FILE = DATA_DIR / "netops-demo.safetensors.zst"
MANIFEST_FILE = DATA_DIR / "netops-demo.json"
VOCAB_TENSOR = "compact_vocab"
ZSTD_LEVEL = 19


class ShippedModelError(RuntimeError):
    """The shipped files are missing, damaged, or do not expand to their content hash."""


def manifest() -> dict[str, Any]:
    try:
        return json.loads(MANIFEST_FILE.read_text())
    except OSError as e:
        raise ShippedModelError(f"no shipped demo model manifest ({MANIFEST_FILE}: {e.strerror})") from e
    except ValueError as e:
        raise ShippedModelError(f"the shipped demo model manifest {MANIFEST_FILE} is not JSON: {e}") from e


def content_hash() -> str:
    """The shipped demo model's content hash (sha256 hex of its expanded weights): its name."""
    return manifest()["content_hash"]


def expand(compact: dict[str, Any], vocab: list[int], spec) -> dict[str, Any]:
    """The full ``Qwen3ForCausalLM`` state dict (bfloat16, names sorted) of the compact parameters
    ``compact`` (rows of ``vocab`` in the embedding and LM head; ``spec`` a ``DemoSpec``)."""
    import torch

    V, H = rig_models.QWEN3_VOCAB_SIZE, spec.hidden_size
    if len(set(vocab)) != len(vocab) or not all(0 <= t < V for t in vocab):
        raise ValueError("the compact vocabulary must be distinct token ids below the vocabulary size")
    idx = torch.tensor(vocab, dtype=torch.long)
    g = torch.Generator().manual_seed(spec.seed + 7)
    embed = torch.randn((V, H), generator=g) * spec.unused_embed_std
    embed[idx] = compact["model.embed_tokens.weight"].float()
    head = torch.zeros((V, H))
    head[idx] = compact["lm_head.weight"].float()
    full = dict(compact)
    full["model.embed_tokens.weight"], full["lm_head.weight"] = embed, head
    return {k: v.float().to(torch.bfloat16).contiguous() for k, v in sorted(full.items())}


def pack(compact: dict[str, Any], vocab: list[int]) -> bytes:
    """The compressed compact file's bytes (deterministic)."""
    import torch
    import zstandard
    from safetensors.torch import save

    if VOCAB_TENSOR in compact:
        raise ValueError(f"{VOCAB_TENSOR} is reserved")
    tensors = dict(compact) | {VOCAB_TENSOR: torch.tensor(vocab, dtype=torch.int32)}
    raw = save(tensors, metadata={"format": "tensorverse-demo-compact"})
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)


def unpack(blob: bytes) -> tuple[dict[str, Any], list[int]]:
    import zstandard
    from safetensors.torch import load

    tensors = load(zstandard.ZstdDecompressor().decompress(blob))
    vocab = [int(t) for t in tensors.pop(VOCAB_TENSOR)]
    return tensors, vocab


def load_compact() -> tuple[dict[str, Any], list[int]]:
    """The shipped compact parameters and vocabulary, checked against the manifest's checksum."""
    m = manifest()
    try:
        blob = COMPACT_FILE.read_bytes()
    except OSError as e:
        raise ShippedModelError(f"no shipped demo model parameters ({COMPACT_FILE}: {e.strerror})") from e
    got = hashlib.sha256(blob).hexdigest()
    if got != m["file_sha256"]:
        raise ShippedModelError(f"{COMPACT_FILE} is damaged: sha256 {got[:16]}..., the manifest says "
                                f"{m['file_sha256'][:16]}... (a Git LFS pointer or a partial copy?)")
    return unpack(blob)


def expand_shipped(spec) -> tuple[dict[str, Any], list[int]]:
    """The full state dict and compact vocabulary of the shipped model, checked: its content hash
    must be the manifest's (:class:`ShippedModelError` if not)."""
    compact, vocab = load_compact()
    full = expand(compact, vocab, spec)
    got, want = rig_models.weights_hash(full), content_hash()
    if got != want:
        raise ShippedModelError(f"the shipped demo model expands to content hash {got[:16]}..., not the "
                                f"manifest's {want[:16]}... (another torch's random numbers?)")
    return full, vocab


def write(compact: dict[str, Any], vocab: list[int], spec, *, training_key: str, key_parts: dict[str, Any],
          training: dict[str, Any], data_dir: Path = DATA_DIR) -> dict[str, Any]:
    """Write the compact file and the manifest into ``data_dir``; returns the manifest."""
    import dataclasses

    blob = pack(compact, vocab)
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    m = {
        "name": spec.name,
        "content_hash": rig_models.weights_hash(expand(compact, vocab, spec)),
        "content_hash_of": "tensorverse.rig.models.weights_hash of the expanded Qwen3ForCausalLM weights",
        "training_key": training_key,
        "key_parts": key_parts,
        "spec": dataclasses.asdict(spec),
        "compact_vocab": len(vocab),
        "file": COMPACT_FILE.name,
        "file_bytes": len(blob),
        "file_sha256": hashlib.sha256(blob).hexdigest(),
        "training": training,
    }
    (data_dir / COMPACT_FILE.name).write_bytes(blob)
    (data_dir / MANIFEST_FILE.name).write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    return m
