"""The LMDB store: records, indexes, retention, map growth, size cap, migrations, crash safety."""

from __future__ import annotations

import json

import asyncio
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import lmdb
import msgspec
import pytest

from tensorverse.store import RecordNotFound, Store, StoreFullError, StoreNotReadyError, StoreVersionError
from tensorverse.store import schema as S
from tensorverse.store.records import BackendInfo, ForcedComparison, Run, Session, Turn
from tensorverse.testing.records import store_session


def _session_with_turn(store: Store, sid: str, created_ns: int, turns: int = 1) -> list[str]:
    return store_session(store, sid, created_ns=created_ns, turns=turns, compare=("fp32", "primary"))


def test_a_dict_or_a_wrong_type_write_fails_and_stores_nothing(tmp_path: Path) -> None:
    from tensorverse.store.records import RecordError

    with Store.open(tmp_path / "s") as store:
        store.put_session(Session(id="s", created_ns=5, tags={"agent": "x"})).result()
        bad = [(lambda: store.put_turn({"id": "t", "session_id": "s", "index": 0}), "kind"),  # writes take records
               (lambda: store.put_turn(Turn(id="t", session_id="s", index="zero")), "type"),
               (lambda: store.put_turn(Turn(id="t", session_id="s", index="3")), "type"),  # a number as text
               (lambda: store.put_run(Run(id="r", turn_id="t", backend="b", mode=None)), "type"),  # no mode
               (lambda: store.put_comparison("r", "q", {"kl_mean": 0.1}), "kind"),
               (lambda: store.put_backend("b", BackendInfo(name="b", url=3)), "type"),
               (lambda: store.put_backend("b", {"url": "http://x/v1"}), "kind"),
               (lambda: store.put_session({"id": "s2"}), "kind"),
               (lambda: store.put_session(Turn(id="s")), "kind"),  # a turn is not a session
               # a Struct checks no types when built: its write does
               (lambda: store.put_run(Run(id="r", turn_id="t", backend="b", mode="forced", token_ids=["x"])), "type")]
        for put, reason in bad:
            with pytest.raises(RecordError) as e:
                put()  # raised on the caller's thread, before anything is queued
            assert e.value.reason == reason, e.value
        assert list(store.iter_turns("s")) == [] and store.get_session("s").turns == 0
        assert list(store.iter_backends()) == [] and [x["id"] for x in store.records("session")] == ["s"]
        assert list(store.records("run")) == [] and list(store.records("comparison")) == []
        # a typed record is stored with every field, defaults written out as a reader fills them in
        store.put_turn(Turn(id="t", session_id="s", index=0, created_ns=6)).result()
        store.put_run(Run(id="r", turn_id="t", backend="b", mode="forced", created_ns=7)).result()
        t, r = store.get_turn("t"), store.get_run("r")
        assert t.tool_calls == [] and t.kind == "main" and t.state is None and t.created_ns == 6
        assert r.status == "ok" and r.token_ids == [] and r.created_ns == 7
        want = {"id": "s", "created_ns": 5, "tags": {"agent": "x"}, "grouping": None, "endpoint": None, "turns": 1,
                "side_turns": 0, "tool_call_turns": 0, "updated_ns": None, "edits": [], "pinned": False, "split_from": None}
        assert msgspec.structs.replace(store.get_session("s"), updated_ns=None) == Session(**want)
        (stored,) = store.records("session")  # every field written out, as stored
        assert stored | {"updated_ns": None} == want


def test_a_number_a_writer_stored_as_text_still_reads_as_its_value(tmp_path: Path) -> None:
    """Reads are lax where writes are strict: a record an older writer stored with a number or a
    flag as text reads as the value (the write path refuses it since records are typed)."""
    with Store.open(tmp_path / "s") as store:
        store._put_json(S.SESSIONS, b"s", {"id": "s", "created_ns": "5", "pinned": "true"}).result()
        assert store.get_session("s") == Session(id="s", created_ns=5, pinned=True)


def test_a_typed_record_without_a_creation_time_gets_the_time_of_its_write(tmp_path: Path) -> None:
    """A typed record holds every field, and its default (0) of ``created_ns`` was stored as the
    creation time (replay's sessions and turns were stored as from 1970, the
    oldest of any store for retention by age and the viewer's order)."""
    with Store.open(tmp_path / "s") as store:
        before = time.time_ns()
        store.put_session(Session(id="s", tags={"case": "1"})).result()
        store.put_turn(Turn(id="t", session_id="s", index=0)).result()
        store.put_run(Run(id="r", turn_id="t", backend="b", mode="free")).result()
        store.put_run(Run(id="q", turn_id="t", backend="b", mode="forced", created_ns=5)).result()  # set: kept
        after = time.time_ns()
        got = [store.get_session("s").created_ns, store.get_turn("t").created_ns, store.get_run("r").created_ns]
        assert all(before <= c <= after for c in got), got
        assert store.get_run("q").created_ns == 5 and store.get_session("s").tags == {"case": "1"}


def test_forced_and_free_comparisons_are_separate_types_told_apart_by_mode(tmp_path: Path) -> None:
    from tensorverse.store import records
    from tensorverse.testing.records import tcomparison, tfree_comparison

    with pytest.raises(TypeError):  # a field of the other mode: no such record can be built
        tfree_comparison("r", "q", verdict="match", flips=[1])
    with pytest.raises(TypeError):
        tcomparison("r", "q", verdict="match")
    with Store.open(tmp_path / "s") as store:
        for put, reason in (
                (lambda: store.put_comparison("r", "q", {"mode": "free", "verdict": "match", "flips": [1]}), "kind"),
                (lambda: store.put_comparison("r", "q", {"mode": "forced", "verdict": "match"}), "kind"),
                (lambda: store.put_comparison("r", "q", records.ComparisonBase(run_id="r", ref_run_id="q",
                                                                               mode="sideways")), "mode"),
                (lambda: store.put_comparison("r", "q", tfree_comparison("r", "q", mode="forced")), "type")):
            with pytest.raises(records.RecordError) as e:
                put()  # a dict, or no such mode: refused before it is queued
            assert e.value.reason == reason, e.value
        assert store.comparison_keys("t") == [] and list(store.records("comparison")) == []
        store.put_comparison("f", "p", tcomparison("f", "p", flips=[2], n=5)).result()
        store.put_comparison("g", "p", tfree_comparison("g", "p", verdict="wrong_tool", first_flip=3)).result()
        # no mode: forced, as the records stored before free ones (written as they were, past put_comparison)
        store._put_json(S.COMPARISONS, S.comparison_key("h", "p"), {"run_id": "h", "ref_run_id": "p", "n": 4}).result()
        forced, free, old = (store.get_comparison(r, "p") for r in "fgh")
    assert type(forced) is records.ForcedComparison and (forced.mode, forced.flips, forced.n) == ("forced", [2], 5)
    assert type(free) is records.FreeComparison and (free.mode, free.verdict, free.first_flip) == ("free", "wrong_tool", 3)
    assert type(old) is records.ForcedComparison and old.n == 4
    assert not hasattr(free, "flips") and not hasattr(forced, "verdict")


def test_records_round_trip_and_indexes(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as store:
        store.put_backend("fp32", BackendInfo(name="fp32", url="http://127.0.0.1:1/v1", role="shadow")).result()
        tids = _session_with_turn(store, "sess-a", 2_000, turns=3)
        _session_with_turn(store, "sess-b", 1_000)

        assert store.get_backend("fp32").role == "shadow"
        assert [b.name for b in store.iter_backends()] == ["fp32"]
        assert [s.id for s in store.iter_sessions()] == ["sess-b", "sess-a"]  # time order
        assert [s.id for s in store.iter_sessions(since_ns=1_500)] == ["sess-a"]
        assert [s.id for s in store.iter_sessions(until_ns=1_500)] == ["sess-b"]
        assert store.get_session("sess-a").turns == 3
        assert [t.id for t in store.iter_turns("sess-a")] == tids
        assert sorted(r.backend for r in store.iter_runs(tids[0])) == ["fp32", "primary"]
        rows = store.read_rows(f"{tids[0]}-fp32")
        assert [p for p, _ in rows] == [0, 1, 2] and all(len(b) == 64 for _, b in rows)
        assert store.read_row(f"{tids[0]}-fp32", 1) == rows[1][1]
        assert store.get_comparison(f"{tids[0]}-fp32", f"{tids[0]}-primary").summary["kl_mean"] == 0.1
        with pytest.raises(RecordNotFound):
            store.get_turn("nope")
        with pytest.raises(RecordNotFound):
            store.read_row("nope", 0)


def test_turn_needs_its_session(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as store:
        with pytest.raises(RecordNotFound, match="session missing does not exist"):
            store.put_turn(Turn(id="t", session_id="missing", index=0)).result()
        with pytest.raises(ValueError, match="invalid run id"):
            store.write_rows("bad\x00id", [(0, b"x")])


def test_bad_operation_does_not_sink_its_batch(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as store:
        store.put_session(Session(id="ok", created_ns=1)).result()
        # Submitted back to back, these are committed as one group; the bad one must not
        # take the good ones down with it.
        futs = [store.put_turn(Turn(id=f"t{i}", session_id="ok", index=i)) for i in range(20)]
        bad = store.put_turn(Turn(id="m", session_id="missing", index=0))
        futs += [store.put_turn(Turn(id=f"u{i}", session_id="ok", index=20 + i)) for i in range(20)]
        assert all(f.result() for f in futs)
        with pytest.raises(RecordNotFound):
            bad.result()
        assert len(list(store.iter_turns("ok"))) == 40


def test_asyncio_callers_await_commits(tmp_path: Path) -> None:
    async def main(store: Store) -> list[str]:
        await asyncio.wrap_future(store.put_session(Session(id="s", created_ns=5)))
        futs = [asyncio.wrap_future(store.put_turn(Turn(id=f"t{i}", session_id="s", index=i))) for i in range(50)]
        return await asyncio.gather(*futs)

    with Store.open(tmp_path / "s") as store:
        assert asyncio.run(main(store)) == [f"t{i}" for i in range(50)]
        assert store.get_session("s").turns == 50


def test_paged_iteration_crosses_pages(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as store:
        for i in range(700):
            store.put_session(Session(id=f"s{i:04d}", created_ns=10 + i))
        store.write_rows("r", [(p, b"%d" % p) for p in range(600)]).result()
        assert [s.id for s in store.iter_sessions()] == [f"s{i:04d}" for i in range(700)]
        assert [p for p, _ in store.read_rows("r")] == list(range(600))
        # a time window across pages: [since, until), from the first page into the third
        window = [s.id for s in store.iter_sessions(since_ns=10 + 3, until_ns=10 + 650)]
        assert window == [f"s{i:04d}" for i in range(3, 650)]
        assert [s.id for s in store.iter_sessions(since_ns=10 + 699)] == ["s0699"]
        assert list(store.iter_sessions(since_ns=10 + 700)) == list(store.iter_sessions(until_ns=10)) == []
        store.delete_session("s0004").result()  # a deleted session is left out, the window goes on past it
        assert [s.id for s in store.iter_sessions(since_ns=10 + 3, until_ns=10 + 7)] == ["s0003", "s0005", "s0006"]


def test_a_compact_row_and_a_full_row_of_one_position_replace_each_other(tmp_path: Path) -> None:
    from tensorverse.store.stored_rows import RowCompacted, StoredRows
    from tensorverse.store.compact import compact_row, encode_compact
    import numpy as np

    x = np.arange(50, dtype=np.float32)
    blob = encode_compact(compact_row(x, k=4))
    with Store.open(tmp_path / "s") as store:
        store.write_rows("r", [(0, blob, None, True), (1, b"full-1")]).result()
        assert store.read_compact_rows("r") == [(0, blob)]
        assert store.read_rows("r") == [(1, b"full-1")]
        with pytest.raises(RowCompacted) as e:
            StoredRows(store).row("r", 0)
        assert e.value.compact.ids.tolist() == [49, 48, 47, 46]
        store.write_rows("r", [(0, b"full-0"), (1, blob, None, True)]).result()  # a retried capture, other forms
        assert store.read_rows("r") == [(0, b"full-0")]
        assert store.read_compact_rows("r") == [(1, blob)]


def test_retention_deletes_old_sessions_with_everything_below(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as store:
        old = _session_with_turn(store, "old", 1_000, turns=2)
        new = _session_with_turn(store, "new", 5_000)
        assert store.delete_older_than(2_000) == 1
        assert [s.id for s in store.iter_sessions()] == ["new"]
        with pytest.raises(RecordNotFound):
            store.get_turn(old[0])
        with pytest.raises(RecordNotFound):
            store.get_run(f"{old[0]}-fp32")
        assert store.read_rows(f"{old[1]}-primary") == []
        assert list(store.iter_comparisons(f"{old[0]}-fp32")) == []
        assert len(store.read_rows(f"{new[0]}-primary")) == 3
        entries = store.stats()["entries"]
        assert entries["turns"] == 1 and entries["runs"] == 2 and entries["rows"] == 6


def test_map_grows_without_losing_writes_under_concurrent_readers(tmp_path: Path) -> None:
    blob = os.urandom(200_000)  # about one encoded 151,936-wide row
    with Store.open(tmp_path / "s", map_size=1 << 20) as store:
        store.write_rows("seed", [(0, blob)]).result()
        stop = threading.Event()
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                while not stop.is_set():
                    assert store.read_rows("seed")[0][1] == blob
                    list(store.read_rows("grow"))
            except BaseException as exc:  # pragma: no cover - reported below  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        futs = [store.write_rows("grow", [(i, blob)]) for i in range(60)]
        assert all(f.result(timeout=60) == 1 for f in futs)
        stop.set()
        for t in threads:
            t.join()
        assert not errors, errors
        st = store.stats()
        assert st["map_grows"] >= 3 and st["map_size"] > 12 << 20
        assert [p for p, _ in store.read_rows("grow")] == list(range(60))
        assert all(b == blob for _, b in store.read_rows("grow"))
    with Store.open(tmp_path / "s", map_size=1 << 20) as again:  # reopen after growth
        assert len(again.read_rows("grow")) == 60


def test_size_cap_stops_writes_and_keeps_reads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blob = os.urandom(100_000)
    cap = 2 << 20
    with Store.open(tmp_path / "s", map_size=1 << 20, max_size=cap) as store:
        store.put_session(Session(id="s", created_ns=1)).result()
        written = 0
        with caplog.at_level("ERROR", logger="tensorverse.store"):
            for i in range(100):
                try:
                    store.write_rows("r", [(i, blob)]).result()
                    written += 1
                except StoreFullError:
                    break
        assert 5 <= written < 30
        st = store.stats()
        assert st["full"] and st["writes_refused"] == 1 and st["map_size"] <= cap
        assert "size cap" in caplog.text
        with pytest.raises(StoreFullError):
            store.write_rows("r", [(999, blob)]).result()
        assert store.stats()["writes_refused"] == 2
        # Reads keep working and nothing committed was lost.
        assert len(store.read_rows("r")) == written
        assert store.get_session("s").id == "s"


def test_file_modes_are_private(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as store:
        store.put_session(Session(id="s")).result()
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    for name in ("data.mdb", "lock.mdb"):
        assert stat.S_IMODE((tmp_path / "s" / name).stat().st_mode) == 0o600


def test_readonly_open_and_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError):
        Store.open(tmp_path / "none", readonly=True)
    with Store.open(tmp_path / "s") as store:
        store.put_session(Session(id="s", created_ns=3)).result()
        assert store.format_version == S.FORMAT_VERSION
    with Store.open(tmp_path / "s", readonly=True) as ro:
        assert ro.get_session("s").id == "s"
        with pytest.raises(PermissionError):
            ro.put_session(Session(id="x"))

    # A store written by a newer Tensorverse is refused with a clear message.
    env = lmdb.open(str(tmp_path / "s"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"99", db=env.open_db(S.META, txn=txn))
    env.close()
    with pytest.raises(StoreVersionError, match="newer than this Tensorverse"):
        Store.open(tmp_path / "s")


def test_readonly_open_of_a_store_being_created_waits_for_its_writer(tmp_path: Path) -> None:
    """A reader started beside a new proxy finds ``data.mdb`` before the writer's first commit:
    it waits for the format version instead of refusing the store as format ``None``."""
    path = tmp_path / "s"
    path.mkdir()
    lmdb.open(str(path), max_dbs=16).close()  # the file exists, nothing committed yet
    opened: list[Store] = []

    def writer() -> None:
        time.sleep(0.3)
        with Store.open(path) as w:
            w.put_session(Session(id="s", created_ns=3)).result()
            time.sleep(0.5)

    t = threading.Thread(target=writer)
    t.start()
    try:
        ro = Store.open(path, readonly=True, ready_timeout_s=10)
        opened.append(ro)
        assert ro.format_version == S.FORMAT_VERSION
    finally:
        t.join()
        for ro in opened:
            ro.close()
    with Store.open(path, readonly=True) as ro:
        assert ro.get_session("s").id == "s"


def test_readonly_open_of_a_store_never_created_is_refused_as_not_ready(tmp_path: Path) -> None:
    path = tmp_path / "s"
    path.mkdir()
    lmdb.open(str(path), max_dbs=16).close()
    t0 = time.monotonic()
    with pytest.raises(StoreNotReadyError):
        Store.open(path, readonly=True, ready_timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5


def test_migration_runs_once_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Store.open(tmp_path / "s") as store:
        store.put_session(Session(id="s", created_ns=3, tags={"env": "prod"})).result()

    calls: list[int] = []
    now = S.FORMAT_VERSION

    def step(txn: lmdb.Transaction, dbs: dict) -> None:  # e.g. a renamed tag
        import orjson

        calls.append(now + 1)
        raw = orjson.loads(txn.get(b"s", db=dbs[S.SESSIONS]))
        raw["tags"]["environment"] = raw["tags"].pop("env")
        txn.put(b"s", orjson.dumps(raw), db=dbs[S.SESSIONS])

    monkeypatch.setattr(S, "FORMAT_VERSION", now + 1)
    monkeypatch.setitem(S.MIGRATIONS, now, step)
    with Store.open(tmp_path / "s") as store:
        assert store.format_version == now + 1
        assert store.get_session("s").tags == {"environment": "prod"}
    with Store.open(tmp_path / "s") as store:  # already migrated: not run again
        assert store.format_version == now + 1
    assert calls == [now + 1]

    monkeypatch.setattr(S, "FORMAT_VERSION", now + 2)
    with pytest.raises(StoreVersionError, match=f"no migration from store format {now + 1}"):
        Store.open(tmp_path / "s")


def test_format_1_store_migrates_and_its_plain_json_turn_reads_with_its_logprobs(tmp_path: Path) -> None:
    """A store written by the format-1 code (fixtures/make_format1_store.py, run at commit
    1c87e80): its turn is plain JSON with the logprobs that recorder converted, and format 2 only
    adds compressed turns and ``upstream_logprobs``, so after the migration to the current format
    (through 2) the turn reads unchanged, from ``get_turn`` and ``iter_turns``; the session, runs,
    rows (bit-exact) and the comparison that code computed read too, each record as its type. A
    read-only open of the unmigrated copy refuses it."""
    import shutil


    from tensorverse.store import records
    from tensorverse.store.codec import blob_info, decode_row

    from tests.store.fixtures.fixture_rows import row

    turn_id = "1825b8c7f52e0000f1000000000001"
    primary = f"{turn_id}~primary"
    src = Path(__file__).parent / "fixtures" / "format1-store"
    shutil.copytree(src, tmp_path / "ro")
    env = lmdb.open(str(tmp_path / "ro"), max_dbs=16, readonly=True)
    with env.begin() as txn:  # as format 1 wrote it: JSON, not a zstd frame
        raw = bytes(txn.get(turn_id.encode(), db=env.open_db(S.TURNS, txn=txn, create=False)))
    env.close()
    assert json.loads(raw)["choices"][0]["logprobs"][1]["top"] == [[9, -0.5], [10, -1.0]]
    with pytest.raises(StoreVersionError, match="has format 1"):
        Store.open(tmp_path / "ro", readonly=True)
    shutil.copytree(src, tmp_path / "s")
    with Store.open(tmp_path / "s") as store:
        assert store.format_version == S.FORMAT_VERSION  # through 2 to the current format
        stored = {"id": "s1", "created_ns": 1_740_000_000_000_000_000, "updated_ns": 1_740_000_000_000_000_000,
                  "tags": {"agent": "turnstone", "case": "c1"}, "grouping": "header", "endpoint": "chat.completions",
                  "turns": 1}
        assert store.get_session("s1") == records.Session(**stored)
        assert list(store.records("session")) == [stored]  # no field added by the migrations
        choices = [{"index": 0, "text": "up.", "reasoning": None, "tool_calls": [], "finish_reason": "stop",
                    "stop_reason": None, "token_ids": [5, 9],
                    "logprobs": [{"token": 5, "logprob": -0.125, "top": [[5, -0.125], [6, -2.25]]},
                                 {"token": 9, "logprob": -0.5, "top": [[9, -0.5], [10, -1.0]]}]}]
        turn = store.get_turn(turn_id)
        assert [t.id for t in store.iter_turns("s1")] == [turn_id]
        for got in (turn, next(store.iter_turns("s1"))):
            assert got.choices == choices
        assert (turn.backend, turn.state, turn.prompt_token_ids, turn.output_token_ids, turn.text) == (
            "vllm-main", "ok", [1, 9, 4], [5, 9], "up.")
        assert "authorization" not in turn.request_headers
        assert type(turn) is records.Turn and turn.backend == "vllm-main"
        runs = {r.id: r for r in store.iter_runs(turn_id)}
        assert sorted(runs) == [primary, "r1-fp32-forced"]
        assert runs[primary].mode == "recorded" and runs[primary].pieces == ["up", "."]
        assert runs[primary].top_logprobs == [[[5, -0.125], [6, -2.25]], [[9, -0.5], [10, -1.0]]]
        forced = runs["r1-fp32-forced"]
        assert (forced.backend, forced.mode, forced.status, forced.capture, forced.token_ids) == (
            "fp32", "forced", "ok", "full", [5, 9])
        rows = store.read_rows("r1-fp32-forced")
        assert [p for p, _ in rows] == [0, 1]
        for (_, blob), want, mode in zip(rows, [row(5, 6), row(10, 9, 0.0625, plain=True)],
                                         ["bf16", "plain"]):
            assert decode_row(blob).tobytes() == want.tobytes() and blob_info(blob)["mode"] == mode
        c = store.get_comparison("r1-fp32-forced", primary)
        assert (c.kind, c.status, c.n, c.flips, c.metrics["top1_agree"]) == (
            "topk", "ok", 2, [1], [True, False])
        assert c.flip_tokens == [{"position": 1, "token": 9, "ref_top1": 9, "cand_top1": 10, "region": "content"}]
        assert type(c) is records.ForcedComparison and c.flips == [1]
        for kind in records.KINDS:
            for rec in store.records(kind):
                cls = records.record_type(kind, rec)
                assert records.unknown_fields(rec, cls) == [], (kind, rec)
                records.decode(rec, cls)
    env = lmdb.open(str(tmp_path / "s"), max_dbs=16, readonly=True)
    with env.begin() as txn:  # migrated once through every format
        meta = env.open_db(S.META, txn=txn, create=False)
        assert [v for v in range(2, S.FORMAT_VERSION + 1) if txn.get(b"migrated:%d" % v, db=meta) is None] == []
    env.close()


def test_turn_with_upstream_logprobs_reads_in_the_canonical_shape(tmp_path: Path) -> None:
    from tensorverse.jsonbytes import RawJSON
    from tensorverse.store import records

    upstream = [{"content": [{"token": "token_id:7", "logprob": -0.25, "bytes": [116],
                              "top_logprobs": [{"token": "token_id:7", "logprob": -0.25, "bytes": [116]},
                                               {"token": "b", "logprob": -1.5, "bytes": [98]}]}]},
                None, {"content": []}, {"content": [{"token": "x", "logprob": -2.0, "top_logprobs": []}]}]
    canonical = [{"token": 7, "logprob": -0.25, "top": [[7, -0.25], ["b", -1.5]]},
                 {"token": "x", "logprob": -2.0, "top": []}]
    turn = records.Turn(id="t", session_id="s", index=0, choices=[  # as the recorder writes it
        {"index": 0, "logprobs": None, "upstream_logprobs": RawJSON(json.dumps(upstream).encode())}])
    with Store.open(tmp_path / "s") as store:
        store.put_session(Session(id="s", created_ns=3)).result()
        store.put_turn(turn).result()
        for got in (store.get_turn("t"), next(store.iter_turns("s"))):
            assert got.choices == [{"index": 0, "logprobs": canonical}]
    # stored as a zstd frame of the JSON, not the JSON itself
    env = lmdb.open(str(tmp_path / "s"), max_dbs=16, readonly=True)
    with env.begin() as txn:
        raw = txn.get(b"t", db=env.open_db(S.TURNS, txn=txn, create=False))
    env.close()
    assert raw[:4] == b"\x28\xb5\x2f\xfd" and b"token_id:7" not in raw
    import zstandard

    assert json.loads(zstandard.ZstdDecompressor().decompress(raw))["choices"][0]["upstream_logprobs"] == upstream


_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from tensorverse.store import Store
    from tensorverse.store.records import Run, Session
    store = Store.open(sys.argv[1], map_size=1 << 20)
    store.put_session(Session(id="s", created_ns=1)).result()
    i = 0
    while True:
        # a record = a turn with its rows, each row carrying its record number
        rid = "run-%06d" % i
        store.write_rows(rid, [(p, (b"%06d:" % i) * 5000) for p in range(4)]).result()
        store.put_run(Run(id=rid, turn_id="t", backend="b", mode="forced",
                          positions=[0, 1, 2, 3])).result()
        print(i, flush=True)
        i += 1
    """
)


def test_sigkill_mid_stream_leaves_only_whole_records(tmp_path: Path) -> None:
    path = tmp_path / "crash"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    acked = -1
    deadline = time.monotonic() + 60
    while acked < 40 and time.monotonic() < deadline:  # let it commit, then kill mid-write
        acked = int(child.stdout.readline())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert acked >= 40

    with Store.open(path) as store:
        runs = {r.id: r for r in store.iter_runs("t")}
        # Every acknowledged record is intact...
        for i in range(acked + 1):
            rid = "run-%06d" % i
            assert runs[rid].positions == [0, 1, 2, 3]
        # ...and no partial one is visible: each row set is complete and self-consistent.
        for rid in runs:
            rows = store.read_rows(rid)
            assert [p for p, _ in rows] == [0, 1, 2, 3]
            i = int(rid.split("-")[1])
            assert all(b == (b"%06d:" % i) * 5000 for _, b in rows)
        rows_only = {k.split(b"\x00")[0] for k in _row_keys(store)}
        for rid in rows_only:  # rows written, run record not yet: still 4 whole rows
            assert len(store.read_rows(rid.decode())) == 4
        store.put_session(Session(id="after", created_ns=2)).result()  # writable again


def _row_keys(store: Store) -> list[bytes]:
    return [k for k, _ in store._paged(S.ROWS, b"")]


_GROWER = textwrap.dedent(
    """
    import os, sys
    from tensorverse.store import Store
    store = Store.open(sys.argv[1], map_size=1 << 20)
    store.write_rows("other", [(i, os.urandom(100_000)) for i in range(100)]).result()
    assert store.stats()["map_grows"] >= 3
    store.close()
    """
)


def test_map_grown_by_another_process_is_adopted(tmp_path: Path) -> None:
    """Two processes on one store (e.g. the proxy and a capture plugin's `dir:` sink)."""
    with Store.open(tmp_path / "s", map_size=1 << 20) as store:
        store.write_rows("mine", [(0, b"x")]).result()
        subprocess.run([sys.executable, "-c", _GROWER, str(tmp_path / "s")], check=True, timeout=120)
        assert len(store.read_rows("other")) == 100  # reader adopts the grown map
        store.write_rows("mine", [(1, os.urandom(100_000))]).result()  # so does the writer
        assert [p for p, _ in store.read_rows("mine")] == [0, 1]


def test_turn_stamp_changes_with_everything_below_the_turn(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as store:
        (tid,) = _session_with_turn(store, "s", 1)
        first = store.turn_stamp(tid)
        assert first is not None and store.turn_stamp(tid) == first  # stable while unchanged
        assert store.turn_stamp("missing") is None
        store.write_rows(f"{tid}-fp32", [(9, b"row")]).result()
        assert store.turn_stamp(tid) == first  # rows are not part of a view's inputs
        store.put_run(Run(id=f"{tid}-fp32", turn_id=tid, backend="fp32", mode="free")).result()
        second = store.turn_stamp(tid)
        assert second != first  # a run replaced in place
        store.put_comparison(f"{tid}-fp32", f"{tid}-primary",
                             ForcedComparison(run_id=f"{tid}-fp32", ref_run_id=f"{tid}-primary",
                                              summary={"kl_mean": 0.2})).result()
        third = store.turn_stamp(tid)
        assert third != second
        store.put_backend("fp16", BackendInfo(name="fp16", url="http://x/v1")).result()
        assert store.turn_stamp(tid) != third


def test_format_2_store_migrates_to_3_and_rows_gain_engine_states(tmp_path: Path) -> None:
    """A store written by the format-2 code (fixtures/make_format2_store.py, run at commit
    c5adb6f) opens, migrates to the current format once (through 3), reads its rows unchanged with no engine state, and then
    takes rows with engine states; a read-only open of the unmigrated copy refuses it."""
    import shutil

    import numpy as np

    from tensorverse.store.codec import decode_row, encode_row
    from tensorverse.store.engine_state import RUNNER_V1, EngineState

    src = Path(__file__).parent / "fixtures" / "format2-store"
    shutil.copytree(src, tmp_path / "ro")
    with pytest.raises(StoreVersionError, match="has format 2"):
        Store.open(tmp_path / "ro", readonly=True)
    shutil.copytree(src, tmp_path / "s")
    with Store.open(tmp_path / "s") as store:
        assert store.format_version == S.FORMAT_VERSION
        rows = store.read_rows("r2")
        assert [p for p, _ in rows] == [0, 1, 2]
        np.testing.assert_array_equal(decode_row(rows[2][1]), np.arange(16, dtype=np.float32) * 3)
        assert store.get_run("r2").token_ids == [4, 5, 6]
        assert store.read_engine_states("r2") == {} and store.read_engine_state("r2", 0) is None
        st = EngineState(runner=RUNNER_V1, step=7, batch_size=3, row=1, joined=0)
        store.write_rows("r2", [(3, encode_row(np.ones(16, np.float32)), st),
                                (0, rows[0][1])]).result()
        assert store.read_engine_states("r2") == {3: st}
    with Store.open(tmp_path / "s") as store:  # migrated once; the history says when
        assert store.format_version == S.FORMAT_VERSION and store.read_engine_state("r2", 3) == st
    with Store.open(tmp_path / "s", readonly=True) as store:
        assert store.read_engine_state("r2", 3).as_dict() == {
            "runner": "v1", "step": 7, "batch_size": 3, "row": 1, "joined": 0,
            "context_tokens": None, "prefill_reqs": None, "tp": None, "pp": None}
    env = lmdb.open(str(tmp_path / "s"), max_dbs=16, readonly=True)
    with env.begin() as txn:
        assert txn.get(b"migrated:3", db=env.open_db(S.META, txn=txn, create=False)) is not None
    env.close()


def test_format_3_store_migrates_to_4_with_one_name_per_field(tmp_path: Path) -> None:
    """A store written by the format-3 code (fixtures/make_format3_store.py, run at commit
    d4d4627): the turn ``tensorverse replay`` wrote with ``primary`` reads with ``backend`` after
    the migration, every record decodes as its type, and rows, engine states and comparisons are
    unchanged."""
    import shutil

    import numpy as np

    from tensorverse.store import records
    from tensorverse.store.codec import decode_row

    src = Path(__file__).parent / "fixtures" / "format3-store"
    shutil.copytree(src, tmp_path / "ro")
    with pytest.raises(StoreVersionError, match="has format 3"):
        Store.open(tmp_path / "ro", readonly=True)
    shutil.copytree(src, tmp_path / "s")
    with Store.open(tmp_path / "s") as store:
        assert store.format_version == S.FORMAT_VERSION  # through 4 to the current format
        proxy, replay = list(store.iter_turns("s3"))
        stored = {t["id"]: t for t in store.records("turn")}  # the field renamed in the stored dict
        assert "primary" not in stored[replay.id] and replay.backend == "reference-b" == replay.reference
        assert proxy.backend == "vllm-main" and proxy.text == "abc"
        assert type(replay) is records.Turn and replay.output_token_ids == [7, 8]
        assert store.get_session("s3").turns == 2 and store.get_session("s3").tags == {"case": "c1"}
        rows = store.read_rows("r3")
        np.testing.assert_array_equal(decode_row(rows[0][1]), np.arange(16, dtype=np.float32))
        assert store.read_engine_state("r3", 0).step == 2 and store.read_engine_state("r3", 1) is None
        assert store.get_comparison("r3", "t3-proxy~primary").flips == [1]
        for kind in records.KINDS:
            for rec in store.records(kind):
                cls = records.record_type(kind, rec)
                assert records.unknown_fields(rec, cls) == [], (kind, rec)
                records.decode(rec, cls)


def test_engine_state_is_replaced_and_deleted_with_its_row(tmp_path: Path) -> None:
    from tensorverse.store.engine_state import RUNNER_V2, EngineState

    st = EngineState(runner=RUNNER_V2, step=1, batch_size=2, row=0, joined=2, context_tokens=40,
                     prefill_reqs=2)
    with Store.open(tmp_path / "s") as store:
        store.put_session(Session(id="s", created_ns=5)).result()
        store.put_turn(Turn(id="t", session_id="s", index=0)).result()
        store.put_run(Run(id="r", turn_id="t", session_id="s", backend="b", mode="forced")).result()
        store.write_rows("r", [(0, b"x", st), (1, b"y", st)]).result()
        store.write_rows("r", [(1, b"y2")]).result()  # rewritten without a state: it has none
        assert store.read_engine_states("r") == {0: st}
        assert store.delete_session("s").result()
        assert store.read_engine_states("r") == {} and store.read_rows("r") == []


def test_the_record_factories_write_whole_valid_sessions(tmp_path: Path) -> None:
    from tensorverse.testing.records import T0, tcomparison, trun, tsession, tturn

    with Store.open(tmp_path / "s") as store:
        tids = store_session(store, "a", turns=2, runs=(("fp8", "forced"), ("fp8", "free")),
                             run_id="{turn}-{backend}-{mode}", compare=None)
        assert tids == ["a-t0", "a-t1"] and store.get_session("a").turns == 2
        assert sorted(r.id for r in store.iter_runs("a-t1")) == ["a-t1-fp8-forced", "a-t1-fp8-free"]
        assert [p for p, _ in store.read_rows("a-t0-fp8-free")] == [0, 1, 2]
        t = store.get_turn("a-t1")
        assert t.created_ns == T0 + 1 and t.state == "ok" and t.output_token_ids == [4, 5, 6]
    # overriding any field; an unknown one is refused as any write would refuse it
    assert tturn(index=3, text="hi").text == "hi" and tsession(pinned=True).pinned
    assert trun(status="failed").ok is False and tcomparison(flips=[2]).flips == [2]
    with pytest.raises(TypeError):
        tturn(colour="red")


def test_the_comparison_index_lists_compared_turns_by_session_time_across_pages(tmp_path: Path) -> None:
    """What the verdict's refresh walks: every turn with comparisons, under its current session,
    sessions oldest first, turns in index order, from the indexes alone; a session gone is gone,
    and a store of more sessions than one read transaction's page is walked whole."""
    from tensorverse.store.base import _PAGE
    from tensorverse.testing.records import T0

    with Store.open(tmp_path / "s", durable=False) as store:
        n = _PAGE + 44  # more than one page of sessions
        for i in range(n):  # created newest first: the index orders them by time, not by write
            store_session(store, f"s{i:03d}", created_ns=T0 + (n - i) * 10, turns=2, rows=0,
                          compare=("fp32", "primary") if i % 3 == 0 else None)
        store_session(store, "quiet", turns=3, rows=0)  # recorded, never compared
        want = [(f"s{i:03d}", f"s{i:03d}-t{k}", [(f"s{i:03d}-t{k}-fp32", f"s{i:03d}-t{k}-primary")])
                for i in reversed(range(n)) if i % 3 == 0 for k in range(2)]
        assert list(store.comparison_index()) == want
        store.delete_session("s000").result()
        store.move_turn("s003-t1", "s006").result()  # a turn moved by hand: listed under its new session
        got = list(store.comparison_index())
        assert [t for _, t, _ in got if t.startswith("s000")] == []
        assert ("s006", "s003-t1") in [(s, t) for s, t, _ in got] and len(got) == len(want) - 2
