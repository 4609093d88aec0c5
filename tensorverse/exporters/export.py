"""Export the store as flat tables for pandas, DuckDB, Spark...: Parquet (pyarrow) or JSONL.

``tensorverse export parquet --store PATH --out DIR [--since 7d]`` writes one file per table into
DIR (``sessions``, ``turns``, ``runs``, ``comparisons``, ``positions``, ``engine``; ``logits`` with
``--logits``), each ``<table>.parquet`` or ``<table>.jsonl``. The schema (:data:`SCHEMA`) is the
same in both formats and documented in ``docs/metrics.md``: one row per session, turn, run,
comparison, and **one row per position per forced comparison** (the per-position metrics of
``tensorverse analyze``, README.md). Texts (prompts, outputs) are left out unless ``include_text``; request headers and
credentials never leave the store.

Tables are written in batches (``batch_rows``), so a store larger than memory exports in bounded
memory. JSONL needs nothing beyond the core dependencies; Parquet needs the ``export`` extra
(``pip install 'tensorverse[export]'``, pyarrow).

    import duckdb
    duckdb.sql("select backend, sum(flip::int) / count(*) as flip_rate "
               "from 'out/positions.parquet' group by backend")
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import orjson

from tensorverse.store.records import Comparison, ForcedComparison, FreeComparison, Run, Session, Turn

if TYPE_CHECKING:
    from tensorverse.store import Store

__all__ = ["SCHEMA", "TABLES", "FORMATS", "export_store", "parse_since", "ExportError"]

FORMATS = ("parquet", "jsonl")

# column -> type: string, int64, float64, bool, list<int64>, list<float32>, json (a JSON string)
SCHEMA: dict[str, dict[str, str]] = {
    "sessions": {
        "session_id": "string", "created_ns": "int64", "updated_ns": "int64", "turns": "int64",
        "grouping": "string", "endpoint": "string", "tags": "json",
    },
    "turns": {
        "turn_id": "string", "session_id": "string", "index": "int64", "created_ns": "int64",
        "endpoint": "string", "backend": "string", "model": "string", "state": "string",
        "status": "int64", "stream": "bool", "tools_offered": "bool", "finish_reason": "string",
        "prompt_tokens": "int64", "output_tokens": "int64", "n_tool_calls": "int64",
        "ttfb_ms": "float64", "ttft_ms": "float64", "total_ms": "float64",
        "prompt_token_ids": "list<int64>", "output_token_ids": "list<int64>",
        "text": "string",  # with include_text only (else null)
    },
    "runs": {
        "run_id": "string", "turn_id": "string", "session_id": "string", "backend": "string",
        "role": "string", "mode": "string", "status": "string", "capture": "string",
        "approximate": "bool", "method": "string", "created_ns": "int64", "n_tokens": "int64",
        "finish_reason": "string", "rows_expected": "int64", "rows_present": "int64",
        "rows_complete": "bool", "request_s": "float64", "rows_wait_s": "float64", "total_s": "float64",
        "error": "string", "token_ids": "list<int64>",
        "text": "string",  # with include_text only
        # the primary's parser check (recorded runs; issue 19)
        "parser_mismatch": "bool", "parser_verdict": "string",
    },
    "comparisons": {
        "run_id": "string", "ref_run_id": "string", "turn_id": "string", "session_id": "string",
        "backend": "string", "ref_backend": "string", "role": "string", "ref_role": "string",
        "mode": "string", "kind": "string", "status": "string", "error": "string",
        "approximate": "bool", "noise_floor": "bool", "template_mismatch": "bool",
        "compact_positions": "int64",
        "n": "int64", "flips": "int64", "flip_rate": "float64", "first_flip": "int64",
        "kl_mean": "float64", "kl_se": "float64", "kl_max": "float64", "kl_p99_9": "float64",
        "kl_p99": "float64", "kl_p95": "float64", "kl_p90": "float64", "kl_p50": "float64",
        "kl_p10": "float64", "kl_p5": "float64", "kl_p1": "float64", "kl_p0_1": "float64",
        "kl_min": "float64", "rms_delta_p": "float64", "same_top_p": "float64", "same_top_p_se": "float64",
        "flips_by_region": "json",
        "diverged": "bool", "common_prefix": "int64", "verdict": "string", "tool_calls": "json",
        "forced_departure": "int64", "confirms_forced": "bool",
        "noise_verdict": "string", "noise_p_value": "float64", "noise_difference": "float64",
        # why each flip happened (issue 19): counts per class; a free run's class; the excess
        # flip rate (runtime class minus the noise floor) and its 95% interval
        "flips_by_class": "json", "flip_class": "string", "runtime_flips": "int64",
        "excess": "float64", "excess_low": "float64", "excess_high": "float64",
        # what the verdict reads (issue 25; docs/verdict.md): the turn's time (recording order),
        # tool calls on each side of a free run, flips by region and class, positions by region
        "turn_created_ns": "int64", "ref_tool_calls": "int64", "cand_tool_calls": "int64",
        "flips_by_region_class": "json", "positions_by_region": "json",
    },
    "positions": {
        "run_id": "string", "ref_run_id": "string", "turn_id": "string", "session_id": "string",
        "backend": "string", "ref_backend": "string", "role": "string", "ref_role": "string",
        "kind": "string", "position": "int64", "token": "int64", "ref_top1": "int64",
        "cand_top1": "int64", "top1_agree": "bool", "flip": "bool", "kl": "float64",
        "delta_p": "float64", "margin": "float64", "rank": "int64", "rank_lower_bound": "bool",
        "entropy": "float64", "region": "string", "flip_class": "string",
        # the engine's batch when each side's row was computed (null: no engine state stored)
        "batch_size": "int64", "ref_batch_size": "int64",
    },
    "engine": {  # one row per captured row with an engine state (store format 3)
        "run_id": "string", "turn_id": "string", "backend": "string", "mode": "string",
        "position": "int64", "runner": "string", "step": "int64", "batch_size": "int64",
        "row": "int64", "joined": "int64", "context_tokens": "int64", "prefill_reqs": "int64",
        "tp": "int64", "pp": "int64",  # the engine's parallel layout (null: unknown)
    },
    "logits": {  # one row per stored position: the full row, or what compaction kept of it
        "run_id": "string", "turn_id": "string", "backend": "string", "mode": "string",
        "position": "int64", "vocab": "int64",
        "form": "string",  # full, or compact (its full row was compacted: logits null)
        "logits": "list<float32>",
        "kept_ids": "list<int64>", "kept_logits": "list<float32>",  # compact: top-k, then extras
        "lse": "float64",  # compact: the full row's log-sum-exp (logprob = logit - lse)
    },
}
TABLES = tuple(SCHEMA)


class ExportError(ValueError):
    """Bad export arguments (format, --since) or a missing optional dependency."""


# --------------------------------------------------------------------------- --since

_REL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(value: str | None, *, now_ns: int | None = None) -> int:
    """``--since``: a duration back from now (``90m``, ``24h``, ``7d``, ``2w``), an ISO 8601 date
    or time (``2026-11-30``, ``2026-11-30T12:00:00+00:00``; naive = UTC), or Unix seconds.
    Returns nanoseconds since the epoch (0 when None)."""
    if value is None or value == "":
        return 0
    now = time.time_ns() if now_ns is None else now_ns
    m = _REL.match(value)
    if m:
        return max(0, now - int(float(m.group(1)) * _UNIT_S[m.group(2)] * 1e9))
    try:
        return int(float(value) * 1e9)
    except ValueError:
        pass
    try:
        t = _dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ExportError(f"--since: {value!r} is neither a duration (24h, 7d), an ISO date/time "
                          "nor Unix seconds") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return int(t.timestamp() * 1e9)


# --------------------------------------------------------------------------- rows


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if not math.isnan(f) else None


def _bool(v: Any) -> bool | None:
    return bool(v) if v is not None else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else (None if v is None else str(v))


def _json(v: Any) -> str | None:
    return None if v is None else orjson.dumps(v, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode()


def session_row(s: Session) -> dict[str, Any]:
    return {"session_id": s.id, "created_ns": s.created_ns, "updated_ns": s.updated_ns, "turns": s.turns,
            "grouping": s.grouping, "endpoint": s.endpoint, "tags": _json(s.tags)}


def turn_row(t: Turn, include_text: bool) -> dict[str, Any]:
    timings = t.timings
    prompt, output = t.prompt_token_ids, t.output_token_ids
    return {"turn_id": t.id, "session_id": t.session_id, "index": t.index,
            "created_ns": t.created_ns, "endpoint": t.endpoint,
            "backend": t.backend, "model": t.model, "state": t.state,
            "status": t.status, "stream": t.stream,
            "tools_offered": t.tools_offered, "finish_reason": t.finish_reason,
            "prompt_tokens": len(prompt) if prompt is not None else None,
            "output_tokens": len(output) if output is not None else None,
            "n_tool_calls": len(t.tool_calls or ()),
            "ttfb_ms": _float(timings.get("ttfb_ms")), "ttft_ms": _float(timings.get("ttft_ms")),
            "total_ms": _float(timings.get("total_ms")),
            "prompt_token_ids": prompt, "output_token_ids": output,
            "text": t.text if include_text else None}


def run_row(r: Run, session_id: str | None, include_text: bool) -> dict[str, Any]:
    rows = r.rows or {}
    timings = r.timings
    pc = r.parser_check or {}
    return {"run_id": r.id, "turn_id": r.turn_id, "session_id": r.session_id or session_id,
            "backend": r.backend, "role": r.role, "mode": r.mode,
            "status": r.status, "capture": r.capture,
            "approximate": r.approximate, "method": r.method,
            "created_ns": r.created_ns, "n_tokens": len(r.token_ids),
            "finish_reason": r.finish_reason, "rows_expected": _int(rows.get("expected")),
            "rows_present": _int(rows.get("present")), "rows_complete": _bool(rows.get("complete")),
            "request_s": _float(timings.get("request_s")), "rows_wait_s": _float(timings.get("rows_wait_s")),
            "total_s": _float(timings.get("total_s")), "error": r.error, "token_ids": r.token_ids,
            "text": r.text if include_text else None,
            "parser_mismatch": _bool(pc.get("mismatch")), "parser_verdict": _str(pc.get("verdict"))}


def _pcol(p: str) -> str:
    return "kl_" + p.replace(".", "_")


def comparison_row(c: Comparison, turn_id: str | None, session_id: str | None,
                   turn_created_ns: int | None = None) -> dict[str, Any]:
    """One row per comparison, forced and free alike: the columns of the other mode are None."""
    forced = c if isinstance(c, ForcedComparison) else None
    free = c if isinstance(c, FreeComparison) else None
    s = (forced.summary if forced is not None else None) or {}
    kl = s.get("kl") or {}
    dp = s.get("delta_p") or {}
    same = s.get("same_top_p") or {}
    noise = (forced.noise if forced is not None else None) or {}
    n: int | None = None
    n_flips: int | None = None
    if forced is not None:
        n = forced.n
        n_flips = len(forced.flips) if forced.flips is not None else None
    elif free is not None and free.status == "ok":
        prefix = free.common_prefix if free.common_prefix is not None else \
            _int((free.divergence or {}).get("common_prefix")) or 0
        n = prefix + (1 if free.diverged else 0)  # as tensorverse_compared_tokens_total
        n_flips = int(bool(free.diverged))
    row = {"run_id": c.run_id, "ref_run_id": c.ref_run_id, "turn_id": c.turn_id or turn_id,
           "session_id": session_id, "backend": c.backend, "ref_backend": c.ref_backend,
           "role": c.role, "ref_role": c.ref_role, "mode": c.mode,
           "kind": c.kind, "status": c.status, "error": c.error,
           "approximate": c.approximate, "noise_floor": c.noise_floor,
           "template_mismatch": c.template_mismatch,
           "compact_positions": len(forced.compact_positions)
           if forced is not None and forced.compact_positions is not None else None,
           "n": n, "flips": n_flips,
           "flip_rate": (n_flips / n) if n_flips is not None and n else None,
           "first_flip": c.first_flip,
           "kl_mean": _float(kl.get("mean")), "kl_se": _float(kl.get("se")), "kl_max": _float(kl.get("max")),
           "kl_min": _float(kl.get("min")), "rms_delta_p": _float(dp.get("rms")),
           "same_top_p": _float(same.get("p")), "same_top_p_se": _float(same.get("se")),
           "flips_by_region": _json(s.get("flips_by_region")),
           "diverged": None, "common_prefix": None, "verdict": None, "tool_calls": None,
           "forced_departure": None, "confirms_forced": None,
           "noise_verdict": _str(noise.get("verdict")), "noise_p_value": _float(noise.get("p_value")),
           "noise_difference": _float(noise.get("difference")),
           "turn_created_ns": turn_created_ns, "ref_tool_calls": None, "cand_tool_calls": None,
           "flips_by_region_class": _json(s.get("flips_by_region_class")),
           "positions_by_region": _json(s.get("positions_by_region")),
           **_class_columns(c, s)}
    if free is not None:
        row.update(diverged=free.diverged, common_prefix=free.common_prefix, verdict=free.verdict,
                   tool_calls=_json(free.tool_calls), forced_departure=free.forced_departure,
                   confirms_forced=free.confirms_forced, ref_tool_calls=free.ref_tool_calls,
                   cand_tool_calls=free.cand_tool_calls)
    for p in ("p99.9", "p99", "p95", "p90", "p50", "p10", "p5", "p1", "p0.1"):
        row[_pcol(p)] = _float(kl.get(p))
    return row


def _class_columns(c: Comparison, s: Mapping[str, Any]) -> dict[str, Any]:
    by_class = c.flips_by_class or s.get("flips_by_class")
    excess = (c.excess if isinstance(c, ForcedComparison) else None) or {}
    return {"flips_by_class": _json(by_class),
            "flip_class": c.flip_class if isinstance(c, FreeComparison) else None,
            "runtime_flips": _int(by_class.get("runtime")) if isinstance(by_class, Mapping) else None,
            "excess": _float(excess.get("excess")), "excess_low": _float(excess.get("low")),
            "excess_high": _float(excess.get("high"))}


def position_rows(c: Comparison, turn_id: str | None, session_id: str | None) -> Iterator[dict[str, Any]]:
    """One row per compared position of a forced comparison (nothing for free ones)."""
    if not isinstance(c, ForcedComparison) or c.status != "ok" or c.metrics is None:
        return
    m = c.metrics
    n = int(c.n or len(m.get("kl") or ()))
    positions = c.positions or list(range(n))
    regions = c.regions or [None] * n
    tokens = m.get("tokens")
    lb = m.get("rank_lower_bound")
    base = {"run_id": c.run_id, "ref_run_id": c.ref_run_id, "turn_id": c.turn_id or turn_id,
            "session_id": session_id, "backend": c.backend, "ref_backend": c.ref_backend,
            "role": c.role, "ref_role": c.ref_role, "kind": c.kind}
    cols = {k: m.get(k) or [None] * n for k in ("ref_top1", "cand_top1", "top1_agree", "kl", "delta_p",
                                                 "margin", "rank", "entropy")}
    flip_tokens = {f.get("position"): f.get("token") for f in c.flip_tokens or () if isinstance(f, Mapping)}
    class_at = dict(zip(c.flips or (), c.flip_classes)) if c.flip_classes is not None else {}
    for i in range(n):
        agree = cols["top1_agree"][i]
        token = tokens[i] if isinstance(tokens, list) else flip_tokens.get(positions[i])
        yield {**base, "position": int(positions[i]), "token": _int(token),
               "ref_top1": _int(cols["ref_top1"][i]), "cand_top1": _int(cols["cand_top1"][i]),
               "top1_agree": _bool(agree), "flip": (not agree) if agree is not None else None,
               "kl": _float(cols["kl"][i]), "delta_p": _float(cols["delta_p"][i]),
               "margin": _float(cols["margin"][i]), "rank": _int(cols["rank"][i]),
               "rank_lower_bound": _bool(lb[i]) if isinstance(lb, list) else False,
               "entropy": _float(cols["entropy"][i]), "region": _str(regions[i]) if i < len(regions) else None,
               "flip_class": _str(class_at.get(positions[i]))}




# --------------------------------------------------------------------------- writers


class _JsonlWriter:
    def __init__(self, path: Path, table: str) -> None:
        self.path = path
        self._f = open(path, "wb")
        self.rows = 0

    def write(self, rows: list[dict[str, Any]]) -> None:
        opt = orjson.OPT_APPEND_NEWLINE
        self._f.write(b"".join(orjson.dumps(r, option=opt) for r in rows))
        self.rows += len(rows)

    def close(self) -> None:
        self._f.close()


def _arrow_type(pa: Any, t: str) -> Any:
    return {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(),
            "json": pa.string(), "list<int64>": pa.list_(pa.int64()),
            "list<float32>": pa.list_(pa.float32())}[t]


class _ParquetWriter:
    def __init__(self, path: Path, table: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.pa = pa
        self.schema = pa.schema([pa.field(k, _arrow_type(pa, t)) for k, t in SCHEMA[table].items()],
                                metadata={b"tensorverse.table": table.encode(),
                                          b"tensorverse.schema": orjson.dumps(SCHEMA[table])})
        self.path = path
        self._w = pq.ParquetWriter(str(path), self.schema, compression="zstd")
        self.rows = 0

    def write(self, rows: list[dict[str, Any]]) -> None:
        cols = {name: [r.get(name) for r in rows] for name in self.schema.names}
        self._w.write_table(self.pa.Table.from_pydict(cols, schema=self.schema))
        self.rows += len(rows)

    def close(self) -> None:
        self._w.close()


class _Table:
    def __init__(self, writer: Any, table: str, batch_rows: int) -> None:
        self.writer = writer
        self.table = table
        self.columns = tuple(SCHEMA[table])
        self.batch_rows = batch_rows
        self.buf: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.buf.append({k: row.get(k) for k in self.columns})
        if len(self.buf) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            self.writer.write(self.buf)
            self.buf = []

    def close(self) -> None:
        self.flush()
        self.writer.close()


# --------------------------------------------------------------------------- export


def _logits_rows(store: Store, run: Run) -> Iterator[dict[str, Any]]:
    """A run's rows in position order: full ones decoded (deltas through their reference),
    compacted ones as what compaction kept (never as missing or zero logits)."""
    import numpy as np

    from tensorverse.analysis.metrics import widen_bf16
    from tensorverse.store.compact import decode_compact
    from tensorverse.store.stored_rows import StoredRows

    src = StoredRows(store)
    base = {"run_id": run.id, "turn_id": run.turn_id, "backend": run.backend, "mode": run.mode}
    full = [("full", p, b) for p, b in store.read_rows(run.id)]
    compact = [("compact", p, b) for p, b in store.read_compact_rows(run.id)]
    for form, pos, blob in sorted(full + compact, key=lambda x: x[1]):
        if form == "full":
            a = np.asarray(widen_bf16(src.decode(run.id, pos, blob)), dtype=np.float32).reshape(-1)
            yield {**base, "position": int(pos), "vocab": int(a.size), "form": "full", "logits": a.tolist(),
                   "kept_ids": None, "kept_logits": None, "lse": None}
        else:
            c = decode_compact(blob, record=f"{run.id}@{pos}")
            yield {**base, "position": int(pos), "vocab": c.vocab, "form": "compact", "logits": None,
                   "kept_ids": c.ids.tolist(), "kept_logits": c.logits.tolist(), "lse": c.lse}


def export_store(store: Store, out_dir: str | os.PathLike, *, fmt: str = "parquet", since_ns: int = 0,
                 until_ns: int | None = None, include_text: bool = False, logits: bool = False,
                 tables: Sequence[str] | None = None, batch_rows: int = 50_000,
                 progress: Callable[[str, int], None] | None = None) -> dict[str, dict[str, Any]]:
    """Write the store's sessions created in [since_ns, until_ns) as tables under ``out_dir``.

    Returns ``{table: {"path": ..., "rows": n}}``. ``logits``: also the decoded logits rows (one
    row per stored position, float32; large). ``tables``: a subset of :data:`TABLES`."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "parquet":
        try:
            import pyarrow
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise ExportError("Parquet export needs pyarrow: pip install 'tensorverse[export]' "
                              "(or use --format jsonl)") from None
    wanted = list(tables) if tables is not None else [t for t in TABLES if t != "logits" or logits]
    unknown = [t for t in wanted if t not in SCHEMA]
    if unknown:
        raise ExportError(f"unknown table(s) {unknown}: {', '.join(TABLES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cls = _ParquetWriter if fmt == "parquet" else _JsonlWriter
    ext = "parquet" if fmt == "parquet" else "jsonl"
    writers: dict[str, _Table] = {}
    try:
        for name in wanted:
            writers[name] = _Table(cls(out / f"{name}.{ext}", name), name, batch_rows)

        def add(table: str, row: dict[str, Any]) -> None:
            w = writers.get(table)
            if w is not None:
                w.add(row)

        need_runs = any(table in writers for table in ("runs", "comparisons", "positions", "logits", "engine"))
        states = _EngineStates(store)
        n_sessions = 0
        for s in store.iter_sessions(since_ns=since_ns, until_ns=until_ns):
            n_sessions += 1
            add("sessions", session_row(s))
            for t in store.iter_turns(s.id):
                add("turns", turn_row(t, include_text))
                if not need_runs:
                    continue
                for r in store.iter_runs(t.id):
                    add("runs", run_row(r, s.id, include_text))
                    if "comparisons" in writers or "positions" in writers:
                        for c in store.iter_comparisons(r.id):
                            add("comparisons", comparison_row(c, t.id, s.id, t.created_ns))
                            if "positions" in writers:
                                for p in _with_tokens(position_rows(c, t.id, s.id), t):
                                    states.fill(p)
                                    add("positions", p)
                    if "engine" in writers and r.mode != "recorded":
                        for pos, st in sorted(states.of(r.id).items()):
                            add("engine", {"run_id": r.id, "turn_id": r.turn_id,
                                           "backend": r.backend, "mode": r.mode,
                                           "position": pos, **st.as_dict()})
                    if "logits" in writers and r.mode != "recorded":
                        for row in _logits_rows(store, r):
                            add("logits", row)
            if progress is not None:
                progress("sessions", n_sessions)
    finally:
        for w in writers.values():
            w.close()
    return {t: {"path": str(w.writer.path), "rows": w.writer.rows} for t, w in writers.items()}


class _EngineStates:
    """Engine states of the runs being exported, read once per run (the last few kept)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cache: dict[str, dict] = {}

    def of(self, run_id: str | None) -> dict:
        if not run_id or not hasattr(self.store, "read_engine_states"):
            return {}
        got = self._cache.get(run_id)
        if got is None:
            if len(self._cache) > 64:
                self._cache.clear()
            got = self._cache[run_id] = self.store.read_engine_states(run_id)
        return got

    def fill(self, row: dict[str, Any]) -> None:
        """``batch_size`` / ``ref_batch_size`` of a positions row."""
        for col, rid in (("batch_size", row.get("run_id")), ("ref_batch_size", row.get("ref_run_id"))):
            st = self.of(rid).get(row["position"])
            row[col] = st.batch_size if st is not None and st.batch_size >= 0 else None


def _with_tokens(rows: Iterable[dict[str, Any]], turn: Turn) -> Iterator[dict[str, Any]]:
    """Fill ``token`` (the primary's token at the position) from the turn when the comparison's
    metrics do not carry it."""
    tokens = turn.output_token_ids
    for row in rows:
        if row["token"] is None and tokens is not None and 0 <= row["position"] < len(tokens):
            row["token"] = tokens[row["position"]]
        yield row
