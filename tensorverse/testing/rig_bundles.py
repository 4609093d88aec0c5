"""Synthetic rig bundles: a small corpus and bundles of made-up rigs, built through the same code
a rig run uses (:func:`tensorverse.rig.positions.turn_positions`, :func:`tensorverse.bundle.make.make_bundle`),
for the checker's, the hypercube's and the benchmark's tests of Tensorverse itself.

Rows are random logits over a small vocabulary (seeded); the corpus's recorded tokens are the
argmax of each position's *base* row, so the reference setting never flips; a setting adds noise
of its ``scale`` to the base rows (``scale`` 0: exactly the reference), so it flips where the
base row's top-2 gap is small: flips land on the same positions across rigs for the same scale,
as real ones cluster on small margins. ``rig_jitter`` moves every rig's rows a little (a rig is
not another's copy).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Mapping

import numpy as np

from tensorverse.bundle.known import KnownCorpus, known_corpus
from tensorverse.bundle.make import SettingOutcome, make_bundle

__all__ = ["make_corpus", "synth_bundle", "SYNTH_MODEL"]

SYNTH_MODEL = {"name": "synthetic", "content_hash": hashlib.sha256(b"synthetic model").hexdigest()}


def _base(seed: int, case: int, turn: int, n: int, vocab: int) -> np.ndarray:
    return np.random.default_rng([seed, case, turn]).normal(0.0, 2.0, (n, vocab)).astype(np.float32)


def make_corpus(path: str | Path, *, cases: int = 3, turns: int = 2, tokens: int = 12, vocab: int = 64,
                seed: int = 0, name: str = "synthetic-v1") -> KnownCorpus:
    """A corpus directory whose recorded tokens are the base rows' argmax (prompt ids are
    placeholders: nothing runs it)."""
    from tensorverse.replay.corpus import CASE_FORMAT, FORMAT_VERSION, write_corpus

    out = []
    for c in range(cases):
        ts = []
        for t in range(turns):
            ids = _base(seed, c, t, tokens, vocab).argmax(axis=1).tolist()
            ts.append({"index": t, "prompt_token_ids": [1, 2, 3], "reference": {"output_token_ids": ids}})
        out.append({"format": CASE_FORMAT, "format_version": FORMAT_VERSION, "id": f"case-{c:02d}",
                    "tokenizer": {"fingerprint": None}, "provenance": {"reference_backend": "synthetic",
                                                                       "scrubbed": True}, "turns": ts})
    write_corpus(path, out, name=name, created="2026-12-02T00:00:00Z", with_version=False, model=SYNTH_MODEL)
    k = known_corpus(path)
    object.__setattr__(k, "vocab", vocab)
    object.__setattr__(k, "seed", seed)
    return k


def synth_bundle(path: str | Path, corpus: KnownCorpus, *, rig_label: str, scales: Mapping[str, float],
                 refused: Mapping[str, str] | None = None, rig_jitter: float = 0.02, rig_seed: int = 1,
                 gpu: str = "Synthetic GPU", created: str = "2026-12-02T00:00:00Z") -> Path:
    """A bundle of a made-up rig: ``scales`` maps setting name -> noise scale (the first is the
    reference; a setting named ``*_noise`` is the noise point); ``refused``: settings that did
    not run, with their reasons."""
    from tensorverse.rig.positions import flips_of, turn_positions

    vocab = getattr(corpus, "vocab", 64)
    seed = getattr(corpus, "seed", 0)
    names = list(scales)
    ref = names[0]
    noise = next((n for n in names if n.endswith("_noise")), None)
    positions, free = [], []
    rng_rig = np.random.default_rng([rig_seed, 7])
    case_ids = sorted({c for c, _ in corpus.tokens})
    for (cid, t), toks in sorted(corpus.tokens.items()):
        ci = case_ids.index(cid)
        base = _base(seed, ci, t, len(toks), vocab)
        base = base + rng_rig.normal(0.0, rig_jitter, base.shape).astype(np.float32)
        rows = {}
        for k, (s, scale) in enumerate(scales.items()):
            noise_rows = np.random.default_rng([rig_seed, ci, t, k]).normal(0.0, 1.0, base.shape)
            rows[s] = (base + scale * noise_rows).astype(np.float32) if scale else base
        nf = flips_of(rows[noise], toks) if noise else None
        for s in names:
            positions += turn_positions(s, cid, t, toks, rows[s], None if s == ref else rows[ref], noise_flips=nf)
            fl = np.flatnonzero(flips_of(rows[s], toks))
            first = int(fl[0]) if fl.size else None
            free.append({"setting": s, "case": cid, "turn": t, "status": "ok", "tokens": len(toks),
                         "diverged": first is not None, "first_divergence": first,
                         "verdict": "value_mismatch" if first is not None and first < 3 else "match"})
    settings = [SettingOutcome(s, "dtype" if s == ref or s == noise else s.split("_")[0], s, "ran")
                for s in names]
    settings += [SettingOutcome(s, s.split("_")[0], s, "refused", why) for s, why in (refused or {}).items()]
    fp = {"gpus": {"count": 1, "models": [gpu]}, "label": rig_label, "seed": rig_seed}
    return make_bundle(path, suite={"name": "synthetic", "version": 1}, corpus=corpus, rig_label=rig_label,
                       fingerprint=fp, settings=settings, reference=ref, noise=noise, positions=positions,
                       free=free, provenance={"synthetic": True, "rig_seed": rig_seed}, created=created)
