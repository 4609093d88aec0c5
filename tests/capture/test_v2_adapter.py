"""The Model Runner V2 adapter against vLLM's real V2 classes (RequestState,
LogitsProcRequestState, LogitsContext, the plugin loader). The CPU engine never runs V2, so the
runner's calls are replayed here the way vllm/v1/worker/gpu/model_runner.py makes them."""

import random
import types
import zlib

import numpy as np
import pytest
import torch

import vllm  # noqa: F401  (installed by `make setup`)

import vllm.v1.worker.gpu.buffer_utils as buffer_utils
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    LogitsProcessor,
    build_custom_logits_processors,
)
from vllm.v1.worker.gpu.sample.logits_processor import loader as v2_loader

from tensorverse.capture import runtime
from tensorverse.capture.plugin import CaptureLogitsProcessor
from tensorverse.capture.sink import MemorySink
from tensorverse.capture.tap import Tap
from tensorverse.capture.v2 import V2CaptureProcessor
from tensorverse.store.codec import decode_row

V = 89
PROMPT = [1, 2, 3, 4, 5]


def marker(rid, pos, chunk):
    seed = zlib.crc32(f"{rid}/{pos}/{chunk}".encode())
    return torch.randn(V, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def sink(monkeypatch):
    # No pinned memory on a CPU-only machine: let vLLM use its explicit-copy fallback.
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    monkeypatch.delenv("TENSORVERSE_CAPTURE", raising=False)
    s = MemorySink()
    tap = Tap(s, max_rows=64)
    monkeypatch.setattr(runtime, "_tap", tap)
    monkeypatch.setattr(runtime, "_adapter_errors", 0)
    yield s
    tap.close()


class Runner:
    """Replays Model Runner V2's calls: req_states.add_request, processor.add_request,
    apply_staged_writes, and per step apply(logits, ctx) with rows in a new order each step."""

    def __init__(self, chunk=2, max_reqs=4, seed=0):
        from vllm.v1.worker.gpu.states import RequestState

        self.rs = RequestState(max_num_reqs=max_reqs, max_model_len=128, max_num_batched_tokens=128,
                               num_speculative_steps=0, vocab_size=V, device=torch.device("cpu"))
        cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace())
        procs = build_custom_logits_processors(cfg, self.rs, is_pooling_model=False)
        self.proc = [p for p in procs if isinstance(p, CaptureLogitsProcessor)][0]
        self.chunk = chunk
        self.rng = random.Random(seed)
        self.reqs = {}  # rid -> dict(slot, computed, out, max_tokens, prefill)
        self.tokens = {}
        self.wants_processing = {}

    def add(self, rid, xargs, max_tokens, output=None):
        out = list(output or [])
        all_ids = PROMPT + out
        self.rs.add_request(rid, prompt_len=len(PROMPT), all_token_ids=all_ids,
                            num_computed_tokens=0, max_tokens=max_tokens)
        slot = self.rs.req_id_to_index[rid]
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=xargs)
        self.wants_processing[slot] = self.proc.add_request(slot, sp)
        # RequestState.apply_staged_writes also runs a Triton kernel for the device-side token
        # buffers (absent on CPU); the host tensors the processor reads are these two:
        self.rs.prompt_len.copy_to_uva()
        self.rs.prefill_len.copy_to_uva()
        self.reqs[rid] = dict(slot=slot, computed=0, out=out, max_tokens=max_tokens,
                              prefill=len(all_ids))
        self.tokens.setdefault(rid, [])

    def finish(self, rid):
        self.rs.remove_request(rid)  # V2 tells processors nothing: the slot is just freed
        del self.reqs[rid]

    def step(self, extra_rows=0):
        self.proc.apply_staged_writes()  # V2: once per step, before the forward pass
        self.steps = getattr(self, "steps", 0) + 1
        self.batches = getattr(self, "batches", {})
        rids = list(self.reqs)
        self.rng.shuffle(rids)
        if not rids:
            return
        seq_lens, rows = [], []
        for rid in rids:
            r = self.reqs[rid]
            todo = r["prefill"] - r["computed"]
            sched = min(self.chunk, todo) if todo > 0 else 1
            seq = r["computed"] + sched
            seq_lens.append(seq)
            # a chunked-prefill row (discarded by vLLM) differs from the row that is sampled
            rows.append(marker(rid, len(r["out"]), 0 if seq >= r["prefill"] else seq))
        self.batches[self.steps] = (list(rids), list(seq_lens))
        idx = np.array([self.reqs[rid]["slot"] for rid in rids], dtype=np.intp)
        logits = torch.stack(rows + [torch.zeros(V)] * extra_rows)
        raw = logits.clone()
        idx_t = torch.from_numpy(idx).long()
        ctx = LogitsContext(
            expanded_idx_mapping=idx_t, idx_mapping=idx_t, idx_mapping_np=idx,
            expanded_local_pos=torch.zeros(len(rids), dtype=torch.int32),
            input_ids=torch.zeros(len(rids), dtype=torch.int32),
            pos=torch.tensor(seq_lens) - 1,
            seq_lens_upper_bound_np=np.array(seq_lens, dtype=np.int32))
        if any(self.wants_processing.get(int(s)) for s in idx):
            logits = self.proc.apply(logits, ctx)
        self.untouched = [torch.equal(logits[i], raw[i]) for i in range(len(rids))]
        for i, rid in enumerate(rids):
            r = self.reqs[rid]
            r["computed"] = seq_lens[i]
            if seq_lens[i] < r["prefill"]:
                continue  # chunked prefill: no token
            tok = int(logits[i].argmax())
            r["out"].append(tok)
            self.tokens[rid].append(tok)
            if len(r["out"]) >= r["max_tokens"]:
                self.finish(rid)

    def run(self, n=30):
        for _ in range(n):
            self.step()


def check_rows(sink, rid, positions):
    runtime.flush(10)
    fs = sorted((f for f in sink.frames if f.capture_id == rid), key=lambda f: f.position)
    assert [f.position for f in fs] == list(positions), rid
    for f in fs:
        want = marker(rid, f.position, 0)
        assert np.array_equal(decode_row(f.blob), want.numpy()), (rid, f.position)


def test_plugin_is_a_v2_processor_and_loads_through_vllms_loader(sink):
    assert issubclass(CaptureLogitsProcessor, LogitsProcessor)
    classes = v2_loader._load_v2_logitsprocs_plugins()  # raises for V1-only plugins
    assert CaptureLogitsProcessor in classes
    r = Runner()
    assert r.proc.runner == "v2" and isinstance(r.proc.impl, V2CaptureProcessor)


def test_capture_force_slot_reuse_and_reordering(sink):
    r = Runner(chunk=2)
    r.add("a", {"tv_capture": "a"}, 5)
    r.add("b", None, 7)
    r.add("c", {"tv_capture": "c", "tv_force": [7, 8, 9]}, 4)  # forced prefix, then free
    assert r.wants_processing == {r.reqs["a"]["slot"]: True, r.reqs["b"]["slot"]: False,
                                  r.reqs["c"]["slot"]: True}
    r.run(8)
    # "a" and "c" finished; their slots get reused by a plain and an opted-in request
    r.add("d", None, 3)
    r.add("e", {"tv_capture": "e", "tv_positions": "every:2", "tv_force": "1 2"}, 5)
    r.run(20)
    assert not r.reqs
    check_rows(sink, "a", range(5))
    check_rows(sink, "c", range(4))
    check_rows(sink, "e", [0, 2, 4])
    assert r.tokens["c"][:3] == [7, 8, 9]
    assert r.tokens["c"][3] == int(marker("c", 3, 0).argmax())
    assert r.tokens["e"][:2] == [1, 2]
    assert r.tokens["b"] == [int(marker("b", p, 0).argmax()) for p in range(7)]
    assert r.tokens["d"] == [int(marker("d", p, 0).argmax()) for p in range(3)]
    s = runtime.stats()
    assert s["rows_dropped"] == 0 and s["errors"] == 0 and s["rows_forced"] == 5


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_compact_requests_ship_compact_rows_except_their_evidence(sink, on_device):
    """Both places a row is reduced (``TENSORVERSE_CAPTURE_REDUCE``; here the device is the
    host) ship the same frames through Model Runner V2, the GPU default."""
    from tensorverse.store.compact import compact_row, decode_compact

    runtime.get_tap().reduce_on_device = on_device
    r = Runner()
    force = [int(marker("ev", p, 0).argmax()) for p in range(4)]
    force[1] = (force[1] + 1) % V  # position 1 is forced to another token than its top-1: a flip
    r.add("ev", {"tv_capture": "ev", "tv_force": force, "tv_compact": 5, "tv_close": 0.0, "tv_full": [2]}, 4)
    r.run(8)
    runtime.flush(10)
    fs = sorted((f for f in sink.frames if f.capture_id == "ev"), key=lambda f: f.position)
    assert [(f.position, f.compact) for f in fs] == [(0, True), (1, False), (2, False), (3, True)]
    for f in fs:
        row = marker("ev", f.position, 0).numpy()
        if f.compact:
            assert decode_compact(f.blob).ids.tolist() == compact_row(row, k=5).ids.tolist()
        else:
            assert np.array_equal(decode_row(f.blob), row)
    assert r.tokens["ev"] == force
    st = runtime.get_tap().stats()
    assert (st["rows_on_device"], st["device_rows"], st["errors"]) == ((3 if on_device else 0), 0, 0)
    assert runtime.stats()["adapter_errors"] == 0


def test_preemption_resume(sink):
    r = Runner(chunk=3)
    r.add("p", {"tv_capture": "p", "tv_force": [4, 5, 6, 7, 8]}, 5)
    r.run(4)  # prefill (2 steps) + 2 tokens... then preempted
    out = r.reqs["p"]["out"]
    assert 0 < len(out) < 5
    r.finish("p")  # preempted; resumed later with prompt + its outputs as the prefill
    r.add("p", {"tv_capture": "p", "tv_force": [4, 5, 6, 7, 8]}, 5, output=out)
    r.run(10)
    check_rows(sink, "p", range(5))
    assert r.tokens["p"] == [4, 5, 6, 7, 8]


def test_no_opt_in_costs_nothing(sink):
    r = Runner()
    r.add("x", None, 3)
    r.add("y", {"other": 1}, 3)
    assert not any(r.wants_processing.values())  # V2 then never calls apply for them
    sentinel = object()
    assert r.proc.apply(sentinel, None) is sentinel  # and apply would be O(1) anyway
    r.run(6)
    assert runtime.stats()["rows_captured"] == 0


def test_speculative_rows_are_left_alone(sink):
    r = Runner(chunk=8)
    r.add("s", {"tv_capture": "s", "tv_force": [1, 2]}, 2)
    r.step(extra_rows=2)  # more logits rows than requests
    assert all(r.untouched)
    assert runtime.stats()["rows_captured"] == 0


def test_switched_off(monkeypatch, sink):
    monkeypatch.setenv("TENSORVERSE_CAPTURE", "0")
    r = Runner()
    r.add("o", {"tv_capture": "o", "tv_force": [1]}, 2)
    assert r.wants_processing == {r.reqs["o"]["slot"]: False}


def test_batch_sharded_sampling_captures_on_every_rank(monkeypatch, sink):
    monkeypatch.setattr(runtime, "is_capture_rank",
                        lambda sharded_sampling=False: sharded_sampling)
    rs = Runner().rs
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

    lp = LogitsProcRequestState.from_request_state(rs)
    plain = V2CaptureProcessor(types.SimpleNamespace(parallel_config=types.SimpleNamespace()), lp)
    sharded = V2CaptureProcessor(types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(enable_batch_sharded_sampling=True)), lp)
    assert not plain.capturing and sharded.capturing


def test_engine_state_with_every_row(sink):
    r = Runner(chunk=2)
    r.add("a", {"tv_capture": "a"}, 4)
    r.add("b", None, 6)
    r.run(3)
    r.add("c", {"tv_capture": "c"}, 3)
    r.run(12)
    runtime.flush(10)
    for cid in ("a", "c"):
        fs = sorted((f for f in sink.frames if f.capture_id == cid), key=lambda f: f.position)
        assert [f.position for f in fs] == list(range(4 if cid == "a" else 3))
        steps = [f.engine.step for f in fs]
        assert steps == sorted(set(steps))
        for f in fs:
            st = f.engine
            rids, seqs = r.batches[st.step]
            assert st.runner == 2 and st.batch_size == len(rids) and rids[st.row] == cid
            assert st.context_tokens == sum(seqs)
            assert st.prefill_reqs == sum(1 for rid, q in zip(rids, seqs)
                                          if q <= len(PROMPT))  # no preemption here
    fa = min((f for f in sink.frames if f.capture_id == "a"), key=lambda f: f.position)
    assert fa.engine.step == 3 and fa.engine.prefill_reqs == 2  # 5-token prompts, 2 per step
    q = Runner(chunk=8)  # whole prompts in one step: the first row is in the step they joined
    q.add("d", {"tv_capture": "d"}, 2)
    q.add("e", None, 2)
    q.run(3)
    runtime.flush(10)
    fd = sorted((f for f in sink.frames if f.capture_id == "d"), key=lambda f: f.position)
    assert [(f.engine.step, f.engine.joined, f.engine.prefill_reqs) for f in fd] == [(1, 2, 2), (2, 0, 0)]


def test_engine_state_off_switch(monkeypatch, sink):
    monkeypatch.setenv("TENSORVERSE_CAPTURE_ENGINE_STATE", "0")
    r = Runner()
    r.add("a", {"tv_capture": "a"}, 2)
    r.run(5)
    runtime.flush(10)
    fs = [f for f in sink.frames if f.capture_id == "a"]
    assert len(fs) == 2 and all(f.engine is None for f in fs)
