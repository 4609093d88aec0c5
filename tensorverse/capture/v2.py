"""Capture as a Model Runner V2 logits processor
(``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``; GPU default in vLLM 0.33).

V2 calls ``add_request(req_idx, sampling_params)`` when a request takes a slot (slots are
recycled with no removal call, so every add overwrites the slot's state) and returns whether the
processor touches that request; ``apply(logits, ctx)`` then runs only on steps where some request
in the batch said yes, after V2's own logit-bias, penalties and bad-words stages (rejected for
opted-in requests) and before temperature, min-p, top-k/p and thinking-budget forcing.

Row -> request: ``ctx.idx_mapping_np[b]`` is the slot of batch position *b*; without speculative
decoding row *b* is batch position *b*. Position of the token sampled from that row:
``seq_len - prompt_len[slot]`` with ``seq_len = ctx.seq_lens_upper_bound_np[b]`` (exact without
speculative decoding). A row with ``seq_len < prefill_len[slot]`` is a chunked-prefill step whose
sample vLLM discards: it is neither captured nor forced. Everything is read on the host: no
device sync. With speculative decoding (more logits rows than requests) opted-in rows are left
alone and the condition is logged once.

Engine state (:class:`~tensorverse.store.engine_state.EngineState`, sent with each captured row):
``batch_size`` (``len(ctx.idx_mapping_np)``), the row, the step (``apply_staged_writes`` runs
once per step: one integer increment), ``joined`` (``add_request`` calls since the previous
step), and, computed only on steps that capture, from host arrays: ``context_tokens`` (the sum
of the batch's ``seq_lens_upper_bound_np``: the keys and values attention reads this step) and
``prefill_reqs`` (requests whose ``seq_len <= prefill_len``: their step feeds a prompt chunk).
Not shown: the tokens scheduled per request (``ctx.pos`` / ``input_ids`` are device tensors;
reading them would sync), the attention backend's split decisions, CUDA-graph padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

from tensorverse.capture import optin, runtime
from tensorverse.capture.tap import force_tokens, log_once
from tensorverse.capture.v1 import opt_in_of, validate_params
from tensorverse.store.engine_state import RUNNER_V2

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams

__all__ = ["V2CaptureProcessor"]


class V2CaptureProcessor(LogitsProcessor):
    """See the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", req_states: LogitsProcRequestState) -> None:
        self.enabled = runtime.enabled()
        parallel = getattr(vllm_config, "parallel_config", None)
        sharded = bool(getattr(parallel, "enable_batch_sharded_sampling", False))
        self.capturing = self.enabled and runtime.is_capture_rank(sharded_sampling=sharded)
        self.req_states = req_states
        self._slots: dict[int, optin.OptIn] = {}
        self._keys = np.empty(0, dtype=np.intp)
        self.engine_state = self.enabled and runtime.engine_state_enabled()
        self._tp, self._pp = runtime.parallel_layout(vllm_config)
        self._step = 0  # steps seen (apply_staged_writes calls), with engine state on
        self._joined = 0  # add_request calls since the previous step
        self._joining = 0

    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:
        validate_params(sampling_params)

    def apply_staged_writes(self) -> None:
        """Called by V2 once per step before the forward pass: counts steps (engine state)."""
        if self.engine_state:
            self._step += 1
            self._joined, self._joining = self._joining, 0

    def add_request(self, req_idx: int, sampling_params: "SamplingParams") -> bool:
        self._joining += 1
        try:
            if self._slots.pop(req_idx, None) is not None:
                self._keys = np.fromiter(self._slots, dtype=np.intp, count=len(self._slots))
            if not self.enabled or sampling_params is None:
                return False
            opt = opt_in_of(sampling_params)
            if opt is None:
                return False
            self._slots[req_idx] = opt
            self._keys = np.fromiter(self._slots, dtype=np.intp, count=len(self._slots))
            return True
        except Exception as e:  # noqa: BLE001 - never raise into vLLM
            runtime.note_error("v2.add_request", e)
            return False

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self._slots:
            return logits
        try:
            self._apply(logits, ctx)
        except Exception as e:  # noqa: BLE001 - never raise into vLLM
            runtime.note_error("v2.apply", e)
        return logits

    def _apply(self, logits: torch.Tensor, ctx: LogitsContext) -> None:
        idx_np = ctx.idx_mapping_np
        num_reqs = len(idx_np)
        batch_pos = np.flatnonzero(np.isin(idx_np, self._keys))
        if batch_pos.size == 0:
            return
        if logits.shape[0] != num_reqs:
            log_once("v2-spec", "%d logits rows for %d requests (speculative decoding?): "
                     "opted-in requests are neither captured nor forced", logits.shape[0], num_reqs)
            return
        vocab = logits.shape[-1]
        prompt_len = self.req_states.prompt_len.np
        prefill_len = self.req_states.prefill_len.np
        seq_lens = ctx.seq_lens_upper_bound_np
        items: list[tuple] = []
        engine: list[int] | None = None  # built at the step's first captured row
        f_rows: list[int] = []
        f_toks: list[int] = []
        finished: list[int] = []
        for b in batch_pos.tolist():
            slot = int(idx_np[b])
            seq_len = int(seq_lens[b])
            if seq_len < int(prefill_len[slot]):
                continue  # chunked prefill: vLLM discards this row's sample
            pos = seq_len - int(prompt_len[slot])
            opt = self._slots[slot]
            if self.capturing and opt.captures(pos):
                if self.engine_state:
                    if engine is None:
                        sl = seq_lens[:num_reqs]
                        engine = [RUNNER_V2, self._step, num_reqs, -1, self._joined, int(sl.sum()),
                                  int(np.count_nonzero(sl <= prefill_len[idx_np])), self._tp, self._pp]
                    engine[3] = b
                    items.append((b, opt.capture_id, pos, tuple(engine), opt.evidence(pos)))
                else:
                    items.append((b, opt.capture_id, pos, None, opt.evidence(pos)))
            tok = opt.forced_token(pos)
            if tok is not None:
                if tok < vocab:
                    f_rows.append(b)
                    f_toks.append(tok)
                else:
                    log_once("force-range", "forced token %d outside the vocabulary (%d)", tok, vocab)
            if opt.finished_at(pos + 1):
                finished.append(slot)
        if items or f_rows:
            tap = runtime.get_tap()
            if items:
                tap.capture(logits, items)
            if f_rows:
                force_tokens(logits, f_rows, f_toks)
                tap.rows_forced += len(f_rows)
        if finished:
            for slot in finished:
                del self._slots[slot]
            self._keys = np.fromiter(self._slots, dtype=np.intp, count=len(self._slots))
