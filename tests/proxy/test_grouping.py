"""Session grouping (`tensorverse.proxy.grouping`, `tensorverse.proxy.sessions`): the rule as
pure functions, and the `Sessions` addon driven turn by turn with real flows and the real chat
accumulator (what the proxy calls it with)."""

from __future__ import annotations

import asyncio
import copy
import random

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from tensorverse.proxy import grouping as G
from tensorverse.proxy.flow import Flow
from tensorverse.proxy.accumulate import ACCUMULATORS
from tensorverse.proxy.protocol import CHAT
from tensorverse.proxy.recorder import Recorder
from tensorverse.proxy.sessions import Sessions

SYSTEM = {"role": "system", "content": "You are a network automation agent."}
TOOLS = [{"type": "function", "function": {"name": "show", "parameters": {"type": "object"}}}]


def call(name: str, args: dict, cid: str = "call_1") -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": orjson.dumps(args).decode()}}]}


class Driver:
    """Sends requests through a `Sessions` addon as the proxy does: `request_forwarded`, then
    (after the answer) `response_done` with the answer in the real chat accumulator."""

    def __init__(self, store=None, **kw) -> None:
        self.clock = [0.0]
        self.sessions = Sessions(store, clock=lambda: self.clock[0], **kw)
        self.recorder = Recorder(store) if store is not None else None  # next in line, as in the proxy

    def start(self, messages, *, tools=TOOLS, headers=None, body_extra=None) -> Flow:
        body = {"model": "m", "messages": messages, **({"tools": tools} if tools else {}), **(body_extra or {})}
        f = Flow("POST", "/v1/chat/completions", "", CIMultiDictProxy(CIMultiDict(headers or {})),
                 orjson.dumps(body), kind=CHAT)
        self.clock[0] += 1
        self.sessions.request_forwarded(f)
        return f

    def finish(self, f: Flow, answer: dict) -> None:
        f.status = 200
        acc = ACCUMULATORS[CHAT]()
        msg = {"role": "assistant", "content": answer.get("content"), "tool_calls": answer.get("tool_calls") or []}
        acc.add_body({"id": "x", "object": "chat.completion", "model": "m",
                      "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]})
        f.meta["acc"] = acc
        asyncio.run(self.sessions.response_done(f))
        if self.recorder is not None:
            asyncio.run(self.recorder.response_done(f))
            f.meta["turn_future"].result(timeout=10)  # raises what the store refused

    def turn(self, messages, answer, **kw) -> Flow:
        f = self.start(messages, **kw)
        self.finish(f, answer)
        return f


def conversation(tag: str, n: int) -> list[tuple[list[dict], dict]]:
    """n turns of an agent: each turn's request is the history so far; answers alternate tool
    calls and texts. Every text carries ``tag`` (unrelated conversations share nothing else but
    the system prompt and the tools)."""
    msgs = [SYSTEM, {"role": "user", "content": f"[{tag}] check the uplinks of site {tag}"}]
    out = []
    for i in range(n):
        answer = call("show", {"what": f"{tag}-{i}"}, f"c{i}") if i % 2 == 0 else {"role": "assistant", "content": f"{tag}: step {i} done"}
        out.append((copy.deepcopy(msgs), answer))
        msgs.append(answer)
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"{tag} result {i}\nline two"} if i % 2 == 0
                    else {"role": "user", "content": f"[{tag}] and now part {i}"})
    return out


# -- the rule, pure ------------------------------------------------------------------------------

def test_rule_extends_edits_notes_whitespace():
    conv = conversation("a", 4)
    prev_req, prev_ans = conv[2]
    prev = G.history(prev_req, TOOLS, prev_ans)
    nxt = conv[3][0]
    assert G.continuation(prev, G.history(nxt, TOOLS)) == G.Match(len(prev.body), G.EXTENDS)
    edited = copy.deepcopy(nxt)
    edited[2] = call("show", {"what": "something else"})  # the agent substituted its own call
    assert G.continuation(prev, G.history(edited, TOOLS)).evidence == G.EDITED
    noted = copy.deepcopy(nxt)
    noted[3]["content"] = "a  result 0\n\n  line   two  "  # whitespace re-rendered
    noted.insert(4, {"role": "system", "content": "context is 80% full"})  # a transient note
    assert G.continuation(prev, G.history(noted, TOOLS)).evidence == G.EXTENDS
    # another conversation with the same system prompt and tools
    assert G.continuation(prev, G.history(conversation("b", 4)[3][0], TOOLS)) is None
    # same messages but a shorter request does not extend the latest history
    assert G.continuation(prev, G.history(nxt[:3], TOOLS)) is None


def test_rule_compaction_and_tail():
    conv = conversation("a", 6)
    req, ans = conv[5]
    prev = G.history(req, TOOLS, ans)
    summary = "The user asked to check uplinks of site a; show was called five times."
    compacted = [SYSTEM, {"role": "user", "content": "[Conversation summary]"},
                 {"role": "assistant", "content": summary}, {"role": "user", "content": "go on"}]
    assert G.continuation(prev, G.history(compacted, TOOLS)) is None
    assert G.continuation(prev, G.history(compacted, TOOLS), [summary]).evidence == G.COMPACTION
    noted = copy.deepcopy(compacted)
    noted[2]["content"] += "\n\n## Continue\nThe user's last message was: ..."  # turnstone's note
    assert G.continuation(prev, G.history(noted, TOOLS), [summary]).evidence == G.COMPACTION
    # with another system prompt the summary is not enough
    assert G.continuation(prev, G.history([{"role": "system", "content": "x"}, *compacted[1:]], TOOLS), [summary]) is None
    # tail: the newest messages kept, older ones dropped without a summary
    tail = [SYSTEM, *req[-2:], ans, {"role": "user", "content": "next"}]
    m = G.continuation(prev, G.history(tail, TOOLS))
    assert m is not None and m.evidence == G.TAIL and m.score == 3


def test_client_ids():
    h = CIMultiDictProxy(CIMultiDict({"session_id": "abc"}))
    assert G.client_session_id(h, {}, ["session_id"]) == "session_id:abc"
    empty = CIMultiDictProxy(CIMultiDict())
    assert G.client_session_id(empty, {"conversation": {"id": "conv_1"}}, ["session_id"]) == "conversation:conv_1"
    uid = "user_ab12_account_x_session_0f8e2a6c-1111-2222-3333-444455556666"
    assert G.client_session_id(empty, {"metadata": {"user_id": uid}}, []) == "claude-code:0f8e2a6c-1111-2222-3333-444455556666"
    assert G.client_session_id(empty, {"metadata": {"user_id": "u1"}}, ["session_id"]) is None


# -- the addon -----------------------------------------------------------------------------------

def test_one_session_through_edits_notes_compaction_and_side_requests():
    d = Driver()
    conv = conversation("a", 6)
    flows = [d.turn(req, ans) for req, ans in conv[:3]]
    # the title generator: other system prompt, no tools, quotes the first user message
    title = d.turn([{"role": "system", "content": "You are a conversation title generator."},
                    {"role": "user", "content": f"Generate a title:\n\nUser: {conv[0][0][1]['content']}\n\nTitle:"}],
                   {"role": "assistant", "content": "Uplink check"}, tools=None)
    # the agent repairs an old call and appends a note to its newest tool result
    req, ans = copy.deepcopy(conv[3])
    req[2] = call("show", {"what": "repaired"}, "c0")
    req[-1]["content"] += "\n[system-reminder] you have 3 turns left"
    flows.append(d.turn(req, ans))
    req, ans = conv[4]
    flows.append(d.turn(req, ans))  # the note is gone again
    # compaction: a summary request (side), then the history with the summary in it
    transcript = "\n\n".join(f"{m['role'].upper()}: {G.message_text(m)}" for m in conv[4][0][1:])
    summ = d.turn([{"role": "system", "content": "# Conversation Compactor"},
                   {"role": "user", "content": "Compact the following conversation:\n\n" + transcript}],
                  {"role": "assistant", "content": "Summary: uplinks of site a checked, results 0..4."}, tools=None)
    compacted = [SYSTEM, {"role": "user", "content": "[Conversation summary]"},
                 {"role": "assistant", "content": "Summary: uplinks of site a checked, results 0..4."},
                 {"role": "user", "content": "continue"}]
    after = d.turn(compacted, call("show", {"what": "after"}, "z1"))
    later = d.turn([*compacted, after_call := call("show", {"what": "after"}, "z1"),
                    {"role": "tool", "tool_call_id": "z1", "content": "fine"}], {"role": "assistant", "content": "done"})
    assert after_call
    sids = {f.session_id for f in [*flows, title, summ, after, later]}
    assert len(sids) == 1, sids
    assert title.meta["turn_kind"] == summ.meta["turn_kind"] == G.SIDE
    assert [f.meta["turn_kind"] for f in [*flows, after, later]] == [G.MAIN] * 7
    assert flows[3].meta["grouping"]["evidence"] in (G.PREFIX, G.EDITED)
    assert after.meta["grouping"]["evidence"] == G.COMPACTION
    assert later.meta["grouping"]["evidence"] == G.PREFIX
    assert sorted(f.turn_index for f in [*flows, title, summ, after, later]) == list(range(9))
    assert d.sessions.counters["created"] == 1


def test_title_request_before_the_first_turn_is_linked():
    d = Driver()
    conv = conversation("b", 2)
    title = d.start([{"role": "system", "content": "You are a conversation title generator."},
                     {"role": "user", "content": f"User: {conv[0][0][1]['content']}"}], tools=None)
    assert title.meta["turn_kind"] == G.MAIN  # nothing to link it to yet
    first = d.turn(*conv[0])
    assert title.session_id == first.session_id and title.meta["turn_kind"] == G.SIDE
    # it carries its conversation's record (stored by whichever finishes first; the store keeps one)
    assert title.meta["session_record"]["id"] == first.session_id and d.sessions.counters["created"] == 1
    d.finish(title, {"role": "assistant", "content": "Uplinks"})
    assert d.turn(*conv[1]).session_id == first.session_id


def test_side_request_that_finishes_before_the_first_turn_is_stored(tmp_path):
    """turnstone sends its title request while the first turn streams; the title is quick, so its
    turn reaches the store first: the session's record must too (CI lost such turns once)."""
    from tensorverse.store import Store

    store = Store.open(tmp_path / "store", durable=False)
    try:
        d = Driver(store)
        conv = conversation("q", 2)
        first = d.start(*conv[0][:1])
        title = d.start([{"role": "system", "content": "You are a conversation title generator."},
                         {"role": "user", "content": f"Generate a title:\n\nUser: {conv[0][0][1]['content']}"}],
                        tools=None)
        assert title.session_id == first.session_id and title.meta["turn_kind"] == G.SIDE
        d.finish(title, {"role": "assistant", "content": "Uplinks"})  # raised RecordNotFound before
        d.finish(first, conv[0][1])
        later = d.turn(*conv[1])
        assert later.session_id == first.session_id and "session_record" not in later.meta
        turns = list(store.iter_turns(first.session_id))
        assert [(t["index"], t["kind"]) for t in turns] == [(0, G.MAIN), (1, G.SIDE), (2, G.MAIN)]
        assert store.get_session(first.session_id)["turns"] == 3 and d.sessions.counters["created"] == 1
    finally:
        store.close()


def test_new_conversation_with_the_same_system_prompt_opens_a_session():
    d = Driver()
    a = [d.turn(r, x) for r, x in conversation("a", 3)]
    b = [d.turn(r, x) for r, x in conversation("b", 3)]
    assert len({f.session_id for f in a}) == 1 and len({f.session_id for f in b}) == 1
    assert a[0].session_id != b[0].session_id


def test_header_and_client_ids_take_priority():
    d = Driver()
    conv = conversation("a", 2)
    f1 = d.turn(*conv[0], headers={"X-Tensorverse-Session": "mine"})
    f2 = d.turn(*conv[1])  # no header: found by prefix
    assert f1.session_id == f2.session_id == "mine"
    f3 = d.turn(*conv[1], headers={"session_id": "codex-1"})  # the client's own id wins over the prefix
    f4 = d.turn(*conversation("z", 1)[0], headers={"session_id": "codex-1"})
    assert f3.session_id == f4.session_id != "mine"
    assert f3.meta["grouping"]["evidence"] == G.CLIENT_ID


# -- properties ----------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(n_conv=st.integers(2, 5), turns=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_shuffled_unrelated_conversations_never_merge(n_conv, turns, seed):
    rng = random.Random(seed)
    convs = {f"conv{i}-{rng.getrandbits(24):06x}": conversation(f"conv{i}-{seed}", turns) for i in range(n_conv)}
    # interleave: each conversation's turns stay in order, conversations shuffled against each other
    queue = [name for name in convs for _ in range(turns)]
    rng.shuffle(queue)
    d = Driver()
    seen: dict[str, set[str]] = {name: set() for name in convs}
    pos = {name: 0 for name in convs}
    for name in queue:
        req, ans = convs[name][pos[name]]
        pos[name] += 1
        seen[name].add(d.turn(req, ans).session_id)
    assert all(len(s) == 1 for s in seen.values()), seen
    assert len(set().union(*seen.values())) == n_conv


@settings(max_examples=40, deadline=None)
@given(turns=st.integers(3, 8), data=st.data())
def test_random_edits_to_old_assistant_messages_stay_one_session(turns, data):
    conv = conversation("e", turns)
    d = Driver()
    sids = set()
    edited_history: dict[int, dict] = {}  # position -> the agent's replacement, kept from then on
    for req, ans in conv:
        req = copy.deepcopy(req)
        olds = [i for i, m in enumerate(req) if m["role"] == "assistant"]
        if olds and data.draw(st.booleans()):
            i = data.draw(st.sampled_from(olds))
            how = data.draw(st.sampled_from(["text", "call", "args", "empty"]))
            if how == "text":
                new = {"role": "assistant", "content": data.draw(st.text(max_size=40))}
            elif how == "call":
                new = call("other_tool", {"x": data.draw(st.integers(-2**40, 2**40))})
            elif how == "args":
                new = call("show", {"what": data.draw(st.text(max_size=10))})
            else:
                new = {"role": "assistant", "content": ""}
            edited_history[i] = new
        for i, m in edited_history.items():
            if i < len(req):
                req[i] = m
        sids.add(d.turn(req, ans).session_id)
    assert len(sids) == 1


def test_identical_new_conversations_in_flight_together_are_not_side_requests():
    # four agents open the same conversation at once (the same system prompt, tools and first
    # message), before any answer: each quotes the others' first message, but with the same
    # anchor none is a side request of another (each is a tool-call turn of its own)
    d = Driver()
    msgs = [SYSTEM, {"role": "user", "content": "state of GigabitEthernet0/0/1?"}]
    flows = [d.start(copy.deepcopy(msgs)) for _ in range(4)]
    assert [f.meta["turn_kind"] for f in flows] == [G.MAIN] * 4
    assert len({f.session_id for f in flows}) == 4
