"""``tensorverse sessions``: list the recorded sessions, and correct the automatic grouping by hand.

    tensorverse sessions [--store PATH] [list] [--limit N] [--json]
    tensorverse sessions [--store PATH] merge INTO OTHER [--reason TEXT]   # OTHER's turns go after INTO's
    tensorverse sessions [--store PATH] split SESSION --at INDEX [--reason TEXT]

``--store`` goes before or after the action, ``--limit`` and ``--json`` before or after ``list``
(or without it): each action declares them again with ``default=argparse.SUPPRESS``, so a value
given before the action is never overwritten by the action's default.

The list shows, per session, its turns (main and side: a side request is a title, summary or
judge request the agent made beside the conversation), how many main turns called a tool, how it
was grouped, how many times it was edited by hand, and its first user message with addresses,
names and secrets scrubbed (`tensorverse.replay.scrub.Scrubber`). A merge or split is one store
transaction; it is recorded in the sessions' ``edits`` (who, when, why, which turns from where)
and in each moved turn's ``moved_from``, never silent. Run them on a store no proxy is writing to
the same sessions at that moment (a proxy that does keeps writing; a turn that finds its index
taken takes the next free one).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterator

import orjson

if TYPE_CHECKING:
    from tensorverse.store import Store


FIRST_USER_CHARS = 80


@dataclass(frozen=True, slots=True)
class SessionRow:
    id: str
    created_ns: int
    turns: int
    side_turns: int
    tool_call_turns: int
    grouping: str
    edits: int
    first_user: str


def _first_user(store: Store, sid: str, scrubber: Any) -> str:
    from tensorverse.proxy.grouping import first_user_text
    from tensorverse.proxy.sessions import request_messages

    for turn in store.iter_turns(sid):
        if turn.kind != "main":
            continue
        msgs = request_messages(turn.endpoint, turn.request) or []
        text = first_user_text(msgs)
        if text:
            text = scrubber.scrub_text(text)
            return text if len(text) <= FIRST_USER_CHARS else text[: FIRST_USER_CHARS - 1] + "…"
    return ""


def session_rows(store: Store, limit: int | None = None) -> Iterator[SessionRow]:
    """The newest ``limit`` sessions (all when None), oldest first."""
    from tensorverse.replay.scrub import Scrubber

    sessions = list(store.iter_sessions())
    if limit:
        sessions = sessions[-limit:]
    scrubber = Scrubber()  # one mapping for the whole list: the same host gets the same placeholder
    for s in sessions:
        yield SessionRow(id=s.id, created_ns=s.created_ns, turns=s.turns, side_turns=s.side_turns,
                         tool_call_turns=s.tool_call_turns, grouping=s.grouping or "", edits=len(s.edits),
                         first_user=_first_user(store, s.id, scrubber))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sessions",
        help="list recorded sessions; merge or split them by hand",
        description="List sessions (turns, side requests, tool-call turns, grouping, scrubbed first "
        "user message), or correct the grouping: `merge INTO OTHER` moves OTHER's turns after "
        "INTO's; `split SESSION --at INDEX` moves the turns from INDEX on into a new session. "
        "Both are recorded in the sessions' `edits`. Without an action: `list`. See "
        "docs/proxy.md#sessions.",
    )
    store_help = "store directory (default: $TENSORVERSE_STORE or ./tensorverse-data)"
    p.add_argument("--store", default=None, metavar="PATH", help=store_help)
    _list_args(p, default=True)
    p.set_defaults(func=_run_list)
    acts = p.add_subparsers(dest="action", metavar="ACTION")
    # Each action accepts its parent's options again (after the action), with no default of its
    # own: argparse copies every attribute an action's parser sets over the parent's, so a
    # default here would overwrite `sessions --store PATH list`'s PATH (issue 27).
    ls = acts.add_parser("list", help="list sessions (the default)")
    _list_args(ls, default=False)
    ls.add_argument("--store", default=argparse.SUPPRESS, metavar="PATH", help=store_help)
    ls.set_defaults(func=_run_list)
    m = acts.add_parser("merge", help="move OTHER's turns after INTO's and delete OTHER")
    m.add_argument("into")
    m.add_argument("other")
    m.add_argument("--reason", default="", help="why (recorded)")
    m.add_argument("--store", default=argparse.SUPPRESS, metavar="PATH", help=store_help)
    m.set_defaults(func=_run_merge)
    s = acts.add_parser("split", help="move the turns from INDEX on into a new session")
    s.add_argument("session")
    s.add_argument("--at", type=int, required=True, metavar="INDEX")
    s.add_argument("--reason", default="", help="why (recorded)")
    s.add_argument("--store", default=argparse.SUPPRESS, metavar="PATH", help=store_help)
    s.set_defaults(func=_run_split)


def _list_args(p: argparse.ArgumentParser, *, default: bool) -> None:
    """``--limit`` and ``--json``: on ``sessions`` itself with their defaults, on ``list`` with
    none (see `register`)."""
    p.add_argument("--limit", type=int, default=None if default else argparse.SUPPRESS, metavar="N",
                   help="only the newest N")
    p.add_argument("--json", action="store_true", default=False if default else argparse.SUPPRESS,
                   help="one JSON object per line")


def _store_path(args: argparse.Namespace) -> str:
    from tensorverse.store import store_path as default

    return default(args.store)


def _run_list(args: argparse.Namespace) -> int:
    from tensorverse.store import Store, StoreVersionError

    try:
        with Store.open(_store_path(args), readonly=True) as store:
            rows = list(session_rows(store, args.limit))
    except (FileNotFoundError, StoreVersionError) as e:
        print(f"tensorverse sessions: {e}", file=sys.stderr)
        return 2
    if args.json:
        for r in rows:
            sys.stdout.write(orjson.dumps(asdict(r)).decode() + "\n")
        return 0
    import time

    print(f"{'session':<26} {'created (UTC)':<19} {'turns':>5} {'side':>4} {'tools':>5} {'grouping':<9} {'edits':>5}  first user message")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.created_ns / 1e9))
        print(f"{r.id:<26} {when:<19} {r.turns:>5} {r.side_turns:>4} {r.tool_call_turns:>5} {r.grouping:<9} "
              f"{r.edits:>5}  {r.first_user}")
    print(f"{len(rows)} session(s), {sum(r.turns for r in rows)} turn(s), "
          f"{sum(r.side_turns for r in rows)} side request(s)")
    return 0


def _edit(args: argparse.Namespace, what: str, call: Any) -> tuple[bool, Any]:
    from tensorverse.store import RecordNotFound, Store, StoreVersionError

    try:
        with Store.open(_store_path(args)) as store:
            return True, call(store).result()
    except (FileNotFoundError, StoreVersionError, RecordNotFound, ValueError) as e:
        print(f"tensorverse sessions {what}: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return False, None


def _run_merge(args: argparse.Namespace) -> int:
    ok, n = _edit(args, "merge", lambda st: st.merge_sessions(args.into, args.other, reason=args.reason))
    if ok:
        print(f"merged {args.other} into {args.into}: {n} turn(s) moved (recorded in {args.into}'s edits)")
    return 0 if ok else 2


def _run_split(args: argparse.Namespace) -> int:
    ok, nid = _edit(args, "split", lambda st: st.split_session(args.session, args.at, reason=args.reason))
    if ok:
        print(f"split {args.session} at turn {args.at}: turns moved into {nid} (recorded in both sessions' edits)")
    return 0 if ok else 2
