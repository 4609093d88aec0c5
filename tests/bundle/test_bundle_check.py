"""The submission checker (``tensorverse report check``, :func:`tensorverse.bundle.check.check_bundle`):
a synthetic bundle of the real writer passes and is deterministic; each kind of tampering is
refused with its own reason; the CLI's lines, JSON and exit codes.

Bundles here are made by :mod:`tensorverse.testing.rig_bundles` (the code a rig run uses) and
tampered with by rewriting one member of the tar (`rewrite_member`), re-hashing it in the
manifest where the tamper is meant to get past the hash check.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest

from tensorverse.bundle.check import check_bundle
from tensorverse.bundle.format import (FREE, FREE_COLUMNS, MANIFEST, POSITION_COLUMNS, POSITIONS, SUMMARIES,
                                       BundleRefused, free_schema, positions_schema)
from tensorverse.bundle.io import _table_bytes, canonical_json, sha256
from tensorverse.cli import main
from tensorverse.rig.suite import known_corpora
from tensorverse.testing.rig_bundles import make_corpus, synth_bundle

SCALES = {"bf16": 0, "bf16_noise": 0.05, "fp8": 0.6}
REFUSED = {"fp8_kv": "refused before start: no AVX-512"}


# ---------------------------------------------------------------------------------------------
# helpers (also used by test_bundle_hostile.py)


def members_of(path: Path) -> list[tuple[str, bytes]]:
    """The bundle's members in archive order (a valid bundle: regular files only)."""
    with tarfile.open(path, "r:") as tf:
        return [(ti.name, tf.extractfile(ti).read()) for ti in tf]


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A plain uncompressed tar of regular files, headers as the writer makes them."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
            tf.addfile(ti, io.BytesIO(data))
    return path


def rewrite_member(src: Path, name: str, data: bytes | Callable[[bytes], bytes], *, rehash: bool = True,
                   out: Path | None = None) -> Path:
    """Copy the bundle at ``src`` to ``out`` (default: over ``src``) with member ``name``'s bytes
    replaced by ``data`` (or ``data(old)``); ``rehash``: the manifest's sha256 and size of it are
    updated to match (a data member only)."""
    members = members_of(src)
    by = dict(members)
    new = data(by[name]) if callable(data) else data
    by[name] = new
    if rehash and name != MANIFEST:
        m = json.loads(by[MANIFEST])
        m["members"][name] = {"sha256": sha256(new), "bytes": len(new)}
        by[MANIFEST] = canonical_json(m)
    return write_tar(out or src, [(n, by[n]) for n, _ in members])


def edit_json(src: Path, name: str, fn: Callable[[Any], Any], **kw: Any) -> Path:
    """`rewrite_member` of a JSON member through ``fn(obj) -> obj`` (canonical JSON again)."""
    return rewrite_member(src, name, lambda b: canonical_json(fn(json.loads(b))), **kw)


def edit_rows(src: Path, name: str, fn: Callable[[list[dict]], list[dict]], **kw: Any) -> Path:
    """`rewrite_member` of a table through ``fn(rows) -> rows`` (the writer's encoding)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols, schema = (POSITION_COLUMNS, positions_schema()) if name == POSITIONS else (FREE_COLUMNS, free_schema())

    def redo(b: bytes) -> bytes:
        rows = pq.read_table(pa.BufferReader(b)).to_pylist()
        return _table_bytes(fn(rows), cols, schema)

    return rewrite_member(src, name, redo, **kw)


def refusal(path: Path, corpora, **kw: Any) -> BundleRefused:
    with pytest.raises(BundleRefused) as e:
        check_bundle(str(path), corpora, **kw)
    return e.value


# ---------------------------------------------------------------------------------------------
# the good bundle


def test_synthetic_bundle_passes(good, corpora, corpus):
    b = check_bundle(str(good), corpora)
    assert b.ran == list(SCALES) and b.rig["label"] == "rig-a"
    assert len(b.positions) == len(SCALES) * corpus.positions
    assert len(b.free) == len(SCALES) * len(corpus.tokens)
    assert b.summaries["bf16"]["flips"] == 0 and b.summaries["fp8"]["flips"] > 0  # the reference never flips
    assert [s["status"] for s in b.manifest["settings"]] == ["ran"] * len(SCALES) + ["refused"]


def test_bundle_is_byte_identical_when_written_twice(tmp_path, good, corpus):
    again = synth_bundle(tmp_path / "again.tvbundle", corpus, rig_label="rig-a", scales=SCALES, refused=REFUSED)
    assert again.read_bytes() == good.read_bytes()
    # another time of day: only the manifest's `created` differs
    later = synth_bundle(tmp_path / "later.tvbundle", corpus, rig_label="rig-a", scales=SCALES, refused=REFUSED,
                         created="2027-01-01T00:00:00Z")
    a, b = dict(members_of(good)), dict(members_of(later))
    assert [n for n in a if a[n] != b[n]] == [MANIFEST]
    ma, mb = json.loads(a[MANIFEST]), json.loads(b[MANIFEST])
    assert {k for k in ma if ma[k] != mb[k]} == {"created"}


def test_the_rewrite_helper_keeps_a_bundle_valid(bundle, corpora):
    edit_rows(bundle, POSITIONS, lambda rows: rows)
    edit_json(bundle, SUMMARIES, lambda s: s)
    check_bundle(str(bundle), corpora)


# ---------------------------------------------------------------------------------------------
# tampering: one reason each


def _bump_flips(s: dict) -> dict:
    s["fp8"]["flips"] += 1
    return s


def test_edited_summary_rehashed_is_a_summary_mismatch(bundle, corpora):
    edit_json(bundle, SUMMARIES, _bump_flips)
    e = refusal(bundle, corpora)
    assert e.reason == "summary_mismatch" and e.detail.startswith("fp8.flips: bundle "), e.detail


def test_edited_summary_not_rehashed_is_a_hash_mismatch(bundle, corpora):
    edit_json(bundle, SUMMARIES, _bump_flips, rehash=False)
    e = refusal(bundle, corpora)
    assert e.reason == "hash_mismatch" and e.detail.startswith("summaries.json: "), e.detail


def _first(rows: list[dict], setting: str, flip: bool) -> dict:
    return next(r for r in rows if r["setting"] == setting and r["flip"] is flip)


def test_position_row_with_a_changed_top1_is_impossible(bundle, corpora):
    """top1 changed, flip left False: the row contradicts itself, which the row checks see
    before the summaries are recomputed."""
    def tamper(rows):
        r = _first(rows, "fp8", False)
        r["top1"] = (r["token"] + 1) % 64
        return rows

    edit_rows(bundle, POSITIONS, tamper)
    e = refusal(bundle, corpora)
    assert e.reason == "impossible_value" and "flip is False but top1" in e.detail, e.detail


def test_position_row_turned_into_a_consistent_flip_is_a_summary_mismatch(bundle, corpora):
    """A non-flip made into a flip with every field agreeing (top1, flip, margin, class, top-k):
    each row is possible, but the flips no longer add up to the summary."""
    def tamper(rows):
        r = _first(rows, "fp8", False)
        other = (r["token"] + 1) % 64
        r.update(top1=other, flip=True, flip_class="runtime", margin=-abs(r["margin"]) or -0.5,
                 topk_ids=[other, r["token"]], topk_logits=[3.0, 2.0])
        return rows

    edit_rows(bundle, POSITIONS, tamper)
    e = refusal(bundle, corpora)
    assert e.reason == "summary_mismatch" and e.detail.startswith("fp8.flips: bundle "), e.detail


def test_changed_recorded_token_is_a_token_mismatch(bundle, corpora, corpus):
    def tamper(rows):
        r = _first(rows, "bf16", False)
        r["token"] = r["top1"] = (r["token"] + 1) % 64  # the row itself stays consistent
        return rows

    edit_rows(bundle, POSITIONS, tamper)
    e = refusal(bundle, corpora)
    assert e.reason == "token_mismatch" and "is not the recorded" in e.detail, e.detail


def test_missing_position_is_coverage(bundle, corpora, corpus):
    edit_rows(bundle, POSITIONS, lambda rows: [r for r in rows if not (r["setting"] == "fp8" and r["case"] ==
                                                                        "case-01" and r["turn"] == 1 and
                                                                        r["position"] == 5)])
    e = refusal(bundle, corpora)
    assert e.reason == "coverage" and e.detail == (f"setting 'fp8' has {corpus.positions - 1} positions; corpus "
                                                   f"synthetic-v1 has {corpus.positions}"), e.detail


def test_duplicated_position_is_coverage(bundle, corpora):
    edit_rows(bundle, POSITIONS, lambda rows: rows + [rows[-1]])
    e = refusal(bundle, corpora)
    assert e.reason == "coverage" and e.detail.endswith("appears twice"), e.detail


def test_bundle_of_another_corpus_with_the_same_name_is_a_corpus_mismatch(tmp_path, corpora):
    other = make_corpus(tmp_path / "other", seed=5)  # same name, other recorded tokens
    assert other.name == "synthetic-v1"
    b = synth_bundle(tmp_path / "other.tvbundle", other, rig_label="rig-a", scales=SCALES)
    check_bundle(str(b), known_corpora([other.path]))  # fine against its own corpus
    e = refusal(b, corpora)
    assert e.reason == "corpus_mismatch" and e.detail.startswith("corpus.manifest_sha256 is "), e.detail


def test_bundle_of_an_unknown_corpus_is_unknown_corpus(tmp_path, corpora):
    other = make_corpus(tmp_path / "elsewhere", name="elsewhere-v1")
    b = synth_bundle(tmp_path / "elsewhere.tvbundle", other, rig_label="rig-a", scales=SCALES)
    e = refusal(b, corpora)
    assert e.reason == "unknown_corpus" and e.detail.startswith("corpus 'elsewhere-v1' is not known here (known: ")
    assert "synthetic-v1" in e.detail  # the shipped corpora, and this one


def test_changed_model_hash_is_a_corpus_mismatch(bundle, corpora):
    def tamper(m):
        m["corpus"]["model"]["content_hash"] = "0" * 64
        return m

    edit_json(bundle, MANIFEST, tamper)
    e = refusal(bundle, corpora)
    assert e.reason == "corpus_mismatch" and e.detail.startswith("corpus.model is "), e.detail


def test_free_row_missing_is_coverage(bundle, corpora):
    edit_rows(bundle, FREE, lambda rows: rows[1:])
    e = refusal(bundle, corpora)
    assert e.reason == "coverage" and e.detail.startswith("free runs missing for "), e.detail


def test_reference_that_did_not_run_is_schema(bundle, corpora):
    edit_json(bundle, MANIFEST, lambda m: {**m, "reference_setting": "fp8_kv"})
    assert refusal(bundle, corpora).reason == "schema"


# ---------------------------------------------------------------------------------------------
# the CLI


def test_cli_accepts_a_good_bundle(good, corpus, capsys):
    assert main(["report", "check", str(good), "--corpus", str(corpus.path)]) == 0
    out = capsys.readouterr()
    assert out.out == f"{good}: ok (rig rig-a, 3 settings ran, 1 refused; {3 * corpus.positions} positions)\n"
    assert out.err == ""


def test_cli_refuses_a_tampered_bundle_and_names_the_reason(good, bundle, corpus, capsys):
    edit_json(bundle, SUMMARIES, _bump_flips, rehash=False)
    assert main(["report", "check", str(good), str(bundle), "--corpus", str(corpus.path)]) == 2
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[0].startswith(f"{good}: ok (rig rig-a, ")
    assert lines[1].startswith(f"{bundle}: refused: hash_mismatch: summaries.json: sha256 ")
    assert out.err == "report check: 1 of 2 bundle(s) refused (hash_mismatch)\n"


def test_cli_json(good, bundle, corpus, capsys):
    edit_rows(bundle, POSITIONS, lambda rows: rows[:-1])
    assert main(["report", "check", str(good), str(bundle), "--corpus", str(corpus.path), "--json"]) == 2
    out = capsys.readouterr()
    got = json.loads(out.out)["bundles"]
    assert got[0] == {"path": str(good), "ok": True, "reason": None, "detail": None, "rig": "rig-a",
                      "settings_ran": list(SCALES)}
    assert {k: got[1][k] for k in ("path", "ok", "reason", "rig", "settings_ran")} == {
        "path": str(bundle), "ok": False, "reason": "coverage", "rig": None, "settings_ran": None}
    assert got[1]["detail"].startswith("setting 'fp8' has ")
    assert "refused (coverage)" in out.err


def test_cli_without_the_corpus_refuses_as_unknown_corpus(good, capsys):
    assert main(["report", "check", str(good)]) == 2
    assert f"{good}: refused: unknown_corpus: corpus 'synthetic-v1' is not known here" in capsys.readouterr().out


def test_cli_missing_bundle_is_unreadable(tmp_path, corpus, capsys):
    missing = tmp_path / "nope.tvbundle"
    assert main(["report", "check", str(missing), "--corpus", str(corpus.path)]) == 2
    assert capsys.readouterr().out.startswith(f"{missing}: refused: unreadable: ")


def test_cli_usage_errors_exit_2(tmp_path, good, capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", "check"])  # no bundle
    assert e.value.code == 2
    assert "the following arguments are required: BUNDLE" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["report", "check", str(good), "--frobnicate"])
    assert e.value.code == 2
    capsys.readouterr()
    assert main(["report", "check", str(good), "--corpus", str(tmp_path / "no-corpus")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("report check: a corpus cannot be read: ")
    assert f"{tmp_path / 'no-corpus'}: no corpus.json" in out.err
