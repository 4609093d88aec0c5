"""Real turnstone through the recording proxy, against a scripted chat server (fast and
deterministic: `tensorverse.testing.turnstone.scripted`), long enough to compact: one session per
conversation, side requests (title, compaction summaries) linked and marked, counters and turn
indices whole.

Marked ``turnstone``: the first run creates turnstone's Python 3.13 environment (pyenv's 3.13,
turnstone 1.9.0 from PyPI; cached), so `make test-fast` leaves it out."""

from __future__ import annotations

import pytest

from tensorverse.testing.turnstone import agent, scripted


pytestmark = pytest.mark.turnstone

FILES = {f"f{k}.txt": "\n".join(f"Gi0/0/{k}.{i} up up uplink to dist-{k}-{i}" for i in range(120)) for k in range(8)}


def test_compacting_turnstone_conversations_are_one_session_each(loop, make_proxy, settle, tmp_path):
    server = scripted.ScriptedChat(rounds=8)
    runner, port = loop.run(scripted.start(server))
    try:
        proxy = make_proxy(f"http://127.0.0.1:{port}")
        runs = [agent.drive(f"{proxy.url}/v1", "m", f"Read f0.txt to f7.txt one by one and say which uplinks "
                            f"are up (run {n}).", tmp_path / f"run{n}", files=FILES, context_window=4500)
                for n in range(2)]
    finally:
        loop.run(runner.cleanup())
    assert [r.rc for r in runs] == [0, 0], [r.stdout[-1500:] for r in runs]

    settle(proxy)
    sessions = list(proxy.store.iter_sessions())
    turns = {s.id: list(proxy.store.iter_turns(s.id)) for s in sessions}
    compactions = [r for r in server.requests if not r.get("tools") and "Compactor" in str(r["messages"][0]["content"])]
    assert compactions, "turnstone did not compact: the test proves nothing"
    assert len(sessions) == 2, _describe(turns)
    for s in sessions:
        ts = turns[s.id]
        side = [t for t in ts if t.kind == "side"]
        main = [t for t in ts if t.kind == "main"]
        assert all(not t.tools_offered for t in side) and all(t.tools_offered for t in main)
        assert any("title generator" in t.request["messages"][0]["content"] for t in side), _describe(turns)
        assert any("Compactor" in t.request["messages"][0]["content"] for t in side)
        assert any(t.grouping["evidence"] == "compaction" for t in main)
        assert s.side_turns == len(side) and s.tool_call_turns == sum(bool(t.tool_calls) for t in main)
        assert [t.index for t in ts] == list(range(len(ts)))
    assert sum(len(v) for v in turns.values()) == len(server.requests)


def _describe(turns: dict) -> str:
    """What each session holds, for a failure message."""
    lines = []
    for sid, ts in turns.items():
        lines.append(sid)
        for t in ts:
            msgs = t.request["messages"]
            lines.append(f"  {t.index} {t.kind} {t.grouping} tools={t.tools_offered} "
                         f"{[(m['role'], str(m.get('content'))[:30]) for m in msgs][:2]} n={len(msgs)}")
    return "\n".join(lines)
