"""The one `tensorverse` command: every tool is a subcommand over the same core."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

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
    p.add_argument("--noise", help="rows of a noise run at the same positions, .npy (e.g. the "
                   "secondary's): flips where it flips too are classed `noise`")
    p.add_argument("--near-tie-ulps", type=int, default=1, metavar="N",
                   help="a flip whose two reference logits are at most N representable values apart "
                   "in the reference's dtype is a near_tie (default 1; 0: off)")
    p.add_argument("--near-tie-nats", type=float, default=0.0, metavar="X",
                   help="a flip whose reference margin is at most X nats is a near_tie too (default 0: off)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_analyze)


def _run_analyze(args: argparse.Namespace) -> int:
    from tensorverse.analysis.attribution import TieRule
    from tensorverse.analysis.metrics import AnalysisInputError
    from tensorverse.analysis.report import run_analyze

    try:
        rule = TieRule(ulps=args.near_tie_ulps, nats=args.near_tie_nats)
    except AnalysisInputError as e:
        print(f"tensorverse analyze: error: {e}", file=sys.stderr)
        return 2
    return run_analyze(args.ref, args.cand, args.tokens, as_json=args.json, noise_path=args.noise,
                       rule=rule)


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
    from tensorverse.store import store_path

    return store_path(arg)


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
        help="export recorded data (html: one session as a page; parquet/jsonl: tables)",
        description="Export recorded data. `export html` writes one session as a single HTML file "
        "(the viewer with the data embedded; opens with no network). `export parquet` and "
        "`export jsonl` write the store as tables (sessions, turns, runs, comparisons, "
        "per-position metrics; optionally logits rows) into a directory for pandas/DuckDB "
        "(schema: docs/metrics.md). `export --format parquet|jsonl ...` is the same.",
    )
    p.add_argument("--format", dest="format", choices=("parquet", "jsonl"), default=None,
                   help="table format (same as `export parquet` / `export jsonl`)")
    _table_args(p, required=False)
    kinds = p.add_subparsers(dest="kind", metavar="KIND")
    # A kind declares the parent's options again with no default (argparse.SUPPRESS): argparse
    # copies every attribute a kind's parser sets over the parent's, so a default here would
    # overwrite `export --store PATH parquet`'s PATH (issue 27); `--out` is checked when run.
    h = kinds.add_parser("html", help="one session as a self-contained HTML file")
    h.add_argument("--session", required=True, metavar="ID", help="session id")
    h.add_argument("--out", default=argparse.SUPPRESS, metavar="FILE", help="HTML file to write (required)")
    h.add_argument("--store", default=argparse.SUPPRESS, metavar="PATH",
                   help="store directory (default: $TENSORVERSE_STORE or ./tensorverse-data)")
    h.set_defaults(func=_run_export_html)
    for fmt, what in (("parquet", "Parquet files (needs pyarrow: the `export` extra)"),
                      ("jsonl", "JSON Lines files (no extra dependency)")):
        t = kinds.add_parser(fmt, help=f"the store as tables, {what}")
        _table_args(t, required=True)
        t.set_defaults(func=_run_export_tables, format=fmt)

    def no_kind(a: argparse.Namespace) -> int:
        if a.format:
            return _run_export_tables(a)
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=no_kind)


def _table_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    """The table options: on `export` with their defaults, on its kinds (``required``: `--out`
    must be given, before or after the kind) with none, so a value given before the kind stays."""
    none = argparse.SUPPRESS if required else None
    p.add_argument("--out", default=none, metavar="DIR",
                   help="directory for the tables (<table>.parquet or <table>.jsonl)" + (" (required)" if required else ""))
    p.add_argument("--store", default=none, metavar="PATH",
                   help="store directory (default: $TENSORVERSE_STORE or ./tensorverse-data)")
    p.add_argument("--since", default=none, metavar="WHEN",
                   help="only sessions created since: 24h, 7d, 2026-11-30, 2026-11-30T12:00Z or Unix seconds")
    p.add_argument("--until", default=none, metavar="WHEN", help="only sessions created before (same forms)")
    p.add_argument("--tables", default=none, metavar="LIST",
                   help="comma-separated subset of sessions,turns,runs,comparisons,positions,logits")
    p.add_argument("--logits", action="store_true", default=argparse.SUPPRESS if required else False,
                   help="also the logits rows, decoded to float32 (one row per position: large)")
    p.add_argument("--include-text", action="store_true", default=argparse.SUPPRESS if required else False,
                   help="also the turns' and runs' output text (left out by default)")


def _run_export_tables(args: argparse.Namespace) -> int:
    from tensorverse.exporters.export import ExportError, export_store, parse_since
    from tensorverse.store import Store, StoreVersionError

    name = f"tensorverse export {args.format}"
    if not args.out:
        print(f"{name}: --out DIR is required", file=sys.stderr)
        return 2
    try:
        since = parse_since(args.since)
        until = parse_since(args.until) if args.until else None
        tables = [t.strip() for t in args.tables.split(",") if t.strip()] if args.tables else None
        if tables is not None and args.logits and "logits" not in tables:
            tables.append("logits")
        with Store.open(_store_path(args.store), readonly=True) as store:
            result = export_store(store, args.out, fmt=args.format, since_ns=since, until_ns=until,
                                  include_text=args.include_text, logits=args.logits, tables=tables)
    except (FileNotFoundError, StoreVersionError, ExportError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    for info in result.values():
        print(f"{info['path']}: {info['rows']} rows")
    return 0


def _run_export_html(args: argparse.Namespace) -> int:
    from tensorverse.store import Store, StoreVersionError
    from tensorverse.viz.data import NotFound
    from tensorverse.viz.export import export_session

    if not args.out:
        print("tensorverse export html: --out FILE is required", file=sys.stderr)
        return 2
    try:
        with Store.open(_store_path(args.store), readonly=True) as store:
            path = export_session(store, args.session, args.out)
    except (FileNotFoundError, StoreVersionError, NotFound) as e:
        print(f"tensorverse export html: {e.args[0] if isinstance(e, NotFound) else e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def _add_scrub(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scrub",
        help="scrub recorded sessions into a replay corpus",
        description="Read sessions from a store, replace IPs, MACs, host names, e-mails, API keys "
        "and config secrets with consistent, format-preserving placeholders, re-tokenize the "
        "token ids, and write a corpus directory (see docs/replay.md). The store holds token ids "
        "but no tokenizer: name one with --tokenizer DIR (the served model's directory or any "
        "Hugging Face tokenizer directory of that model) or --tokenizer-url URL (a vLLM server of "
        "the same model). Prints the scrub report (counts by kind, never an original).",
    )
    p.add_argument("--store", default=None, metavar="PATH",
                   help="store directory (default: $TENSORVERSE_STORE or ./tensorverse-data)")
    p.add_argument("--out", required=True, metavar="CORPUS", help="corpus directory to write")
    p.add_argument("--session", action="append", default=None, metavar="ID",
                   help="only this session (repeatable; default: every session)")
    p.add_argument("--rules", metavar="FILE", help="extra patterns and words to keep (TOML or JSON)")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", metavar="DIR", help="a Hugging Face tokenizer directory")
    tok.add_argument("--tokenizer-url", metavar="URL", help="a vLLM server of the same model")
    p.add_argument("--name", help="corpus name (manifest)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run_scrub)


def _run_scrub(args: argparse.Namespace) -> int:
    from tensorverse.replay.cli import run_scrub

    return run_scrub(args, _store_path(args.store))


def _add_replay(sub: argparse._SubParsersAction) -> None:
    from tensorverse.replay.cli import add_replay_arguments

    p = sub.add_parser(
        "replay",
        help="replay a corpus on a set of backends; report and gate on divergence",
        description="Run every case of a corpus on the backends (forced and free runs), compare "
        "with the reference backend and the recorded output, print a summary table, write a "
        "results file, and exit 1 when a --fail-on threshold is exceeded. See docs/replay.md.",
    )
    add_replay_arguments(p)
    p.set_defaults(func=_run_replay)


def _run_replay(args: argparse.Namespace) -> int:
    from tensorverse.replay.cli import run_replay_args

    return run_replay_args(args)


def _add_noise(sub: argparse._SubParsersAction) -> None:
    from tensorverse.replay.batch_noise import add_noise_arguments

    p = sub.add_parser(
        "noise",
        help="a backend's batch-noise floor: the same forced tokens at several batch sizes",
        description="Force the same tokens on one backend at each --concurrency level (filler "
        "requests make the batch), compare each level's rows with the first level's and print "
        "flips and KL in replay's summary form. See docs/replay.md, 'Batch noise'.",
    )
    add_noise_arguments(p)
    p.set_defaults(func=_run_noise)


def _run_noise(args: argparse.Namespace) -> int:
    from tensorverse.replay.batch_noise import run_noise_args

    return run_noise_args(args)


def _demo_model(log):
    """The model ``tensorverse rig run`` uses without ``--model``: the demo model (built or
    unpacked once, then cached). Wired here so that rig imports no demo."""
    from tensorverse.demo import model as demo_model

    return demo_model.build(log=log)


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
    _add_scrub(sub)
    _add_replay(sub)
    _add_noise(sub)
    from tensorverse.demo.cli import register as register_demo

    register_demo(sub)  # tensorverse demo
    from tensorverse.matrix.cli import register as register_matrix
    from tensorverse.report_cli import register as register_report

    from tensorverse.sessions_cli import register as register_sessions

    register_sessions(sub)  # tensorverse sessions [list|merge|split]
    from tensorverse.verdict_cli import register as register_verdict

    register_verdict(sub)  # tensorverse verdict
    from tensorverse.store_cli import register as register_store

    register_store(sub)  # tensorverse store [stats|prune|pin]
    register_report(sub)  # tensorverse report ...
    from tensorverse.rig.cli import register as register_rig

    register_rig(sub, default_model=_demo_model)  # tensorverse rig run|suites
    from tensorverse.hypercube.cli import register as register_hypercube

    register_hypercube(sub)  # tensorverse hypercube build
    register_matrix(sub)  # tensorverse matrix, tensorverse bisect
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
