"""The one `tensorverse` command: every tool is a subcommand over the same core."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

# Subcommands whose issue has not landed yet: they say so and exit 2 rather than pretend.
PLANNED: dict[str, str] = {
    "replay": "the replay runner (issue: Replay)",
    "scrub": "the corpus scrubber (issue: Replay)",
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


def _add_proxy(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "proxy",
        help="run the recording proxy in front of a vLLM server",
        description="OpenAI/Anthropic-compatible recording proxy: relays every request to the "
        "primary, records each turn into the store and tees selected turns to the shadow backends. "
        "See docs/proxy.md for the configuration file.",
    )
    p.add_argument("--config", required=True, metavar="FILE", help="configuration file (TOML, or YAML)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.add_argument("--check", action="store_true", help="validate the configuration and exit")
    p.set_defaults(func=_run_proxy)


def _run_proxy(args: argparse.Namespace) -> int:
    import logging

    from tensorverse.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"tensorverse proxy: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.config}: ok ({len(config.shadows)} shadow backend(s))")
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tensorverse.proxy.server import run

    return run(config)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="what a backend supports: plugin, capture, logprobs, tokenizer",
        description="Check one OpenAI-compatible (vLLM) backend: reachable, vLLM version, served "
        "models, max logprobs, vocabulary size, Tensorverse plugin present (forcing probed with "
        "one token), full or top-k capture, tokenizer fingerprint. Exit 0 when reachable, 2 "
        "otherwise. The backend's API key, if any, is read from TENSORVERSE_BACKEND_API_KEY.",
    )
    p.add_argument("--backend", required=True, metavar="URL",
                   help="the backend's base URL (http://host:port or http://host:port/v1)")
    p.add_argument("--model", help="the served model to check (default: the first served)")
    p.add_argument("--primary", metavar="URL",
                   help="also check that the backend uses this primary's dictionary and template")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    from tensorverse.shadow.doctor import run_doctor

    return run_doctor(args.backend, args.model, as_json=args.json, timeout_s=args.timeout,
                      primary=args.primary)


def _add_view(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "view",
        help="the multiverse viewer: a read-only web app over the store",
        description="Serve the multiverse viewer: sessions, turns, the branching token streams of "
        "every backend, top-k at each position, tool-call verdicts. Read-only; binds 127.0.0.1 "
        "unless told otherwise. See docs/viewer.md.",
    )
    p.add_argument("--store", default=None, metavar="PATH",
                   help="store directory (default: $TENSORVERSE_STORE or ./tensorverse-data)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    p.set_defaults(func=_run_view)


def _store_path(arg: str | None) -> str:
    import os

    return arg or os.environ.get("TENSORVERSE_STORE") or "./tensorverse-data"


def _run_view(args: argparse.Namespace) -> int:
    from tensorverse.store import StoreVersionError
    from tensorverse.viz.server import run

    try:
        return run(_store_path(args.store), host=args.host, port=args.port)
    except (FileNotFoundError, StoreVersionError) as e:
        print(f"tensorverse view: {e}", file=sys.stderr)
        return 2


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export recorded data (html: one session as a self-contained page)",
        description="Export recorded data. `export html` writes one session as a single HTML file "
        "(the viewer with the data embedded; opens with no network).",
    )
    kinds = p.add_subparsers(dest="kind", metavar="KIND")
    h = kinds.add_parser("html", help="one session as a self-contained HTML file")
    h.add_argument("--session", required=True, metavar="ID", help="session id")
    h.add_argument("--out", required=True, metavar="FILE", help="HTML file to write")
    h.add_argument("--store", default=None, metavar="PATH",
                   help="store directory (default: $TENSORVERSE_STORE or ./tensorverse-data)")
    h.set_defaults(func=_run_export_html)
    p.set_defaults(func=lambda _a: (p.print_help(sys.stderr), 2)[1])


def _run_export_html(args: argparse.Namespace) -> int:
    from tensorverse.store import Store, StoreVersionError
    from tensorverse.viz.data import NotFound
    from tensorverse.viz.export import export_session

    try:
        with Store.open(_store_path(args.store), readonly=True) as store:
            path = export_session(store, args.session, args.out)
    except (FileNotFoundError, StoreVersionError, NotFound) as e:
        print(f"tensorverse export html: {e.args[0] if isinstance(e, NotFound) else e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


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
    _add_view(sub)
    _add_export(sub)
    _add_doctor(sub)
    _add_proxy(sub)
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
