import threading
import time

import numpy as np
import pytest
import torch

from tensorverse.capture.sink import MemorySink
from tensorverse.capture.tap import Tap, force_tokens
from tensorverse.store.codec import decode_row
from tensorverse.testing.evidence_rows import DECISIONS, FORCED, evidence_rows

V = 1000


def _logits(n=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g) * 3).to(dtype)


def _as_f32(arr):
    if arr.dtype == np.uint16:  # bfloat16 bit patterns
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_are_copied_before_masking_and_arrive_exact(dtype):
    sink = MemorySink()
    tap = Tap(sink, max_rows=8)
    logits = _logits(dtype=dtype)
    raw = logits.clone()
    slots = [tap.copy_row(logits, r) for r in (1, 3)]
    tap.mark_copied(slots)
    force_tokens(logits, [1, 3], [5, 7])  # the engine masks the rows right after the copy
    tap.submit(slots[0], "run-a", 0)
    tap.submit(slots[1], "run-b", 4)
    assert tap.flush(10)
    frames = sorted(sink.frames, key=lambda f: f.capture_id)
    assert [(f.capture_id, f.position) for f in frames] == [("run-a", 0), ("run-b", 4)]
    assert [f.seq for f in sorted(sink.frames, key=lambda f: f.seq)] == [1, 2]
    assert {f.origin for f in frames} == {tap.origin}
    for f, r in zip(frames, (1, 3)):
        got = _as_f32(decode_row(f.blob))
        assert np.array_equal(got, raw[r].float().numpy())  # raw, not the masked row
    s = tap.stats()
    assert s["rows_captured"] == 2 and s["rows_encoded"] == 2 and s["rows_shipped"] == 2
    assert s["rows_dropped"] == 0 and s["bytes_encoded"] == s["bytes_shipped"] > 0
    assert s["queue_depth"] == 0
    tap.close()


def test_capture_helper_and_buffer_reuse():
    sink = MemorySink()
    tap = Tap(sink, max_rows=2)
    for step in range(5):
        logits = _logits(seed=step)
        assert tap.capture(logits, [(0, "r", step), (2, "q", step)]) == 2
        assert tap.flush(10)
    assert len(sink.frames) == 10
    assert tap.stats()["buffers"] == 2  # buffers are reused, not reallocated
    tap.close()


def test_full_pool_drops_and_never_blocks():
    gate = threading.Event()

    def slow_encoder(arr, dtype):
        gate.wait(10)
        return arr.tobytes()

    sink = MemorySink()
    tap = Tap(sink, max_rows=2, encoder=slow_encoder)
    logits = _logits()
    t0 = time.monotonic()
    taken = [tap.copy_row(logits, r) for r in range(4)]
    for s in taken:
        if s is not None:
            tap.submit(s, "r", 0)
    assert time.monotonic() - t0 < 1.0
    assert sum(s is not None for s in taken) == 2
    assert tap.stats()["dropped_no_buffer"] == 2
    assert tap.stats()["rows_dropped"] == 2
    gate.set()
    assert tap.flush(10)
    assert len(sink.frames) == 2
    # buffers came back: the next rows are taken again
    assert tap.capture(logits, [(0, "r", 1)]) == 1
    tap.close()


def test_encoder_failure_is_counted_and_the_thread_goes_on():
    calls = []

    def flaky(arr, dtype):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return b"ok"

    sink = MemorySink()
    tap = Tap(sink, encoder=flaky)
    tap.capture(_logits(), [(0, "r", 0), (1, "r", 1)])
    assert tap.flush(10)
    s = tap.stats()
    assert s["dropped_encode"] == 1 and s["errors"] == 1 and s["rows_shipped"] == 1
    assert [f.position for f in sink.frames] == [1]
    tap.close()


def test_sink_failure_is_counted_not_raised():
    sink = MemorySink(fail=True, retry_min_s=0.0)
    tap = Tap(sink)
    tap.capture(_logits(), [(0, "r", 0), (1, "r", 1)])
    assert tap.flush(10)
    s = tap.stats()
    assert s["dropped_sink"] == 2 and s["sink_errors"] >= 1 and s["rows_shipped"] == 0
    assert "memory sink set to fail" in s["last_sink_error"]
    sink.fail = False
    tap.capture(_logits(), [(0, "r", 2)])
    assert tap.flush(10)
    assert [f.position for f in sink.frames] == [2]
    tap.close()


def test_no_sink_drops_counted():
    tap = Tap(None)
    tap.capture(_logits(), [(0, "r", 0)])
    assert tap.flush(10)
    assert tap.stats()["dropped_sink"] == 1
    tap.close()


def test_bad_input_never_raises():
    tap = Tap(MemorySink())
    logits = _logits()
    assert tap.copy_row(logits, 99) is None  # index out of range
    assert tap.stats()["errors"] == 1
    tap.release(None)
    tap.close()
    assert tap.copy_row(logits, 0) is None  # closed


def test_release_discarded_returns_the_buffer():
    tap = Tap(MemorySink(), max_rows=1)
    logits = _logits()
    s = tap.copy_row(logits, 0)
    assert tap.copy_row(logits, 1) is None
    tap.release(s, discarded=True)
    assert tap.copy_row(logits, 1) is not None
    assert tap.stats()["rows_discarded"] == 1
    tap.close()


def test_copy_into_an_existing_slot_overwrites_it():
    sink = MemorySink()
    tap = Tap(sink, max_rows=1)
    a, b = _logits(seed=1), _logits(seed=2)
    s = tap.copy_row(a, 0)
    s2 = tap.copy_row(b, 0, s)  # same position recomputed (chunked prefill): reuse the buffer
    assert s2 is s
    tap.submit(s2, "r", 0)
    assert tap.flush(10)
    assert np.array_equal(decode_row(sink.frames[0].blob), b[0].numpy())
    tap.close()


def test_no_thread_until_first_row():
    tap = Tap(MemorySink())
    assert tap._thread is None
    force_tokens(_logits(), [0], [1])
    assert tap._thread is None and tap.flush(1)
    tap.close()


@pytest.mark.parametrize("n", [1, 3, 8])
def test_force_tokens(n):
    logits = _logits(n=10)
    raw = logits.clone()
    rows = list(range(0, 10, 10 // n))[:n]
    toks = [(7 * r + 3) % V for r in rows]
    force_tokens(logits, rows, toks)
    for r, t in zip(rows, toks):
        assert int(logits[r].argmax()) == t
        assert logits[r, t] == 0.0
        assert torch.isneginf(logits[r]).sum() == V - 1
        p = torch.softmax(logits[r] / 0.7, dim=-1)
        assert p[t] == 1.0
    untouched = [r for r in range(10) if r not in rows]
    assert torch.equal(logits[untouched], raw[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_numpy_copy_is_bit_exact_including_odd_values(dtype):
    """The CPU copy goes through numpy for float32/bf16/f16 (torch for other dtypes): NaN
    payloads, -0.0, infinities and subnormals survive bit for bit, and strided rows too."""
    sink = MemorySink()
    tap = Tap(sink, max_rows=8)
    base = _logits(3, torch.float32, seed=5)
    base[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")])
    base[0, 4] = 1e-40  # subnormal in float32
    logits = base.to(dtype)
    strided = logits.t().contiguous().t()  # same values, non-contiguous rows
    assert tap.capture(logits, [(0, "c", 0)]) == 1
    assert tap.capture(strided, [(0, "s", 0)]) == 1
    assert tap.flush(10)
    want = logits[0].to(torch.float32) if dtype is torch.float64 else logits[0]
    if want.dtype is torch.bfloat16:
        want_bits = want.view(torch.int16).numpy().view(np.uint16)
    else:
        want_bits = want.numpy().view(np.uint32 if want.dtype is torch.float32 else np.uint16)
    for f in sink.frames:
        got = decode_row(f.blob)
        got_bits = got.view(np.uint32) if got.dtype == np.float32 else got.view(np.uint16)
        assert np.array_equal(got_bits, want_bits), f.capture_id
    tap.close()


def test_deferred_encoding_waits_for_a_pause_and_flush_covers_it():
    sink = MemorySink()
    tap = Tap(sink, max_rows=64, defer_s=1.0, poll_s=0.005)
    logits = _logits()
    for pos in range(5):  # rows arriving back to back: a request being decoded
        assert tap.capture(logits, [(pos % 4, "r", pos)]) == 1
        time.sleep(0.02)
    assert tap.stats()["rows_encoded"] == 0  # still arriving: nothing encoded yet
    deadline = time.monotonic() + 10
    while tap.stats()["rows_encoded"] < 5 and time.monotonic() < deadline:
        time.sleep(0.01)  # the pause: everything gets encoded without a flush
    assert tap.stats()["rows_encoded"] == 5
    # flush does not wait for a pause
    assert tap.capture(logits, [(1, "r", 5)]) == 1
    t0 = time.monotonic()
    assert tap.flush(10)
    assert time.monotonic() - t0 < 0.75  # a flush that waited for the pause would take 1 s
    assert sorted(f.position for f in sink.frames) == list(range(6))
    tap.close()


def test_deferred_encoding_drains_from_half_the_pool():
    sink = MemorySink()
    tap = Tap(sink, max_rows=8, defer_s=60.0, poll_s=0.005)
    logits = _logits()
    for pos in range(4):  # high water = 4
        assert tap.capture(logits, [(0, "r", pos)]) == 1
    deadline = time.monotonic() + 10
    while tap.stats()["rows_encoded"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tap.stats()["rows_encoded"] >= 1  # encoded although rows "keep arriving"
    assert tap.stats()["rows_dropped"] == 0
    tap.close()
    assert len(sink.frames) == 4  # close ships what is queued


def test_encoder_thread_runs_at_lower_priority_than_the_engine():
    import os

    seen = {}

    def enc(arr, dtype):
        tid = threading.get_native_id()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        from tensorverse.store.codec import encode_row
        return encode_row(arr, dtype=dtype)

    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    tap = Tap(MemorySink(), encoder=enc, nice=5)
    tap.capture(_logits(), [(0, "r", 0)])
    assert tap.flush(10)
    assert seen["nice"] == min(19, me + 5)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == me  # caller untouched
    tap.close()


def test_rows_with_an_evidence_spec_travel_compact_unless_they_are_evidence():
    from tensorverse.capture.optin import EvidenceSpec
    from tensorverse.store.compact import compact_row, decode_compact

    sink = MemorySink()
    tap = Tap(sink, max_rows=8)
    logits = torch.linspace(-5.0, -1.0, V).repeat(3, 1)
    logits[0, 11] = 9.0  # forced 11: agrees, clear: compact
    logits[1, 12] = 9.0  # forced 13: this runtime prefers 12, a flip: full
    logits[2, 14] = 9.0  # requested: full
    raw = logits.clone()
    specs = [EvidenceSpec(20, 0.1, 11, False), EvidenceSpec(20, 0.1, 13, False), EvidenceSpec(20, 0.1, 14, True)]
    assert tap.capture(logits, [(r, "run", r, None, specs[r]) for r in range(3)]) == 3
    force_tokens(logits, [0, 1, 2], [11, 13, 14])
    assert tap.flush(10)
    by_pos = {f.position: f for f in sink.frames}
    assert [by_pos[p].compact for p in range(3)] == [True, False, False]
    c = decode_compact(by_pos[0].blob)
    assert c.ids.tolist() == compact_row(raw[0].numpy()).ids.tolist() and c.ids[0] == 11
    for p in (1, 2):
        assert decode_row(by_pos[p].blob).tobytes() == raw[p].numpy().tobytes()
    s = tap.stats()
    assert (s["rows_compact"], s["rows_evidence"], s["rows_shipped"]) == (1, {"flip": 1, "requested": 1}, 3)
    assert s["bytes_shipped"] < 2 * V * 4 + 1000  # the compact row is a few hundred bytes
    tap.close()


def test_rows_sent_in_full_are_counted_once_each_under_their_reason():
    from tensorverse.capture.optin import EvidenceSpec

    sink = MemorySink()
    tap = Tap(sink, max_rows=8)
    logits = torch.linspace(-5.0, -1.0, V).repeat(4, 1)
    logits[:3, 12] = 9.0  # forced 13, this runtime prefers 12: three flips
    logits[3, 14] = 9.0  # requested
    specs = [EvidenceSpec(20, 0.1, 13, False)] * 3 + [EvidenceSpec(20, 0.1, 14, True)]
    assert tap.capture(logits, [(r, "run", r, None, specs[r]) for r in range(4)]) == 4
    assert tap.flush(10)
    assert tap.stats()["rows_evidence"] == {"flip": 3, "requested": 1}
    assert [f.compact for f in sorted(sink.frames, key=lambda f: f.position)] == [False] * 4
    tap.close()


# -- the counters: every row the tap takes is shipped or counted where it was lost ------------


class CountingSink(MemorySink):
    """A memory sink that counts its flush attempts and can fail them, or break in a way the
    sink protocol does not allow (a bug in a sink)."""

    def __init__(self, fail=False, broken=False, refuse_put=False):
        super().__init__(fail=fail, retry_min_s=0.0, retry_max_s=0.0)
        self.attempts = 0
        self.broken = broken
        self.refuse_put = refuse_put

    def put(self, frame):
        if self.refuse_put:
            raise MemoryError("no room for the frame")
        super().put(frame)

    def flush(self):
        if self.pending():
            self.attempts += 1
        if self.broken:
            self._buf, self._buf_bytes = [], 0
            raise TypeError("a sink bug")
        return super().flush()


def test_rows_without_an_evidence_spec_travel_as_full_frames():
    sink = MemorySink()
    tap = Tap(sink)
    assert tap.capture(_logits(), [(0, "r", 0), (1, "r", 1)]) == 2
    assert tap.flush(10)
    assert [f.compact for f in sink.frames] == [False, False]
    assert tap.stats()["rows_compact"] == 0
    tap.close()


def test_every_failed_encode_is_one_dropped_row_and_one_error():
    def broken(arr, dtype):
        raise RuntimeError("boom")

    tap = Tap(MemorySink(), encoder=broken)
    tap.capture(_logits(), [(r, "r", r) for r in range(3)])
    assert tap.flush(10)
    s = tap.stats()
    assert (s["rows_encoded"], s["dropped_encode"], s["rows_dropped"], s["errors"]) == (0, 3, 3, 3)
    assert s["queue_depth"] == 0  # a failed row is done with, not left queued
    tap.close()


def test_queue_depth_counts_the_rows_not_yet_encoded():
    go = threading.Semaphore(0)

    def one_at_a_time(arr, dtype):
        go.acquire(timeout=10)
        return arr.tobytes()

    tap = Tap(MemorySink(), encoder=one_at_a_time, max_rows=8)
    tap.capture(_logits(), [(r, "r", r) for r in range(4)])
    assert tap.stats()["queue_depth"] == 4
    go.release()
    deadline = time.monotonic() + 10
    while tap.stats()["rows_encoded"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert tap.stats()["queue_depth"] == 3
    for _ in range(3):
        go.release()
    assert tap.flush(10)
    assert tap.stats()["queue_depth"] == 0
    tap.close()


def test_every_row_without_a_sink_is_counted_dropped():
    tap = Tap(None)
    tap.capture(_logits(), [(r, "r", r) for r in range(3)])
    assert tap.flush(10)
    s = tap.stats()
    assert (s["rows_encoded"], s["dropped_sink"], s["rows_dropped"], s["errors"]) == (3, 3, 3, 0)
    tap.close()


def test_a_sink_that_refuses_frames_counts_each_row_dropped_and_an_error():
    tap = Tap(CountingSink(refuse_put=True))
    tap.capture(_logits(), [(r, "r", r) for r in range(3)])
    assert tap.flush(10)
    s = tap.stats()
    assert (s["rows_shipped"], s["dropped_sink"], s["rows_dropped"], s["errors"]) == (0, 3, 3, 3)
    tap.close()


def test_shipped_rows_and_bytes_add_up_over_batches():
    sink = MemorySink()
    tap = Tap(sink)
    tap.capture(_logits(seed=1), [(0, "r", 0), (1, "r", 1)])
    assert tap.flush(10)
    tap.capture(_logits(seed=2), [(r, "r", 2 + r) for r in range(3)])
    assert tap.flush(10)
    assert sink.batches >= 2
    s = tap.stats()
    assert s["rows_shipped"] == 5
    assert s["bytes_shipped"] == s["bytes_encoded"] == sum(len(f.blob) for f in sink.frames)
    tap.close()


def test_each_failed_flush_counts_one_sink_error_and_drops_its_rows():
    sink = CountingSink(fail=True)
    tap = Tap(sink)
    tap.capture(_logits(), [(0, "r", 0), (1, "r", 1)])
    assert tap.flush(10)
    tap.capture(_logits(), [(r, "r", 2 + r) for r in range(3)])
    assert tap.flush(10)
    s = tap.stats()
    assert sink.attempts >= 2
    assert (s["sink_errors"], s["dropped_sink"], s["rows_dropped"]) == (sink.attempts, 5, 5)
    assert s["errors"] == 0  # a sink that fails as sinks do is not a bug of the tap
    tap.close()


def test_a_broken_sink_is_counted_as_an_error_and_the_tap_goes_on():
    sink = CountingSink(broken=True)
    tap = Tap(sink)
    tap.capture(_logits(), [(0, "r", 0)])
    assert tap.flush(10)
    tap.capture(_logits(), [(1, "r", 1)])
    assert tap.flush(10)
    s = tap.stats()
    assert sink.attempts >= 2
    assert (s["sink_errors"], s["errors"]) == (sink.attempts, sink.attempts)
    assert s["last_sink_error"].startswith("TypeError")
    tap.close()


def test_a_submit_that_fails_is_counted_and_gives_its_buffer_back():
    class RefusingQueue:
        def put(self, item):
            raise RuntimeError("queue gone")

    sink = MemorySink()
    tap = Tap(sink, max_rows=2)
    logits = _logits()
    assert tap.capture(logits, [(0, "r", 0)]) == 1 and tap.flush(10)  # the encoder is running
    slots = [tap.copy_row(logits, r) for r in range(2)]
    q, tap._q = tap._q, RefusingQueue()
    for s in slots:
        tap.submit(s, "r", 1)
    tap._q = q
    assert tap.stats()["errors"] == 2
    # the tap goes on, with its whole pool: the failed rows' buffers came back
    assert tap.capture(logits, [(0, "r", 2), (1, "r", 3)]) == 2 and tap.flush(10)
    assert [f.position for f in sink.frames] == [0, 2, 3]
    tap.close()


def test_drops_of_every_kind_add_up_in_rows_dropped():
    calls = []

    def broken_once(arr, dtype):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return arr.tobytes()

    tap = Tap(None, encoder=broken_once, max_rows=2)
    logits = _logits()
    taken = [tap.copy_row(logits, r) for r in range(3)]  # the third finds no buffer
    for s in taken:
        if s is not None:
            tap.submit(s, "r", 0)
    assert tap.flush(10)
    s = tap.stats()
    assert (s["dropped_no_buffer"], s["dropped_encode"], s["dropped_sink"]) == (1, 1, 1)
    assert s["rows_dropped"] == 3
    tap.close()


def test_stats_name_the_pool_size_and_the_sink():
    tap = Tap(MemorySink(), max_rows=3)
    tap.rows_forced = 5  # counted by the adapters
    t0 = time.time()
    s = tap.stats()
    assert (s["max_rows"], s["sink"], s["buffers"], s["rows_forced"]) == (3, "memory", 0, 5)
    assert t0 <= s["time"] <= time.time()
    assert Tap(None).stats()["sink"] is None
    tap.close()


# -- rows reduced where they live (reduce_on_device): here the "device" is the host, so the same
#    code path runs; the CUDA-only steps (pinned copies, the event, the side stream) are
#    checked by benchmarks/capture_cuda.py on a GPU -----------------------------------------


def _ship(tap, logits, specs, forced=FORCED[0], tokens=FORCED[1]):
    sink = tap.sink
    assert tap.capture(logits, [(r, "run", r, None, specs[r]) for r in range(len(specs))]) == len(specs)
    force_tokens(logits, list(forced), list(tokens))  # the engine masks right after the copies
    assert tap.flush(10)
    return {f.position: f for f in sink.frames}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_rows_reduced_on_the_device_travel_as_the_host_path_sends_them(dtype):
    from tensorverse.store.compact import decode_compact

    logits, specs = evidence_rows(V, dtype)
    host_tap = Tap(MemorySink(), max_rows=16)
    dev_tap = Tap(MemorySink(), max_rows=16, reduce_on_device=True)
    want = _ship(host_tap, logits.clone(), specs)
    got = _ship(dev_tap, logits.clone(), specs)
    assert sorted(got) == sorted(want) == list(range(7))
    assert [got[p].compact for p in range(7)] == [want[p].compact for p in range(7)] == [d is None for d in DECISIONS]
    for p in range(7):
        if want[p].compact:
            a, b = decode_compact(got[p].blob), decode_compact(want[p].blob)
            assert (a.vocab, a.dtype, a.k, a.lse) == (b.vocab, b.dtype, b.k, b.lse)
            assert a.ids.tolist() == b.ids.tolist() and a.logits.tobytes() == b.logits.tobytes()
            assert a.fingerprint == 0  # the full row's crc32 is never computed on the device path
        else:  # the raw row, bit for bit, although the engine masked it after the copy
            assert got[p].blob == want[p].blob
    d, h = dev_tap.stats(), host_tap.stats()
    assert d["rows_evidence"] == h["rows_evidence"] == {"flip": 1, "close": 1, "ties": 1, "nonfinite": 1,
                                                        "requested": 1}
    assert (d["rows_compact"], d["rows_on_device"], d["device_rows"], d["rows_dropped"]) == (2, 6, 0, 0)
    assert d["errors"] == 0  # the step was reduced on the device, not row by row after a failure
    assert h["rows_on_device"] == 0
    host_tap.close()
    dev_tap.close()


def test_a_full_device_budget_sends_rows_by_the_host_path_and_counts_them():
    from tensorverse.capture.optin import EvidenceSpec

    logits = torch.linspace(-5.0, -1.0, V).repeat(4, 1)
    logits[:, 11] = 9.0
    spec = EvidenceSpec(20, 0.1, 11, False)
    tap = Tap(MemorySink(), reduce_on_device=True, max_device_rows=2)
    frames = _ship(tap, logits, [spec] * 4, forced=(), tokens=())
    assert [frames[p].compact for p in range(4)] == [True] * 4  # nothing lost, all compact
    s = tap.stats()
    assert (s["rows_on_device"], s["device_overflow"], s["device_rows"], s["rows_compact"]) == (2, 2, 0, 4)
    assert s["errors"] == 0
    tap.close()


def test_a_device_row_computed_again_replaces_the_old_one_and_is_given_back_once():
    from tensorverse.capture.optin import EvidenceSpec

    spec = EvidenceSpec(20, 0.1, -1, False)
    tap = Tap(MemorySink(), reduce_on_device=True, max_device_rows=1)
    a, b = _logits(seed=1), _logits(seed=2)
    s1 = tap.copy_row(a, 0, evidence=spec)
    s2 = tap.copy_row(b, 0, s1, evidence=spec)  # chunked prefill: the same position again
    assert s2 is not s1 and tap.stats()["device_rows"] == 1 and tap.stats()["device_overflow"] == 0
    tap.release(s1)  # already given back: no effect
    assert tap.stats()["device_rows"] == 1
    tap.release(s2, discarded=True)
    tap.release(s2, discarded=True)
    assert tap.stats()["device_rows"] == 0
    assert tap.copy_row(a, 1, evidence=spec) is not None  # the budget is whole again
    tap.close()


def test_a_device_row_whose_step_was_never_reduced_is_reduced_by_the_encoder():
    from tensorverse.capture.optin import EvidenceSpec
    from tensorverse.store.compact import compact_row, decode_compact

    spec = EvidenceSpec(20, 0.1, -1, False)
    sink = MemorySink()
    tap = Tap(sink, reduce_on_device=True)
    logits = torch.linspace(-5.0, -1.0, V).repeat(2, 1)
    logits[0, 33] = 9.0
    slot = tap.copy_row(logits, 0, evidence=spec)
    tap.submit(slot, "run", 0, None, spec)  # no mark_copied: its step was never reduced
    assert tap.flush(10)
    c = decode_compact(sink.frames[0].blob)
    assert sink.frames[0].compact and c.ids.tolist() == compact_row(logits[0].numpy()).ids.tolist()
    assert tap.stats()["rows_on_device"] == 1 and tap.stats()["device_rows"] == 0
    tap.close()


def test_a_device_step_whose_reduction_fails_is_counted_and_its_rows_still_arrive(monkeypatch):
    import tensorverse.capture.reduce as reduce_mod

    logits, specs = evidence_rows(V)
    tap = Tap(MemorySink(), max_rows=16, reduce_on_device=True)
    real = reduce_mod.reduce_on_device
    calls = []

    def fails_in_the_step(rows, k, **kw):  # the step's batch fails; the encoder's own call works
        calls.append(rows.dim())
        if rows.dim() == 2 and rows.shape[0] > 1:
            raise RuntimeError("out of device memory")
        return real(rows, k, **kw)

    monkeypatch.setattr(reduce_mod, "reduce_on_device", fails_in_the_step)
    frames = _ship(tap, logits.clone(), specs)
    assert [frames[p].compact for p in range(7)] == [True, True] + [False] * 5
    s = tap.stats()
    assert (s["errors"], s["rows_on_device"], s["rows_dropped"]) == (1, 6, 0)
    tap.close()


def test_a_deferring_encoder_drains_from_half_the_device_budget():
    from tensorverse.capture.optin import EvidenceSpec

    spec = EvidenceSpec(20, 0.1, -1, False)
    sink = MemorySink()
    tap = Tap(sink, max_rows=64, defer_s=60.0, poll_s=0.005, reduce_on_device=True, max_device_rows=4)
    logits = _logits()
    assert tap.capture(logits, [(0, "r", 0, None, spec)]) == 1
    time.sleep(0.2)
    assert tap.stats()["rows_encoded"] == 0  # one row held: still deferring
    assert tap.capture(logits, [(1, "r", 1, None, spec)]) == 1  # two held: half the budget
    deadline = time.monotonic() + 10
    while tap.stats()["rows_encoded"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    s = tap.stats()
    assert s["rows_encoded"] >= 1 and s["device_overflow"] == 0  # encoded although rows "keep arriving"
    tap.close()
    assert len(sink.frames) == 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the test
def test_a_flush_does_not_wait_out_its_timeout_on_a_dead_encoder():
    tap = Tap(MemorySink())
    assert tap.capture(_logits(), [(0, "r", 0)]) == 1 and tap.flush(10)
    tap._q.put(("not", "a", "row"))  # a malformed item: the encoder thread dies on it
    tap._thread.join(5)
    assert not tap._thread.is_alive()
    t0 = time.monotonic()
    assert tap.flush(10) is False
    assert time.monotonic() - t0 < 1.0
    tap.close(timeout=0.1)


def test_a_flush_that_times_out_says_so():
    gate = threading.Event()

    def stuck(arr, dtype):
        gate.wait(10)
        return arr.tobytes()

    tap = Tap(MemorySink(), encoder=stuck)
    assert tap.capture(_logits(), [(0, "r", 0)]) == 1
    t0 = time.monotonic()
    assert tap.flush(0.3) is False
    assert 0.25 <= time.monotonic() - t0 < 2.0
    gate.set()
    assert tap.flush(10)
    tap.close()


def test_a_failed_copy_gives_the_slot_it_replaced_back_once():
    from tensorverse.capture.optin import EvidenceSpec

    tap = Tap(MemorySink(), max_rows=1, reduce_on_device=True)
    logits = _logits()
    s = tap.copy_row(logits, 0)  # the pool's one host buffer
    assert tap.copy_row(logits, 99, s, evidence=EvidenceSpec(20, 0.1, -1, False)) is None  # no row 99
    assert tap.stats()["errors"] == 1 and tap.stats()["device_rows"] == 0
    # the buffer came back once: one copy gets it, the next finds the pool empty
    assert tap.copy_row(logits, 0) is not None
    assert tap.copy_row(logits, 1) is None and tap.stats()["dropped_no_buffer"] == 1
    tap.close()


def test_a_steps_rows_are_reduced_on_the_device_in_one_batch(monkeypatch):
    import tensorverse.capture.reduce as reduce_mod
    from tensorverse.capture.optin import EvidenceSpec

    batches = []
    real = reduce_mod.reduce_on_device

    def counted(rows, k, **kw):
        batches.append(tuple(rows.shape))
        return real(rows, k, **kw)

    monkeypatch.setattr(reduce_mod, "reduce_on_device", counted)
    logits = torch.linspace(-5.0, -1.0, V).repeat(5, 1)
    logits[:, 12] = 9.0  # forced 13, this runtime prefers 12: five flips
    tap = Tap(MemorySink(), reduce_on_device=True)
    spec = EvidenceSpec(20, 0.1, 13, False)
    _ship(tap, logits, [spec] * 3, forced=(), tokens=())  # one step of three rows
    _ship(tap, logits, [spec] * 2, forced=(), tokens=())  # the next, of two
    assert batches == [(3, V), (2, V)]
    s = tap.stats()
    assert (s["rows_evidence"], s["rows_on_device"], s["errors"]) == ({"flip": 5}, 5, 0)
    tap.close()


def test_rows_discarded_are_counted_one_by_one():
    tap = Tap(MemorySink(), max_rows=2)
    logits = _logits()
    for r in range(2):
        tap.release(tap.copy_row(logits, r), discarded=True)
    assert tap.stats()["rows_discarded"] == 2
    tap.close()


def test_items_with_engine_state_carry_it_to_their_frames():
    from tensorverse.store.engine_state import EngineState

    sink = MemorySink()
    tap = Tap(sink)
    state = (1, 7, 4, 0, 1, 12, 0, 1, 1)
    assert tap.capture(_logits(), [(0, "r", 0, state), (1, "r", 1, None)]) == 2  # 4-item tuples
    assert tap.flush(10)
    by_pos = {f.position: f for f in sink.frames}
    assert by_pos[0].engine == EngineState(*state) and by_pos[1].engine is None
    assert [by_pos[p].compact for p in (0, 1)] == [False, False]
    tap.close()


def test_a_buffer_of_another_vocabulary_is_replaced_not_added():
    tap = Tap(MemorySink(), max_rows=1)
    assert tap.capture(_logits(), [(0, "r", 0)]) == 1 and tap.flush(10)
    wide = torch.randn(2, 2 * V)
    assert tap.capture(wide, [(0, "w", 0)]) == 1 and tap.flush(10)  # the pool's one buffer, resized
    assert tap.stats()["buffers"] == 1
    assert tap.capture(wide, [(0, "w", 1)]) == 1 and tap.flush(10)
    tap.close()


def test_every_failed_copy_is_counted():
    tap = Tap(MemorySink())
    logits = _logits()
    assert tap.copy_row(logits, 99) is None and tap.copy_row(logits, 98) is None
    assert tap.stats()["errors"] == 2
    tap.close()
