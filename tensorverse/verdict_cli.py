"""``tensorverse verdict``: can I ship it? One verdict per shadow (docs/verdict.md).

    tensorverse verdict --store DIR [--shadow NAME] [--json]
    tensorverse verdict --comparisons PATH [PATH ...] [--json]   # exported tables, a fleet's

Exit 0 with the verdicts; 2 on bad input (no store, an unreadable or too old export, a bad
margin), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import orjson

from tensorverse.analysis.verdict import Interval, ShadowVerdict, VerdictPolicy, verdicts, verdicts_json

__all__ = ["register", "format_verdicts", "load_policy", "store_verdicts"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verdict",
        help="can I ship it? regression / equivalent / undecided per shadow, turns as the unit",
        description="One verdict per shadow from its comparisons with the primary, each turn one "
        "paired observation against the noise floor (the secondary): regression (the excess of "
        "broken tool calls is above 0 at the stated confidence), equivalent (below the margin), "
        "or undecided (with the tool-calling turns still needed). The bounds are anytime-valid: "
        "they hold however often you look. See docs/verdict.md.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--store", default=None, metavar="PATH",
                     help="store directory (default: $TENSORVERSE_STORE or ./tensorverse-data)")
    src.add_argument("--comparisons", nargs="+", metavar="PATH",
                     help="exported comparisons tables instead of a store (`tensorverse export`): "
                     "files or export directories, JSONL or Parquet; many replicas' exports together")
    p.add_argument("--shadow", metavar="NAME", help="only this backend's verdict")
    p.add_argument("--config", metavar="FILE", help="read confidence and margins from [verdict] of this file")
    p.add_argument("--confidence", type=float, metavar="P", help="confidence of every bound (default 0.95)")
    p.add_argument("--margin", type=float, metavar="X",
                   help="excess broken tool calls per tool-calling turn that still counts as "
                   "equivalent (default 0.005)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def load_policy(config: str | None, confidence: float | None, margin: float | None) -> VerdictPolicy:
    base = VerdictPolicy()
    if config:
        from tensorverse.config import load_config

        base = load_config(config).verdict.policy()
    return VerdictPolicy(confidence=base.confidence if confidence is None else confidence,
                         tool_call_break_margin=base.tool_call_break_margin if margin is None else margin,
                         flip_margin=base.flip_margin)


def store_verdicts(store: Any, policy: VerdictPolicy, backend: str | None = None) -> list[ShadowVerdict]:
    from tensorverse.exporters.comparison_rows import from_store

    return verdicts(from_store(store), policy, backend=backend)


def _pct(x: float | None, signed: bool = True) -> str:
    if x is None:
        return "n/a"
    return f"{x * 100:+.2f}%" if signed else f"{x * 100:.2f}%"


def _interval(i: Interval) -> str:
    if not i.turns:
        return "no turns yet"
    return f"{_pct(i.estimate)}  [{_pct(i.low)}, {_pct(i.high)}]  over {i.turns} turns"


def _needed(v: ShadowVerdict) -> str:
    if v.decision != "undecided":
        return ""
    if v.turns_needed is None:
        return "; no decision in sight at the current rates"
    hours = f", about {v.hours_needed:.1f} h at {v.tool_call_turns_per_hour:.1f}/h" \
        if v.hours_needed is not None and v.tool_call_turns_per_hour else ""
    return f"; about {v.turns_needed} more tool-calling turns{hours}"


def format_verdicts(vs: Sequence[ShadowVerdict]) -> str:
    lines: list[str] = []
    for v in vs:
        floor = f"noise floor: {v.floor_backend}" if v.floor_backend else "no noise floor"
        lines.append(f"{v.backend} ({v.role}, {floor}): {v.decision.upper()} after "
                     f"{v.tool_call_turns} tool-calling turns{_needed(v)}")
        b = v.tool_call_break_excess
        lines.append(f"  tool-call break excess   {_interval(b)}   margin {_pct(b.margin, False)}"
                     f"   (broken {v.tool_call_breaks}, floor {v.floor_tool_call_breaks})")
        lines.append(f"  flip excess per turn     {_interval(v.flip_excess)}")
        lines.append(f"  tool-region flip excess  {_interval(v.tool_flip_excess)}")
        lines.append(f"  position-level, descriptive only: {v.runtime_flips}/{v.positions} runtime flips"
                     + (f" vs floor {v.floor_flips}/{v.floor_positions}" if v.floor_positions else ""))
        for n in v.notes:
            lines.append(f"  note: {n}")
    if vs:
        lines.append(f"bounds: {vs[0].confidence:.0%} each, anytime-valid ({vs[0].method})")
    else:
        lines.append("no shadow has a comparison with the primary yet")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tensorverse.config import ConfigError
    from tensorverse.exporters.comparison_rows import TableError, read_tables

    try:
        policy = load_policy(args.config, args.confidence, args.margin)
        if args.comparisons:
            vs = verdicts(read_tables(args.comparisons), policy, backend=args.shadow)
        else:
            from tensorverse.store import Store, StoreVersionError, store_path

            try:
                with Store.open(store_path(args.store), readonly=True) as store:
                    vs = store_verdicts(store, policy, args.shadow)
            except (FileNotFoundError, StoreVersionError) as e:
                raise TableError(str(e)) from None
    except (ConfigError, TableError, ValueError) as e:
        print(f"tensorverse verdict: {e}", file=sys.stderr)
        return 2
    if args.shadow and not vs:
        print(f"tensorverse verdict: no comparisons of backend {args.shadow!r} with the primary", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(orjson.dumps(verdicts_json(vs, policy), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(format_verdicts(vs))
    return 0
