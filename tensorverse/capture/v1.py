"""Capture as a V1 logits processor (``vllm.v1.sample.logits_processor.LogitsProcessor``).

The V1 model runner (all of vLLM-CPU, and GPU with Model Runner V2 off) calls, every step:
``update_state(batch_update)`` before the forward pass, then ``apply(logits)`` on the float32
logits ``[num_reqs, vocab]`` whose row *i* is the request at persistent-batch index *i*.

Where the copy happens: V1 applies, in order, allowed-token-ids, bad-words, the built-in
non-argmax-invariant processors (min-tokens, logit-bias) and then custom ones like this one;
penalties, temperature, top-k/p come after. Requests that opt in may not use the earlier ones
(rejected in :func:`~tensorverse.capture.optin.check_sampling_params`), so the copied row is the
raw model output (what the API's ``raw_logprobs`` are computed from).

``is_argmax_invariant()`` is False: vLLM then applies this processor on the greedy path too
(argmax-invariant processors are skipped when the whole batch is greedy), which capture at
temperature 0 and forcing both need. When the plugin is switched off (``TENSORVERSE_CAPTURE=0``)
it returns True, so greedy batches never call it.

Position of a row = ``len(output_tok_ids)`` of the request at the time of ``apply``
(``output_tok_ids`` is the runner's live list, handed over in ``BatchUpdate.added``; with async
scheduling it holds ``-1`` placeholders, which count as tokens). A row is not necessarily
sampled: during a chunked prefill vLLM computes and then discards a row per chunk. So a copied
row stays *pending* in its buffer until the request's output grows past its position (then it is
shipped) or the request leaves the batch without having grown (then it is dropped as
``rows_discarded``); a later copy for the same position reuses the buffer.

BatchUpdate handling (vLLM 0.32 semantics): ``added`` is ``(index, params, prompt_tok_ids,
output_tok_ids)``; an added index may replace a request that finished without appearing in
``removed`` (vLLM reuses freed indices); ``removed`` lists the freed indices that stayed empty;
``moved`` is ``(a, b, UNIDIRECTIONAL)`` (request a moves to b, whatever was at b is gone) or
``(a, b, SWAP)``. Order: removed, added, moved.

Forced mode: see :mod:`tensorverse.capture` (the caller's sampling params must keep the run from
ending early: ``ignore_eos=true``, ``max_tokens=len(tv_force)``, no ``stop``/``stop_token_ids``).

Engine state (:class:`~tensorverse.store.engine_state.EngineState`, sent with each captured row):
what this interface shows of a step is the number of logits rows (= requests in the persistent
batch, ``batch_size``), the request's row index, and, through ``update_state`` (called once per
step, before the forward pass), the step itself and the requests added since the last step
(``joined``). Per step that costs one integer increment and one store in ``update_state``; the
tuple is built only for captured rows and turned into a record on the encoder thread. It does
not show the tokens scheduled in the step, the other requests' lengths or whether they are
prefilling (``context_tokens`` and ``prefill_reqs`` are ``-1``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

from tensorverse.capture import optin, runtime
from tensorverse.capture.tap import DeviceSlot, RowSlot, force_tokens, log_once
from tensorverse.store.engine_state import RUNNER_V1

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams

__all__ = ["V1CaptureProcessor", "validate_params"]


def validate_params(sampling_params: "SamplingParams") -> None:
    """Reject bad opt-ins at admission (ValueError -> HTTP 400). Inert when switched off."""
    if not runtime.enabled():
        return
    opt = optin.check_sampling_params(sampling_params)
    if opt is not None and opt.capture_id is not None and not runtime.sink_configured():
        raise optin.OptInError(
            "tensorverse capture: tv_capture needs a sink on this server "
            "(set TENSORVERSE_CAPTURE_SINK=http://HOST:PORT/PATH or dir:/path/to/store)")


def opt_in_of(params: "SamplingParams") -> optin.OptIn | None:
    """Engine side: the request's opt-in, or None. Never raises (admission already checked)."""
    extra = params.extra_args
    if not extra:
        return None
    try:
        return optin.parse_extra_args(extra)
    except Exception as e:  # noqa: BLE001
        log_once("optin", "ignoring an invalid tv_* opt-in: %s", e)
        return None


class _Req:
    __slots__ = ("opt", "out", "slot", "slot_pos", "slot_engine", "slot_evidence")

    def __init__(self, opt: optin.OptIn, out: list[int]) -> None:
        self.opt = opt
        self.out = out  # the runner's live output token list
        self.slot: RowSlot | DeviceSlot | None = None  # pending copy of a row not yet known to be sampled
        self.slot_pos = -1
        self.slot_engine: tuple[int, ...] | None = None  # the engine state of that copy
        self.slot_evidence: optin.EvidenceSpec | None = None  # tv_compact: what to decide of it


class V1CaptureProcessor(LogitsProcessor):
    """See the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", device: torch.device, is_pin_memory: bool) -> None:
        self.enabled = runtime.enabled()
        self.capturing = self.enabled and runtime.is_capture_rank()
        self.device = device
        self._reqs: dict[int, _Req] = {}
        self.engine_state = self.enabled and runtime.engine_state_enabled()
        self._step = 0  # engine steps seen (update_state calls), with engine state on
        self._joined = 0  # requests added by this step's BatchUpdate
        self._tp, self._pp = runtime.parallel_layout(vllm_config)

    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:
        validate_params(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return not self.enabled

    # -- batch bookkeeping -----------------------------------------------------------------
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if self.engine_state:
            self._step += 1
            self._joined = len(batch_update.added) if batch_update is not None else 0
        if not self._reqs and (batch_update is None or not batch_update.added):
            return
        try:
            self._update(batch_update)
        except Exception as e:  # noqa: BLE001 - never raise into vLLM
            runtime.note_error("v1.update_state", e)

    def _settle(self, st: _Req, *, leaving: bool = False) -> None:
        """Ship the pending row if its token was sampled; drop it if the request is leaving."""
        slot = st.slot
        if slot is None:
            return
        cid = st.opt.capture_id  # set: only a capturing request holds a slot
        if len(st.out) > st.slot_pos and cid is not None:
            st.slot = None
            runtime.get_tap().submit(slot, cid, st.slot_pos, st.slot_engine, st.slot_evidence)
        elif leaving:
            st.slot = None
            runtime.get_tap().release(slot, discarded=True)

    def _gone(self, st: _Req | None) -> None:
        if st is not None:
            self._settle(st, leaving=True)

    def _update(self, bu: BatchUpdate | None) -> None:
        reqs = self._reqs
        for st in reqs.values():
            self._settle(st)
        if bu is None:
            return
        for index in bu.removed:
            self._gone(reqs.pop(index, None))
        for index, params, _prompt, out in bu.added:
            self._gone(reqs.pop(index, None))
            if not self.enabled or params is None:
                continue
            opt = opt_in_of(params)
            if opt is not None:
                reqs[index] = _Req(opt, out)
        for a, b, direction in bu.moved:
            sa = reqs.pop(a, None)
            sb = reqs.pop(b, None)
            if direction == MoveDirectionality.SWAP:
                if sb is not None:
                    reqs[a] = sb
            else:
                self._gone(sb)
            if sa is not None:
                reqs[b] = sa

    # -- per step --------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._reqs:
            return logits
        try:
            self._apply(logits)
        except Exception as e:  # noqa: BLE001 - never raise into vLLM
            runtime.note_error("v1.apply", e)
        return logits

    def _apply(self, logits: torch.Tensor) -> None:
        n_rows, vocab = logits.shape[0], logits.shape[-1]
        tap = None
        copied: list[RowSlot | DeviceSlot] = []
        f_rows: list[int] = []
        f_toks: list[int] = []
        finished: list[int] = []
        for index, st in self._reqs.items():
            pos = len(st.out)
            if st.slot is not None and pos > st.slot_pos:
                self._settle(st)
            opt = st.opt
            if index >= n_rows:
                log_once("v1-index", "request index %d outside a %d-row logits batch", index, n_rows)
                continue
            if self.capturing and opt.captures(pos):
                tap = tap or runtime.get_tap()
                evidence = opt.evidence(pos)
                slot = tap.copy_row(logits, index, st.slot, evidence=evidence)
                st.slot = slot
                st.slot_pos = pos
                st.slot_evidence = evidence
                if self.engine_state:
                    st.slot_engine = (RUNNER_V1, self._step, n_rows, index, self._joined, -1, -1,
                                      self._tp, self._pp)
                if slot is not None:
                    copied.append(slot)
            tok = opt.forced_token(pos)
            if tok is not None:
                if tok < vocab:
                    f_rows.append(index)
                    f_toks.append(tok)
                else:
                    log_once("force-range", "forced token %d outside the vocabulary (%d)", tok, vocab)
            elif st.slot is None and opt.finished_at(pos):
                finished.append(index)
        if copied and tap is not None:  # a row was copied: the tap was taken
            tap.mark_copied(copied)
        if f_rows:
            force_tokens(logits, f_rows, f_toks)
            runtime.get_tap().rows_forced += len(f_rows)
        for index in finished:  # nothing left to capture or force: stop tracking
            del self._reqs[index]
