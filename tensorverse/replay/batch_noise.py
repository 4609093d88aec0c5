"""``tensorverse noise``: a backend's batch-noise floor, from the same forced tokens run at
several batch sizes.

    tensorverse noise --backend NAME=URL[#MODEL] (--store DIR | --corpus DIR [--rows DIR])
                      --concurrency 1,8,32 [--turns N] [--max-positions N] [--out FILE] [--json]

Every turn (a recorded turn of ``--store``, or a case turn of ``--corpus`` with its reference
output) is decoded in **forced** mode (the shadow runner's teacher forcing through the capture
plugin, rows captured) once per concurrency level *c*, while *c − 1* **filler** requests (the
same prompt, free-running, nothing captured) run on the same server, so the forced request's
rows are computed inside a batch of *c*. The forced tokens are the same at every level, so the
rows align by position; each level is compared with the first (``--concurrency 1,8,32``: 8 and
32 against 1) exactly as ``tensorverse analyze`` and the matrix compare rows
(:func:`tensorverse.matrix.compare.forced_turn`, float64 over the whole vocabulary), and
summarised as replay summarises a backend (:func:`tensorverse.replay.report.summarize_backend`:
flip rate with its interval over turns, KL percentiles, ...). A flip between levels is batch noise:
nothing changed but the batch.

The batch each row really saw is read back from the rows' engine states (store format 3; the
capture plugin records the batch size of every captured step): ``batch`` in the results gives,
per level, the smallest, median and largest batch the forced rows were computed in. A level
whose fillers finished early, or that the server could not batch (``--max-num-seqs`` below
*c*), shows it there.

Rows travel as in replay: the server's capture sink (``TENSORVERSE_CAPTURE_SINK``) must write
into the store the probe reads, ``--store DIR`` itself, or ``--rows DIR`` (``dir:DIR`` on the
server, or a recorder whose ``/ingest`` writes there).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tensorverse.shadow.backend import Backend

if TYPE_CHECKING:
    from tensorverse.store import Store
    from tensorverse.store.records import Run

__all__ = ["NoiseOptions", "ProbeTurn", "probe_noise", "forced_in_batch", "turns_from_store", "turns_from_corpus",
           "parse_levels", "render_noise", "RESULTS_FORMAT"]

RESULTS_FORMAT = "tensorverse.noise-results"


def parse_levels(spec: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]`` (distinct, each >= 1; the first is the reference)."""
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {spec!r}: a comma-separated list of integers, e.g. 1,8,32") from None
    if len(levels) < 2 or any(c < 1 for c in levels) or len(set(levels)) != len(levels):
        raise ValueError(f"--concurrency {spec!r}: at least two distinct levels >= 1, e.g. 1,8,32")
    return levels


@dataclass
class ProbeTurn:
    """One turn to force: its id (for the report), prompt ids and the tokens to force."""

    id: str
    prompt_token_ids: list[int]
    tokens: list[int]
    model: str | None = None


@dataclass
class NoiseOptions:
    backend: Backend
    levels: list[int]
    max_positions: int | None = 64  # forced positions per turn (the first ones)
    filler_tokens: int | None = None  # default: 4 x forced + 64, at most 1024
    settle_s: float = 0.2  # fillers start this long before the forced request
    rows_timeout_s: float = 60.0
    probe_id: str = field(default_factory=lambda: f"{time.time_ns():x}")


def turns_from_store(store: Store, *, limit: int | None = None) -> list[ProbeTurn]:
    """Recorded turns of a store that have prompt and output token ids (newest sessions first)."""
    from tensorverse.shadow.turn import TurnInput

    out: list[ProbeTurn] = []
    for s in store.iter_sessions():
        for t in store.iter_turns(s.id):
            try:
                ti = TurnInput.from_dict(t)
            except ValueError:
                continue
            if ti.output_token_ids:
                out.append(ProbeTurn(ti.id, ti.prompt_token_ids, ti.output_token_ids, ti.model))
            if limit is not None and len(out) >= limit:
                return out
    return out


def turns_from_corpus(path: str | Path, *, limit: int | None = None,
                      cases: Sequence[str] | None = None) -> list[ProbeTurn]:
    """Case turns of a corpus with their reference output ids."""
    from tensorverse.replay.corpus import load_corpus
    from tensorverse.replay.runner import case_turn_input

    out: list[ProbeTurn] = []
    for case in load_corpus(path).cases:
        if cases and case["id"] not in cases:
            continue
        for turn in case["turns"]:
            d = case_turn_input(case, turn)
            if d["output_token_ids"]:
                out.append(ProbeTurn(d["id"], list(d["prompt_token_ids"]), list(d["output_token_ids"])))
            if limit is not None and len(out) >= limit:
                return out
    return out


def _label(c: int) -> str:
    return f"c={c}"


async def _filler(session: Any, backend: Backend, prompt: Sequence[int], model: str | None,
                  max_tokens: int) -> None:
    from tensorverse.shadow.client import BackendClient

    body: dict[str, Any] = {"prompt": list(prompt), "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": False}
    if backend.model or model:
        body["model"] = backend.model or model
    try:
        await BackendClient(backend, session).completions(body)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a filler that fails only makes the batch smaller (reported)
        pass


async def forced_in_batch(runner: Any, backend: Backend, turn: Any, concurrency: int, *,
                          run_id: str | None = None, filler_tokens: int | None = None,
                          settle_s: float = 0.2, session: Any = None) -> Run:
    """``runner.run_forced(turn, backend)`` (a :class:`~tensorverse.shadow.turn.TurnInput`)
    inside a batch of ``concurrency`` requests: ``concurrency - 1`` fillers (the same prompt,
    free-running, ``ignore_eos``, nothing captured) start ``settle_s`` before it and are
    abandoned (the server aborts them) once it is done. Returns the run record."""
    import aiohttp

    if concurrency <= 1:
        return await runner.run_forced(turn, backend, run_id)
    own = session is None
    if own:
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=backend.timeout_s))
    n = len(turn.output_token_ids)
    ft = filler_tokens or min(4 * n + 64, 1024)
    fillers = [asyncio.create_task(_filler(session, backend, turn.prompt_token_ids, turn.model, ft))
               for _ in range(concurrency - 1)]
    try:
        await asyncio.sleep(settle_s)
        return await runner.run_forced(turn, backend, run_id)
    finally:
        for f in fillers:  # the client goes away: the server aborts the filler
            f.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
        if own:
            await session.close()


async def _forced_in_batch(runner: Any, session: Any, backend: Backend, turn: ProbeTurn, c: int,
                           run_id: str, opts: NoiseOptions) -> Run:
    from tensorverse.shadow.turn import TurnInput

    ti = TurnInput(id=turn.id, prompt_token_ids=list(turn.prompt_token_ids),
                   output_token_ids=list(turn.tokens), model=turn.model)
    return await forced_in_batch(runner, backend, ti, c, run_id=run_id, filler_tokens=opts.filler_tokens,
                                 settle_s=opts.settle_s, session=session)


def _batch_stats(sizes: list[int]) -> dict[str, Any] | None:
    if not sizes:
        return None
    return {"min": min(sizes), "median": statistics.median(sizes), "max": max(sizes), "rows": len(sizes)}


async def probe_noise(store: Store, turns: Sequence[ProbeTurn], opts: NoiseOptions) -> dict[str, Any]:
    """Run the probe (see the module docstring); return the results dict."""
    import aiohttp

    from tensorverse.replay.entries import forced_turn
    from tensorverse.replay.report import summarize_backend
    from tensorverse.shadow.compare import load_rows
    from tensorverse.shadow.runner import ShadowRunner

    if not turns:
        raise ValueError("no turn with prompt and output token ids to force")
    t0 = time.monotonic()
    backend = opts.backend
    backend.capture = "full"
    backend.concurrency = max(backend.concurrency, 1)
    turns = [ProbeTurn(t.id, t.prompt_token_ids, t.tokens[: opts.max_positions] if opts.max_positions else t.tokens,
                       t.model) for t in turns]
    runs: dict[int, list[Run]] = {c: [] for c in opts.levels}
    timeout = aiohttp.ClientTimeout(total=backend.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        runner = ShadowRunner(store, [backend], rows_timeout_s=opts.rows_timeout_s, check_tokenizer=False,
                              check_template=False, session=session)
        for c in opts.levels:
            for i, t in enumerate(turns):
                rid = f"noise-{opts.probe_id}-c{c}-{i}"
                runs[c].append(await _forced_in_batch(runner, session, backend, t, c, rid, opts))
    ref_c = opts.levels[0]
    cases: dict[int, list[dict[str, Any]]] = {c: [] for c in opts.levels[1:]}
    batch: dict[str, Any] = {}
    errors: list[str] = []
    for c in opts.levels:
        sizes: list[int] = []
        for run in runs[c]:
            sizes.extend(st.batch_size for st in (await asyncio.to_thread(store.read_engine_states, run.id)).values())
            if run.status != "ok" or run.capture != "full":
                errors.append(f"{_label(c)} {run.turn_id}: {run.status} "
                              f"{run.capture} {run.error or ''}".strip())
        batch[_label(c)] = _batch_stats(sizes)
    for c in opts.levels[1:]:
        for t, ref_run, run in zip(turns, runs[ref_c], runs[c]):
            forced: dict[str, Any] = {"status": run.status or "failed", "capture": run.capture}
            ok = all(r.status == "ok" and r.capture == "full" for r in (ref_run, run))
            if ok:
                ps = list(range(len(t.tokens)))
                try:
                    r = await asyncio.to_thread(load_rows, store, ref_run.id, ps)
                    q = await asyncio.to_thread(load_rows, store, run.id, ps)
                    forced.update(forced_turn(r, q, list(t.tokens)))
                except KeyError as e:  # a row that never arrived
                    forced.update(status="failed", error=f"missing row: {e}")
            else:
                forced["status"] = "failed"
                forced["error"] = run.error or ref_run.error or "no full rows"
            cases[c].append({"id": t.id, "turns": [{"index": 0, "positions": len(t.tokens),
                                                    "backends": {_label(c): {"forced": forced}}}]})
    summary = {_label(c): summarize_backend(_label(c), cases[c], is_reference=False) for c in opts.levels[1:]}
    positions = sum(len(t.tokens) for t in turns)
    wall = time.monotonic() - t0
    return {
        "format": RESULTS_FORMAT,
        "format_version": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend": backend.name,
        "levels": list(opts.levels),
        "reference": _label(ref_c),
        "turns": len(turns),
        "positions_per_level": positions,
        "batch": batch,
        "summary": summary,
        "flips": {k: v["flips"] for k, v in summary.items()},
        "kl_max": {k: (v.get("kl") or {}).get("max") for k, v in summary.items()},
        "cases": {_label(c): cases[c] for c in opts.levels[1:]},
        "run_ids": {_label(c): [r.id for r in runs[c]] for c in opts.levels},
        "errors": errors,
        "wall_s": round(wall, 3),
        "s_per_1000_positions": round(wall / max(1, positions * len(opts.levels)) * 1000, 3),
    }


def render_noise(results: Mapping[str, Any]) -> str:
    from tensorverse.replay.report import _summary_rows, format_table

    head = (f"batch-noise probe of {results['backend']}: {results['turns']} turn(s), "
            f"{results['positions_per_level']} forced positions per level, levels "
            f"{', '.join(_label(c) for c in results['levels'])} vs {results['reference']}; "
            f"{results['wall_s']:.1f} s")
    rows = _summary_rows(results["summary"])
    drop = {"departures", "free", "verdicts", "branches"}  # free-run columns: the probe has none
    keep = [i for i, h in enumerate(rows[0]) if h not in drop]
    rows = [[r[i] for i in keep] for r in rows]
    rows[0][0] = "level"
    rows[0].append("batch min/median/max")
    for r in rows[1:]:
        b = results["batch"].get(r[0]) or {}
        r.append(f"{b['min']}/{b['median']:g}/{b['max']}" if b else "-")
    ref = results["batch"].get(results["reference"]) or {}
    out = [head, format_table(rows),
           f"{results['reference']} (reference) batch min/median/max: "
           + (f"{ref['min']}/{ref['median']:g}/{ref['max']}" if ref else "- (no engine states)")]
    for e in results.get("errors") or ():
        out.append(f"error: {e}")
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI


def add_noise_arguments(p: Any) -> None:
    p.add_argument("--backend", required=True, metavar="NAME=URL[#MODEL]",
                   help="the backend to probe (a vLLM server with the capture plugin and a sink "
                   "into the store the probe reads); a bare URL is named 'backend'")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--store", metavar="DIR", help="turns from this store; runs and rows go here too")
    src.add_argument("--corpus", metavar="DIR", help="turns from this corpus (reference outputs)")
    p.add_argument("--rows", metavar="DIR", help="the store the server's capture sink writes into "
                   "(default: --store; required with --corpus)")
    p.add_argument("--concurrency", default="1,8,32", help="batch sizes, the first is the reference (1,8,32)")
    p.add_argument("--turns", type=int, default=None, help="at most this many turns")
    p.add_argument("--case", action="append", default=None, metavar="ID", help="only this corpus case (repeatable)")
    p.add_argument("--max-positions", type=int, default=64, help="forced positions per turn (64; 0: all)")
    p.add_argument("--filler-tokens", type=int, default=None,
                   help="max_tokens of each filler (default 4 x forced + 64, at most 1024)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (300)")
    p.add_argument("--rows-timeout", type=float, default=60.0, help="seconds to wait for a run's rows (60)")
    p.add_argument("--out", metavar="FILE", help="write the results JSON here")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def run_noise_args(args: Any) -> int:
    from tensorverse.replay.options import parse_backend
    from tensorverse.store import Store, StoreVersionError

    try:
        spec = args.backend if "=" in args.backend else f"backend={args.backend}"
        backend = parse_backend(spec, capture="full", concurrency=1, timeout_s=args.timeout)
        levels = parse_levels(args.concurrency)
        rows = args.rows or args.store
        if rows is None:
            raise ValueError("--corpus needs --rows DIR: the store the server's capture sink writes into")
        opts = NoiseOptions(backend=backend, levels=levels, max_positions=args.max_positions or None,
                            filler_tokens=args.filler_tokens, rows_timeout_s=args.rows_timeout)
        store = Store.open(rows)
    except (ValueError, OSError, StoreVersionError) as e:
        print(f"tensorverse noise: {e}", file=sys.stderr)
        return 2
    try:
        turns = (turns_from_store(store, limit=args.turns) if args.store
                 else turns_from_corpus(args.corpus, limit=args.turns, cases=args.case))
        results = asyncio.run(probe_noise(store, turns, opts))
    except ValueError as e:
        print(f"tensorverse noise: {e}", file=sys.stderr)
        return 2
    finally:
        store.close()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1) if args.json else render_noise(results))
    return 1 if results["errors"] else 0
