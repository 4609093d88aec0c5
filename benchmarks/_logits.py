"""Realistic *synthetic* logits rows for benchmarks (until recorded rows exist).

A random tiny LM head: hidden state ``h ~ N(0, 1)`` of size ``hidden``, weight
``W ~ N(0, w_std)`` of shape ``vocab x hidden``, ``logits = W @ h`` in float32, rounded
to the nearest bfloat16 and kept as float32 (bf16-exact, like the rows vLLM hands a logits
processor). A *shadow* row repeats the computation with ``h`` perturbed by ``shadow_rel``
(relative), as a second runtime that nearly agrees would, again rounded to bf16, so most
entries are bit-identical to the reference row and the rest differ by an ulp or two.

Everything here is deterministic for a given seed. Other benchmarks may import it:

    from benchmarks._logits import synthetic_rows
    ref, shadow = synthetic_rows(8)          # two (8, 151936) float32 matrices
"""

from __future__ import annotations

import numpy as np

QWEN3_VOCAB = 151_936
SOURCE = "synthetic"  # what benchmarks should report as their data source


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even); returns bf16-exact float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    nan = np.isnan(x)
    if nan.any():  # keep NaNs NaN (rounding could carry a NaN payload into infinity)
        r[nan] = np.uint32(0x7FC00000)
    return r.view(np.float32)


def lm_head(vocab: int = QWEN3_VOCAB, hidden: int = 128, w_std: float = 0.035,
            seed: int = 0) -> np.ndarray:
    """A random LM head weight, float32, shape (vocab, hidden)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((vocab, hidden), dtype=np.float32) * np.float32(w_std))


def synthetic_rows(n: int, *, vocab: int = QWEN3_VOCAB, hidden: int = 128,
                   w_std: float = 0.035, shadow_rel: float = 1e-3, bf16: bool = True,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` reference rows and their near-identical shadow rows, each (n, vocab) float32.

    With ``bf16=True`` (default) both are rounded to bf16-exact float32; with ``bf16=False``
    they are full float32 (like a float32 model's logits).
    """
    rng = np.random.default_rng(seed + 1)
    w = lm_head(vocab, hidden, w_std, seed)
    h = rng.standard_normal((n, hidden), dtype=np.float32)
    noise = rng.standard_normal((n, hidden), dtype=np.float32)
    h_shadow = h + np.float32(shadow_rel) * np.abs(h) * noise
    ref = h @ w.T
    shadow = h_shadow @ w.T
    if bf16:
        ref, shadow = round_to_bf16(ref), round_to_bf16(shadow)
    return np.ascontiguousarray(ref), np.ascontiguousarray(shadow)


def describe(rows: np.ndarray) -> str:
    """One human line about a batch of rows (to print next to benchmark figures)."""
    return (f"SYNTHETIC logits: {rows.shape[0]} rows x {rows.shape[-1]} vocab, "
            f"dtype {rows.dtype}, std {float(rows.std()):.3f}, max {float(rows.max()):.3f}")
