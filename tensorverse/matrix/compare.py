"""Compare a cached run with the reference run, case turn by case turn, from the stored rows,
and write the result in ``tensorverse replay``'s case format.

Forced runs of every configuration decode the same basis tokens (:mod:`tensorverse.matrix.run`),
so their rows align by position: the reference run's rows are P, the point's rows are Q, and the
metrics are exactly those of ``tensorverse analyze``
(:func:`tensorverse.analysis.metrics.position_metrics`: full vocabulary, float64).
``departures`` are positions where a run's own top-1 is not the basis token. Free runs are
compared as replay compares them: a point's free output with the basis (the reference
configuration's output: "does this setting change what the agent does"), the reference's own
free output with the recorded one (what scrubbing changed). Both give the divergence position
and the tool-call verdict.

Because the output has replay's shape, :func:`tensorverse.replay.report.summarize_backend`
computes a point's summary exactly as ``tensorverse replay`` would with both servers up at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from tensorverse.matrix.layout import run_dir
from tensorverse.replay.entries import forced_turn, free_turn

__all__ = ["TurnRows", "point_cases"]


class TurnRows:
    """A run's index and its forced rows (float32, positions x vocabulary), read lazily."""

    def __init__(self, out: Path, key: str) -> None:
        self.dir = run_dir(out, key)
        self.index = json.loads((self.dir / "index.json").read_text(encoding="utf-8"))
        self._store: Any = None

    def __enter__(self) -> "TurnRows":
        from tensorverse.store import Store

        self._store = Store.open(self.dir / "store", durable=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._store is not None:
            self._store.close()

    def entry(self, case: str, turn: int | str, mode: str) -> dict[str, Any] | None:
        return ((self.index["cases"].get(case) or {}).get(str(turn)) or {}).get(mode)

    def forced_rows(self, case: str, turn: int | str) -> np.ndarray | None:
        from tensorverse.shadow.compare import load_rows

        e = self.entry(case, turn, "forced")
        if not e or e.get("status") != "ok" or e.get("capture") != "full" or not e.get("tokens"):
            return None
        try:
            return load_rows(self._store, e["run_id"], list(range(len(e["tokens"]))))
        except KeyError:
            return None


def _forced_status(e: Mapping[str, Any] | None) -> dict[str, Any]:
    e = e or {}
    out = {"status": e.get("status") or "missing", "capture": e.get("capture"), "method": e.get("method"),
           "template": None}
    if e.get("status") != "ok":
        out["error"] = e.get("error")
    return out


def point_cases(out: Path, corpus: Any, ref_key: str | None, key: str, name: str, ref_name: str,
                cases: list[str]) -> list[dict[str, Any]]:
    """The run's cases in replay's case format, backend named ``name``. ``ref_key`` None: this
    is the reference (forced compared with nothing; free compared with the recorded output)."""
    by_id = {c["id"]: c for c in corpus.cases}
    is_ref = ref_key is None or ref_key == key and name == ref_name
    res: list[dict[str, Any]] = []
    basis_source = "recorded" if ref_key is None and name != ref_name else "reference"
    R = TurnRows(out, ref_key) if not is_ref and ref_key is not None else None
    with TurnRows(out, key) as C:
        if R is not None:
            R.__enter__()
        try:
            for cid in cases:
                turns_out = []
                branch: dict[str, Any] = {"status": "completed", "turn": None}
                for turn in by_id[cid]["turns"]:
                    idx = turn["index"]
                    fe = C.entry(cid, idx, "forced") or {}
                    tokens = list(fe.get("tokens") or [])
                    forced = _forced_status(fe)
                    crow = C.forced_rows(cid, idx)
                    if crow is not None:
                        forced["departures"] = np.flatnonzero(crow.argmax(axis=1) != np.asarray(tokens)).tolist()
                    if R is not None and forced["status"] == "ok":
                        rrow = R.forced_rows(cid, idx)
                        rtok = (R.entry(cid, idx, "forced") or {}).get("tokens")
                        if rrow is None or crow is None:
                            forced["compare_error"] = "no full rows on " + ("the reference" if rrow is None else "this point")
                        elif list(rtok or []) != tokens:
                            forced["compare_error"] = "this run forced other tokens than the reference"
                        else:
                            forced.update(forced_turn(rrow, crow, tokens))
                    rec = turn.get("reference") or {}
                    if R is None:
                        free = free_turn(list(rec.get("output_token_ids") or []), rec.get("text") or "",
                                         C.entry(cid, idx, "free"), "recorded")
                    else:
                        rf = R.entry(cid, idx, "free") or {}
                        free = free_turn(list(rf.get("token_ids") or tokens), rf.get("text") or "",
                                         C.entry(cid, idx, "free"), "basis") if rf.get("status") == "ok" else None
                    row: dict[str, Any] = {"forced": forced}
                    if free is not None:
                        row["free"] = free
                        if branch["status"] == "completed" and (free.get("status") != "ok" or free.get("verdict") != "match"):
                            branch = {"status": "diverged" if free.get("status") == "ok" else "error",
                                      "turn": idx, "verdict": free.get("verdict")}
                    turns_out.append({"index": idx, "positions": len(tokens),
                                      "basis": {"source": basis_source, "backend": ref_name},
                                      "backends": {name: row}})
                res.append({"id": cid, "turns": turns_out, "branches": {name: branch}})
        finally:
            if R is not None:
                R.__exit__(None, None, None)
    return res
