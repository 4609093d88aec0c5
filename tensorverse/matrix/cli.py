"""Argument handling of ``tensorverse matrix`` and ``tensorverse bisect`` (wired by :mod:`tensorverse.cli`)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    for name in ("matrix", "bisect"):
        p = sub.add_parser(name, help="(not built yet) the settings matrix / flip bisection")
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=_planned(name))


def _planned(name: str):
    def run(_: argparse.Namespace) -> int:
        print(f"tensorverse {name}: not built yet.", file=sys.stderr)
        return 2

    return run
