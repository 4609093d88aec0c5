"""Argument handling of ``tensorverse scrub``, ``tensorverse replay`` and ``tensorverse report``
(``merge A.json B.json ... [--out F] [--parquet F]``: many rigs' results in one table;
``html RESULTS --store DIR --out DIR``: the HTML report of a finished replay;
``check BUNDLE ... [--corpus DIR] [--json]``: accept or refuse rig results bundles)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["run_scrub", "add_replay_arguments", "run_replay_args", "register_report", "run_check", "main"]


def run_scrub(args: argparse.Namespace, store: str) -> int:
    from tensorverse.replay.corpus import CorpusError, render_scrub_report, scrub_store
    from tensorverse.replay.tokenizers import HFTokenizer, TokenizerError, VLLMTokenizer
    from tensorverse.store import RecordNotFound, StoreVersionError

    try:
        tok = HFTokenizer(args.tokenizer) if args.tokenizer else VLLMTokenizer(args.tokenizer_url)
        report = scrub_store(store, args.out, tokenizer=tok, sessions=args.session, rules=args.rules,
                             name=args.name)
    except (TokenizerError, CorpusError, ValueError, FileNotFoundError, StoreVersionError,
            RecordNotFound) as e:
        print(f"tensorverse scrub: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render_scrub_report(report))
        print(f"wrote {args.out}")
    return 0


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("corpus", metavar="CORPUS", help="corpus directory (or one case file)")
    p.add_argument("--backend", action="append", required=True, metavar="NAME=URL[#MODEL]",
                   help="a backend to replay on (repeatable); API key from "
                   "TENSORVERSE_BACKEND_API_KEY_<NAME> or TENSORVERSE_BACKEND_API_KEY")
    p.add_argument("--reference", metavar="NAME",
                   help="the backend whose forced runs are the reference distribution "
                   "(default: the first --backend)")
    p.add_argument("--mode", default="forced,free", help="forced, free or both (default forced,free)")
    p.add_argument("--capture", choices=("full", "topk", "auto"), default="auto",
                   help="full: the servers run the plugin with a sink into --store; topk: API "
                   "logprobs only; auto: probe (default)")
    p.add_argument("--concurrency", type=int, default=4, help="cases and requests per backend in flight (4)")
    p.add_argument("--out", metavar="RESULTS", default="replay-results.json",
                   help="results JSON (default replay-results.json); RESULTS.partial.jsonl keeps "
                   "finished cases until the run completes")
    p.add_argument("--store", metavar="DIR", help="keep runs and rows in this store (for "
                   "`tensorverse view`, and the capture sink); default: a temporary one")
    p.add_argument("--fail-on", action="append", default=[], metavar="RULE",
                   help="[BACKEND:]METRIC OP NUMBER, e.g. 'flip_rate>0.01' or "
                   "'toolcall_mismatch_rate>0', or [BACKEND:]verdict=DECISION, e.g. "
                   "'fp8:verdict=regression' (docs/verdict.md) (repeatable): exit 1 when met")
    p.add_argument("--tool-simulator", metavar="SPEC",
                   help="module:function or http(s) URL answering a diverged branch's tool calls")
    p.add_argument("--case", action="append", default=None, metavar="ID", help="only this case (repeatable)")
    p.add_argument("--retries", type=int, default=3, help="retries of a failed backend request (3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (300)")
    p.add_argument("--include-text", action="store_true",
                   help="write output text and tool-call values into the results (off: shareable)")
    p.add_argument("--no-resume", action="store_true", help="ignore RESULTS.partial.jsonl")
    p.add_argument("--no-tokenizer-check", action="store_true",
                   help="replay on backends whose tokenizer fingerprint differs from the corpus's")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--html", metavar="DIR", help="write the HTML report here: DIR/index.html and the "
                   "multiverse view of each diverging case (DIR/cases/*.html)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    from tensorverse.matrix.executor import add_executor_arguments

    add_executor_arguments(p, what="replay")  # --executor ray: the replay as a Ray task (replay/ray_task.py)


def run_replay_args(args: argparse.Namespace) -> int:
    from tensorverse.replay.options import ReplayOptions, parse_backend
    from tensorverse.replay.runner import run_replay
    from tensorverse.replay.tools import load_simulator

    try:
        backends = [parse_backend(s, capture=args.capture, concurrency=max(1, args.concurrency),
                                  timeout_s=args.timeout) for s in args.backend]
        modes = tuple(m.strip() for m in args.mode.split(",") if m.strip())
        opts = ReplayOptions(
            backends=backends, reference=args.reference, modes=modes, concurrency=args.concurrency,
            out=Path(args.out) if args.out else None, store=Path(args.store) if args.store else None,
            retries=max(0, args.retries), simulator=load_simulator(args.tool_simulator),
            include_text=args.include_text, check_tokenizer=not args.no_tokenizer_check,
            progress=not args.no_progress and sys.stderr.isatty(), resume=not args.no_resume,
            cases=args.case, html=Path(args.html) if args.html else None)
    except ValueError as e:
        print(f"tensorverse replay: {e}", file=sys.stderr)
        return 2
    if getattr(args, "executor", "local") == "ray":
        from tensorverse.matrix.executor import executor_options
        from tensorverse.replay.ray_task import run_replay_on_ray

        try:
            ex = executor_options(args, progress=not args.no_progress)
        except ValueError as e:
            print(f"tensorverse replay: {e}", file=sys.stderr)
            return 2
        return run_replay_on_ray(args.corpus, opts, fail_on=args.fail_on, as_json=args.json, ex=ex)
    return run_replay(args.corpus, opts, fail_on=args.fail_on, as_json=args.json)


def register_report(sub: argparse._SubParsersAction) -> None:
    """``tensorverse report ...`` (wired by :mod:`tensorverse.cli`)."""
    p = sub.add_parser("report", help="work with replay results: merge rigs' results, HTML report, "
                       "check rig results bundles")
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="merge A.json B.json ... [--out F] [--parquet F] | html RESULTS --store DIR --out DIR"
                   " | check BUNDLE ... [--corpus DIR] [--json]")
    p.set_defaults(func=lambda a: main(a.rest))


def run_check(bundles: Sequence[str], corpus_dirs: Sequence[str], as_json: bool) -> int:
    """``tensorverse report check``: each bundle accepted or refused (docs/replay.md). Exit
    status 0 when every bundle is accepted, 2 when one is refused or a ``--corpus`` is unreadable."""
    from tensorverse.bundle.check import check_bundle
    from tensorverse.bundle.format import BundleRefused, missing_packages
    from tensorverse.rig.suite import known_corpora

    need = missing_packages("pyarrow")
    if need:
        print(f"report check: {need}", file=sys.stderr)
        return 2
    try:
        corpora = known_corpora(corpus_dirs)
    except (ValueError, OSError, KeyError) as e:  # CorpusError is a ValueError
        print(f"report check: a corpus cannot be read: {e}", file=sys.stderr)
        return 2
    out, reasons = [], []
    for path in bundles:
        try:
            b = check_bundle(path, corpora)
        except BundleRefused as e:
            reasons.append(e.reason)
            out.append({"path": path, "ok": False, "reason": e.reason, "detail": e.detail, "rig": None,
                        "settings_ran": None})
            if not as_json:
                print(f"{path}: refused: {e.reason}: {e.detail}")
            continue
        statuses = [s["status"] for s in b.manifest["settings"]]
        out.append({"path": path, "ok": True, "reason": None, "detail": None, "rig": b.rig["label"],
                    "settings_ran": b.ran})
        if not as_json:
            failed = statuses.count("failed")
            print(f"{path}: ok (rig {b.rig['label']}, {len(b.ran)} settings ran, {statuses.count('refused')} "
                  f"refused{f', {failed} failed' if failed else ''}; {len(b.positions)} positions)")
    if as_json:
        print(json.dumps({"bundles": out}, indent=1))
    if reasons:
        print(f"report check: {len(reasons)} of {len(bundles)} bundle(s) refused "
              f"({', '.join(sorted(set(reasons)))})", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``tensorverse report merge|html|check``. Exit status: 0 done, 2 unreadable input (or a
    refused bundle)."""
    from tensorverse.replay.report import merge_results, render_merged, write_parquet

    p = argparse.ArgumentParser(prog="tensorverse report")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="aggregate replay results of many rigs into one table")
    m.add_argument("results", nargs="+", help="results JSON files")
    m.add_argument("--out", help="write the merged JSON here")
    m.add_argument("--parquet", help="write the merged rows as Parquet here")
    h = sub.add_parser("html", help="the HTML report of a replay from its results and --store")
    h.add_argument("results", help="the replay's results JSON")
    h.add_argument("--store", required=True, help="the store the replay kept (replay --store DIR)")
    h.add_argument("--out", required=True, help="the report directory (index.html, cases/)")
    c = sub.add_parser("check", help="accept or refuse rig results bundles (the submission checker)")
    c.add_argument("bundles", nargs="+", metavar="BUNDLE", help="results bundles (*.tvbundle)")
    c.add_argument("--corpus", action="append", default=[], metavar="DIR",
                   help="a corpus directory the bundles may be about, besides the shipped ones (repeatable)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.cmd == "check":
        return run_check(args.bundles, args.corpus, args.json)
    if args.cmd == "html":
        from tensorverse.replay.html import report_from_files
        from tensorverse.store import StoreVersionError

        try:
            index = report_from_files(args.results, args.store, args.out)
        except (ValueError, OSError, StoreVersionError) as e:
            print(f"report html: {e}", file=sys.stderr)
            return 2
        print(f"wrote {index}")
        return 0
    try:
        merged = merge_results(args.results)
    except (ValueError, OSError) as e:
        print(f"merge: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
    if args.parquet:
        write_parquet(merged, args.parquet)
    print(render_merged(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
