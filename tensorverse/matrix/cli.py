"""Argument handling of ``tensorverse matrix`` and ``tensorverse bisect`` (wired by :mod:`tensorverse.cli`).

Exit status: 0 done (points that could not start are recorded in the report, not failures of the
command), 2 a usage, spec or corpus error, 130 interrupted (finished points are kept in
``OUT/runs``; rerun the same command to resume).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tensorverse.cluster.options import add_executor_arguments

__all__ = ["register", "run_matrix_args", "run_bisect_args"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("matrix", help="replay a corpus over a grid of vLLM settings (the hypercube)",
                       description="Start a vLLM server with the capture plugin for each point of the "
                       "spec (one at a time unless [matrix] parallel > 1), replay the corpus forced and "
                       "free, stop it; compare every point with the reference point; write "
                       "OUT/matrix.json, replay-results.json, matrix.parquet and matrix.html.")
    p.add_argument("--spec", required=True, metavar="MATRIX.toml", help="the matrix spec (docs/matrix.md)")
    p.add_argument("--corpus", required=True, metavar="CORPUS", help="a replay corpus directory")
    p.add_argument("--out", required=True, metavar="RESULTS", help="results directory (runs are cached there)")
    p.add_argument("--retry-failed", action="store_true", help="retry points recorded as failed to start")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", action="store_true", help="print matrix.json instead of the table")
    add_executor_arguments(p)
    p.set_defaults(func=run_matrix_args)

    b = sub.add_parser("bisect", help="find the settings that cause a flip (delta debugging)",
                       description="Between a good and a bad point of the spec, find the smallest set "
                       "of setting changes that reproduces the bad point's first forced flip on one case.")
    b.add_argument("--spec", required=True, metavar="MATRIX.toml")
    b.add_argument("--corpus", required=True, metavar="CORPUS")
    b.add_argument("--out", required=True, metavar="RESULTS", help="results directory (shares a matrix's run cache)")
    b.add_argument("--good", required=True, metavar="POINT")
    b.add_argument("--bad", required=True, metavar="POINT")
    b.add_argument("--case", required=True, metavar="ID")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--json", action="store_true", help="print the bisection as JSON")
    add_executor_arguments(b, what="configuration")
    b.set_defaults(func=run_bisect_args)


def _term_as_exit() -> Any:
    """SIGTERM unwinds like Ctrl-C, so every started server is stopped on the way out. Returns
    the previous handler (restored by the caller)."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def _restore(old: Any) -> None:
    import signal

    if old is not None:
        signal.signal(signal.SIGTERM, old)


def _load(args: argparse.Namespace, cmd: str):
    from tensorverse.matrix.spec import SpecError, load_spec
    from tensorverse.replay.corpus import CorpusError, load_corpus

    try:
        spec = load_spec(args.spec)
        load_corpus(args.corpus)
    except (SpecError, CorpusError, FileNotFoundError) as e:
        print(f"tensorverse {cmd}: {e}", file=sys.stderr)
        return None
    return spec


def _executor(args: argparse.Namespace, cmd: str):
    """The executor of ``--executor`` (None after printing why it cannot run: exit 2)."""
    from tensorverse.cluster.options import ExecutorUnavailable, executor_options
    from tensorverse.matrix.executor import make_executor

    try:
        ex = make_executor(executor_options(args, progress=not args.no_progress))
    except (ExecutorUnavailable, ValueError) as e:
        print(f"tensorverse {cmd}: {e}", file=sys.stderr)
        return None
    if hasattr(ex, "describe") and not args.no_progress:
        print(f"{cmd}: {ex.describe()}", file=sys.stderr)
    return ex


def run_matrix_args(args: argparse.Namespace) -> int:
    from tensorverse.matrix.grid import run_matrix
    from tensorverse.matrix.report import render_table

    spec = _load(args, "matrix")
    if spec is None:
        return 2
    executor = _executor(args, "matrix")
    if executor is None:
        return 2
    old = _term_as_exit()
    try:
        report = run_matrix(spec, args.corpus, args.out, progress=not args.no_progress,
                            retry_failed=args.retry_failed, executor=executor)
    except KeyboardInterrupt:
        print(f"tensorverse matrix: interrupted; finished points are kept in {args.out}/runs — "
              "rerun the same command to resume", file=sys.stderr)
        return 130
    except ValueError as e:
        print(f"tensorverse matrix: {e}", file=sys.stderr)
        return 2
    finally:
        _restore(old)
        executor.close()
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if not k.startswith("_")}, indent=1))
    else:
        print(render_table(report))
        print(f"wrote {args.out}/matrix.json, replay-results.json, matrix.parquet, matrix.html")
    return 0


def run_bisect_args(args: argparse.Namespace) -> int:
    from tensorverse.matrix.bisect_run import BisectError, render_bisect, run_bisect
    from tensorverse.matrix.outlock import OutputBusy
    from tensorverse.matrix.spec import SpecError

    spec = _load(args, "bisect")
    if spec is None:
        return 2
    executor = _executor(args, "bisect")
    if executor is None:
        return 2
    old = _term_as_exit()
    try:
        r = run_bisect(spec, args.corpus, args.out, args.good, args.bad, args.case,
                       progress=not args.no_progress, executor=executor)
    except (BisectError, SpecError, OutputBusy, ValueError) as e:  # ValueError: e.g. the executor refusing the spec
        print(f"tensorverse bisect: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tensorverse bisect: interrupted; finished runs are kept — rerun to resume", file=sys.stderr)
        return 130
    finally:
        _restore(old)
        executor.close()
    print(json.dumps(r, indent=1) if args.json else render_bisect(r))
    return 0
