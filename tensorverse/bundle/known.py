"""What a checker knows of a corpus: the hashes a bundle must carry to be about that corpus, and
its recorded tokens (every bundle position's ``token`` is checked against them).

``manifest_sha256`` is the sha256 of the corpus's ``corpus.json`` (which holds each case file's
sha256, so it names every byte of the corpus); ``tokens_sha256`` is the sha256 of the canonical
JSON of ``[[case, turn, [recorded token ids]], ...]`` in case and turn order: what a rig forces.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = ["KnownCorpus", "known_corpus", "tokens_sha256"]


def tokens_sha256(turn_tokens: Mapping[tuple[str, int], list[int]]) -> str:
    rows = [[c, t, list(v)] for (c, t), v in sorted(turn_tokens.items())]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class KnownCorpus:
    name: str
    path: Path
    manifest_sha256: str
    tokens_sha256: str
    model: dict[str, str]  # {"name", "content_hash"}
    tokens: dict[tuple[str, int], list[int]]  # (case, turn index) -> recorded output ids

    @property
    def cases(self) -> int:
        return len({c for c, _ in self.tokens})

    @property
    def positions(self) -> int:
        return sum(len(v) for v in self.tokens.values())

    def identity(self) -> dict[str, Any]:
        """The manifest's ``corpus`` object for this corpus."""
        return {"name": self.name, "manifest_sha256": self.manifest_sha256, "tokens_sha256": self.tokens_sha256,
                "model": dict(self.model), "cases": self.cases, "positions": self.positions}


def known_corpus(path: str | Path) -> KnownCorpus:
    """Load (and verify) a corpus directory that names its model (``corpus.json`` ``model``)."""
    from tensorverse.replay.corpus import CorpusError, load_corpus

    p = Path(path)
    c = load_corpus(p)
    model = c.manifest.get("model")
    if not model:
        raise CorpusError(f"{p}: the corpus names no model (corpus.json has no 'model'); a rig "
                          "suite's corpus must name its model by content hash", "no_model")
    tokens = {(case["id"], int(t["index"])): list((t.get("reference") or {}).get("output_token_ids") or [])
              for case in c.cases for t in case["turns"]}
    return KnownCorpus(name=c.manifest.get("name") or p.name, path=p,
                       manifest_sha256=hashlib.sha256((p / "corpus.json").read_bytes()).hexdigest(),
                       tokens_sha256=tokens_sha256(tokens), model={"name": model["name"],
                                                                   "content_hash": model["content_hash"]},
                       tokens=tokens)
