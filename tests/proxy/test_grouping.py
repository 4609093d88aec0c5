"""Session grouping (`tensorverse.proxy.grouping`, `tensorverse.proxy.sessions`): the rule as
pure functions, and the `Sessions` addon driven turn by turn with real flows and the real chat
accumulator (what the proxy calls it with: `tensorverse.testing.grouping.Driver`)."""

from __future__ import annotations

import copy
import random

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from tensorverse.proxy import grouping as G
from tensorverse.testing.grouping import TOOLS, Driver

SYSTEM = {"role": "system", "content": "You are a network automation agent."}


def call(name: str, args: dict, cid: str = "call_1") -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": orjson.dumps(args).decode()}}]}


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
    assert title.turn_kind == summ.turn_kind == G.SIDE
    assert [f.turn_kind for f in [*flows, after, later]] == [G.MAIN] * 7
    assert flows[3].grouping["evidence"] in (G.PREFIX, G.EDITED)
    assert after.grouping["evidence"] == G.COMPACTION
    assert later.grouping["evidence"] == G.PREFIX
    assert sorted(f.turn_index for f in [*flows, title, summ, after, later]) == list(range(9))
    assert d.sessions.counters["created"] == 1


def test_title_request_before_the_first_turn_is_linked():
    d = Driver()
    conv = conversation("b", 2)
    title = d.start([{"role": "system", "content": "You are a conversation title generator."},
                     {"role": "user", "content": f"User: {conv[0][0][1]['content']}"}], tools=None)
    assert title.turn_kind == G.MAIN  # nothing to link it to yet
    first = d.turn(*conv[0])
    assert title.session_id == first.session_id and title.turn_kind == G.SIDE
    # it carries its conversation's record (stored by whichever finishes first; the store keeps one)
    assert title.session_record.id == first.session_id and d.sessions.counters["created"] == 1
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
        assert title.session_id == first.session_id and title.turn_kind == G.SIDE
        d.finish(title, {"role": "assistant", "content": "Uplinks"})  # raised RecordNotFound before
        d.finish(first, conv[0][1])
        later = d.turn(*conv[1])
        assert later.session_id == first.session_id and later.session_record is None
        turns = list(store.iter_turns(first.session_id))
        assert [(t.index, t.kind) for t in turns] == [(0, G.MAIN), (1, G.SIDE), (2, G.MAIN)]
        assert store.get_session(first.session_id).turns == 3 and d.sessions.counters["created"] == 1
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
    assert f3.grouping["evidence"] == G.CLIENT_ID


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
    assert [f.turn_kind for f in flows] == [G.MAIN] * 4
    assert len({f.session_id for f in flows}) == 4


# -- conversations that share messages, then differ (issue 27) -----------------------------------
# Every other test gives each conversation its own tag, so no two of them share a user or tool
# message; real agents do: the same opening request, the same first tool call, a generic answer.

OPENER = {"role": "user", "content": "show the status of the uplinks"}
FIRST_CALL = call("show", {"what": "interfaces"}, "c0")


def _result(text: str) -> dict:
    return {"role": "tool", "tool_call_id": "c0", "content": text}


def test_shared_opener_then_different_tool_results_do_not_continue():
    # two agents ask the same thing and get the same first call, on two routers: the tool
    # results differ, so the second conversation's next request does not continue the first's
    x_req = [SYSTEM, OPENER, FIRST_CALL, _result("edge-1: Gi0/0/1 up, Gi0/0/2 down")]
    x_ans = {"role": "assistant", "content": "Gi0/0/2 is down on edge-1."}
    prev = G.history(x_req, TOOLS, x_ans)
    y_next = [SYSTEM, OPENER, FIRST_CALL, _result("core-7: Te1/1 up, Te1/2 up"),
              {"role": "assistant", "content": "All uplinks of core-7 are up."},
              {"role": "user", "content": "thanks, now the VLANs"}]
    assert G.continuation(prev, G.history(y_next, TOOLS)) is None
    # the first conversation's own next request does continue it (the case above is not refused
    # for another reason)
    x_next = [*x_req, x_ans, {"role": "user", "content": "thanks, now the VLANs"}]
    assert G.continuation(prev, G.history(x_next, TOOLS)) == G.Match(4, G.EXTENDS)


def test_shared_opener_then_different_user_messages_do_not_continue():
    greeting = {"role": "assistant", "content": "Hello! Which device should I look at?"}
    x_req = [SYSTEM, OPENER, greeting, {"role": "user", "content": "edge-1, please"}]
    x_ans = call("show", {"what": "edge-1"})
    prev = G.history(x_req, TOOLS, x_ans)
    y_next = [SYSTEM, OPENER, greeting, {"role": "user", "content": "core-7 instead"},
              call("show", {"what": "core-7"}), _result("core-7: Te1/1 up")]
    assert G.continuation(prev, G.history(y_next, TOOLS)) is None
    # with the other anchor rule too (a system prompt that carries the hour): still not
    hourly = [{"role": "system", "content": "It is 10:00."}, *y_next[1:]]
    assert G.continuation(prev, G.history(hourly, TOOLS)) is None


def test_one_shared_assistant_message_is_not_a_tail():
    # the tail rule needs the last two messages of the session: a generic answer that both
    # conversations end with is not enough
    done = {"role": "assistant", "content": "Done."}
    x_req = [SYSTEM, {"role": "user", "content": "save the config of edge-1"}]
    prev = G.history(x_req, TOOLS, done)
    y_next = [SYSTEM, {"role": "user", "content": "reload core-7 at midnight"}, done,
              {"role": "user", "content": "and notify the NOC"}]
    assert G.continuation(prev, G.history(y_next, TOOLS)) is None
    # two adjacent messages (the tool result and the answer after it) are: score 2
    x_req2 = [SYSTEM, OPENER, FIRST_CALL, _result("edge-1: Gi0/0/1 up, Gi0/0/2 down")]
    prev2 = G.history(x_req2, TOOLS, done)
    dropped = [SYSTEM, _result("edge-1: Gi0/0/1 up, Gi0/0/2 down"), done,
               {"role": "user", "content": "and notify the NOC"}]
    assert G.continuation(prev2, G.history(dropped, TOOLS)) == G.Match(2, G.TAIL)


# -- the rule's edges: extends, another anchor, compaction, tails; the keys and the text helpers ---

U1 = {"role": "user", "content": "check the uplinks of edge-1"}
U_OTHER = {"role": "user", "content": "what changed on core-7 last night?"}
A1 = call("show", {"what": "uplinks"}, "c1")
T1 = {"role": "tool", "tool_call_id": "c1", "content": "Gi0/0/1 up\nGi0/0/2 down"}
A2 = {"role": "assistant", "content": "Gi0/0/2 is down."}
NEXT = {"role": "user", "content": "bring it up"}
LONG_TOOL = {"role": "tool", "tool_call_id": "c1",
             "content": "Interface  Status  Protocol  Description\nGi0/0/1  up  up  uplink-a\nGi0/0/2  down  down  uplink-b"}
LONG_USER = {"role": "user", "content": "Please check every uplink of the edge router edge-1 and tell me which are down."}


def _hist(messages, answer=None):
    return G.history(messages, TOOLS, answer)


def test_keys_are_eight_bytes():
    k = G.message_key(U1)
    assert len(k.loose) == len(k.head) == 8 and k.role == "user"
    assert len(G.tools_key(TOOLS)) == 8


def test_a_note_appended_to_a_tool_result_or_user_message_still_extends():
    assert len(G.message_text(LONG_TOOL)) > G.HEAD_CHARS and len(G.message_text(LONG_USER)) > G.HEAD_CHARS
    prev = _hist([SYSTEM, LONG_USER, A1, LONG_TOOL], A2)
    noted_tool = dict(LONG_TOOL, content=LONG_TOOL["content"] + "\n[output truncated by the agent]")
    noted_user = dict(LONG_USER, content=LONG_USER["content"] + "\n(sent from my phone)")
    assert G.continuation(prev, _hist([SYSTEM, LONG_USER, A1, noted_tool, A2, NEXT])) == G.Match(4, G.EXTENDS)
    assert G.continuation(prev, _hist([SYSTEM, noted_user, A1, LONG_TOOL, A2, NEXT])) == G.Match(4, G.EXTENDS)
    # an assistant message with the same head but another text is edited, not equal
    long_answer = {"role": "assistant", "content": "Gi0/0/2 is down on edge-1; the other uplinks are up and carry traffic."}
    prev2 = _hist([SYSTEM, LONG_USER, A1, LONG_TOOL], long_answer)
    rewritten = dict(long_answer, content=long_answer["content"] + " I opened a ticket.")
    assert G.continuation(prev2, _hist([SYSTEM, LONG_USER, A1, LONG_TOOL, rewritten, NEXT])) == G.Match(4, G.EDITED)


def test_a_request_as_long_as_the_latest_history_extends_it():
    # the agent sends the history and the answer back, with no new message (a "continue" turn)
    prev = _hist([SYSTEM, U1, A1, T1], A2)
    assert G.continuation(prev, _hist([SYSTEM, U1, A1, T1, A2])) == G.Match(4, G.EXTENDS)


def test_a_request_that_does_not_extend_can_still_be_a_tail():
    prev = _hist([SYSTEM, U1, A1, T1], A2)
    other_call = call("show", {"what": "bgp"}, "c9")
    # unequal first user message, then the session's newest two messages
    assert G.continuation(prev, _hist([SYSTEM, U_OTHER, other_call, T1, A2, NEXT])) == G.Match(2, G.TAIL)
    # another role first, then the same two
    assert G.continuation(prev, _hist([SYSTEM, other_call, U_OTHER, T1, A2, NEXT])) == G.Match(2, G.TAIL)


def test_no_equal_user_message_no_extends():
    hello = {"role": "assistant", "content": "Hello, I am ready."}
    prev = _hist([SYSTEM], hello)
    assert G.continuation(prev, _hist([SYSTEM, hello, U1])) is None


def test_another_anchor_needs_two_equal_user_or_tool_messages_and_an_equal_assistant_one():
    at10, at11 = ({"role": "system", "content": f"It is {h}:00. You are a network automation agent."} for h in (10, 11))
    a2_edited = {"role": "assistant", "content": "Gi0/0/2 is down (since 09:12)."}
    a1_edited = call("show", {"what": "uplinks", "detail": True}, "c1")
    prev = G.history([at10, U1, A1, T1], TOOLS, A2)
    # U1 and T1 equal, A1 equal, A2 edited: the same conversation
    assert G.continuation(prev, G.history([at11, U1, A1, T1, a2_edited, NEXT], TOOLS)) == G.Match(4, G.EDITED)
    # both assistant messages edited: not enough
    assert G.continuation(prev, G.history([at11, U1, a1_edited, T1, a2_edited, NEXT], TOOLS)) is None
    # one equal user message and one equal assistant message: not enough
    short = G.history([at10, U1], TOOLS, A1)
    assert G.continuation(short, G.history([at11, U1, A1, T1], TOOLS)) is None
    assert G.continuation(short, G.history([at10, U1, A1, T1], TOOLS)) == G.Match(2, G.EXTENDS)


def test_compaction_needs_a_summary_in_the_request_and_scores_the_history():
    prev = _hist([SYSTEM, U1, A1, T1], A2)
    summary = "Checked the uplinks of edge-1: Gi0/0/2 is down."
    compacted = [SYSTEM, {"role": "user", "content": "[summary]"}, {"role": "assistant", "content": summary}, NEXT]
    assert G.continuation(prev, _hist(compacted), ["A summary of another session entirely."]) is None
    assert G.continuation(prev, _hist(compacted), [summary]) == G.Match(4, G.COMPACTION)


def test_tail_edges():
    prev = _hist([SYSTEM, U1, A1, T1], A2)
    # a history of two messages is a tail of two
    two = _hist([SYSTEM, U1], A1)
    assert G.continuation(two, _hist([SYSTEM, U_OTHER, U1, A1, NEXT])) == G.Match(2, G.TAIL)
    # the whole history after another first message: a tail of all of it
    assert G.continuation(prev, _hist([SYSTEM, U_OTHER, U1, A1, T1, A2, NEXT])) == G.Match(4, G.TAIL)
    # the request's start is not its end: no wrap-around
    assert G.continuation(prev, _hist([SYSTEM, T1, A2, NEXT, A1])) == G.Match(2, G.TAIL)
    # the newest message again later, alone: the longest place counts
    done = {"role": "assistant", "content": "Done."}
    prev_done = _hist([SYSTEM, U1, A1, T1], done)
    again = [SYSTEM, U_OTHER, T1, done, NEXT, done, {"role": "user", "content": "and the VLANs?"}]
    assert G.continuation(prev_done, _hist(again)) == G.Match(2, G.TAIL)
    # two assistant messages at the end (a continued answer) are a tail
    part1 = {"role": "assistant", "content": "Gi0/0/2 is down"}
    part2 = {"role": "assistant", "content": "and has been since 09:12."}
    prev_parts = _hist([SYSTEM, U1, part1], part2)
    assert G.continuation(prev_parts, _hist([SYSTEM, U_OTHER, part1, part2, NEXT])) == G.Match(2, G.TAIL)


def test_message_text_of_every_shape():
    assert G.message_text("  a plain \n string ") == "a plain string"
    blocks = {"role": "user", "content": [
        "plain  part", {"type": "text", "text": "text part"},
        {"type": "tool_use", "name": "show", "input": {"b": 1, "a": [2]}},
        {"type": "tool_use", "input": {}},  # no name
        {"type": "tool_use", "name": "odd", "input": {1: "a"}},  # not JSON: repr
        {"type": "tool_result", "content": "result  text"},
        {"type": "tool_result", "content": [{"type": "text", "text": "nested result"}]},
        {"type": "image", "source": "..."}]}
    assert G.message_text(blocks) == ('plain part text part show({"a":[2],"b":1}) ({}) '
                                      "odd({1: 'a'}) result text nested result")
    calls = {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "show", "arguments": '{"b": 1, "a": 2}'}},
        {"function": {"arguments": "not  json"}}, "junk", {"function": "junk"}]}
    assert G.message_text(calls) == 'show({"a":2,"b":1}) (not json)'


def test_roles_anchors_and_notes_in_history():
    assert G.message_key("a string").role == "?" and G.message_key({"content": "x"}).role == "?"
    # a lone surrogate (kept by a lenient JSON parser) does not break the keys
    k = G.message_key({"role": "user", "content": "bad \ud800 text " * 10})
    assert len(k.loose) == len(k.head) == 8 and k.loose != k.head
    assert G.history([]).body == () and G.history([]).system == b""
    plain = G.history([U1, A2])
    assert plain.system == b"" and [m.role for m in plain.body] == ["user", "assistant"]
    dev = {"role": "developer", "content": "You are a network automation agent."}
    h = G.history([dev, U1, {"role": "developer", "content": "context 80% full"}, A2], TOOLS)
    assert h.system == G.message_key(dev).loose and [m.role for m in h.body] == ["user", "assistant"]
    assert h.tools == G.tools_key(TOOLS) != b""


def test_tools_key():
    anthropic = [{"name": "show", "input_schema": {"type": "object"}}]
    assert G.tools_key(anthropic) == G.tools_key(TOOLS)  # the names count, not the format
    other = [{"type": "function", "function": {"name": "configure"}}]
    assert G.tools_key(other) != G.tools_key(TOOLS)
    assert G.tools_key(TOOLS + other) == G.tools_key(other + TOOLS)
    assert G.tools_key([{"function": {}}]) == G.tools_key([{"function": {"name": ""}}])
    assert G.tools_key(None) == G.tools_key([]) == b""


def test_choose_and_the_text_helpers():
    new, old = G.Match(3, G.EXTENDS), G.Match(3, G.TAIL)
    assert G.choose([("s1", None)]) is None
    assert G.choose([("recent", new), ("older", old)]) == ("recent", new)  # a tie: the more recent
    assert G.choose([("recent", G.Match(2, G.TAIL)), ("older", None), ("oldest", old)]) == ("oldest", old)
    assert G.request_text([U1, A2]) == "check the uplinks of edge-1 Gi0/0/2 is down."
    q = "x" * G.MIN_QUOTE_CHARS
    assert G.quotes(f"a {q} b", [q]) and not G.quotes("a xxxx b", ["xxxx"])
    assert G.first_user_text([SYSTEM, A2]) == "" and G.last_user_text([SYSTEM, A2]) == ""
    assert G.last_user_text([U1, A1, NEXT, A2]) == "bring it up" and G.first_user_text([A2, U1, NEXT]) == U1["content"]
    assert G.client_session_id(None, {"conversation": "c-1"}, ["session_id"]) == "conversation:c-1"


def test_a_compaction_joins_by_its_summary_among_the_last_eight_side_answers_only():
    """The tracker keeps a session's last 8 side answers (summaries): a compacted history whose
    summary is one of them continues the session; one 9 side answers old starts its own."""
    d = Driver()
    conv = conversation("a", 3)
    first = [d.turn(req, ans) for req, ans in conv][0]
    transcript = "\n\n".join(f"{m['role'].upper()}: {G.message_text(m)}" for m in conv[2][0][1:])

    def summary(i: int) -> str:
        text = f"Summary {i}: uplinks of site a checked, results 0..{i}."
        d.turn([{"role": "system", "content": "# Conversation Compactor"},
                {"role": "user", "content": "Compact the following conversation:\n\n" + transcript}],
               {"role": "assistant", "content": text}, tools=None)
        return text

    texts = [summary(i) for i in range(9)]

    def compacted(text: str, tag: str):
        return d.turn([SYSTEM, {"role": "user", "content": "[Conversation summary]"},
                       {"role": "assistant", "content": text}, {"role": "user", "content": "continue"}],
                      call("show", {"what": tag}, tag))

    assert compacted(texts[1], "recent").session_id == first.session_id  # the 8th newest
    assert compacted(texts[0], "old").session_id != first.session_id  # 9 side answers ago
