"""Logits rows that take every evidence decision of `tensorverse.capture.reduce`, with the specs
that ask for them: the tap's tests and the GPU script's device-path check (`benchmarks/
capture_cuda.py`, point 5) use the same rows.

Row by row: 0 forced to its clear top-1 (compact), 1 free and clear (compact, another k), 2 forced
to a token this runtime does not prefer (a flip), 3 a top-2 gap of 0.01 (a close call), 4 a clear
top-1 then every entry tied (the ties reach past the window), 5 a NaN (non-finite), 6 requested in
full. After the copies, the engine forces rows 0, 2 and 6 (`FORCED`).
"""

from __future__ import annotations

import torch

from tensorverse.capture.optin import EvidenceSpec

__all__ = ["evidence_rows", "FORCED", "DECISIONS"]

#: (rows, tokens) the engine forces after the copies
FORCED = ((0, 2, 6), (11, 13, 14))
#: each row's decision: None travels compact, else the reason it travels in full
DECISIONS = (None, None, "flip", "close", "ties", "nonfinite", "requested")


def evidence_rows(vocab: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  seed: int = 7) -> tuple[torch.Tensor, list[EvidenceSpec]]:
    """Seven rows of ``vocab`` logits (``dtype``, on ``device``) and their specs (module doc)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, vocab, generator=g) * 2
    x[0, 11] = 30.0
    x[1, 40] = 30.0
    x[2, 12] = 30.0
    x[3, 50], x[3, 51] = 30.0, 29.99
    x[4] = 0.0
    x[4, 60] = 30.0
    x[5, 3] = float("nan")
    x[6, 14] = 30.0
    specs = [EvidenceSpec(20, 0.1, 11, False), EvidenceSpec(5, 0.1, -1, False), EvidenceSpec(20, 0.1, 13, False),
             EvidenceSpec(20, 0.1, -1, False), EvidenceSpec(20, 0.1, -1, False), EvidenceSpec(20, 0.1, -1, False),
             EvidenceSpec(20, 0.1, 14, True)]
    return x.to(dtype).to(device), specs
