"""The V1 adapter driven by vLLM's real persistent batch (``InputBatch``): its add_request,
remove_request, condense and swap_states produce the BatchUpdates the engine would send."""

import zlib

import numpy as np
import pytest
import torch

import vllm  # noqa: F401  (installed by `make setup`)

from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors, MoveDirectionality
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from tensorverse.capture import optin, runtime
from tensorverse.capture.plugin import CaptureLogitsProcessor
from tensorverse.capture.sink import MemorySink
from tensorverse.capture.tap import Tap
from tensorverse.store.codec import decode_row

V = 97
CPU = torch.device("cpu")


def marker(rid: str, pos: int, chunk: int = 0) -> torch.Tensor:
    """The logits row the fake model produces for request ``rid`` at ``pos`` (per chunk)."""
    seed = zlib.crc32(f"{rid}/{pos}/{chunk}".encode())
    return torch.randn(V, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def sink(monkeypatch):
    s = MemorySink()
    tap = Tap(s, max_rows=64)
    monkeypatch.setattr(runtime, "_tap", tap)
    monkeypatch.setattr(runtime, "_adapter_errors", 0)
    monkeypatch.delenv("TENSORVERSE_CAPTURE", raising=False)
    yield s
    tap.close()


class Engine:
    """The parts of vLLM's V1 model runner that talk to logits processors."""

    def __init__(self, max_reqs=6, placeholders=False):
        self.proc = CaptureLogitsProcessor(None, CPU, False)
        self.ib = InputBatch(max_num_reqs=max_reqs, max_model_len=256, max_num_batched_tokens=256,
                             device=CPU, vocab_size=V, block_sizes=[16], max_num_blocks_per_req=[16],
                             logitsprocs=LogitsProcessors([self.proc]))
        self.states: dict[str, CachedRequestState] = {}
        self.to_add: list[str] = []
        self.to_remove: list[str] = []
        self.prefill_steps: dict[str, int] = {}
        self.max_tokens: dict[str, int] = {}
        self.placeholders = placeholders  # async scheduling: -1 placeholders in the output list
        self.tokens: dict[str, list[int]] = {}
        self.untouched: list[bool] = []
        self.batches: list[list[str]] = []

    def add(self, rid, xargs=None, max_tokens=6, prefill_steps=1, output=None):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=xargs)
        st = self.states.get(rid)
        if st is None or output is None:
            st = CachedRequestState(req_id=rid, prompt_token_ids=[1, 2, 3], mm_features=[],
                                    sampling_params=sp, generator=None, block_ids=([0],),
                                    num_computed_tokens=0, output_token_ids=output or [])
            self.states[rid] = st
            self.tokens[rid] = []
        self.to_add.append(rid)
        self.prefill_steps[rid] = prefill_steps
        self.max_tokens[rid] = max_tokens

    def remove(self, rid):
        self.to_remove.append(rid)

    def step(self, swap=None):
        for rid in self.to_remove:
            self.ib.remove_request(rid)
        self.to_remove = []
        for rid in self.to_add:
            self.ib.add_request(self.states[rid])
        self.to_add = []
        self.ib.condense()
        if swap is not None:
            self.ib.swap_states(*swap)
        self.ib.refresh_metadata()
        rids = list(self.ib.req_ids)
        self.batches.append(rids)  # the batch of engine step len(self.batches)
        if not rids:
            return
        chunks = {rid: self.prefill_steps.get(rid, 1) for rid in rids}
        logits = torch.stack([marker(rid, len(self.states[rid].output_token_ids), chunks[rid])
                              for rid in rids])
        raw = logits.clone()
        out = self.proc.apply(logits)
        assert out is logits
        for i, rid in enumerate(rids):
            self.untouched.append(torch.equal(out[i], raw[i]))
            if self.prefill_steps.get(rid, 1) > 1:  # chunked prefill: sample discarded
                self.prefill_steps[rid] -= 1
                continue
            self.prefill_steps[rid] = 1
            tok = int(out[i].argmax())
            self.tokens[rid].append(tok)
            self.states[rid].output_token_ids.append(-1 if self.placeholders else tok)
            if len(self.states[rid].output_token_ids) >= self.max_tokens[rid]:
                self.remove(rid)

    def run(self, steps=40):
        for _ in range(steps):
            self.step()

    def busy(self):
        return bool(self.ib.req_ids) or bool(self.to_add)


def frames_of(sink, cid):
    runtime.flush(10)
    fs = sorted((f for f in sink.frames if f.capture_id == cid), key=lambda f: f.position)
    return fs


def assert_rows(sink, cid, positions, chunks=None):
    fs = frames_of(sink, cid)
    assert [f.position for f in fs] == list(positions), cid
    for f in fs:
        want = marker(cid.split(":")[0], f.position, (chunks or {}).get(f.position, 1))
        assert np.array_equal(decode_row(f.blob), want.numpy()), (cid, f.position)


def test_capture_force_and_bystanders_through_adds_removes_condense_and_swaps(sink):
    e = Engine()
    e.add("a", {"tv_capture": "a"}, max_tokens=5)
    e.add("b", None, max_tokens=9)
    e.add("c", {"tv_capture": "c", "tv_force": [10, 11, 12, 13]}, max_tokens=4)
    e.add("d", {"tv_capture": "d", "tv_positions": "every:2"}, max_tokens=7)
    e.step()
    e.step(swap=(0, 3))
    e.step()
    e.add("f", {"tv_force": "20 21 22"}, max_tokens=5)  # force only, then free
    e.step(swap=(1, 2))
    for _ in range(3):
        e.step()
    e.add("g", {"tv_capture": "g", "tv_positions": [1, 3]}, max_tokens=5)
    e.run(20)
    assert not e.busy()
    assert_rows(sink, "a", range(5))
    assert_rows(sink, "c", range(4))
    assert_rows(sink, "d", [0, 2, 4, 6])
    assert_rows(sink, "g", [1, 3])
    assert frames_of(sink, "b") == [] and frames_of(sink, "f") == []
    assert e.tokens["c"] == [10, 11, 12, 13]
    assert e.tokens["f"][:3] == [20, 21, 22]
    # free positions follow the model's own argmax
    assert e.tokens["f"][3:] == [int(marker("f", p, 1).argmax()) for p in (3, 4)]
    assert e.tokens["b"] == [int(marker("b", p, 1).argmax()) for p in range(9)]
    s = runtime.stats()
    assert s["rows_dropped"] == 0 and s["errors"] == 0 and s["rows_forced"] == 7
    assert e.proc.impl._reqs == {}  # everything left the batch: apply is O(1) again


def test_chunked_prefill_rows_are_not_shipped_twice(sink):
    e = Engine()
    e.add("p", {"tv_capture": "p", "tv_force": [5, 6, 7]}, max_tokens=3, prefill_steps=3)
    e.add("q", {"tv_capture": "q"}, max_tokens=2)
    e.run(10)
    # position 0 of "p" was computed three times (chunks 3, 2, 1); only the sampled one counts
    assert_rows(sink, "p", range(3))
    assert_rows(sink, "q", range(2))
    assert e.tokens["p"] == [5, 6, 7]


def test_request_aborted_during_prefill_ships_nothing(sink):
    e = Engine()
    e.add("x", {"tv_capture": "x"}, max_tokens=3, prefill_steps=5)
    e.step()
    e.step()
    e.remove("x")
    e.step()
    assert frames_of(sink, "x") == []
    assert runtime.stats()["rows_discarded"] == 1
    assert runtime.get_tap().stats()["buffers"] == 1  # the buffer went back to the pool


def test_preempted_request_resumes_where_it_stopped(sink):
    e = Engine()
    e.add("r", {"tv_capture": "r", "tv_force": [3, 4, 5, 6, 7, 8]}, max_tokens=6)
    e.add("s", {"tv_capture": "s"}, max_tokens=6)
    e.step()
    e.step()
    e.step()
    e.remove("r")  # preempted: leaves the batch with 3 tokens
    e.step()
    e.step()
    out = e.states["r"].output_token_ids
    e.add("r", {"tv_capture": "r", "tv_force": [3, 4, 5, 6, 7, 8]}, max_tokens=6, output=out,
          prefill_steps=2)  # recomputes prompt + 3 outputs, in two chunks
    e.run(10)
    assert_rows(sink, "r", range(6))
    assert_rows(sink, "s", range(6))
    assert e.tokens["r"] == [3, 4, 5, 6, 7, 8]


def test_async_scheduling_placeholders(sink):
    e = Engine(placeholders=True)
    e.add("h", {"tv_capture": "h", "tv_force": [1, 2, 3, 4]}, max_tokens=4)
    e.run(6)
    assert_rows(sink, "h", range(4))


def test_no_opt_in_is_o1_and_untouched(sink):
    e = Engine()
    e.add("u", None, max_tokens=3)
    e.add("v", {"unrelated": "x"}, max_tokens=3)
    e.run(5)
    assert all(e.untouched)
    assert e.proc.impl._reqs == {}
    sentinel = object()  # not even a tensor: proves apply does no tensor work
    assert e.proc.apply(sentinel) is sentinel
    assert runtime.stats()["rows_captured"] == 0


def test_switched_off(monkeypatch, sink):
    monkeypatch.setenv("TENSORVERSE_CAPTURE", "0")
    e = Engine()
    assert e.proc.is_argmax_invariant() is True
    e.add("z", {"tv_capture": "z", "tv_force": [1, 2]}, max_tokens=2)
    e.run(3)
    assert all(e.untouched) and frames_of(sink, "z") == []
    CaptureLogitsProcessor.validate_params(  # ignored, not rejected
        SamplingParams(n=1, logit_bias={1: 1.0}, extra_args={"tv_capture": "z"}))


def test_on_by_default_and_not_argmax_invariant(sink):
    assert Engine().proc.is_argmax_invariant() is False


def test_errors_never_reach_vllm(sink, monkeypatch):
    e = Engine()
    e.add("k", {"tv_capture": "k", "tv_force": [1]}, max_tokens=2)
    e.step()
    before = runtime.stats()["adapter_errors"]
    assert e.proc.apply("not a tensor") == "not a tensor"
    assert runtime.stats()["adapter_errors"] == before + 1


def test_validate_params(monkeypatch):
    monkeypatch.delenv("TENSORVERSE_CAPTURE", raising=False)
    monkeypatch.setenv("TENSORVERSE_CAPTURE_SINK", "dir:/tmp/x")
    ok = CaptureLogitsProcessor.validate_params
    ok(SamplingParams())
    ok(SamplingParams(extra_args={"tv_capture": "r1", "tv_force": [1, 2], "tv_positions": "0-3"}))
    ok(SamplingParams(presence_penalty=0.5, extra_args={"tv_force": "1,2"}))  # force only: fine
    bad = [
        ({"tv_capture": ""}, {}),
        ({"tv_capture": "a\nb"}, {}),
        ({"tv_capture": 5}, {}),
        ({"tv_force": []}, {}),
        ({"tv_force": [1, -2]}, {}),
        ({"tv_force": [1.5]}, {}),
        ({"tv_force": "1,x"}, {}),
        ({"tv_positions": "all"}, {}),
        ({"tv_capture": "r", "tv_positions": "every:0"}, {}),
        ({"tv_capture": "r", "tv_positions": "5-2"}, {}),
        ({"tv_capture": "r"}, {"n": 2, "temperature": 1.0}),
        ({"tv_capture": "r"}, {"logit_bias": {3: 1.0}}),
        ({"tv_capture": "r"}, {"allowed_token_ids": [1, 2]}),
        ({"tv_capture": "r"}, {"min_tokens": 2}),
        ({"tv_capture": "r"}, {"repetition_penalty": 1.1}),
        ({"tv_force": [1]}, {"thinking_token_budget": 5}),
        ({"tv_force": [1], "tv_compact": 20}, {}),  # compact rows need a capture
        ({"tv_capture": "r", "tv_compact": 0}, {}),
        ({"tv_capture": "r", "tv_compact": 5000}, {}),
        ({"tv_capture": "r", "tv_close": 0.5}, {}),  # tv_close and tv_full need tv_compact
        ({"tv_capture": "r", "tv_full": "0-3"}, {}),
        ({"tv_capture": "r", "tv_compact": 20, "tv_close": -1.0}, {}),
        ({"tv_capture": "r", "tv_compact": 20, "tv_close": "nan"}, {}),
        ({"tv_capture": "r", "tv_compact": 20, "tv_full": "3-1"}, {}),
    ]
    for xargs, kw in bad:
        with pytest.raises(ValueError):
            ok(SamplingParams(extra_args=xargs, **kw))
    monkeypatch.delenv("TENSORVERSE_CAPTURE_SINK")
    with pytest.raises(ValueError, match="TENSORVERSE_CAPTURE_SINK"):
        ok(SamplingParams(extra_args={"tv_capture": "r"}))
    ok(SamplingParams(extra_args={"tv_force": [1]}))  # forcing needs no sink


def test_positions_spec():
    P = optin.Positions.parse
    assert 0 in P(None) and 10**6 in P("all")
    every = P("every:3+1")
    assert [p for p in range(10) if p in every] == [1, 4, 7]
    r = P("0-2, 5, 8-")
    assert [p for p in range(12) if p in r] == [0, 1, 2, 5, 8, 9, 10, 11]
    assert r.last() is None and P([4, 1, 2]).last() == 4
    assert [p for p in range(6) if p in P([4, 1, 2])] == [1, 2, 4]
    o = optin.parse_extra_args({"tv_capture": "x", "tv_positions": [0, 1]})
    assert o.finished_at(2) and not o.finished_at(1)


def assert_compact_or_full(frames, rid, k):
    """Each frame is its row's compact form (as the store's compaction makes it) or the row."""
    from tensorverse.store.compact import compact_row, decode_compact

    for f in frames:
        row = marker(rid, f.position, 1).numpy()
        if f.compact:
            assert decode_compact(f.blob).ids.tolist() == compact_row(row, k=k).ids.tolist()
        else:
            assert np.array_equal(decode_row(f.blob), row)


def test_compact_requests_ship_compact_rows_except_their_evidence(sink):
    e = Engine()
    force = [int(marker("ev", p, 1).argmax()) for p in range(4)]
    force[1] = (force[1] + 1) % V  # position 1 is forced to another token than its top-1: a flip
    e.add("ev", {"tv_capture": "ev", "tv_force": force, "tv_compact": 5, "tv_close": 0.0, "tv_full": "2"},
          max_tokens=4)
    e.run(8)
    fs = frames_of(sink, "ev")
    assert [(f.position, f.compact) for f in fs] == [(0, True), (1, False), (2, False), (3, True)]
    assert_compact_or_full(fs, "ev", k=5)
    assert e.tokens["ev"] == force


def test_engine_state_with_every_row(sink):
    """Each row carries the step it was computed in, the batch's size and the row's index in
    it, as the engine's persistent batch had them (checked against the batches the test ran)."""
    e = Engine()
    e.add("a", {"tv_capture": "a"}, max_tokens=6)
    e.add("b", None, max_tokens=3)
    e.step()
    e.add("c", {"tv_capture": "c"}, max_tokens=4, prefill_steps=2)
    e.step(swap=(0, 1))
    e.run(10)
    for cid in ("a", "c"):
        fs = frames_of(sink, cid)
        assert [f.position for f in fs] == list(range(6 if cid == "a" else 4))
        steps = [f.engine.step for f in fs]
        assert steps == sorted(set(steps)) and steps[0] >= 1
        for f in fs:
            st = f.engine
            batch = e.batches[st.step - 1]
            assert st.runner == 1 and st.batch_size == len(batch) >= 1 and batch[st.row] == cid
            assert st.context_tokens == -1 and st.prefill_reqs == -1  # V1 does not show them
    a = frames_of(sink, "a")
    assert a[0].engine.joined == 2 and a[0].engine.batch_size == 2  # a and b joined in step 1
    assert a[1].engine.joined == 1 and a[1].engine.batch_size == 3  # c joined
    c = frames_of(sink, "c")  # chunked prefill: position 0 is the row of the second chunk
    assert c[0].engine.step == 3


def test_engine_state_off_switch(monkeypatch, sink):
    monkeypatch.setenv("TENSORVERSE_CAPTURE_ENGINE_STATE", "0")
    e = Engine()
    e.add("a", {"tv_capture": "a"}, max_tokens=3)
    e.run(4)
    fs = frames_of(sink, "a")
    assert [f.position for f in fs] == [0, 1, 2] and all(f.engine is None for f in fs)
    assert e.proc.impl._step == 0  # no per-step counting either


def test_the_parallel_layout_comes_from_the_engine_config_and_unknown_is_minus_one():
    from types import SimpleNamespace

    from tensorverse.capture.runtime import parallel_layout

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1))
    assert parallel_layout(cfg) == (2, 1)
    big = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=255, pipeline_parallel_size=256))
    assert parallel_layout(big) == (255, -1)  # a size beyond the engine state's byte is unknown
    zero = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=0, pipeline_parallel_size=1.0))
    assert parallel_layout(zero) == (-1, -1)  # not a positive whole number of ranks
    assert parallel_layout(None) == (-1, -1) and parallel_layout(SimpleNamespace()) == (-1, -1)


def test_a_forced_token_outside_the_vocabulary_is_not_forced_and_the_last_id_is(sink):
    e = Engine()
    e.add("o", {"tv_force": [V, V - 1, 0]}, max_tokens=3)
    e.run(4)
    own = int(marker("o", 0, 1).argmax())  # position 0: V is no token, the row's own argmax is sampled
    assert e.tokens["o"] == [own, V - 1, 0]
    assert runtime.stats()["adapter_errors"] == 0


def test_a_request_outside_the_logits_batch_is_skipped_and_the_others_still_forced(sink):
    e = Engine()
    e.add("p", {"tv_force": [5, 6, 7]}, max_tokens=3)
    e.add("q", {"tv_force": [8, 9, 10]}, max_tokens=3)
    e.step()
    reqs = e.proc.impl._reqs
    (ip, sp), (iq, sq) = sorted(reqs.items())
    reqs.clear()
    reqs.update({iq: sq, ip: sp})  # the one outside the batch comes first
    logits = torch.zeros(iq, V)  # one row fewer than the batch: index iq == the row count
    e.proc.apply(logits)
    assert int(logits[ip].argmax()) == 6  # p's position 1 still forced
    assert runtime.stats()["adapter_errors"] == 0


def test_a_step_without_changes_says_no_request_joined(sink):
    e = Engine()
    e.add("j", {"tv_capture": "j"}, max_tokens=3)
    e.run(4)
    fs = frames_of(sink, "j")
    assert [f.engine.joined for f in fs] == [1, 0, 0]  # joined in the first step; nothing after


def test_a_request_removed_and_replaced_at_its_index_in_one_step_gives_back_its_pending_row(sink):
    # vLLM reuses a removed request's index for a request added in the same step, and then does
    # not report the removal: the add itself must retire the old request and its pending row
    e = Engine()
    e.add("x", {"tv_capture": "x", "tv_force": [1, 2, 3]}, max_tokens=3, prefill_steps=4)
    e.step()  # x's first prefill chunk: its row is copied, not yet sampled
    e.remove("x")
    e.add("y", None, max_tokens=3)
    e.step()
    assert e.batches[-1] == ["y"]  # y took x's index
    e.run(4)
    assert frames_of(sink, "x") == []
    assert e.tokens["y"] == [int(marker("y", p, 1).argmax()) for p in range(3)]  # not x's forcing
    assert runtime.stats()["rows_discarded"] == 1
    assert runtime.get_tap().stats()["buffers"] == 1  # the buffer went back to the pool


def _batch_update(size, added=(), moved=(), removed=()):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def test_a_request_overwritten_by_a_move_gives_back_its_pending_row_and_the_mover_keeps_its_own(sink):
    # vLLM's contract: "added or moved requests may replace existing requests with the same index"
    proc = CaptureLogitsProcessor(None, CPU, False)
    out_x: list[int] = []
    out_y: list[int] = []
    proc.update_state(_batch_update(2, added=[
        (0, SamplingParams(extra_args={"tv_capture": "x"}), [1, 2], out_x),
        (1, SamplingParams(extra_args={"tv_capture": "y"}), [1, 2], out_y)]))
    proc.apply(torch.stack([marker("x", 0), marker("y", 0)]))  # both rows pending
    proc.update_state(_batch_update(1, moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert runtime.stats()["rows_discarded"] == 1  # x's row, released once x was overwritten
    out_y.append(7)  # y's token at position 0 sampled: its row ships at the next update
    proc.update_state(None)
    assert [f.position for f in frames_of(sink, "y")] == [0]
    assert np.array_equal(decode_row(frames_of(sink, "y")[0].blob), marker("y", 0).numpy())
    assert frames_of(sink, "x") == []


def test_an_added_request_without_sampling_params_does_not_hide_the_requests_added_after_it(sink):
    proc = CaptureLogitsProcessor(None, CPU, False)
    out: list[int] = []
    proc.update_state(_batch_update(2, added=[
        (0, None, [1, 2], []),  # e.g. a pooling request: nothing to capture or force
        (1, SamplingParams(extra_args={"tv_force": [4]}), [1, 2], out)]))
    logits = torch.zeros(2, V)
    proc.apply(logits)
    assert int(logits[1].argmax()) == 4 and not logits[0].any()


def test_a_force_only_request_past_its_last_forced_token_is_no_longer_tracked(sink):
    e = Engine()
    e.add("f", {"tv_force": [20, 21]}, max_tokens=6)
    e.step()
    e.step()
    assert e.proc.impl._reqs != {}
    e.step()  # position 2: nothing left to force or capture, f still decoding
    assert e.ib.req_ids == ["f"] and e.proc.impl._reqs == {}
    sentinel = object()  # apply is O(1) again: no tensor work at all
    assert e.proc.apply(sentinel) is sentinel


@pytest.fixture
def device_sink(monkeypatch):
    """The tap with ``TENSORVERSE_CAPTURE_REDUCE=device`` (here the device is the host)."""
    s = MemorySink()
    tap = Tap(s, max_rows=64, reduce_on_device=True)
    monkeypatch.setattr(runtime, "_tap", tap)
    monkeypatch.setattr(runtime, "_adapter_errors", 0)
    monkeypatch.delenv("TENSORVERSE_CAPTURE", raising=False)
    yield s
    tap.close()


def test_rows_reduced_on_the_device_ship_as_the_host_path_through_chunked_prefill_and_aborts(device_sink):
    e = Engine()
    force = [int(marker("ev", p, 1).argmax()) for p in range(4)]
    force[1] = (force[1] + 1) % V  # a flip at position 1
    e.add("ev", {"tv_capture": "ev", "tv_force": force, "tv_compact": 5, "tv_close": 0.0, "tv_full": "2"},
          max_tokens=4, prefill_steps=3)  # position 0 computed three times (chunked prefill)
    e.add("gone", {"tv_capture": "gone", "tv_compact": 5}, max_tokens=3, prefill_steps=5)
    e.step()
    e.step()
    e.remove("gone")  # aborted during its prefill: its row kept on the device is given back
    e.run(8)
    fs = frames_of(device_sink, "ev")
    assert [(f.position, f.compact) for f in fs] == [(0, True), (1, False), (2, False), (3, True)]
    assert_compact_or_full(fs, "ev", k=5)
    assert frames_of(device_sink, "gone") == []
    s = runtime.get_tap().stats()
    assert (s["rows_on_device"], s["device_rows"], s["rows_discarded"]) == (3, 0, 1)
    assert runtime.stats()["adapter_errors"] == 0
    assert e.tokens["ev"] == force


@pytest.mark.parametrize("value, on_device", [("device", True), (" Device ", True), ("host", False), ("", False),
                                              ("gpu", False)])
def test_the_environment_chooses_where_rows_are_reduced(monkeypatch, value, on_device):
    monkeypatch.setattr(runtime, "_tap", None)
    monkeypatch.delenv("TENSORVERSE_CAPTURE_SINK", raising=False)
    monkeypatch.setenv("TENSORVERSE_CAPTURE_REDUCE", value)
    monkeypatch.setenv("TENSORVERSE_CAPTURE_DEVICE_ROWS", "8")
    tap = runtime.get_tap()
    try:
        assert (tap.reduce_on_device, tap.max_device_rows) == (on_device, 8)
    finally:
        tap.close()
