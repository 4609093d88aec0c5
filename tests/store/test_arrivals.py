"""Rows committed by this process announce themselves to in-process waiters (the shadow runner
waiting for a run's rows in the proxy), so that nobody polls the store for them."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tensorverse.store import Store
from tensorverse.store.arrivals import RowArrivals


def test_a_waiter_wakes_when_its_last_row_commits_from_another_thread(store):
    async def main():
        def writer():
            for p in range(4):
                time.sleep(0.05)
                store.write_rows("r1", [(p, b"row%d" % p)]).result()

        t0 = time.monotonic()
        th = threading.Thread(target=writer)
        th.start()
        got = await store.arrivals.wait("r1", [0, 1, 2, 3], timeout=10.0)
        waited = time.monotonic() - t0
        th.join()
        return got, waited

    got, waited = asyncio.run(main())
    assert got == {0, 1, 2, 3}
    assert waited < 5.0  # woken by the last commit, not by the 10 s timeout
    assert store.read_row("r1", 3) == b"row3"  # announced only once readable


def test_rows_committed_before_the_wait_are_found_at_once(store):
    store.write_rows("r1", [(0, b"a"), (1, b"b")]).result()

    async def main():
        return await store.arrivals.wait("r1", [0, 1], timeout=0.0)

    assert asyncio.run(main()) == {0, 1}


def test_a_timed_out_wait_returns_the_positions_that_did_arrive(store):
    store.write_rows("r1", [(0, b"a")]).result()

    async def main():
        t0 = time.monotonic()
        got = await store.arrivals.wait("r1", [0, 1, 2], timeout=0.2)
        return got, time.monotonic() - t0

    got, waited = asyncio.run(main())
    assert got == {0}
    assert 0.15 <= waited < 2.0


def test_compact_rows_count_only_for_a_waiter_that_accepts_them(store):
    store.write_rows("r1", [(0, b"full", None, False), (1, b"compact", None, True)]).result()

    async def main():
        return (await store.arrivals.wait("r1", [0, 1], timeout=0.05, compact=False),
                await store.arrivals.wait("r1", [0, 1], timeout=0.05, compact=True))

    full_only, either = asyncio.run(main())
    assert full_only == {0}
    assert either == {0, 1}


def test_a_compact_write_replaces_the_full_row_of_its_position():
    arr = RowArrivals()
    arr.add("r", full=[0, 1])
    arr.add("r", compact=[1])

    async def main():
        return await arr.wait("r", [0, 1], timeout=0.0, compact=False)

    assert asyncio.run(main()) == {0}


def test_a_write_refused_by_the_size_cap_announces_nothing(tmp_path):
    from tensorverse.store import StoreFullError

    st = Store.open(tmp_path / "small", durable=False, max_size=1 << 20)
    try:
        with pytest.raises(StoreFullError):
            st.write_rows("r1", [(0, b"x" * (4 << 20))]).result()
        assert not st.arrivals.knows("r1")
    finally:
        st.close()


def test_only_the_most_recent_runs_are_remembered():
    arr = RowArrivals(max_runs=2)
    arr.add("a", full=[0])
    arr.add("b", full=[0])
    arr.add("a", full=[1])  # touched: now the most recent
    arr.add("c", full=[0])
    assert (arr.knows("a"), arr.knows("b"), arr.knows("c")) == (True, False, True)
    arr.forget("a")
    assert not arr.knows("a")


def test_waiters_on_two_loops_are_each_woken():
    arr = RowArrivals()
    results: list[set[int]] = []

    def waiter():
        results.append(asyncio.run(arr.wait("r", [0, 1], timeout=10.0)))

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for th in threads:
        th.start()
    time.sleep(0.1)
    arr.add("r", full=[0])
    arr.add("r", full=[1])
    for th in threads:
        th.join(timeout=5)
    assert results == [{0, 1}, {0, 1}]


def test_remembered_positions_are_bounded_over_all_runs():
    arr = RowArrivals(max_runs=100, max_positions=10)
    arr.add("a", full=range(6))
    arr.add("b", full=range(6))  # 12 positions: the oldest run goes
    assert (arr.knows("a"), arr.knows("b")) == (False, True)
    arr.add("c", full=range(20))  # one run over the bound alone is kept: it is the one announced
    assert (arr.knows("b"), arr.knows("c")) == (False, True)
    arr.forget("c")
    arr.add("d", full=range(5))
    arr.add("e", full=range(5))
    assert (arr.knows("d"), arr.knows("e")) == (True, True)  # forgetting gave its positions back
