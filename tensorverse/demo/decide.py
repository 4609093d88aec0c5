"""The demo's second act: keep the agent working until the shadow under test is decided.

One scripted session is a handful of tool-calling turns, too few for a verdict (docs/verdict.md
decides on tool-calling turns, with anytime-valid bounds, so it may be looked at after every
batch). After it, the demo's agent goes on as a real agent would: more sessions of held-out tasks
(:func:`heldout_batch`, drawn from a fixed seed, never chosen by outcome), one session per batch,
each shadowed like the first. After each batch the verdict of the shadow under test is computed
again over all the demo's sessions and one live line printed (:func:`progress_line`). It stops
when the verdict is ``regression`` or ``equivalent``, at ``max_turns`` tool-calling turns, or at
``max_seconds``; where the shadow is truly within noise it ends ``undecided`` and says so.

:func:`run_until_decided` is the loop itself, with the batch and the verdict passed in (the demo
passes the real ones: vLLM servers behind the proxy; the tests pass both kinds).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from tensorverse.demo import corpus

if TYPE_CHECKING:
    from tensorverse.store import Store

DECIDE_SEED = 515_151  # the batches' tasks: Random(DECIDE_SEED + batch), router Random the same
TASKS_PER_BATCH = 4
DEFAULT_MAX_TURNS = 120  # tool-calling turns of the shadow under test
DEFAULT_MAX_SECONDS = 240.0  # the loop's wall-clock cap ("a few minutes")


def heldout_batch(batch: int, n_tasks: int = TASKS_PER_BATCH) -> tuple[list[str], corpus.Router]:
    """The user tasks of batch ``batch`` and the router that answers them: held-out tasks of
    every kind (the training sessions are drawn from other seeds)."""
    rng = random.Random(DECIDE_SEED + batch)
    router = corpus.Router(rng.randrange(2**31))
    tasks = corpus.make_session(rng, n_tasks, router)
    return [t.user for t in tasks], router


@dataclass
class Decision:
    """Where the loop stopped: the verdict of the shadow under test (docs/verdict.md, as
    ``verdicts_json`` writes one shadow) over every session so far."""

    backend: str
    verdict: dict[str, Any] | None
    sessions: list[str] = field(default_factory=list)
    batches: int = 0  # sessions run after the scripted one
    stopped: str = "disabled"  # decided, max_turns, max_seconds, disabled, no_verdict
    seconds: float = 0.0

    @property
    def decision(self) -> str:
        return (self.verdict or {}).get("decision") or "undecided"

    @property
    def tool_call_turns(self) -> int:
        return int((self.verdict or {}).get("tool_call_turns") or 0)

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "decision": self.decision, "tool_call_turns": self.tool_call_turns,
                "sessions": list(self.sessions), "batches": self.batches, "stopped": self.stopped,
                "seconds": round(self.seconds, 1), "verdict": self.verdict}


def progress_line(backend: str, verdict: dict[str, Any] | None) -> str:
    """One line per batch: ``fp8_kv: undecided after 24 tool-calling turns, about 12 more``."""
    if verdict is None:
        return f"{backend}: no verdict yet (no comparison with the primary)"
    n = verdict.get("tool_call_turns") or 0
    d = verdict.get("decision") or "undecided"
    if d != "undecided":
        return f"{backend}: {d.upper()} after {n} tool-calling turns"
    more = verdict.get("turns_needed")
    tail = "no decision in sight at this rate" if more is None else f"about {more} more"
    return f"{backend}: undecided after {n} tool-calling turns, {tail}"


def run_until_decided(backend: str, first_session: str, *, run_batch: Callable[[int], str],
                      verdict_of: Callable[[list[str]], dict[str, Any] | None],
                      say: Callable[[str], None], max_turns: int = DEFAULT_MAX_TURNS,
                      max_seconds: float = DEFAULT_MAX_SECONDS, enabled: bool = True,
                      clock: Callable[[], float] = time.monotonic) -> Decision:
    """Run batches (``run_batch(i)`` runs batch ``i`` as one session, shadowed and drained, and
    returns its session id) until ``verdict_of(sessions)`` decides, the shadow under test has
    ``max_turns`` tool-calling turns, or ``max_seconds`` passed (checked between batches: a batch
    started is finished). One :func:`progress_line` per batch."""
    t0 = clock()
    sessions = [first_session]
    verdict = verdict_of(sessions)
    out = Decision(backend, verdict, sessions)
    say(progress_line(backend, verdict) + " (the scripted session)")
    if not enabled:
        out.stopped = "disabled"
        return out
    while True:
        out.verdict = verdict
        if verdict is None and out.batches:  # a batch brought no comparison either: more will not
            out.stopped = "no_verdict"
            break
        if verdict is not None and verdict.get("decision") in ("regression", "equivalent"):
            out.stopped = "decided"
            break
        if out.tool_call_turns >= max_turns:
            out.stopped = "max_turns"
            break
        if clock() - t0 >= max_seconds:
            out.stopped = "max_seconds"
            break
        sessions.append(run_batch(out.batches))
        out.batches += 1
        verdict = verdict_of(sessions)
        say(progress_line(backend, verdict) + f" (batch {out.batches}, {clock() - t0:.0f} s)")
    out.seconds = clock() - t0
    return out


def stop_reason_text(d: Decision, max_turns: int, max_seconds: float) -> str:
    return {"decided": "decided",
            "max_turns": f"stopped at the cap of {max_turns} tool-calling turns (--max-turns)",
            "max_seconds": f"stopped at the cap of {max_seconds:.0f} s (--until-decided lifts it)",
            "disabled": "one session only (--no-decide)",
            "no_verdict": "no verdict: no comparison with the primary"}.get(d.stopped, d.stopped)


# -- the first broken tool call, side by side ----------------------------------------------------


def _calls_text(calls: Iterable[Any]) -> str:
    parts = []
    for c in calls:
        args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in (c.arguments or {}).items())
        parts.append(f"{c.name}({args})")
    return "; ".join(parts) or "(no tool call)"


def first_broken_call(store: Store, sessions: list[str], backend: str, token_text: Callable[[int | None], str]
                      ) -> dict[str, Any] | None:
    """The first free run of ``backend`` (sessions in order, turns in order) whose tool calls
    differ from the primary's: both calls, the token where the run left the primary's path, and
    the margin there: the forced comparison's (p1 - p2 of its reference, ``forced_margin``) and the
    free flip's attribution (``margin``: logit difference in nats, where the primary's recorded
    top-k holds both tokens)."""
    from tensorverse.analysis.toolcalls import extract_tool_calls

    for sid in sessions:
        for t in sorted(store.iter_turns(sid), key=lambda t: t.index):
            runs = {(r.backend, r.mode): r for r in store.iter_runs(t.id)}
            rec = next((r for (b, m), r in runs.items() if m == "recorded"), None)
            free = runs.get((backend, "free"))
            if rec is None or free is None or free.status != "ok":
                continue
            cmp = next((c for c in store.iter_comparisons(free.id)
                        if c.mode == "free" and c.status == "ok"), None)
            if cmp is None or cmp.verdict in (None, "match"):
                continue
            ref = extract_tool_calls(rec.text or "", openai_tool_calls=rec.tool_calls)
            cand = extract_tool_calls(free.text or "")
            d = cmp.divergence or {}
            flip = (cmp.attribution or {}).get("flip") or {}
            pos = d.get("position")
            forced_margin, forced_ref = _forced_margin(store, runs.get((backend, "forced")), pos)
            return {"session_id": sid, "turn": t.index, "turn_id": t.id, "verdict": cmp.verdict,
                    "primary_call": _calls_text(ref.calls), "shadow_call": _calls_text(cand.calls),
                    "position": pos, "token": d.get("ref_token"), "cand_token": d.get("cand_token"),
                    "token_text": token_text(d.get("ref_token")), "cand_token_text": token_text(d.get("cand_token")),
                    "margin": flip.get("margin"), "forced_margin": forced_margin, "forced_ref": forced_ref,
                    "flip_class": cmp.flip_class}
    return None


def _forced_margin(store: Store, forced: Any, position: int | None) -> tuple[float | None, str | None]:
    """The forced comparison's margin (p1 - p2 of its reference) at ``position``: the free run left
    the primary's path there, on the primary's exact prefix, which is what the forced run decodes."""

    if forced is None or forced.status != "ok" or position is None:
        return None, None
    cmps = [c for c in store.iter_comparisons(forced.id)
            if c.mode == "forced" and c.status == "ok" and not c.noise_floor]
    for c in sorted(cmps, key=lambda c: c.kind != "full"):  # full rows first
        margins = (c.metrics or {}).get("margin") or []
        positions = c.positions or list(range(len(margins)))
        if position in positions:
            i = positions.index(position)
            if i < len(margins) and margins[i] is not None:
                return float(margins[i]), c.ref_backend
    return None, None


def viewer_link(base: str, b: dict[str, Any]) -> str:
    """The viewer at the turn's free runs, the position where the shadow left the primary selected
    (``base`` the viewer's URL; empty: the fragment alone)."""
    pos = b.get("position")
    return f"{base}/#/t/{b['turn_id']}?mode=free" + (f"&p={pos}" if pos is not None else "")


def runs_seconds(store: Store, sessions: list[str], backend: str) -> float:
    """The request time of ``backend``'s runs in ``sessions``: what the shadow cost (CPU-seconds
    here, GPU-seconds on a GPU shadow: how `[shadow] gpu_seconds_per_day` budgets are charged)."""

    total = 0.0
    for sid in sessions:
        for t in store.iter_turns(sid):
            for r in store.iter_runs(t.id):
                if r.backend == backend and r.mode in ("forced", "free"):
                    total += float(r.timings.get("request_s") or 0.0)
    return total


def format_decision_head(d: dict[str, Any], decision_text: str | None, broken: dict[str, Any] | None,
                         link: str | None, stop_text: str, cpu_seconds: float | None) -> list[str]:
    """The summary's first lines: the verdict of the shadow under test over all the demo's
    sessions (``decision_text``: the verdict in a line), the first broken tool call side by side,
    the viewer link to it."""
    cost = f", {cpu_seconds:.0f} CPU-seconds of its runs" if cpu_seconds is not None else ""
    lines = [f"{d['backend']}: " + (decision_text or "no verdict (no comparison with the primary)"),
             f"  {len(d['sessions'])} session(s), {d['tool_call_turns']} tool-calling turns, "
             f"{d['seconds']:.0f} s after the scripted session{cost}; {stop_text}"]
    if broken is None:
        lines.append(f"  no broken tool call: every free run of {d['backend']} called the primary's tools")
        return lines
    if broken.get("forced_margin") is not None:
        mg = f"margin p1-p2 = {abs(broken['forced_margin']):.4f} under {broken['forced_ref']}"
    elif broken.get("margin") is not None:
        mg = f"the primary's margin {abs(broken['margin']):.4f} nats"
    else:
        mg = "margin unknown"
    lines += [f"  first broken tool call ({broken['verdict']}), session {broken['session_id']} turn {broken['turn']}:",
              f"    primary:  {broken['primary_call']}",
              f"    {d['backend'] + ':':<9} {broken['shadow_call']}"]
    if broken.get("position") is not None:
        lines.append(f"    left the primary's path at output position {broken['position']}: primary "
                     f"{broken['token_text']!r}, {d['backend']} {broken['cand_token_text']!r} "
                     f"({mg})")
    if link:
        lines.append(f"  viewer: {link}")
    return lines
