"""``tensorverse report check BUNDLE``: the submission checker.

A bundle is accepted only when all of this holds, checked in this order (the first failure is
the reason, one of :data:`~tensorverse.bundle.format.REASONS`):

1. it opens safely within the limits (:func:`tensorverse.bundle.io.open_bundle`);
2. the manifest passes its JSON Schema, and no string anywhere in a JSON member is longer than
   the limit;
3. every member's sha256 and size are the manifest's;
4. the corpus is one the checker knows, with the same manifest hash, recorded-token hash,
   model content hash, case and position counts;
5. the settings make sense (unique names; the reference ran; the noise setting, if any, is one
   of them);
6. every position row is of a setting that ran, at a (case, turn, position) of the corpus, with
   the corpus's recorded token there; each (setting, case, turn, position) once; every setting
   that ran has every position of the corpus and a free row for every turn;
7. no value is impossible: finite margins and KLs, KL >= 0 and 0 for the reference setting,
   ``flip`` exactly where ``top1 != token``, the margin's sign agreeing with it, a class exactly
   at flips, top-k at flips only with the flip's top-1 first and logits descending; a free run's
   divergence within its tokens, a verdict exactly for runs that finished;
8. every summary is what :func:`tensorverse.bundle.summary.summarize` gives from the tables.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from tensorverse.bundle.format import (DATA_MEMBERS, DEFAULT_LIMITS, FLIP_CLASSES, FREE, FREE_VERDICTS, MANIFEST,
                                       NAME_RE, POSITIONS, PROVENANCE, SUMMARIES, TOPK_AT_FLIPS,
                                       BundleRefused, Limits)
from tensorverse.bundle.known import KnownCorpus
from tensorverse.bundle.manifest import manifest_schema, validate_manifest

__all__ = ["check_bundle", "CheckedBundle", "validate_manifest", "manifest_schema"]

_KL_FLOOR = -1e-9  # float64 rounding of a KL that is mathematically >= 0
_INT32 = 2**31


def _strings(obj: Any, limit: int, where: str, depth: int = 0) -> None:
    if depth > 32:
        raise BundleRefused("schema", f"{where} is nested more than 32 levels deep")
    if isinstance(obj, str):
        if len(obj) > limit:
            raise BundleRefused("too_large", f"a string of {len(obj)} characters in {where} (limit {limit})")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _strings(k, limit, where, depth + 1)
            _strings(v, limit, where, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _strings(v, limit, where, depth + 1)


@dataclass(frozen=True)
class CheckedBundle:
    """An accepted bundle: its manifest, tables and summaries (what the hypercube builder reads)."""

    path: str
    manifest: dict[str, Any]
    positions: list[dict[str, Any]]
    free: list[dict[str, Any]]
    summaries: dict[str, Any]
    provenance: dict[str, Any]

    @property
    def rig(self) -> dict[str, Any]:
        return self.manifest["rig"]

    @property
    def ran(self) -> list[str]:
        return [s["name"] for s in self.manifest["settings"] if s["status"] == "ran"]


def _bad(what: str) -> BundleRefused:
    return BundleRefused("impossible_value", what)


def _check_positions(rows: Iterable[dict[str, Any]], ran: set[str], ref: str, corpus: KnownCorpus) -> None:
    seen: set[tuple[str, str, int, int]] = set()
    count = {s: 0 for s in ran}
    for r in rows:
        s, c, t, p = r["setting"], r["case"], r["turn"], r["position"]
        where = f"positions.parquet: {s!r} {c!r} turn {t} position {p}"
        if s not in ran:
            raise BundleRefused("coverage", f"{where}: setting {s!r} did not run (manifest)")
        toks = corpus.tokens.get((c, t))
        if toks is None or p is None or not (0 <= p < len(toks)):
            raise BundleRefused("coverage", f"{where} is not a position of corpus {corpus.name}")
        if r["token"] != toks[p]:
            raise BundleRefused("token_mismatch", f"{where}: token {r['token']} is not the recorded {toks[p]}")
        key = (s, c, t, p)
        if key in seen:
            raise BundleRefused("coverage", f"{where} appears twice")
        seen.add(key)
        count[s] += 1
        top1, flip, cls, margin, kl = r["top1"], r["flip"], r["flip_class"], r["margin"], r["kl"]
        if top1 is None or not (0 <= top1 < _INT32) or flip is None:
            raise _bad(f"{where}: top1 {top1!r}, flip {flip!r}")
        if flip != (top1 != r["token"]):
            raise _bad(f"{where}: flip is {flip} but top1 {top1} vs token {r['token']}")
        if margin is None or not math.isfinite(margin) or kl is None or not math.isfinite(kl):
            raise _bad(f"{where}: margin {margin!r}, kl {kl!r} (finite numbers required)")
        if kl < _KL_FLOOR or (s == ref and kl != 0.0):
            raise _bad(f"{where}: kl {kl!r} ({'the reference setting has kl 0' if s == ref else 'kl >= 0'})")
        if (flip and margin > 0) or (not flip and margin < 0):
            raise _bad(f"{where}: margin {margin!r} disagrees with flip {flip}")
        if flip != (cls is not None) or (cls is not None and cls not in FLIP_CLASSES):
            raise _bad(f"{where}: flip_class {cls!r} with flip {flip}")
        ids, logits = r["topk_ids"], r["topk_logits"]
        if not flip:
            if ids is not None or logits is not None:
                raise _bad(f"{where}: top-k is kept at flips only")
            continue
        if ids is None or logits is None or not (1 <= len(ids) <= TOPK_AT_FLIPS) or len(ids) != len(logits):
            raise _bad(f"{where}: a flip needs its top-k (1 to {TOPK_AT_FLIPS} ids and logits)")
        if ids[0] != top1 or len(set(ids)) != len(ids) or any(i is None or not (0 <= i < _INT32) for i in ids):
            raise _bad(f"{where}: top-k ids {ids[:TOPK_AT_FLIPS]} (distinct, the flip's top1 first)")
        if any(x is None or not math.isfinite(x) for x in logits) or any(a < b for a, b in zip(logits, logits[1:])):
            raise _bad(f"{where}: top-k logits must be finite and descending")
    for s, n in count.items():
        if n != corpus.positions:
            raise BundleRefused("coverage", f"setting {s!r} has {n} positions; corpus {corpus.name} has {corpus.positions}")


def _check_free(rows: Iterable[dict[str, Any]], ran: set[str], corpus: KnownCorpus) -> None:
    seen: set[tuple[str, str, int]] = set()
    for r in rows:
        s, c, t = r["setting"], r["case"], r["turn"]
        where = f"free.parquet: {s!r} {c!r} turn {t}"
        if s not in ran:
            raise BundleRefused("coverage", f"{where}: setting {s!r} did not run (manifest)")
        if (c, t) not in corpus.tokens:
            raise BundleRefused("coverage", f"{where} is not a turn of corpus {corpus.name}")
        if (s, c, t) in seen:
            raise BundleRefused("coverage", f"{where} appears twice")
        seen.add((s, c, t))
        st = r["status"]
        if not isinstance(st, str) or not NAME_RE.match(st):
            raise _bad(f"{where}: status {st!r}")
        if st != "ok":
            if r["verdict"] is not None:
                raise _bad(f"{where}: a run that did not finish has no verdict")
            continue
        n, d, fd, v = r["tokens"], r["diverged"], r["first_divergence"], r["verdict"]
        if n is None or not (0 <= n < _INT32) or d is None or v not in FREE_VERDICTS:
            raise _bad(f"{where}: tokens {n!r}, diverged {d!r}, verdict {v!r}")
        rec = len(corpus.tokens[(c, t)])
        if d != (fd is not None) or (fd is not None and not (0 <= fd <= max(n, rec))):
            raise _bad(f"{where}: diverged {d} with first_divergence {fd!r} ({n} tokens)")
    want = {(s, c, t) for s in ran for (c, t) in corpus.tokens}
    if seen and seen != want:
        missing = sorted(want - seen)[:3]
        raise BundleRefused("coverage", f"free runs missing for {missing} ...")


def check_bundle(path: str, corpora: Mapping[str, KnownCorpus], limits: Limits = DEFAULT_LIMITS) -> CheckedBundle:
    """Check the bundle at ``path`` against the known ``corpora`` (by name); return it, or raise
    :class:`BundleRefused` with the first reason."""
    from tensorverse.bundle.io import open_bundle, sha256
    from tensorverse.bundle.summary import summarize

    b = open_bundle(path, limits)
    m = b.manifest
    _strings(m, limits.string_chars, MANIFEST)
    validate_manifest(m)
    for name in DATA_MEMBERS:
        want = m["members"][name]
        got = b.members[name]
        if len(got) != want["bytes"] or sha256(got) != want["sha256"]:
            raise BundleRefused("hash_mismatch", f"{name}: sha256 {sha256(got)[:16]}... ({len(got)} bytes) is not "
                                                 f"the manifest's {want['sha256'][:16]}... ({want['bytes']} bytes)")
    cid = m["corpus"]
    corpus = corpora.get(cid["name"])
    if corpus is None:
        raise BundleRefused("unknown_corpus", f"corpus {cid['name']!r} is not known here "
                                              f"(known: {', '.join(sorted(corpora)) or 'none'})")
    for k, v in corpus.identity().items():
        if cid[k] != v:
            raise BundleRefused("corpus_mismatch", f"corpus.{k} is {cid[k]!r}; corpus {corpus.name}'s is {v!r}")
    names = [s["name"] for s in m["settings"]]
    if len(set(names)) != len(names):
        raise BundleRefused("schema", f"settings named twice: {sorted({n for n in names if names.count(n) > 1})}")
    ran = [s["name"] for s in m["settings"] if s["status"] == "ran"]
    if m["reference_setting"] not in ran:
        raise BundleRefused("schema", f"reference setting {m['reference_setting']!r} did not run")
    if m["noise_setting"] is not None and m["noise_setting"] not in names:
        raise BundleRefused("schema", f"noise setting {m['noise_setting']!r} is not a setting")
    for s in m["settings"]:
        if (s["status"] == "ran") != (s["reason"] is None):
            raise BundleRefused("schema", f"setting {s['name']!r}: a reason is given exactly when it did not run")
    positions = b.rows(POSITIONS)
    free = b.rows(FREE)
    summaries = b.json(SUMMARIES)
    provenance = b.json(PROVENANCE)
    _strings(summaries, limits.string_chars, SUMMARIES)
    _strings(provenance, limits.string_chars, PROVENANCE)
    for name, obj in ((SUMMARIES, summaries), (PROVENANCE, provenance)):
        if not isinstance(obj, dict):
            raise BundleRefused("schema", f"{name} is a JSON {type(obj).__name__}, not an object")
    for r in positions + free:
        for k in ("setting", "case"):
            if not isinstance(r[k], str) or not NAME_RE.match(r[k]):
                raise BundleRefused("schema", f"a table row's {k} {str(r[k])[:80]!r} is not a plain name")
    _check_positions(positions, set(ran), m["reference_setting"], corpus)
    _check_free(free, set(ran), corpus)
    want = summarize(positions, free, ran)
    if json.dumps(summaries, sort_keys=True) != json.dumps(want, sort_keys=True):
        def bundled(s: str, k: str) -> Any:
            one = summaries.get(s)
            return one.get(k) if isinstance(one, dict) else None

        diff = next((f"{s}.{k}: bundle {repr(bundled(s, k))[:80]}, tables {v!r}"
                     for s in want for k, v in want[s].items()
                     if not isinstance(summaries.get(s), dict)
                     or json.dumps(bundled(s, k), sort_keys=True) != json.dumps(v, sort_keys=True)),
                    f"settings {sorted(summaries)[:20]} vs {ran}, or fields other than the tables give")
        raise BundleRefused("summary_mismatch", diff)
    return CheckedBundle(str(path), m, positions, free, summaries, provenance)
