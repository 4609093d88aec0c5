"""Run records, built by pure functions: what ``store.put_run`` stores for a turn's runs, as
:class:`~tensorverse.store.records.Run` records.

Run record (``store.put_run``; its ``id`` is the capture id): ``id``, ``turn_id``,
``session_id``, ``backend``, ``role``, ``mode`` (``forced``/``free``; the primary's own output is
stored as a ``recorded`` run, id ``<turn id>~primary``), ``status`` (``ok``/``failed``/
``timeout``/``refused``), ``capture`` (``full``/``topk``), ``approximate``, ``method``
(``forced_decode``/``prompt_logprobs``/``generate``), ``token_ids``, ``text``, ``finish_reason``,
``top_logprobs`` (per position ``[[id, logprob], ...]``, best first), ``token_logprobs``, ``k``,
``rows`` (``expected``, ``present``, ``complete``, ``waited_s``), ``timings`` (``request_s``,
``rows_wait_s``, ``total_s``), ``sampling`` (what was sent, without the prompt), ``template``
(the chat-template check), ``tokenizer``, ``attempts`` (earlier tries and why they were abandoned),
``error``.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from tensorverse.capture.optin import KEY_FORCE
from tensorverse.shadow.backend import Backend
from tensorverse.shadow.client import BackendError
from tensorverse.shadow.turn import TurnInput
from tensorverse.store.records import FORCED, FREE, RECORDED, Run

__all__ = ["RECORDED", "MODES", "primary_run_id", "run_record", "fail_run", "sent_sampling",
           "primary_record", "primary_parser_check"]

log = logging.getLogger("tensorverse.shadow")

MODES = (FORCED, FREE)


def primary_run_id(turn_id: str) -> str:
    """The id of the run record holding the primary's own output for a turn."""
    return f"{turn_id}~primary"


def run_record(t: TurnInput, backend: Backend, mode: str, run_id: str) -> Run:
    """A run's record before it runs: ``failed`` with no tokens until the run fills it in."""
    return Run(
        id=run_id,
        turn_id=t.id,
        session_id=t.session_id,
        backend=backend.name,
        role=backend.role,
        mode=mode,
        status="failed",
        capture="topk",
        approximate=True,
        k=backend.logprobs,
        prompt_tokens=len(t.prompt_token_ids),
    )


def fail_run(run: Run, e: BackendError | str) -> Run:
    """Mark ``run`` failed (or ``timeout``) with the error's words; returns it."""
    if isinstance(e, BackendError):
        run.status = "timeout" if e.kind == "timeout" else "failed"
        run.error = str(e)
    else:
        run.status = "failed"
        run.error = e
    return run


def sent_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """What was sent, without the prompt and the forced ids (they are in the turn)."""
    out = {k: v for k, v in body.items() if k != "prompt"}
    xa = out.get("vllm_xargs")
    if isinstance(xa, dict) and KEY_FORCE in xa:
        out["vllm_xargs"] = {**xa, KEY_FORCE: f"<{len(xa[KEY_FORCE])} forced ids>"}
    return out


def primary_record(t: TurnInput, pieces: list[str] | None,
                   primary: Backend | None) -> Run:
    """The ``recorded`` run: the primary's own answer, as the turn holds it."""
    return Run(
        id=primary_run_id(t.id),
        turn_id=t.id,
        session_id=t.session_id,
        backend=t.primary or (primary.name if primary else "primary"),
        role="primary",
        mode=RECORDED,
        status="ok",
        capture="topk" if t.top_logprobs else "none",
        approximate=True,
        method="recorded",
        token_ids=list(t.output_token_ids),
        text=t.text,
        finish_reason=t.finish_reason,
        top_logprobs=t.top_logprobs,
        pieces=None if pieces is None else list(pieces),
        tool_calls=t.tool_calls,
        prompt_tokens=len(t.prompt_token_ids),
        sampling=t.sampling,
    )


def primary_parser_check(t: TurnInput, pieces: Sequence[str]) -> dict[str, Any] | None:
    """The primary's emitted tool calls against its own output ids re-parsed (the ids decoded
    into ``pieces``, the project's extractor): issue 19's parser check, run here in the shadow
    worker, never on the agent's path. None when it cannot be made."""
    from tensorverse.analysis.attribution import parser_check

    try:
        return parser_check("".join(pieces), t.text, t.tool_calls).as_dict()
    except Exception as e:  # noqa: BLE001 - a check never breaks shadowing
        log.info("tensorverse shadow: parser check of turn %s failed: %s", t.id, e)
        return None
