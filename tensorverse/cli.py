"""The one `tensorverse` command: every tool is a subcommand over the same core."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

# Subcommands whose issue has not landed yet: they say so and exit 2 rather than pretend.
PLANNED: dict[str, str] = {
    "proxy": "the recording proxy (issue: Recording proxy)",
    "view": "the multiverse viewer (issue: viewer)",
    "replay": "the replay runner (issue: Replay)",
    "export": "Parquet/JSONL/HTML export (issue: Exporters)",
    "scrub": "the corpus scrubber (issue: Replay)",
    "doctor": "backend capability report (issue: Capture)",
    "matrix": "the settings matrix (issue: Matrix)",
    "bisect": "flip bisection (issue: Matrix)",
    "demo": "the one-command demo (issue: demo)",
}


def _add_analyze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="per-position divergence metrics for two logits matrices",
        description="Compare a reference and a candidate logits matrix (rows = positions, "
        "columns = vocabulary) at the reference tokens; print a table or one JSON object.",
    )
    p.add_argument("--ref", required=True, help="reference logits, .npy (positions x vocab)")
    p.add_argument("--cand", required=True, help="candidate logits, .npy (positions x vocab)")
    p.add_argument("--tokens", required=True, help="JSON list of the reference token ids")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_analyze)


def _run_analyze(args: argparse.Namespace) -> int:
    from tensorverse.analysis.report import run_analyze

    return run_analyze(args.ref, args.cand, args.tokens, as_json=args.json)


def _planned(name: str, what: str) -> Callable[[argparse.Namespace], int]:
    def run(_: argparse.Namespace) -> int:
        print(f"tensorverse {name}: not built yet ({what}).", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    from tensorverse import __version__

    parser = argparse.ArgumentParser(
        prog="tensorverse",
        description="Recording proxy and divergence analysis for vLLM runtimes.",
    )
    parser.add_argument("--version", action="version", version=f"tensorverse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_analyze(sub)
    for name, what in PLANNED.items():
        p = sub.add_parser(name, help=f"(not built yet) {what}")
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=_planned(name, what))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
