"""Argument handling of ``tensorverse scrub`` and ``tensorverse replay`` (``tensorverse report``
is :mod:`tensorverse.report_cli`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["run_scrub", "add_replay_arguments", "run_replay_args"]


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
    from tensorverse.cluster.options import add_executor_arguments

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
        from tensorverse.cluster.options import executor_options
        from tensorverse.replay.ray_task import run_replay_on_ray

        try:
            ex = executor_options(args, progress=not args.no_progress)
        except ValueError as e:
            print(f"tensorverse replay: {e}", file=sys.stderr)
            return 2
        return run_replay_on_ray(args.corpus, opts, fail_on=args.fail_on, as_json=args.json, ex=ex)
    return run_replay(args.corpus, opts, fail_on=args.fail_on, as_json=args.json)
