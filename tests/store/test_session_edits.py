"""Merging and splitting sessions by hand (`Store.merge_sessions`, `Store.split_session`,
`tensorverse sessions`): turns move with their runs, counters follow, every change is recorded."""

from __future__ import annotations

import orjson
import pytest

from tensorverse.cli import main
from tensorverse.store import RecordNotFound, Store
from tensorverse.testing.records import trun, tsession, tturn


def _turn(sid, i, kind="main", calls=False, text="hello", tid=None):
    req = {"messages": [{"role": "user", "content": f"{text} from 10.1.2.3"}]}
    return tturn(tid or f"{sid}-t{i}", sid, i, endpoint="chat.completions", kind=kind, request=req,
                 tool_calls=[{"function": {"name": "f", "arguments": "{}"}}] if calls else [])


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "s") as st:
        for sid, n in (("a", 3), ("b", 2)):
            st.put_session(tsession(sid, created_ns=1000 if sid == "a" else 2000, grouping="prefix")).result()
            for i in range(n):
                st.put_turn(_turn(sid, i, kind="side" if (sid, i) == ("b", 1) else "main", calls=i == 0,
                                  text=f"task {sid}")).result()
        st.put_run(trun("run-b0", "b-t0", "fp32", "forced")).result()
        yield st


def test_counters(store):
    a, b = store.get_session("a"), store.get_session("b")
    assert (a.turns, a.side_turns, a.tool_call_turns) == (3, 0, 1)
    assert (b.turns, b.side_turns, b.tool_call_turns) == (2, 1, 1)


def test_merge_is_recorded_and_moves_turns_with_their_runs(store):
    assert store.merge_sessions("a", "b", reason="one conversation").result() == 2
    with pytest.raises(RecordNotFound):
        store.get_session("b")
    a = store.get_session("a")
    assert (a.turns, a.side_turns, a.tool_call_turns) == (5, 1, 2)
    [edit] = a.edits
    assert edit["op"] == "merge" and edit["from_session"] == "b" and edit["reason"] == "one conversation"
    assert [t["from_index"] for t in edit["turns"]] == [0, 1] and edit["deleted_sessions"][0]["id"] == "b"
    turns = list(store.iter_turns("a"))
    assert [t.id for t in turns] == ["a-t0", "a-t1", "a-t2", "b-t0", "b-t1"]
    assert turns[3].index == 3 and turns[3].moved_from[0]["session_id"] == "b"
    assert [r.id for r in store.iter_runs("b-t0")] == ["run-b0"]
    assert list(store.iter_turns("b")) == []


def test_split_is_recorded_and_renumbers(store):
    nid = store.split_session("a", 1, reason="two tasks").result()
    a, n = store.get_session("a"), store.get_session(nid)
    assert a.turns == 1 and n.turns == 2 and n.grouping == "split" and n.split_from == "a"
    assert a.edits[0]["op"] == "split" and a.edits[0]["to_session"] == nid
    assert [t.index for t in store.iter_turns(nid)] == [0, 1]
    assert [t.id for t in store.iter_turns(nid)] == ["a-t1", "a-t2"]
    # a proxy that still writes turn 1 of "a" (it does not know of the split) gets a free index
    store.put_turn(_turn("a", 1)).result()
    assert [t.index for t in store.iter_turns("a")] == [0, 1]
    with pytest.raises(ValueError):
        store.split_session("a", 9).result()


def test_edited_sessions_and_turns_hold_only_declared_fields(store):
    """A split wrote ``split_from``, which no record type declared: typed reads dropped it. Every
    field an edit writes is declared, so it reads back."""
    from tensorverse.store import records

    nid = store.split_session("a", 1, reason="two tasks").result()
    store.merge_sessions(nid, "b", reason="one conversation").result()
    store.pin_session(nid).result()
    for kind in ("session", "turn", "run"):
        for rec in store.records(kind):
            assert records.unknown_fields(rec, records.record_type(kind, rec)) == [], (kind, rec)
    assert store.get_session(nid).split_from == "a" and store.get_session(nid).pinned


def test_put_turn_never_overwrites_an_index_held_by_another_turn(store):
    store.put_turn(_turn("a", 0, tid="late")).result()
    assert [x.id for x in store.iter_turns("a")] == ["a-t0", "a-t1", "a-t2", "late"]
    assert store.get_turn("late").index_requested == 0


def test_cli_list_merge_split(store, tmp_path, capsys):
    path = str(store.path)
    store.close()
    assert main(["sessions", "--store", path]) == 0
    out = capsys.readouterr().out
    assert "task a from" in out and "10.1.2.3" not in out  # scrubbed
    assert "2 session(s), 5 turn(s), 1 side request(s)" in out
    assert main(["sessions", "merge", "a", "b", "--store", path, "--reason", "same"]) == 0
    assert "2 turn(s) moved" in capsys.readouterr().out
    assert main(["sessions", "split", "a", "--at", "3", "--store", path]) == 0
    capsys.readouterr()
    assert main(["sessions", "list", "--json", "--store", path]) == 0
    rows = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["turns"], r["edits"]) for r in rows] == [(3, 2), (2, 1)]
    assert main(["sessions", "merge", "a", "nope", "--store", path]) == 2
