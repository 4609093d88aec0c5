"""``tensorverse hypercube build``: many rigs' results bundles as one static site (docs/hypercube.md).

    tensorverse hypercube build BUNDLE... --site DIR [--corpus DIR ...]

Every bundle is checked first (:func:`tensorverse.bundle.check.check_bundle`, against the
shipped corpora and the ``--corpus`` directories), one progress line each on stderr; then they
are merged, the statistics computed and the site written; the index's path is printed. Exit 0
when written; 2 when a bundle is refused (``tensorverse hypercube: BUNDLE: REASON: detail``), the
bundles do not fit together (another suite or corpus, one rig twice) or a ``--corpus`` is
unreadable: then nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

__all__ = ["register", "build", "main"]

PROG = "tensorverse hypercube"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hypercube", help="merge rigs' results bundles into one static site (docs/hypercube.md)",
                       description="Check results bundles of many rigs (`tensorverse rig run`), merge them and "
                       "write a static site that opens from disk: each setting's effect with turns as the "
                       "unit, a rig x setting heat map, per case a position map of the flips, and the "
                       "multiverse of any position across rigs and settings.")
    acts = p.add_subparsers(dest="hypercube_action", metavar="ACTION")
    b = acts.add_parser("build", help="check every bundle, merge them and write the site")
    b.add_argument("bundles", nargs="+", metavar="BUNDLE", help="results bundles (*.tvbundle), one per rig")
    b.add_argument("--site", required=True, type=Path, metavar="DIR",
                   help="the site directory to write (index.html, static/)")
    b.add_argument("--corpus", action="append", default=[], metavar="DIR",
                   help="a corpus directory the bundles may be about, besides the shipped ones (repeatable)")
    b.set_defaults(func=_build)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _plain(text: object, limit: int = 120) -> str:
    """A bundle's string for a terminal line: control characters escaped, cut to ``limit``."""
    s = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(text))
    return s if len(s) <= limit else s[:limit - 1] + "…"


def build(bundles: Sequence[str], site: str | Path, corpus_dirs: Sequence[str] = (), *,
          progress: bool = True, timings: dict[str, float] | None = None) -> Path:
    """Check, merge and write; returns the index path. Raises :class:`BuildRefused` (nothing
    written) when a bundle is refused or the bundles do not fit together. ``timings``: filled
    with the seconds of each stage (``check_s``, ``merge_s``, ``stats_s``, ``site_s``)."""
    from tensorverse import __version__
    from tensorverse.bundle.check import check_bundle
    from tensorverse.bundle.format import BundleRefused
    from tensorverse.hypercube.merge import MergeError, merge_bundles
    from tensorverse.hypercube.site import site_data, write_site
    from tensorverse.hypercube.stats import marginals
    from tensorverse.rig.suite import known_corpora

    try:
        corpora = known_corpora(corpus_dirs)
    except (ValueError, OSError, KeyError) as e:  # CorpusError is a ValueError
        raise BuildRefused("--corpus", "unreadable", str(e)) from None
    out = Path(site)
    if out.exists() and not out.is_dir():
        raise BuildRefused(str(out), "unwritable", "--site is a file, not a directory")
    clock = timings if timings is not None else {}
    start = time.perf_counter()
    checked = []
    for i, path in enumerate(bundles, 1):
        t0 = time.perf_counter()
        try:
            b = check_bundle(path, corpora)
        except BundleRefused as e:
            raise BuildRefused(path, e.reason, e.detail) from None
        if progress:
            statuses = [s["status"] for s in b.manifest["settings"]]
            print(f"{PROG}: [{i}/{len(bundles)}] {path}: ok (rig {_plain(b.rig['label'])}, {len(b.ran)} settings "
                  f"ran, {statuses.count('refused')} refused, {statuses.count('failed')} failed; "
                  f"{time.perf_counter() - t0:.2f} s)", file=sys.stderr, flush=True)
        checked.append(b)
    t1 = time.perf_counter()
    try:
        cube = merge_bundles(checked)
    except MergeError as e:
        raise BuildRefused(e.path, e.reason, e.detail) from None
    t2 = time.perf_counter()
    ms = marginals(cube)
    t3 = time.perf_counter()
    index = write_site(site_data(cube, ms, generator=f"tensorverse {__version__}"), out)
    t4 = time.perf_counter()
    clock.update(check_s=t1 - start, merge_s=t2 - t1, stats_s=t3 - t2, site_s=t4 - t3)
    return index


class BuildRefused(Exception):
    def __init__(self, path: str, reason: str, detail: str) -> None:
        super().__init__(f"{path}: {reason}: {detail}")
        self.path, self.reason, self.detail = path, reason, detail


def _build(args: argparse.Namespace) -> int:
    from tensorverse.bundle.format import missing_packages

    need = missing_packages("pyarrow", "duckdb")
    if need:
        print(f"{PROG}: {need}", file=sys.stderr)
        return 2
    try:
        index = build(args.bundles, args.site, args.corpus)
    except BuildRefused as e:
        print(f"{PROG}: {e.path}: {e.reason}: {_plain(e.detail, 2000)}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{PROG}: {args.site}: cannot write the site: {e}", file=sys.stderr)
        return 2
    print(index)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``tensorverse hypercube ...`` on its own (the same parser the main CLI registers)."""
    p = argparse.ArgumentParser(prog="tensorverse")
    register(p.add_subparsers(dest="command", metavar="COMMAND"))
    av = list(sys.argv[1:] if argv is None else argv)
    if not av or av[0] != "hypercube":
        av = ["hypercube", *av]  # `build ...` or `hypercube build ...`
    args = p.parse_args(av)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
