"""``tensorverse rig``: run a standard suite on this machine and write a results bundle.

    tensorverse rig run --out BUNDLE [--suite cpu-v4] [--settings A,B] [--work DIR] [--model DIR]
                        [--corpus DIR] [--label TEXT] [--no-noise] [--json]
    tensorverse rig run --dry-run [--suite gpu-v1] [--settings A,B] [--model DIR] [--json]
    tensorverse rig run --out BUNDLE --executor ray [--ray-address ADDR] [--ray-resource NAME=AMOUNT] ...
                                                 # every point's command and environment, refusals
    tensorverse rig suites                       # the suites, their settings and corpora

Exit 0 with the bundle written; 2 when the run cannot start (wrong weights, unknown suite or
setting), with the reason; 130 when interrupted (finished points are kept in --work: the same
command resumes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from tensorverse.cluster.options import add_executor_arguments
from tensorverse.rig.suite import DEFAULT_SUITE

__all__ = ["register"]


def register(sub: argparse._SubParsersAction, *,
             default_model: Callable[[Callable[[str], None]], Path] | None = None) -> None:
    """``tensorverse rig run|suites``; ``default_model`` gives the model when ``--model`` is not
    given (the composition root, :mod:`tensorverse.cli`, passes the demo model's build)."""
    p = sub.add_parser("rig", help="run the standard suite on this rig and write a results bundle (docs/rigs.md)",
                       description="Run a standard suite (settings x corpus, forced against the corpus's "
                       "recorded tokens) on this machine's vLLM and write one results bundle to send "
                       "(`tensorverse report check` validates it, `tensorverse hypercube build` merges many).")
    acts = p.add_subparsers(dest="rig_action", metavar="ACTION")
    r = acts.add_parser("run", help="run the suite's settings this rig can run; write the bundle")
    r.add_argument("--out", type=Path, metavar="BUNDLE", help="the bundle file to write (.tvbundle; required "
                   "unless --dry-run)")
    r.add_argument("--suite", default=DEFAULT_SUITE, help=f"the suite (default {DEFAULT_SUITE}; `tensorverse rig suites`)")
    r.add_argument("--settings", default=None, metavar="A,B",
                   help="only these settings (the reference and the noise point always run)")
    r.add_argument("--work", type=Path, default=None, metavar="DIR",
                   help="finished points are kept here; rerunning resumes (default BUNDLE.work)")
    r.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="the model directory (default: the shipped demo model); refused unless its "
                   "weights hash to the corpus's model")
    r.add_argument("--corpus", type=Path, default=None, metavar="DIR",
                   help="the corpus (default: the suite's shipped one; gpu-v1 ships none: the one you "
                   "recorded from your checkpoint)")
    r.add_argument("--dry-run", action="store_true",
                   help="start nothing: print every setting's exact server command and environment, "
                   "and why this machine would refuse it")
    r.add_argument("--label", default=None, help="how the rig is shown (default: its GPU or CPU model)")
    r.add_argument("--no-noise", action="store_true", help="skip the same-config noise point (no 'noise' class)")
    r.add_argument("--json", action="store_true", help="print the summaries as one JSON object")
    add_executor_arguments(r, what="setting")
    r.set_defaults(func=lambda a: _run(a, default_model))
    s = acts.add_parser("suites", help="list the suites with their settings and corpora")
    s.set_defaults(func=_suites)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _suites(args: argparse.Namespace) -> int:
    from tensorverse.rig.suite import SUITES

    for su in SUITES.values():
        corpus = su.corpus or "recorded from your checkpoint (--corpus DIR)"
        print(f"{su.name} (version {su.version}): corpus {corpus}; reference {su.reference}, noise {su.noise}")
        for st in su.settings:
            why = st.refusal()
            opts = " ".join(f"{k} {v}" for k, v in st.options.items())
            env = " ".join(f"{k}={v}" for k, v in st.env.items())
            print(f"  {st.name:<14} {st.axis:<15} {st.value:<24} {(opts + ' ' + env).strip() or '(the base)'}"
                  + (f"   [here: {why}]" if why else ""))
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    import shlex

    from tensorverse.rig.run import RigRunError, plan
    from tensorverse.rig.suite import suite

    try:
        su = suite(args.suite)
        names = [x.strip() for x in args.settings.split(",") if x.strip()] if args.settings else None
        points = plan(su, names, noise=not args.no_noise, model_dir=args.model)
    except (KeyError, RigRunError) as e:
        print(f"tensorverse rig run: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"suite": su.name, "points": [p.as_dict() for p in points]}, indent=1))
        return 0
    for p in points:
        print(f"{p.name} ({p.axis} = {p.value}): {p.refusal or 'would run'}")
        print("  " + shlex.join(p.command))
        if p.env:
            print("  env: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p.env.items())))
    runnable = sum(p.refusal is None for p in points)
    print(f"{su.name}: {runnable} of {len(points)} settings would run here")
    return 0


def _run(args: argparse.Namespace, default_model: Callable[[Callable[[str], None]], Path] | None = None) -> int:
    from tensorverse.bundle.format import missing_packages
    from tensorverse.rig.run import RigRunError, RigRunOptions, rig_run
    from tensorverse.rig.suite import suite

    if args.dry_run:
        return _dry_run(args)
    if args.out is None:
        print("tensorverse rig run: --out BUNDLE is required (or --dry-run)", file=sys.stderr)
        return 2
    need = missing_packages("pyarrow")
    if need:
        print(f"tensorverse rig run: {need}", file=sys.stderr)
        return 2
    executor = None
    if args.executor != "local":
        from tensorverse.cluster.options import ExecutorUnavailable, executor_options
        from tensorverse.matrix.executor import make_executor

        try:
            executor = make_executor(executor_options(args, progress=True))
        except (ExecutorUnavailable, ValueError) as e:
            print(f"tensorverse rig run: {e}", file=sys.stderr)
            return 2
    try:
        su = suite(args.suite)
        names = [x.strip() for x in args.settings.split(",") if x.strip()] if args.settings else None
        opts = RigRunOptions(out=args.out, suite=su, settings=names, work=args.work, model_dir=args.model,
                             default_model=default_model, corpus=args.corpus,
                             label=args.label, noise=not args.no_noise, executor=executor)
        res = rig_run(opts, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (KeyError, RigRunError) as e:
        print(f"tensorverse rig run: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tensorverse rig run: interrupted; finished points are kept in "
              f"{args.work or str(args.out) + '.work'}; the same command resumes", file=sys.stderr)
        return 130
    finally:
        if executor is not None:
            executor.close()
    if args.json:
        print(json.dumps({"bundle": str(res.path), "summaries": res.summaries,
                          "settings": [o.as_dict() for o in res.outcomes]}, indent=1))
        return 0
    print(f"{'setting':<14} {'status':<8} {'flips':>11} {'flip rate':>9} {'turns hit':>9} {'KL mean':>10} {'tool breaks':>11}")
    for o in res.outcomes:
        sm = res.summaries.get(o.name)
        if sm is None:
            print(f"{o.name:<14} {o.status:<8} {o.reason}")
            continue
        print(f"{o.name:<14} {o.status:<8} {sm['flips']:>5}/{sm['positions']:<5} {sm['flip_rate']:>9.4f} "
              f"{sm['turns_with_flip']:>4}/{sm['turns']:<4} {sm['kl_mean']:>10.2e} {sm['tool_call_breaks']:>5}/{sm['free_turns']:<5}")
    print(f"bundle: {res.path}")
    return 0
