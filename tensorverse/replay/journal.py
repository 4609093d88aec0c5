"""The replay's journal (``RESULTS.partial.jsonl``): each finished case is appended as it ends, so
an interrupted run keeps them and the same command resumes with the cases not yet done. The key
names the corpus, the backends (by name and model, not URL: ports move), the reference and the
modes; lines of another key, or cut by the interruption, are ignored."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorverse.replay.corpus import Corpus
    from tensorverse.replay.options import ReplayOptions

__all__ = ["journal_key", "read_journal"]


def journal_key(corpus: "Corpus", opts: "ReplayOptions") -> str:
    h = hashlib.sha256()
    h.update(json.dumps([c["id"] for c in corpus.cases]).encode())
    h.update(json.dumps([[b.name, b.model] for b in opts.backends]).encode())  # not URLs: ports move
    h.update(json.dumps([opts.reference, list(opts.modes)]).encode())
    return h.hexdigest()[:16]


def read_journal(path: Path, key: str) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return done
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by the interruption
            if rec.get("key") == key and isinstance(rec.get("case"), dict):
                done[rec["case"]["id"]] = rec["case"]
    return done
