"""Typed records for tests, in mitmproxy's ``tflow()`` style: each factory returns a complete,
valid record (`tensorverse.store.records`) with plain defaults, any field overridden by keyword,
so a test says only what matters to it. :func:`store_session` writes a whole session (turns, runs
with rows, comparisons) through the store's real write path.

For tests and benchmarks only (the package never imports `tensorverse.testing`).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from tensorverse.store.records import ForcedComparison, FreeComparison, Run, Session, Turn

__all__ = ["T0", "tsession", "tturn", "trun", "tcomparison", "tfree_comparison", "store_session"]

T0 = 1_700_000_000_000_000_000  # 2023-11-14: "a while ago" for every retention rule


def tsession(id: str = "s", **fields: Any) -> Session:
    """A session created at :data:`T0`."""
    return Session(**{"id": id, "created_ns": T0, **fields})


def tturn(id: str = "t", session_id: str = "s", index: int = 0, **fields: Any) -> Turn:
    """A finished main turn of ``session_id``: a three-token prompt, a three-token answer."""
    return Turn(**{"id": id, "session_id": session_id, "index": index, "created_ns": T0 + index, "state": "ok",
                   "endpoint": "completions", "prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5, 6],
                   **fields})


def trun(id: str = "r", turn_id: str = "t", backend: str = "shadow", mode: str = "forced", **fields: Any) -> Run:
    """An ``ok`` run of ``backend`` on ``turn_id``."""
    return Run(**{"id": id, "turn_id": turn_id, "backend": backend, "mode": mode, **fields})


def tcomparison(run_id: str = "r", ref_run_id: str = "ref", **fields: Any) -> ForcedComparison:
    """An ``ok`` forced comparison of ``run_id`` against ``ref_run_id``."""
    return ForcedComparison(**{"run_id": run_id, "ref_run_id": ref_run_id, **fields})


def tfree_comparison(run_id: str = "r", ref_run_id: str = "ref", **fields: Any) -> FreeComparison:
    """An ``ok`` free comparison of ``run_id`` against the primary's ``ref_run_id``."""
    return FreeComparison(**{"run_id": run_id, "ref_run_id": ref_run_id, "kind": "tokens", **fields})


def store_session(store: Any, sid: str, *, created_ns: int = T0, turns: int = 1,
                  runs: Sequence[tuple[str, str]] = (("primary", "forced"), ("fp32", "forced")),
                  rows: int = 3, row_bytes: int = 64, compare: tuple[str, str] | None = None,
                  run_id: str = "{turn}-{backend}", turn_fields: dict[str, Any] | None = None) -> list[str]:
    """Write session ``sid`` with ``turns`` turns (``{sid}-t{i}``), each with a run per
    ``(backend, mode)`` (named by the ``run_id`` format: ``turn``, ``backend``, ``mode``) holding
    ``rows`` random blobs of ``row_bytes``, and, with ``compare = (run backend, ref backend)``,
    one comparison between their runs (of the default names); returns the turn ids."""
    store.put_session(tsession(sid, created_ns=created_ns)).result()
    tids = []
    for i in range(turns):
        tid = f"{sid}-t{i}"
        store.put_turn(tturn(tid, sid, i, created_ns=created_ns + i, **(turn_fields or {}))).result()
        for backend, mode in runs:
            rid = run_id.format(turn=tid, backend=backend, mode=mode)
            store.put_run(trun(rid, tid, backend, mode)).result()
            if rows:
                store.write_rows(rid, [(p, os.urandom(row_bytes)) for p in range(rows)]).result()
        if compare is not None:
            store.put_comparison(f"{tid}-{compare[0]}", f"{tid}-{compare[1]}",
                                 tcomparison(f"{tid}-{compare[0]}", f"{tid}-{compare[1]}",
                                             summary={"kl_mean": 0.1})).result()
        tids.append(tid)
    return tids
