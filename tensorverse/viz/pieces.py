"""Token pieces: the text of each token of a turn's lanes.

Runs record their tokens' text in different ways: per-token ``pieces``, a ``token_texts`` map,
or (free runs, usually) only their whole ``text``. :func:`known_pieces` gathers what the lanes
recorded, :func:`infer_free_pieces` recovers the pieces of lanes that recorded only their text
(:func:`infer_pieces`), and :func:`lane_pieces` / :func:`text_of` read a lane's pieces and text.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

from tensorverse.viz.lane import FREE, Lane

__all__ = ["infer_pieces", "known_pieces", "infer_free_pieces", "lane_pieces", "text_of"]

_SPECIAL = re.compile(r"<\|[^|<>]{1,40}\|>")


def infer_pieces(ids: Sequence[int], text: str, vocab: Mapping[int, str]) -> tuple[list[str], list[bool]]:
    """Per-token text of a run that recorded only its whole ``text``, from the pieces known for
    the other tokens: known pieces are matched from both ends of the text; a single unknown
    token in between gets exactly the text left over. Several unknown tokens in a row share
    their span (the first carries it, marked inexact). Special tokens that the server left out
    of the text (``<|im_end|>`` with skip_special_tokens) are matched without consuming text."""
    n = len(ids)
    out = [""] * n
    exact = [True] * n
    cur, i = 0, 0
    while i < n:
        p = vocab.get(ids[i])
        if p is None:
            break
        if text.startswith(p, cur):
            cur += len(p)
        elif not _SPECIAL.fullmatch(p):
            break
        out[i] = p
        i += 1
    end, j = len(text), n
    while j > i:
        p = vocab.get(ids[j - 1])
        if p is None:
            break
        if cur <= end - len(p) and text.endswith(p, cur, end):
            end -= len(p)
        elif not _SPECIAL.fullmatch(p):
            break
        out[j - 1] = p
        j -= 1
    if j > i:
        out[i] = text[cur:end]
        # exact only for one token the vocabulary did not know (a known piece that did not
        # match means the text is not this token sequence's)
        if j - i > 1 or ids[i] in vocab:
            for k in range(i, j):
                exact[k] = False
    return out, exact


def known_pieces(lanes: Iterable[Lane]) -> dict[int, str]:
    """Token id -> text, from what the lanes recorded (a ``token_texts`` map, per-token
    ``pieces``); the first lane to know a token wins."""
    vocab: dict[int, str] = {}
    for lane in lanes:
        if lane.token_texts is not None:
            for t, p in lane.token_texts.items():
                if str(t).isdigit() and isinstance(p, str):
                    vocab.setdefault(int(t), p)
        if lane.pieces is not None:
            for tid, piece in zip(lane.token_ids, lane.pieces):
                vocab.setdefault(tid, piece)
    return vocab


def infer_free_pieces(lanes: Iterable[Lane], vocab: dict[int, str]) -> dict[str, tuple[list[str], list[bool]]]:
    """Per backend, the pieces (and which are exact) of the free lanes that came with their text
    but no per-token pieces. Each exact piece recovered is added to ``vocab`` (in place), so a
    later lane can use it."""
    inferred: dict[str, tuple[list[str], list[bool]]] = {}
    for lane in lanes:
        if lane.pieces is None and lane.text is not None and lane.token_ids:
            pieces, exact = infer_pieces(lane.token_ids, lane.text, vocab)
            inferred[lane.backend] = (pieces, exact)
            for t, p, ok in zip(lane.token_ids, pieces, exact):
                if ok:
                    vocab.setdefault(t, p)
    return inferred


def lane_pieces(lane: Lane, inferred: Mapping[str, tuple[list[str], list[bool]]],
                vocab: Mapping[int, str]) -> list[str]:
    """A lane's per-token text: its recorded pieces, else (a free lane) the inferred ones, else
    each token's known piece ("" where none is known)."""
    if lane.pieces is not None:
        return lane.pieces
    if lane.mode == FREE and lane.backend in inferred:
        return inferred[lane.backend][0]
    return [vocab.get(t, "") for t in lane.token_ids]


def text_of(lane: Lane, vocab: Mapping[int, str]) -> str:
    """A lane's text: as recorded, else its pieces joined, else its tokens' known pieces."""
    if lane.text is not None:
        return lane.text
    if lane.pieces is not None:
        return "".join(lane.pieces)
    return "".join(vocab.get(t, "") for t in lane.token_ids)
