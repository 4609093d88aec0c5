"""``tensorverse store stats | compact | prune | pin``: what the store holds and a budget it keeps.

    tensorverse store --store DIR stats [--json]
    tensorverse store --store DIR compact [--after 2m] [--config FILE] [--dry-run] [--json]
    tensorverse store --store DIR prune [--max-age 30d] [--max-bytes 80G] [--config FILE] [--dry-run]
    tensorverse store --store DIR pin SESSION [--unpin]

``--store`` may stand before or after the action. ``compact`` replaces the rows that are not
evidence by their compact form, turn by turn (`tensorverse.store.compaction`); ``prune``
deletes whole sessions, oldest first, pinned ones never (`tensorverse.store.retention`);
``--config`` reads ``[retention]``. Exit 0, or 2 with the reason (no store, a bad size or
duration, an unknown session).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["register"]


def _add_store(p: argparse.ArgumentParser, *, top: bool) -> None:
    p.add_argument("--store", metavar="PATH", default=None if top else argparse.SUPPRESS,
                   help="store directory (default: $TENSORVERSE_STORE or ./tensorverse-data)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="the store: its size and growth, compaction, retention (prune), pins",
                       description="What the store holds (bytes by table, backend and mode; the "
                       "growth rate; days left), compaction of the rows that are not evidence, "
                       "pruning to a budget (oldest sessions first, pinned "
                       "ones never), and pins. See docs/proxy.md, [retention].")
    _add_store(p, top=True)
    acts = p.add_subparsers(dest="store_action", metavar="ACTION", required=True)
    st = acts.add_parser("stats", help="bytes by table, backend and mode; growth; days left")
    _add_store(st, top=False)
    st.add_argument("--window", default="1d", metavar="DURATION",
                    help="growth measured over the sessions of this last stretch (default 1d)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(func=_run_stats)
    cp = acts.add_parser("compact", help="keep the evidence rows in full, the others in compact form")
    _add_store(cp, top=False)
    cp.add_argument("--after", metavar="DURATION", default=None,
                    help="only turns recorded at least this long ago (default: [retention] compact_after_s, 2m)")
    cp.add_argument("--config", metavar="FILE", help="read the evidence policy from [retention] of this file")
    cp.add_argument("--limit", type=int, metavar="N", help="compact at most N turns")
    cp.add_argument("--dry-run", action="store_true", help="say what would be kept and freed, write nothing")
    cp.add_argument("--json", action="store_true", help="print one JSON object")
    cp.set_defaults(func=_run_compact)
    pr = acts.add_parser("prune", help="delete sessions past the budget (oldest first, pinned never)")
    _add_store(pr, top=False)
    pr.add_argument("--max-age", metavar="DURATION", help="delete sessions older than this (30d, 12h)")
    pr.add_argument("--max-bytes", metavar="SIZE", help="then the oldest until the live bytes fit (80G, 512MiB)")
    pr.add_argument("--config", metavar="FILE", help="read max_age and max_bytes from [retention] of this file")
    pr.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    pr.add_argument("--json", action="store_true", help="print one JSON object")
    pr.set_defaults(func=_run_prune)
    pn = acts.add_parser("pin", help="pin a session (retention never prunes it), or --unpin it")
    _add_store(pn, top=False)
    pn.add_argument("session", metavar="SESSION")
    pn.add_argument("--unpin", action="store_true")
    pn.set_defaults(func=_run_pin)


def _open(args: argparse.Namespace, readonly: bool) -> Any:
    """The store, which must exist (a writable open would create an empty one)."""
    from pathlib import Path

    from tensorverse.store import Store, store_path

    path = store_path(args.store)
    if not (Path(path) / "data.mdb").exists():
        raise FileNotFoundError(f"no Tensorverse store at {path}")
    return Store.open(path, readonly=readonly)


def _size(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _fail(msg: str) -> int:
    print(f"tensorverse store: {msg}", file=sys.stderr)
    return 2


def _run_stats(args: argparse.Namespace) -> int:
    from tensorverse.store import StoreVersionError
    from tensorverse.store.retention import parse_duration, usage

    try:
        window = parse_duration(args.window)
        with _open(args, True) as store:
            u = usage(store, window_s=window)
    except (FileNotFoundError, StoreVersionError, ValueError) as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(u.as_dict(), indent=1))
        return 0
    print(f"store {u.path}: {_size(u.live_bytes)} live in {len(u.sessions)} sessions "
          f"({sum(s.pinned for s in u.sessions)} pinned); file extent {_size(u.file_bytes)}; "
          f"cap {_size(u.max_size) if u.max_size else 'none'}; free {_size(u.free_bytes)}")
    print("tables: " + ", ".join(f"{k} {_size(v)}" for k, v in sorted(u.tables.items(), key=lambda kv: -kv[1]) if v))
    for backend, modes in sorted(u.rows.items()):
        print(f"rows of {backend}: " + ", ".join(f"{m} {c['rows']} rows {_size(c['bytes'])}"
                                                   for m, c in sorted(modes.items())))
    rate = f"{_size(u.bytes_per_day)}/day" if u.bytes_per_day else "n/a"
    days = f"{u.days_left:.1f} days left at that rate" if u.days_left is not None else "days left: n/a"
    print(f"growth over the last {args.window}: {rate}; {days}")
    return 0


def _policy(args: argparse.Namespace) -> Any:
    from tensorverse.store.retention import RetentionPolicy, parse_bytes, parse_duration

    age = parse_duration(args.max_age) if args.max_age else None
    size = parse_bytes(args.max_bytes) if args.max_bytes else None
    if args.config:
        from tensorverse.config import load_config

        r = load_config(args.config).retention
        age = r.max_age_seconds() if age is None else age
        size = r.max_bytes_value() if size is None else size
    if age is None and size is None:
        raise ValueError("prune needs --max-age, --max-bytes or a --config with [retention]")
    return RetentionPolicy(max_age_s=age, max_bytes=size)


def _run_prune(args: argparse.Namespace) -> int:
    from tensorverse.config import ConfigError
    from tensorverse.store import StoreVersionError
    from tensorverse.store.retention import plan, prune, usage

    out: dict[str, Any]
    try:
        policy = _policy(args)
        with _open(args, args.dry_run) as store:
            if args.dry_run:
                p = plan(usage(store), policy)
                out = {"dry_run": True, "sessions": len(p.delete), "bytes": p.bytes,
                       "live_bytes_after": p.live_bytes_after, "over_budget": p.over_budget,
                       "by_reason": {r: sum(1 for _, why, _ in p.delete if why == r) for r in ("age", "rows", "bytes")}}
                out["sessions"] -= out["by_reason"]["rows"]
            else:
                r = prune(store, policy, progress=lambda i: print(f"\rdeleted {i}", end="", file=sys.stderr))
                if r.deleted:
                    print(file=sys.stderr)
                out = {"dry_run": False, "sessions": len(r.deleted), "bytes": r.bytes_freed,
                       "live_bytes_after": r.live_bytes, "over_budget": r.over_budget, "by_reason": r.by_reason()}
    except (FileNotFoundError, StoreVersionError, ValueError, ConfigError) as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        rows = out["by_reason"]["rows"]
        dropped = f"; the rows of {rows} more (their records and comparisons kept)" if rows else ""
        print(f"{verb} {out['sessions']} session(s), {_size(out['bytes'])} ({out['by_reason']['age']} past "
              f"max-age, {out['by_reason']['bytes']} for max-bytes){dropped}; live after: "
              f"{_size(out['live_bytes_after'])}")
        if out["over_budget"]:
            print("still over max-bytes: the rest is pinned (tensorverse store pin SESSION --unpin)")
    return 0


def _run_compact(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tensorverse.config import ConfigError, RetentionSection, load_config
    from tensorverse.store import StoreVersionError
    from tensorverse.store.retention import parse_duration

    try:
        section = load_config(args.config).retention if args.config else RetentionSection()
        policy = section.evidence_policy(even_if_off=True)
        if args.after is not None:
            policy = replace(policy, after_s=parse_duration(args.after))
        if args.limit is not None and args.limit < 1:
            raise ValueError("--limit must be at least 1")
        from tensorverse.store.compaction import compact_store

        done = {"compacted": 0}

        def progress(r: Any) -> None:
            if r.status == "compacted":
                done["compacted"] += 1
                print(f"\rcompacted {done['compacted']} turn(s)", end="", file=sys.stderr)

        with _open(args, False) as store:
            results = compact_store(store, policy, dry_run=args.dry_run, limit=args.limit, progress=progress)
        if done["compacted"]:
            print(file=sys.stderr)
    except (FileNotFoundError, StoreVersionError, ValueError, ConfigError) as e:
        return _fail(str(e))
    ok = [r for r in results if r.status == "compacted"]
    skipped: dict[str, int] = {}
    for r in results:
        if r.status != "compacted":
            skipped[r.why or r.status] = skipped.get(r.why or r.status, 0) + 1
    out = {"dry_run": args.dry_run, "turns": len(ok), "rows_full": sum(r.rows_full for r in ok),
           "rows_delta": sum(r.rows_delta for r in ok), "rows_compact": sum(r.rows_compact for r in ok),
           "bytes_before": sum(r.bytes_before for r in ok), "bytes_after": sum(r.bytes_after for r in ok),
           "skipped": skipped}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    verb = "would compact" if args.dry_run else "compacted"
    ratio = f" ({out['bytes_before'] / out['bytes_after']:.0f}x smaller)" if out["bytes_after"] else ""
    print(f"{verb} {out['turns']} turn(s): {out['rows_full']} rows kept full, {out['rows_delta']} as deltas, "
          f"{out['rows_compact']} compact; row bytes {_size(out['bytes_before'])} -> {_size(out['bytes_after'])}"
          f"{ratio}")
    if skipped:
        print("skipped: " + ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    if not ok:
        print(f"(a turn is due once its comparisons are stored and it was recorded at least "
              f"{policy.after_s:g} s ago; pinned sessions never are)")
    return 0


def _run_pin(args: argparse.Namespace) -> int:
    from tensorverse.store import RecordNotFound, StoreVersionError

    try:
        with _open(args, False) as store:
            was = store.pin_session(args.session, not args.unpin).result()
    except RecordNotFound as e:
        return _fail(str(e).strip("'\""))
    except (FileNotFoundError, StoreVersionError, ValueError) as e:
        return _fail(str(e))
    now = not args.unpin
    state = "pinned" if now else "unpinned"
    print(f"session {args.session} {state}" + (" (already)" if was == now else ""))
    return 0
