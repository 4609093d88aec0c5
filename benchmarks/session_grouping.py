"""Sessions and turns for compacting turnstone conversations, grouped by the previous rule (exact
prefix only: git revision BASE's ``tensorverse/proxy/sessions.py``) and by the current one.

Runs real turnstone 1.9.0 (``tensorverse.testing.turnstone``: its cached Python 3.13 environment
and ``turnstone_drive.sh``) against the scripted chat server of the test suite, with a small context
window so that it compacts, records every request and answer in arrival order, then sends the
same sequence through both `Sessions` addons, driven as the proxy drives them
(``tensorverse.testing.grouping``). Prints a table and, last, one JSON object.

    .venv/bin/python benchmarks/session_grouping.py [--runs 2] [--rounds 8] [--base 937e4c2]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout

from benchmarks._targets import finish  # noqa: E402
from tensorverse.testing.grouping import Driver  # noqa: E402
from tensorverse.testing.turnstone import agent, scripted  # noqa: E402


def record(runs: int, rounds: int, window: int) -> list[tuple[dict, dict]]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = scripted.ScriptedChat(rounds=rounds)
    answers: list[tuple[dict, dict]] = []
    orig = server.answer

    def answer(body: dict) -> dict:
        a = orig(body)
        answers.append((body, a))
        return a

    server.answer = answer  # type: ignore[method-assign]
    runner, port = asyncio.run_coroutine_threadsafe(scripted.start(server), loop).result()
    files = {f"f{k}.txt": "\n".join(f"Gi0/0/{k}.{i} up up uplink to dist-{k}-{i}" for i in range(120)) for k in range(rounds)}
    with tempfile.TemporaryDirectory() as d:
        for n in range(runs):
            r = agent.drive(f"http://127.0.0.1:{port}/v1", "m", f"Read f0.txt to f{rounds - 1}.txt one by one "
                            f"and say which uplinks are up (run {n}).", Path(d) / f"run{n}", files=files,
                            context_window=window)
            if r.rc != 0:
                raise SystemExit(f"turnstone failed ({r.rc}): {r.stdout[-2000:]}")
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
    return answers


def old_sessions_class(base: str):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{base}:tensorverse/proxy/sessions.py"],
                         capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_loader("tv_old_sessions", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, "old_sessions.py", "exec"), mod.__dict__)
    return mod.Sessions


class BaseDriver(Driver):
    """The shared driver for revision BASE's `Sessions` (loaded from git): it builds that class, and
    hands it the answer where BASE read it too, the flow's free-form ``meta`` dict (the current
    rule reads the typed ``flow.acc``)."""

    def __init__(self, sessions_cls) -> None:
        self.sessions_cls = sessions_cls
        super().__init__()

    def new_sessions(self, store, **kw):
        return self.sessions_cls(store, **kw)

    def answer(self, f, acc) -> None:
        super().answer(f, acc)
        f.meta["acc"] = acc


def group(d: Driver, traffic: list[tuple[dict, dict]]) -> dict:
    flows = []
    for body, a in traffic:
        ans = {"role": "assistant", "content": a.get("content"),
               "tool_calls": [{"id": c["id"], "type": "function", "function": c["function"]} for c in a.get("tool_calls", [])]}
        flows.append(d.turn(body["messages"], ans, tools=body.get("tools")))
    sids: dict[str, int] = {}
    side = 0
    for f in flows:  # a side request linked after it was recorded is moved in the store: follow it
        sid = f.linked_to or f.session_id
        sids[sid] = sids.get(sid, 0) + 1
        side += f.turn_kind == "side"
    return {"sessions": len(sids), "turns": sum(sids.values()), "side_turns": side,
            "one_turn_sessions": sum(1 for v in sids.values() if v == 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--window", type=int, default=4500)
    ap.add_argument("--base", default="937e4c2")
    args = ap.parse_args()
    traffic = record(args.runs, args.rounds, args.window)
    compactions = sum(1 for b, _ in traffic if not b.get("tools") and "Compactor" in str(b["messages"][0]["content"]))
    before, after = group(BaseDriver(old_sessions_class(args.base)), traffic), group(Driver(), traffic)
    print(f"{args.runs} turnstone conversation(s), {len(traffic)} requests, {compactions} compaction summary request(s)")
    print(f"{'rule':<8} {'sessions':>8} {'turns':>6} {'side':>5} {'1-turn sessions':>16}")
    for name, r in (("before", before), ("after", after)):
        print(f"{name:<8} {r['sessions']:>8} {r['turns']:>6} {r['side_turns']:>5} {r['one_turn_sessions']:>16}")
    return finish("session_grouping", {"conversations": args.runs, "requests": len(traffic),
                                       "compaction_requests": compactions, "context_window": args.window,
                                       "before": before, "after": after})


if __name__ == "__main__":
    sys.exit(main())
