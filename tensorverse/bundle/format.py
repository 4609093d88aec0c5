"""The results bundle, format 1: what one rig run sends (protocol only; no I/O here).

A bundle is one uncompressed POSIX tar file (``*.tvbundle``) with exactly these members, flat
(no directories), each a regular file:

``manifest.json``      the manifest (JSON Schema ``schema/manifest-1.schema.json``): format and
                       version, the suite, the corpus (its manifest's sha256, the hash of its
                       recorded tokens, the model's content hash), the rig's fingerprint, every
                       setting of the suite with what happened to it (``ran`` / ``refused`` /
                       ``failed``, the reason, the exact vLLM flags and environment), and the
                       sha256 and size of every other member
``positions.parquet``  one row per (setting, case, turn, position) of every forced run:
                       :data:`POSITION_COLUMNS`
``free.parquet``       one row per (setting, case, turn) of every free run: :data:`FREE_COLUMNS`
``summaries.json``     per setting, the figures :func:`tensorverse.bundle.summary.summarize`
                       computes from the two tables (the checker recomputes them)
``provenance.json``    Tensorverse's version, each point's server command line, environment
                       and timings, the host

Positions line up across rigs because every rig forces the **corpus's recorded tokens**: a
row's ``token`` is the recorded token at that position, the same on every rig.

Per position (forced run of one setting): ``top1`` is the setting's own argmax; ``flip`` is
``top1 != token``; ``margin`` is the logit of the recorded token minus the best other logit
(nats, float64; negative exactly at flips, since ties go to the lower id); ``kl`` is
KL(reference setting || this setting) over the full vocabulary (float64; 0 for the reference
itself); ``flip_class`` is the class of a flip (``tie``, ``near_tie``: the two logits at most one
representable value apart in the row's dtype; ``noise``: the rig's same-config noise point flips
there too; ``runtime``: the rest) and null where there is no flip; ``topk_ids`` /
``topk_logits``: the setting's top :data:`TOPK_AT_FLIPS` at flips only (null elsewhere).

No prompt text and no full rows are in a bundle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "POSITIONS", "FREE", "SUMMARIES", "PROVENANCE",
           "MEMBERS", "DATA_MEMBERS", "POSITION_COLUMNS", "FREE_COLUMNS", "TOPK_AT_FLIPS", "FLIP_CLASSES",
           "FREE_VERDICTS", "SETTING_STATUSES", "Limits", "DEFAULT_LIMITS", "BundleRefused", "REASONS",
           "SCHEMA_DIR", "NAME_RE", "positions_schema", "free_schema", "missing_packages"]

FORMAT = "tensorverse.rig-bundle"
FORMAT_VERSION = 1
SCHEMA_DIR = Path(__file__).resolve().parent / "schema"

MANIFEST = "manifest.json"
POSITIONS = "positions.parquet"
FREE = "free.parquet"
SUMMARIES = "summaries.json"
PROVENANCE = "provenance.json"
MEMBERS = (MANIFEST, POSITIONS, FREE, SUMMARIES, PROVENANCE)
DATA_MEMBERS = (POSITIONS, FREE, SUMMARIES, PROVENANCE)  # hashed in the manifest

TOPK_AT_FLIPS = 5
FLIP_CLASSES = ("tie", "near_tie", "noise", "runtime")
# a free run's tool-call verdict against the recorded output (tensorverse.analysis.toolcalls)
FREE_VERDICTS = ("malformed", "count_mismatch", "wrong_func_name", "missing_param", "unexpected_param",
                 "value_mismatch", "match")
SETTING_STATUSES = ("ran", "refused", "failed")
# names of settings, cases, suites and rigs: plain identifiers (the checker refuses others)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=,+-]{0,127}$")

#: (column, arrow type) of positions.parquet, in order
POSITION_COLUMNS = (
    ("setting", "string"), ("case", "string"), ("turn", "int32"), ("position", "int32"),
    ("token", "int32"), ("top1", "int32"), ("flip", "bool"), ("flip_class", "string"),
    ("margin", "float64"), ("kl", "float64"), ("topk_ids", "list<int32>"), ("topk_logits", "list<float32>"),
)
#: (column, arrow type) of free.parquet, in order
FREE_COLUMNS = (
    ("setting", "string"), ("case", "string"), ("turn", "int32"), ("status", "string"),
    ("tokens", "int32"), ("diverged", "bool"), ("first_divergence", "int32"), ("verdict", "string"),
)


def _arrow(t: str):
    import pyarrow as pa

    if t.startswith("list<"):
        return pa.list_(_arrow(t[5:-1]))
    return {"string": pa.string(), "int32": pa.int32(), "bool": pa.bool_(), "float64": pa.float64(),
            "float32": pa.float32()}[t]


def positions_schema():
    import pyarrow as pa

    return pa.schema([(n, _arrow(t)) for n, t in POSITION_COLUMNS])


def free_schema():
    import pyarrow as pa

    return pa.schema([(n, _arrow(t)) for n, t in FREE_COLUMNS])


@dataclass(frozen=True)
class Limits:
    """What a reader accepts before it reads a byte of a table (bundles are untrusted input)."""

    bundle_bytes: int = 256 * 1024 * 1024  # the tar file
    member_bytes: int = 128 * 1024 * 1024  # one member, as stored
    json_bytes: int = 8 * 1024 * 1024  # manifest, summaries, provenance
    table_rows: int = 20_000_000  # rows of one Parquet table
    table_uncompressed_bytes: int = 2 * 1024 * 1024 * 1024  # a table's pages, decompressed
    settings: int = 256
    string_chars: int = 4096  # any string in a JSON member


DEFAULT_LIMITS = Limits()

#: every reason the checker can refuse a bundle for (exit 2 with ``REASON: detail``)
REASONS = (
    "unreadable",        # not a tar file / cannot be opened
    "unsafe_member",     # a link, a directory, a path, an unknown or duplicate member
    "missing_member",
    "too_large",         # a size limit (before reading)
    "schema",            # the manifest or a JSON member fails its schema; a table's columns
    "hash_mismatch",     # a member's bytes are not the manifest's sha256
    "unknown_corpus",    # the corpus is not one the checker knows
    "corpus_mismatch",   # corpus hashes or model hash differ from the known corpus
    "token_mismatch",    # a position's recorded token is not the corpus's
    "coverage",          # a setting that ran lacks positions of the corpus, or has extra ones
    "summary_mismatch",  # a summary is not what the tables give
    "impossible_value",  # schema-valid but absurd (NaN, negative KL, flip with positive margin...)
)


def missing_packages(*names: str) -> str | None:
    """None when every package (``pyarrow``, ``duckdb``) imports, else what to install: the
    bundle commands need the ``rig`` extra, which a plain install of Tensorverse leaves out."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if not missing:
        return None
    return f"needs {', '.join(missing)}: pip install 'tensorverse[rig]'"


class BundleRefused(ValueError):
    """A bundle that is not accepted; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
