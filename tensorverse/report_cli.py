"""``tensorverse report merge | html | check``: work with what replays and rigs produced.

    tensorverse report merge A.json B.json ... [--out F] [--parquet F]   many rigs' results in one table
    tensorverse report html RESULTS --store DIR --out DIR                the HTML report of a finished replay
    tensorverse report check BUNDLE ... [--corpus DIR] [--json]          accept or refuse rig results bundles

A command of its own above ``replay``, ``bundle`` and ``rig`` (it reads all three), so that none
of them imports another's command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["register", "run_check", "main"]


def register(sub: argparse._SubParsersAction) -> None:
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
