"""Fast tests of the demo's world: the corpus generator, the simulated router, the rendering of
training text with the real Qwen3 chat template, the full-softmax-exact compact head, and the
summary helpers of the demo runner. No vLLM."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from tensorverse.analysis.toolcalls import extract_tool_calls
from tensorverse.demo import corpus
from tensorverse.demo.agent import SCRIPT, demo_router, run_session
from tensorverse.demo.corpus import (TOOLS, Router, canonical_interface, make_session, make_task, session_messages,
                                     tool_call_text)


def test_generator_is_deterministic_and_varied():
    a = [t.user for t in make_session(random.Random(7), 5)]
    b = [t.user for t in make_session(random.Random(7), 5)]
    assert a == b
    kinds = {make_task(random.Random(i), Router(i)).kind for i in range(60)}
    assert kinds == set(corpus.TASK_KINDS)


@pytest.mark.parametrize("kind", corpus.TASK_KINDS)
def test_each_task_kind_calls_the_right_tools_with_values_from_the_request(kind):
    rng = random.Random(3)
    for _ in range(20):
        t = make_task(rng, Router(rng.randrange(1000)), kind)
        names = [c.name for c in t.calls]
        expected = {"mac_owner": ["show_mac_address_table", "show_interface"],
                    "describe_interface": ["show_interface"],
                    "set_description": ["configure_interface_description"],
                    "check_vlan": ["show_vlan"],
                    "show_route": ["show_ip_route"]}[kind]
        assert names == expected
        first = t.calls[0].arguments
        for v in first.values():
            assert str(v) in t.user  # the first call's arguments are copied from the request
        if kind == "mac_owner":  # the second call's interface comes from the first result
            short = t.calls[1].arguments["interface"]
            abbrev = short.replace("TenGigabitEthernet", "Te").replace("GigabitEthernet", "Gi").replace("FastEthernet", "Fa")
            assert abbrev in t.calls[0].result
        assert t.answer and "<tool_call>" not in t.answer
        for c in t.calls:
            schema = next(x["function"] for x in TOOLS if x["function"]["name"] == c.name)
            assert list(c.arguments) == schema["parameters"]["required"]


def test_router_is_consistent_and_tolerant():
    r = Router(1)
    a = r.call("show_interface", {"interface": "GigabitEthernet0/0/1.201"})
    assert a == r.call("show_interface", {"interface": "GigabitEthernet0/0/1.201"})
    assert a.startswith("GigabitEthernet0/0/1.201 is ")
    r.call("configure_interface_description", {"interface": "GigabitEthernet0/0/1.201", "description": "x y"})
    assert "Description: x y" in r.call("show_interface", {"interface": "GigabitEthernet0/0/1.201"})
    assert r.call("show_vlan", {"vlan_id": "abc"}).startswith("% Invalid input")
    assert r.call("show_vlan", {}).startswith("% Invalid input")
    assert r.call("reload", {}).startswith("% Unknown command")
    dr = demo_router()
    assert "Gi0/0/3" in dr.call("show_mac_address_table", {"mac_address": "5c8a.38f2.1e04"})
    assert "desk 4F-12 (jsmith)" in dr.call("show_interface", {"interface": "GigabitEthernet0/0/3"})
    # IOS accepts an interface written either way: one state, the spelling echoed back
    assert "desk 4F-12 (jsmith)" in dr.call("show_interface", {"interface": "Gi0/0/3"})
    assert dr.call("show_interface", {"interface": "Gi0/0/3"}).startswith("Gi0/0/3 is up")
    assert canonical_interface("Te1/0/4.30") == "TenGigabitEthernet1/0/4.30"
    assert canonical_interface("GigabitEthernet0/1") == "GigabitEthernet0/1"
    assert canonical_interface("Gizmo0") == "Gizmo0"


def test_the_corpus_holds_fair_near_ties():
    """The two deliberate coins (port spelling in the second MAC-owner call, answer phrasing) come
    out both ways, about half the time each: the near-ties the demo's runtimes can flip on."""
    rng = random.Random(7)
    spelled, phrasing = [], []
    for _ in range(400):
        t = make_task(rng, Router(rng.randrange(1000)), "mac_owner")
        spelled.append(t.calls[1].arguments["interface"] == canonical_interface(t.calls[1].arguments["interface"]))
        phrasing.append(" in VLAN " in t.answer)
        assert t.calls[1].arguments["interface"] in t.answer
    for flags in (spelled, phrasing):
        assert 0.4 < sum(flags) / len(flags) < 0.6


def test_tool_call_text_parses_back():
    text = tool_call_text("show_vlan", {"vlan_id": 201})
    x = extract_tool_calls(text)
    assert x.ok and [(c.name, c.arguments) for c in x.calls] == [("show_vlan", {"vlan_id": 201})]


def test_session_messages_targets_follow_the_conversation():
    tasks = make_session(random.Random(11), 3)
    msgs, targets = session_messages(tasks)
    assert msgs[0]["role"] == "system"
    for k, text in targets:
        assert msgs[k]["role"] == "assistant"
        if text.startswith("<tool_call>"):
            fn = msgs[k]["tool_calls"][0]["function"]
            assert text == tool_call_text(fn["name"], fn["arguments"])
            assert msgs[k + 1]["role"] == "tool"
        else:
            assert msgs[k]["content"] == text


class _FakeChoice:
    def __init__(self, text):
        self.message = type("M", (), {"content": text, "tool_calls": None})()
        self.finish_reason = "stop"


class _FakeClient:
    """Answers like a perfect model that writes tool calls as text (no tool parser)."""

    def __init__(self):
        self.requests = []
        outer = self

        class _C:
            @staticmethod
            def create(**kw):
                outer.requests.append(kw)
                msgs = kw["messages"]
                last = msgs[-1]
                if last["role"] == "user":
                    user = last["content"]
                    if "MAC" in user:
                        text = tool_call_text("show_mac_address_table", {"mac_address": "5c8a.38f2.1e04"})
                    elif "VLAN" in user:
                        text = tool_call_text("show_vlan", {"vlan_id": 201})
                    else:
                        text = tool_call_text("show_interface", {"interface": "GigabitEthernet0/0/1.201"})
                else:
                    text = "Done."
                return type("R", (), {"choices": [_FakeChoice(text)]})()

        self.chat = type("Chat", (), {"completions": _C()})()


def test_agent_loop_runs_tools_and_grows_the_history():
    client = _FakeClient()
    tr = run_session(client, "m", tasks=3, session_id="s1")
    assert [e.kind for e in tr.turns] == ["call", "answer"] * 3
    assert [m["role"] for m in tr.messages].count("user") == 3
    assert tr.messages[1]["content"] == SCRIPT[0]
    assert "Description: uplink to edge-r2" in tr.turns[0].results[0]  # the demo router's state
    assert "Gi0/0/3" in tr.turns[4].results[0]  # the MAC task (third)
    # every request carries the tools, greedy decoding and the session header
    for kw in client.requests:
        assert kw["tools"] == TOOLS and kw["temperature"] == 0
        assert kw["extra_headers"]["X-Tensorverse-Session"] == "s1"
    # history: the call is sent back as an assistant tool_calls message + a tool message
    a = tr.messages[2]
    assert a["role"] == "assistant" and a["tool_calls"][0]["function"]["name"] == "show_interface"
    assert json.loads(a["tool_calls"][0]["function"]["arguments"]) == {"interface": "GigabitEthernet0/0/1.201"}
    assert tr.messages[3]["role"] == "tool" and tr.messages[3]["tool_call_id"] == a["tool_calls"][0]["id"]
    with pytest.raises(ValueError):
        run_session(client, "m", tasks=0)


def _log(task, kind, calls=()):
    from tensorverse.demo.agent import TurnLog

    return TurnLog(task, kind, "" if calls else "done", [{"name": n, "arguments": a} for n, a in calls])


def test_script_check_takes_the_right_calls_in_either_spelling_and_names_each_wrong_task():
    from tensorverse.demo.agent import SCRIPT_CALLS, Transcript, script_check

    right = []
    for ti, calls in enumerate(SCRIPT_CALLS):
        right += [_log(ti, "call", [c]) for c in calls] + [_log(ti, "answer")]
    assert [c.right for c in script_check(Transcript("s", [], right))] == [True] * len(SCRIPT_CALLS)
    # the MAC task's port as the table printed it: the same request (show_interface takes both)
    abbrev = [e if not (e.task == 2 and e.calls and e.calls[0]["name"] == "show_interface")
              else _log(2, "call", [("show_interface", {"interface": "Gi0/0/3"})]) for e in right]
    assert all(c.right for c in script_check(Transcript("s", [], abbrev)))
    # the seed's broken runtime: another interface described; a task cut without an answer
    wrong = [_log(0, "call", [("configure_interface_description",
                               {"interface": "GigabitEthernet1/0/1.201", "description": "uplink to core-sw1"})]),
             _log(0, "answer"), _log(1, "call", [SCRIPT_CALLS[1][0]]), _log(1, "malformed")]
    checks = script_check(Transcript("s", [], wrong))
    assert [(c.task, c.right, c.answered) for c in checks] == [(0, False, True), (1, False, False)]
    assert checks[0].expected == [{"name": n, "arguments": a} for n, a in SCRIPT_CALLS[0]]


def test_script_check_reads_a_session_the_agent_drove():
    """The fake model describes the interface it was asked to relabel (wrong), describes it when
    asked (right) and stops the MAC chase after the table lookup (wrong: the port is not shown)."""
    from tensorverse.demo.agent import script_check

    tr = run_session(_FakeClient(), "m", tasks=3, session_id="s1")
    assert [(c.task, c.right) for c in script_check(tr)] == [(0, False), (1, True), (2, False)]


# -- rendering with the real tokenizer -----------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from tensorverse.demo.model import load_tokenizer

    return load_tokenizer()


def test_training_text_is_what_vllm_renders(tok):
    """Each assistant turn of a training sequence sits right after the prompt vLLM would render
    for that turn (add_generation_prompt=True), and tokenizes the same inside the sequence."""
    from tensorverse.demo.model import Renderer

    rend = Renderer(tok)
    rng = random.Random(5)
    for _ in range(4):
        tasks = make_session(rng, rng.randint(1, 4))
        msgs, targets = session_messages(tasks)
        k_last, last = targets[-1]
        full = rend.prompt(msgs[:k_last]) + last + "<|im_end|>"
        full_ids = tok(full, add_special_tokens=False)["input_ids"]
        for k, text in targets:
            p = rend.prompt(msgs[:k])
            assert full.startswith(p + text + "<|im_end|>")
            p_ids = tok(p, add_special_tokens=False)["input_ids"]
            assert full_ids[: len(p_ids)] == p_ids
        s = rend.sample(tasks, 0.5, 3.0)
        assert rend.prefix_ids + s.ids == full_ids
        # weights only on the assistant's turns; argument values weigh the most
        text_w = "".join(tok.decode([t]) for t, w in zip(s.ids, s.weights) if w > 0)
        assert "<tool_call>" in text_w and "<|im_start|>" not in text_w and "tool_response" not in text_w
        assert max(s.weights) == 3.0 and 0.5 in s.weights


def test_compact_head_is_exact_under_the_full_softmax():
    import torch
    from tensorverse.demo import model as M

    spec = M.DemoSpec(hidden_size=64, intermediate_size=64, num_hidden_layers=1, head_dim=32)
    vocab = [3, 10, 151645, 200]
    m = M._modules()(spec, vocab)
    M._init(m, spec)
    with torch.no_grad():
        h, _ = m(torch.tensor([[0, 1, 2, 3]]))
        compact = torch.log_softmax(m.logits(h).double(), -1)[0, -1]
        full = torch.zeros(151936, dtype=torch.float64)
        full[torch.tensor(vocab)] = m.head(h).double()[0, -1]
        ref = torch.log_softmax(full, -1)
    assert torch.allclose(compact[:-1], ref[torch.tensor(vocab)], atol=1e-9)
    assert math.isclose(float(compact[-1].exp()), float(ref.exp().sum() - ref[torch.tensor(vocab)].exp().sum()),
                        rel_tol=1e-9)


def test_summary_of_an_empty_session_is_honest(tmp_path):
    from tensorverse.demo.run import format_summary, summarize_session
    from tensorverse.store import Store

    with Store.open(tmp_path / "s", durable=False) as st:
        s = summarize_session(st, "nope")
    assert s["turns"] == 0 and s["first_flip"] is None and not s["any_flip"]
    assert "no flip" in format_summary(s)


def _backend(role, flips, regions, diverged, verdicts, n=100, turns=4):
    return {"role": role, "forced_turns": turns, "positions": n, "flips": flips, "flips_by_region": regions,
            "kl_mean": 1e-3, "kl_max": 1e-2, "free_turns": turns, "diverged_turns": diverged,
            "verdicts": verdicts, "noise_floor_flips": None, "failed_runs": 0}


def test_fp8_kv_verdict_against_the_noise_floor():
    from tensorverse.demo.run import DEFAULT_RUNTIMES, RUNTIMES, format_summary, shadow_departures

    assert DEFAULT_RUNTIMES[0] == "fp8_kv" and "secondary" in DEFAULT_RUNTIMES
    fp8 = RUNTIMES["fp8_kv"]
    assert (fp8.dtype, fp8.role, fp8.extra_args) == ("bfloat16", "shadow", ("--kv-cache-dtype", "fp8"))
    assert RUNTIMES["secondary"].dtype == "bfloat16" and RUNTIMES["secondary"].extra_args == ()
    broken = {"turn": 0, "turn_id": "t0", "backend": "fp8_kv", "verdict": "value_mismatch",
              "path": "$.arguments.description", "reference": "uplink to dist-sw3", "candidate": "uplink to core-sw1"}
    first = {"turn": 0, "turn_id": "t0", "backend": "fp8_kv", "ref_backend": "secondary", "position": 38,
             "region": "tool_args", "token": 1, "cand_token": 2, "margin": 0.25, "kl": 0.1,
             "token_text": " dist", "cand_token_text": " core"}
    s = {"session_id": "s", "turns": 4, "output_tokens": 100, "first_flip": first, "closest_call": None,
         "broken_tool_call": broken, "any_flip": True,
         "backends": {"fp8_kv": _backend("shadow", 5, {"content": 2, "tool_args": 3}, 2,
                                         {"match": 3, "value_mismatch": 1}),
                      "secondary": _backend("secondary", 1, {"content": 1}, 1, {"match": 4})},
         "first_flip_by_backend": {"fp8_kv": first}, "broken_tool_call_by_backend": {"fp8_kv": broken}}
    v = shadow_departures(s, "fp8_kv")
    assert (v.flips, v.floor_flips, v.excess_flips) == (5, 1, 4)
    assert (v.diverged_turns, v.excess_diverged_turns) == (2, 1)
    assert (v.broken_tool_calls, v.floor_broken_tool_calls, v.excess_broken_tool_calls) == (1, 0, 1)
    assert v.first_broken_tool_call == broken and v.first_flip == first and v.departs
    assert shadow_departures(s, "fp16") is None
    from tensorverse.analysis.verdict import TurnEvidence, VerdictPolicy, decide, verdicts_json

    ev = [TurnEvidence(turn_id=f"t{i}", session_id="s", created_ns=i, positions=25, flips=[5, 0, 0, 0][i],
                       floor_positions=25, floor_flips=[1, 0, 0, 0][i], tool_call_turn=True,
                       broke=i == 0, floor_broke=False) for i in range(4)]
    decision = verdicts_json([decide("fp8_kv", "shadow", ev, floor_backend="secondary")], VerdictPolicy())["shadows"][0]
    s["verdict"] = {"shadows": [decision]}
    s["under_test"] = dataclasses.asdict(v) | {"departs": v.departs, "verdict": decision}
    text = format_summary(s)
    lines = text.splitlines()
    # the FP8-KV verdict leads, before the per-backend table: the decision, then the counts
    assert lines[2].startswith("FP8-KV verdict: fp8_kv (bfloat16 + FP8 KV cache")
    assert "UNDECIDED after 4 tool-calling turns; about" in lines[2]
    assert "tool-call break excess +25.00% [" in lines[2] and "flip excess per turn +4.00% [" in lines[2]
    assert "(vs secondary)" in lines[2]
    assert lines[3] == "  this session, counted (descriptive, not a decision): DEPARTS from the noise floor"
    assert "content 2, tool_args 3" in lines[4] and "excess +4" in lines[4]
    assert "2/4 turns diverged" in lines[5] and "excess +1" in lines[5]
    assert "    fp8_kv  UNDECIDED after 4 tool-calling turns" in text  # the verdicts section
    assert 'first broken tool call: turn 0: value_mismatch at $.arguments.description: primary ' \
           '"uplink to dist-sw3" vs fp8_kv "uplink to core-sw1"' in text
    assert text.index("FP8-KV verdict") < text.index("backend    role")
    # as many flips as its own noise floor: within it
    s["backends"]["fp8_kv"] = _backend("shadow", 1, {"content": 1}, 1, {"match": 4})
    v = shadow_departures(s, "fp8_kv")
    assert v.excess_flips == 0 and not v.departs
    # no secondary: no floor, any flip departs
    del s["backends"]["secondary"]
    v = shadow_departures(s, "fp8_kv")
    assert v.floor_backend is None and v.excess_flips is None and v.departs
