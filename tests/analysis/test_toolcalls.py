"""Tool-call extraction and the BFCL-style verdict, on network-automation calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorverse.analysis.toolcalls import (
    SEVERITY,
    Extraction,
    ToolCall,
    compare_tool_calls,
    extract_tool_calls,
)


def qwen3(name: str, arguments: dict, *, args_as_string: bool = False) -> str:
    args = json.dumps(json.dumps(arguments)) if args_as_string else json.dumps(arguments)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def xml(name: str, arguments: dict) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


REF_ARGS = {"interface": "GigabitEthernet0/0/1.201", "description": "uplink to core"}
REF = qwen3("configure_interface_description", REF_ARGS)


# ------------------------------------------------------------------------------ extraction


def test_extract_qwen3_json_after_thinking():
    text = (
        "<think>\nThe user wants the subinterface description. I could call "
        '<tool_call>{"name": "not_a_call"}</tool_call> but no.\n</think>\n\n' + REF
    )
    ex = extract_tool_calls(text)
    assert ex.format == "qwen3_json"
    assert ex.malformed == []
    assert [c.name for c in ex.calls] == ["configure_interface_description"]
    assert ex.calls[0].arguments == REF_ARGS
    assert ex.calls[0].raw.startswith("<tool_call>") and ex.calls[0].raw.endswith("</tool_call>")
    assert "not_a_call" in ex.reasoning
    assert ex.content == ""


def test_extract_prefilled_think_only_close_tag():
    ex = extract_tool_calls("checking vlans first\n</think>\n\n" + qwen3("show_vlan", {"vlan_id": 201}))
    assert [c.name for c in ex.calls] == ["show_vlan"]
    assert ex.reasoning.strip() == "checking vlans first"


def test_extract_several_calls_and_content():
    text = "I'll look at both.\n" + qwen3("show_vlan", {"vlan_id": 201}) + "\n" + qwen3("show_mac_address_table", {})
    ex = extract_tool_calls(text)
    assert [c.name for c in ex.calls] == ["show_vlan", "show_mac_address_table"]
    assert ex.content == "I'll look at both."


def test_extract_arguments_as_json_string():
    ex = extract_tool_calls(qwen3("show_vlan", {"vlan_id": 201}, args_as_string=True))
    assert ex.calls[0].arguments == {"vlan_id": 201}
    assert ex.malformed == []


def test_extract_truncated_is_malformed():
    ex = extract_tool_calls('<tool_call>{"name": "show_vlan", "argu')
    assert ex.calls == []
    assert len(ex.malformed) == 1
    assert ex.malformed[0].reason == "unclosed_tag"
    assert ex.malformed[0].raw == '<tool_call>{"name": "show_vlan", "argu'


def test_extract_complete_call_missing_close_tag_is_accepted():
    # the model stopped right before </tool_call>: vLLM's hermes parser accepts it, so do we
    ex = extract_tool_calls('<tool_call>\n{"name": "show_vlan", "arguments": {"vlan_id": 201}}\n')
    assert ex.malformed == [] and ex.calls[0].arguments == {"vlan_id": 201}


@pytest.mark.parametrize(
    "text, reason",
    [
        ('<tool_call>{"name": "show_vlan", "arguments": {"vlan_id": 20,}}</tool_call>', "invalid_json"),
        ('<tool_call>{"arguments": {"vlan_id": 201}}</tool_call>', "missing_name"),
        ('<tool_call>{"name": "show_vlan", "arguments": [201]}</tool_call>', "invalid_arguments"),
        ('<tool_call>{"name": "show_vlan", "arguments": "{vlan 201"}</tool_call>', "invalid_arguments"),
        ('<tool_call>{"name": "show_vlan", "arguments": {}}}</tool_call>', "trailing_data"),
        ("<tool_call>[1, 2]</tool_call>", "not_an_object"),
        ("<tool_call>{\"name\": \"a\"}\n<tool_call>{\"name\": \"b\"}</tool_call>", "unclosed_tag"),
        ("done.</tool_call>", "stray_close_tag"),
    ],
)
def test_extract_malformed_reasons(text, reason):
    ex = extract_tool_calls(text)
    assert reason in [m.reason for m in ex.malformed]


def test_extract_unclosed_then_valid_keeps_the_valid_one():
    ex = extract_tool_calls('<tool_call>{"name": "a"}\n<tool_call>{"name": "b"}</tool_call>')
    assert [c.name for c in ex.calls] == ["b"]
    assert [m.reason for m in ex.malformed] == ["unclosed_tag"]


def test_extract_qwen3_coder_xml():
    text = (
        "<tool_call>\n<function=configure_vlan>\n"
        "<parameter=vlan_id>\n201\n</parameter>\n"
        "<parameter=name>\nusers-floor2\n</parameter>\n"
        "<parameter=ports>\n[\"Gi0/0/1\", \"Gi0/0/2\"]\n</parameter>\n"
        "<parameter=shutdown>\nfalse\n</parameter>\n"
        "<parameter=note>\nline one\nline two\n\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    ex = extract_tool_calls(text)
    assert ex.format == "qwen3_coder_xml"
    assert ex.malformed == []
    (call,) = ex.calls
    assert call.name == "configure_vlan"
    assert call.arguments == {
        "vlan_id": 201,
        "name": "users-floor2",
        "ports": ["Gi0/0/1", "Gi0/0/2"],
        "shutdown": False,
        "note": "line one\nline two\n",  # only one trailing newline stripped
    }


def test_extract_xml_two_functions_and_bare_function():
    ex = extract_tool_calls(xml("show_vlan", {"vlan_id": 201}) + "\n" + xml("show_interfaces", {"name": "Gi0/0/1"}))
    assert [c.name for c in ex.calls] == ["show_vlan", "show_interfaces"]
    bare = extract_tool_calls("<function=show_version>\n</function>")
    assert [c.name for c in bare.calls] == ["show_version"] and bare.calls[0].arguments == {}


def test_extract_xml_truncated_is_malformed():
    ex = extract_tool_calls("<tool_call>\n<function=configure_vlan>\n<parameter=vlan_id>\n20")
    assert ex.calls == [] and ex.malformed[0].reason == "unclosed_tag"
    assert ex.format == "qwen3_coder_xml"


def test_extract_xml_unclosed_parameter_accepted_like_vllm():
    ex = extract_tool_calls("<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n</function>\n</tool_call>")
    assert ex.calls[0].arguments == {"a": 1, "b": "x"}


def test_extract_openai_tool_calls_string_and_dict_arguments():
    tcs = [
        {
            "id": "chatcmpl-tool-1",
            "type": "function",
            "function": {"name": "configure_interface_description", "arguments": json.dumps(REF_ARGS)},
        },
        {"id": "chatcmpl-tool-2", "type": "function", "function": {"name": "show_vlan", "arguments": {"vlan_id": 201}}},
        {"id": "chatcmpl-tool-3", "type": "function", "function": {"name": "bad", "arguments": "{\"vlan"}},
        {"id": "chatcmpl-tool-4", "type": "function", "function": {"arguments": "{}"}},
        "not a dict",
    ]
    ex = extract_tool_calls(openai_tool_calls=tcs)
    assert ex.format == "openai"
    assert [c.name for c in ex.calls] == ["configure_interface_description", "show_vlan"]
    assert ex.calls[0].arguments == REF_ARGS
    assert [m.reason for m in ex.malformed] == ["invalid_arguments", "missing_name", "invalid_entry"]


def test_extract_openai_sdk_like_object():
    class Fn:
        def model_dump(self):
            return {"id": "x", "type": "function", "function": {"name": "show_vlan", "arguments": "{}"}}

    ex = extract_tool_calls(openai_tool_calls=[Fn()])
    assert ex.calls[0].name == "show_vlan"


def test_extract_nothing():
    for ex in (extract_tool_calls(None), extract_tool_calls(""), extract_tool_calls("VLAN 201 is up."),
               extract_tool_calls(openai_tool_calls=[])):
        assert ex.calls == [] and ex.malformed == []
    assert extract_tool_calls("VLAN 201 is up.").format == "none"


def test_extraction_to_dict_is_json():
    ex = extract_tool_calls("<think>x</think>" + REF + '<tool_call>{"name": "show_vlan", "argu')
    json.dumps(ex.to_dict())
    assert ex.to_dict()["malformed"][0]["reason"] == "unclosed_tag"


FRAGMENTS = list('<>/{}[]":,= \n\\abtnoolcfu_kpmegrhi0123') + [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<function=", "</function>", "<parameter=",
    "</parameter>", '"name"', '"arguments"', '{"name": "', '", "arguments": {', "show_vlan", "201",
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=40).map("".join))
def test_extract_never_raises(text):
    ex = extract_tool_calls(text)
    json.dumps(ex.to_dict())
    v = compare_tool_calls(ex, text)
    assert v.verdict in SEVERITY
    json.dumps(v.to_dict())


# ------------------------------------------------------------------------------ verdict


def verdict(ref: str, cand: str):
    return compare_tool_calls(extract_tool_calls(ref), extract_tool_calls(cand))


def test_match_identical_and_formats_agree():
    assert verdict(REF, REF).verdict == "match"
    # same call in three formats
    as_xml = extract_tool_calls(xml("configure_interface_description", REF_ARGS))
    as_openai = extract_tool_calls(openai_tool_calls=[
        {"id": "1", "type": "function",
         "function": {"name": "configure_interface_description", "arguments": json.dumps(REF_ARGS)}}])
    assert compare_tool_calls(extract_tool_calls(REF), as_xml).verdict == "match"
    assert compare_tool_calls(as_openai, as_xml).verdict == "match"


def test_value_mismatch_interface():
    cand = qwen3("configure_interface_description", {**REF_ARGS, "interface": "GigabitEthernet0/1/4"})
    v = verdict(REF, cand)
    assert v.verdict == "value_mismatch"
    (d,) = v.differences
    assert d.kind == "value_mismatch"
    assert d.path == "$.arguments.interface"
    assert d.reference == "GigabitEthernet0/0/1.201"
    assert d.candidate == "GigabitEthernet0/1/4"
    assert d.call_index == 0
    out = v.to_dict()
    json.dumps(out)
    assert out["differences"][0]["reference"] == "GigabitEthernet0/0/1.201"


def test_strings_are_case_sensitive():
    cand = qwen3("configure_interface_description", {**REF_ARGS, "description": "Uplink to core"})
    assert verdict(REF, cand).verdict == "value_mismatch"


def test_wrong_func_name():
    v = verdict(qwen3("show_mac_address_table", {"vlan": 201}), qwen3("show_mac_address-table", {"vlan": 201}))
    assert v.verdict == "wrong_func_name"
    (d,) = v.differences
    assert (d.path, d.reference, d.candidate) == ("$.name", "show_mac_address_table", "show_mac_address-table")


def test_missing_and_unexpected_param():
    v = verdict(REF, qwen3("configure_interface_description", {"interface": REF_ARGS["interface"]}))
    assert v.verdict == "missing_param"
    assert v.differences[0].path == "$.arguments.description"
    assert "candidate" not in v.differences[0].to_dict()

    v = verdict(REF, qwen3("configure_interface_description", {**REF_ARGS, "shutdown": False}))
    assert v.verdict == "unexpected_param"
    d = v.differences[0].to_dict()
    assert d["path"] == "$.arguments.shutdown" and d["candidate"] is False and "reference" not in d

    # missing outranks unexpected outranks value
    v = verdict(REF, qwen3("configure_interface_description", {"interface": "Gi0/1/4", "mtu": 9000}))
    assert v.verdict == "missing_param"
    assert sorted(v.kinds()) == ["missing_param", "unexpected_param", "value_mismatch"]


def test_parallel_calls_in_swapped_order_match():
    a = qwen3("show_vlan", {"vlan_id": 201})
    b = qwen3("show_interfaces", {"interface": "GigabitEthernet0/0/1.201"})
    v = verdict(a + b, b + a)
    assert v.verdict == "match"
    assert v.pairs == [(0, 1), (1, 0)]


def test_parallel_same_name_best_assignment_and_indexed_paths():
    ref = [ToolCall("configure_vlan", {"vlan_id": 10, "name": "mgmt"}),
           ToolCall("configure_vlan", {"vlan_id": 20, "name": "users", "vlans": [1, 2, 3]})]
    cand = [ToolCall("configure_vlan", {"vlan_id": 20, "name": "users", "vlans": [1, 2, 4]}),
            ToolCall("configure_vlan", {"vlan_id": 10, "name": "mgmt"})]
    v = compare_tool_calls(ref, cand)
    assert v.verdict == "value_mismatch"
    assert v.pairs == [(0, 1), (1, 0)]
    (d,) = v.differences
    assert d.path == "$[1].arguments.vlans[2]" and (d.reference, d.candidate) == (3, 4)
    assert (d.call_index, d.candidate_index) == (1, 0)


def test_count_mismatch():
    a = qwen3("show_vlan", {"vlan_id": 201})
    b = qwen3("show_interfaces", {"interface": "GigabitEthernet0/0/1.201"})
    v = verdict(a + b, b)
    assert v.verdict == "count_mismatch"
    assert v.differences[0].path == "$" and (v.differences[0].reference, v.differences[0].candidate) == (2, 1)
    unmatched = [d for d in v.differences if d.path == "$[0]"]
    assert unmatched and unmatched[0].to_dict()["reference"]["name"] == "show_vlan"
    json.dumps(v.to_dict())
    assert verdict("", a).verdict == "count_mismatch"


def test_malformed_beats_everything():
    v = verdict(REF, '<tool_call>{"name": "configure_interface_description", "argu')
    assert v.verdict == "malformed"
    assert v.differences[0].kind == "malformed"
    d = v.differences[0].to_dict()
    assert "candidate" in d and "reference" not in d
    assert verdict('<tool_call>{"name": "x"', REF).verdict == "malformed"


def test_no_calls_both_sides_match():
    v = verdict("VLAN 201 is up.", "VLAN 201 is down.")
    assert v.verdict == "match" and v.differences == []
    assert compare_tool_calls(None, []).verdict == "match"


@pytest.mark.parametrize(
    "ref, cand, equal",
    [
        (1, 1.0, True),
        (1.5, 1.5, True),
        (1, True, False),
        (0, False, False),
        ("1", 1, False),
        (None, "null", False),
        ([1, 2], [2, 1], False),
        ({"a": {"b": [1, {"c": "x"}]}}, {"a": {"b": [1, {"c": "x"}]}}, True),
        (float("nan"), float("nan"), True),
    ],
)
def test_type_aware_values(ref, cand, equal):
    v = compare_tool_calls([ToolCall("f", {"v": ref})], [ToolCall("f", {"v": cand})])
    assert (v.verdict == "match") is equal


def test_nested_paths_and_odd_keys():
    ref = [ToolCall("apply_acl", {"acl": {"rules": [{"permit": "10.0.0.0/8"}], "seq no": 10}})]
    cand = [ToolCall("apply_acl", {"acl": {"rules": [{"permit": "10.0.0.0/16"}], "seq no": 10, "log": True}})]
    v = compare_tool_calls(ref, cand)
    paths = {d.path for d in v.differences}
    assert paths == {"$.arguments.acl.rules[0].permit", "$.arguments.acl.log"}
    v = compare_tool_calls([ToolCall("f", {"seq no": 1})], [ToolCall("f", {"seq no": 2})])
    assert v.differences[0].path == '$.arguments["seq no"]'


def test_list_length_mismatch_is_one_difference():
    v = compare_tool_calls([ToolCall("f", {"vlans": [1, 2]})], [ToolCall("f", {"vlans": [1, 2, 3]})])
    (d,) = v.differences
    assert d.path == "$.arguments.vlans" and d.reference == [1, 2] and d.candidate == [1, 2, 3]


def test_accepts_dicts_and_text():
    v = compare_tool_calls([{"name": "show_vlan", "arguments": "{\"vlan_id\": 201}"}], qwen3("show_vlan", {"vlan_id": 201}))
    assert v.verdict == "match"
    assert isinstance(extract_tool_calls(REF), Extraction)


def test_many_parallel_calls_greedy_path():
    ref = [ToolCall(f"f{i}", {"i": i}) for i in range(10)]
    cand = list(reversed(ref))
    assert compare_tool_calls(ref, cand).verdict == "match"


def test_large_assignments_are_exact_where_greedy_was_not():
    # 9 x 9 (362,880 matchings: past the enumeration limit). Cheapest pairs first takes (0, 0) at
    # 0 and is then left with (1, 1) at 100; the optimum crosses them for 1 + 1.
    from tensorverse.analysis.toolcalls import _assign

    n = 9
    cost = [[0 if i == j else 50 for j in range(n)] for i in range(n)]
    cost[0][1] = cost[1][0] = 1
    cost[1][1] = 100
    pairs = _assign(cost, n, n)
    assert sum(cost[i][j] for i, j in pairs) == 2
    assert sorted(i for i, _ in pairs) == list(range(n)) and sorted(j for _, j in pairs) == list(range(n))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5).flatmap(lambda n: st.integers(1, 5).flatmap(
    lambda m: st.lists(st.lists(st.integers(0, 9), min_size=m, max_size=m), min_size=n, max_size=n))))
def test_exact_assignment_matches_enumeration(cost):
    from tensorverse.analysis.toolcalls import _assign, _assign_exact

    n, m = len(cost), len(cost[0])
    total = lambda pairs: sum(cost[i][j] for i, j in pairs)  # noqa: E731
    exact = _assign_exact(cost)
    assert len(exact) == min(n, m) and total(exact) == total(_assign(cost, n, m))


# ------------------------------------------------------------------------------ exact records and details
# (each test below checks a record, a difference or a detail exactly; the expected records are
# written out from the module's documented format.)


def test_extraction_record_exactly():
    text = "<think>plan</think>Sure." + qwen3("show_vlan", {"vlan_id": 201}) + "</tool_call>"
    ex = extract_tool_calls(text)
    raw = qwen3("show_vlan", {"vlan_id": 201})
    assert ex.to_dict() == {
        "format": "qwen3_json",
        "calls": [{"name": "show_vlan", "arguments": {"vlan_id": 201}, "raw": raw, "format": "qwen3_json"}],
        "malformed": [{"reason": "stray_close_tag", "raw": "</tool_call>", "format": "qwen3_json",
                       "detail": "'</tool_call>' without '<tool_call>'"}],
        "content": "Sure.",
        "reasoning": "plan",
    }


def test_verdict_record_exactly():
    ref = [ToolCall("show_vlan", {"vlan_id": 201}), ToolCall("show_interfaces", {"interface": "Gi0/1"})]
    cand = [ToolCall("show_interfaces", {"interface": "Gi0/2"})]
    v = compare_tool_calls(ref, cand)
    assert v.to_dict() == {
        "verdict": "count_mismatch",
        "n_reference": 2,
        "n_candidate": 1,
        "pairs": [[1, 0]],
        "differences": [
            {"kind": "count_mismatch", "path": "$", "call_index": None, "candidate_index": None,
             "reference": 2, "candidate": 1, "detail": "2 reference call(s) vs 1 candidate call(s)"},
            {"kind": "value_mismatch", "path": "$[1].arguments.interface", "call_index": 1,
             "candidate_index": 0, "reference": "Gi0/1", "candidate": "Gi0/2", "detail": ""},
            {"kind": "count_mismatch", "path": "$[0]", "call_index": 0, "candidate_index": None,
             "reference": {"name": "show_vlan", "arguments": {"vlan_id": 201}},
             "detail": "reference call with no candidate"},
        ],
    }


def test_difference_indices_and_values_of_every_kind():
    ref = [ToolCall("a", {"x": 1}), ToolCall("b", {"keep": 5, "y": 2})]
    cand = [ToolCall("b", {"y": 2, "extra": [1]}), ToolCall("c", {})]
    v = compare_tool_calls(ref, cand)
    got = {(d.kind, d.path, d.call_index, d.candidate_index, repr(d.reference), repr(d.candidate))
           for d in v.differences}
    assert got == {
        ("wrong_func_name", "$[0].name", 0, 1, "'a'", "'c'"),
        ("missing_param", "$[1].arguments.keep", 1, 0, "5", "MISSING"),
        ("unexpected_param", "$[1].arguments.extra", 1, 0, "MISSING", "[1]"),
    }
    d = next(d for d in v.differences if d.kind == "missing_param").to_dict()
    assert d == {"kind": "missing_param", "path": "$[1].arguments.keep", "call_index": 1,
                 "candidate_index": 0, "reference": 5, "detail": ""}


def test_type_mismatch_details_name_both_types():
    cases = [(None, "x", "type null vs string"), (True, 1, "type boolean vs number"),
             (1, "1", "type number vs string"), ({"a": 1}, [1], "type object vs array"),
             ({1, 2}, "x", "type set vs string")]
    for ref, cand, detail in cases:
        (d,) = compare_tool_calls([ToolCall("f", {"v": ref})], [ToolCall("f", {"v": cand})]).differences
        assert (d.kind, d.path, d.detail) == ("value_mismatch", "$.arguments.v", detail)
        assert (d.reference, d.candidate) == (ref, cand)


@pytest.mark.parametrize(
    "ref, cand, equal",
    [(1.5, 2.5, False), (1.0, float("nan"), False), (1, float("nan"), False),
     (float("nan"), 1.0, False), (True, True, True), (False, False, True), (True, False, False)],
)
def test_numbers_nan_and_booleans(ref, cand, equal):
    v = compare_tool_calls([ToolCall("f", {"v": ref})], [ToolCall("f", {"v": cand})])
    assert (v.verdict == "match") is equal


def test_non_ascii_keys_are_written_as_they_are():
    (d,) = compare_tool_calls([ToolCall("f", {"vlan é": 1})], [ToolCall("f", {"vlan é": 2})]).differences
    assert d.path == '$.arguments["vlan é"]'


def test_argument_error_details():
    ex = extract_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1} x"}</tool_call>')
    assert [(m.reason, m.detail) for m in ex.malformed] == [
        ("invalid_arguments", "arguments string is not JSON: trailing data")]
    ex = extract_tool_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')
    assert [(m.reason, m.detail) for m in ex.malformed] == [
        ("invalid_arguments", "arguments is a list, not an object")]


def test_bare_function_without_close_is_malformed_with_its_text():
    text = "<function=a>\n<parameter=x>\n1\n</parameter>\n<function=b>\n</function>"
    ex = extract_tool_calls(text)
    assert [m.to_dict() for m in ex.malformed] == [{
        "reason": "unclosed_tag", "raw": "<function=a>\n<parameter=x>\n1\n</parameter>\n",
        "format": "qwen3_coder_xml", "detail": "'<function=' without '</function>'"}]
    assert [(c.name, c.arguments, c.raw) for c in ex.calls] == [("b", {}, "<function=b>\n</function>")]


def test_nested_difference_records_exactly():
    ref = [ToolCall("g", {}), ToolCall("f", {"o": {"gone": 1, "t": None, "l": [1, 2]}})]
    cand = [ToolCall("f", {"o": {"t": "x", "l": [1], "new": True}}), ToolCall("g", {})]
    v = compare_tool_calls(ref, cand)
    assert v.pairs == [(0, 1), (1, 0)]
    assert [d.to_dict() for d in v.differences] == [
        {"kind": "value_mismatch", "path": "$[1].arguments.o.gone", "call_index": 1, "candidate_index": 0,
         "reference": 1, "detail": "key missing in candidate"},
        {"kind": "value_mismatch", "path": "$[1].arguments.o.t", "call_index": 1, "candidate_index": 0,
         "reference": None, "candidate": "x", "detail": "type null vs string"},
        {"kind": "value_mismatch", "path": "$[1].arguments.o.l", "call_index": 1, "candidate_index": 0,
         "reference": [1, 2], "candidate": [1], "detail": "length 2 vs 1"},
        {"kind": "value_mismatch", "path": "$[1].arguments.o.new", "call_index": 1, "candidate_index": 0,
         "candidate": True, "detail": "key not in reference"},
    ]
    # a nested scalar difference keeps both call indices too
    (d,) = compare_tool_calls(list(reversed(ref)), [ToolCall("g", {}), ToolCall("f", {"o": {"gone": 2, "t": None, "l": [1, 2]}})]).differences
    assert (d.path, d.call_index, d.candidate_index) == ("$[0].arguments.o.gone", 0, 1)


def test_malformed_and_unmatched_candidate_records_exactly():
    bad_ref = '<tool_call>{"name": "a"'
    bad_cand = "<tool_call>[1]</tool_call>"
    v = compare_tool_calls(bad_ref + qwen3("x", {}), bad_cand + qwen3("x", {}) + qwen3("y", {"k": 1}))
    assert (v.n_reference, v.n_candidate, v.pairs) == (1, 2, [(0, 0)])
    d = [x.to_dict() for x in v.differences]
    assert d[0] == {"kind": "malformed", "path": "$", "call_index": None, "candidate_index": None,
                    "reference": bad_ref,
                    "detail": "reference: unclosed_tag: '<tool_call>' without '</tool_call>'"}
    assert d[1] == {"kind": "malformed", "path": "$", "call_index": None, "candidate_index": None,
                    "candidate": bad_cand, "detail": "candidate: not_an_object: JSON list, not an object"}
    assert d[2] == {"kind": "count_mismatch", "path": "$", "call_index": None, "candidate_index": None,
                    "reference": 1, "candidate": 2, "detail": "1 reference call(s) vs 2 candidate call(s)"}
    assert d[3] == {"kind": "count_mismatch", "path": "$[1]", "call_index": None, "candidate_index": 1,
                    "candidate": {"name": "y", "arguments": {"k": 1}}, "detail": "candidate call with no reference"}
    assert len(d) == 4 and v.verdict == "malformed"


def test_one_reference_call_against_two_is_indexed_and_prefers_the_same_name():
    ref = [ToolCall("f", {"a": 1, "b": 2, "c": 3})]
    cand = [ToolCall("g", {}), ToolCall("f", {"a": 9, "b": 9, "c": 9})]
    v = compare_tool_calls(ref, cand)
    assert v.pairs == [(0, 1)]  # three value differences cost less than a wrong name
    assert [d.path for d in v.differences if d.kind == "value_mismatch"] == [
        "$[0].arguments.a", "$[0].arguments.b", "$[0].arguments.c"]


def test_a_function_without_its_closing_angle_bracket_is_read_once():
    # the next <function= is searched for after this one's </function>, never before it
    ex = extract_tool_calls("<function=x</function>")
    assert [(m.reason, m.detail) for m in ex.malformed] == [("invalid_xml", "'<function=' without '>'")]
    assert ex.calls == []


# ------------------------------------------------------------------------------ whole records
# Each refusal and each accepted call as its whole record (reason, raw, format, detail), written
# out by hand from the module's rules: a test that compares only the reason lets the rest drift.


def _mal(reason: str, raw: str, fmt: str, detail: str) -> dict:
    return {"reason": reason, "raw": raw, "format": fmt, "detail": detail}


def _call(name: str, arguments: dict, raw: str, fmt: str) -> dict:
    return {"name": name, "arguments": arguments, "raw": raw, "format": fmt}


J, X, O = "qwen3_json", "qwen3_coder_xml", "openai"
TC = "<tool_call>{}</tool_call>".format

TEXT_RECORDS = [
    # qwen3_json refusals
    (TC(" \n "), [], [_mal("invalid_json", TC(" \n "), J, "empty tool call")]),
    (TC("{bad}"), [], [_mal("invalid_json", TC("{bad}"), J,
                            "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)")]),
    (TC('{"name": "f"} and then some more text that runs on and on'), [],
     [_mal("trailing_data", TC('{"name": "f"} and then some more text that runs on and on'), J,
           "text after the JSON object: ' and then some more text that runs on an'")]),
    (TC("[1, 2]"), [], [_mal("not_an_object", TC("[1, 2]"), J, "JSON list, not an object")]),
    (TC('{"arguments": {}}'), [], [_mal("missing_name", TC('{"arguments": {}}'), J, "no function name")]),
    (TC('{"name": ""}'), [], [_mal("missing_name", TC('{"name": ""}'), J, "no function name")]),
    (TC('{"name": 5}'), [], [_mal("missing_name", TC('{"name": 5}'), J, "no function name")]),
    (TC('{"name": "f", "arguments": 5}'), [],
     [_mal("invalid_arguments", TC('{"name": "f", "arguments": 5}'), J, "arguments is a int, not an object")]),
    # qwen3_json calls: the alias, its precedence, null and missing arguments
    (TC('{"name": "f", "parameters": {"a": 1}}'), [_call("f", {"a": 1}, TC('{"name": "f", "parameters": {"a": 1}}'), J)], []),
    (TC('{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}'),
     [_call("f", {"a": 1}, TC('{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}'), J)], []),
    (TC('{"name": "f", "arguments": null, "parameters": {"b": 2}}'),
     [_call("f", {}, TC('{"name": "f", "arguments": null, "parameters": {"b": 2}}'), J)], []),
    (TC('{"name": "f"}'), [_call("f", {}, TC('{"name": "f"}'), J)], []),
    # qwen3_coder_xml refusals
    (TC("<function=f</function>"), [], [_mal("invalid_xml", TC("<function=f</function>"), X, "'<function=' without '>'")]),
    (TC("<function= >\n</function>"), [], [_mal("missing_name", TC("<function= >\n</function>"), X, "empty function name")]),
    (TC("<function=f><parameter=a\n1</parameter></function>"), [],
     [_mal("invalid_xml", TC("<function=f><parameter=a\n1</parameter></function>"), X, "'<parameter=' without '>'")]),
    (TC("<function=f><parameter= >1</parameter></function>"), [],
     [_mal("invalid_xml", TC("<function=f><parameter= >1</parameter></function>"), X, "empty parameter name")]),
    # qwen3_coder_xml calls: names and keys trimmed, one newline off each end of a value, an
    # unclosed parameter ended by the next, text between parameters ignored, two functions in one
    # <tool_call> (each with the whole <tool_call> as its raw text)
    (TC("<function= f ><parameter= a >\n\nhello\n\n</parameter><parameter=n>\n\n7\n\n</parameter></function>"),
     [_call("f", {"a": "\nhello\n", "n": 7},
            TC("<function= f ><parameter= a >\n\nhello\n\n</parameter><parameter=n>\n\n7\n\n</parameter></function>"), X)], []),
    (TC("<function=f><parameter=a>1<parameter=b>2</parameter>junk<parameter=c>x</parameter></function>"),
     [_call("f", {"a": 1, "b": 2, "c": "x"},
            TC("<function=f><parameter=a>1<parameter=b>2</parameter>junk<parameter=c>x</parameter></function>"), X)], []),
    (TC("\n<function=a></function>\n<function=b></function>\n"),
     [_call("a", {}, TC("\n<function=a></function>\n<function=b></function>\n"), X),
      _call("b", {}, TC("\n<function=a></function>\n<function=b></function>\n"), X)], []),
    # a '>' inside a value (a shell redirect) is the value's, not the end of the name
    (TC("<function=run><parameter=cmd>\necho up > /tmp/state\n</parameter></function>"),
     [_call("run", {"cmd": "echo up > /tmp/state"},
            TC("<function=run><parameter=cmd>\necho up > /tmp/state\n</parameter></function>"), X)], []),
    # an unclosed <tool_call> before another: its own text as raw, its format from its body
    ('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>',
     [_call("b", {}, TC('{"name": "b"}'), J)],
     [_mal("unclosed_tag", '<tool_call>{"name": "a"}', J, "'<tool_call>' without '</tool_call>'")]),
    ("<tool_call> <function=a></function><tool_call>" + '{"name": "b"}</tool_call>',
     [_call("b", {}, TC('{"name": "b"}'), J)],
     [_mal("unclosed_tag", "<tool_call> <function=a></function>", X, "'<tool_call>' without '</tool_call>'")]),
    # unclosed at the end: accepted when whole, otherwise the body's own fault in the detail
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', [_call("f", {"a": 1}, '<tool_call>{"name": "f", "arguments": {"a": 1}}', J)], []),
    ('<tool_call>{"name": "show_vlan", "argu', [],
     [_mal("unclosed_tag", '<tool_call>{"name": "show_vlan", "argu', J,
           "'<tool_call>' without '</tool_call>' (truncated?); invalid_json: "
           "Unterminated string starting at: line 1 column 23 (char 22)")]),
    ("<tool_call>  <function=a>", [],
     [_mal("unclosed_tag", "<tool_call>  <function=a>", X,
           "'<tool_call>' without '</tool_call>' (truncated?); unclosed_tag: '<function=' without '</function>'")]),
    # bare <function=> without <tool_call>: the raw text is the function's own
    ("x <function=f>", [], [_mal("unclosed_tag", "<function=f>", X, "'<function=' without '</function>'")]),
    ("<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",
     [_call("f", {"a": 1}, "<function=f>\n<parameter=a>\n1\n</parameter>\n</function>", X)], []),
]


@pytest.mark.parametrize("text,calls,malformed", TEXT_RECORDS)
def test_text_extraction_records_exactly(text, calls, malformed):
    ex = extract_tool_calls(text).to_dict()
    assert (ex["calls"], ex["malformed"]) == (calls, malformed)
    formats = {r["format"] for r in calls + malformed}
    assert ex["format"] == (formats.pop() if len(formats) == 1 else "mixed")


def test_content_is_the_text_outside_every_call():
    ex = extract_tool_calls("a " + TC('{"name": "f"}') + " b " + TC('{"name": "g"}') + " c")
    assert (ex.content, ex.reasoning) == ("a  b  c", None)
    ex = extract_tool_calls("  before <function=f>\n</function> after\n")
    assert (ex.content, [c.name for c in ex.calls]) == ("before  after", ["f"])
    ex = extract_tool_calls("x <function=f>")
    assert ex.content == "x"
    # a stray close tag is not content, with or without a <tool_call> in the text
    for text in ("done</tool_call> here", "<function=f></function>done</tool_call> here"):
        ex = extract_tool_calls(text)
        assert ex.content == "done here"
        assert [m.to_dict() for m in ex.malformed] == [
            _mal("stray_close_tag", "</tool_call>", J, "'</tool_call>' without '<tool_call>'")]


@pytest.mark.parametrize("text,visible,reasoning", [
    ("no thinking", "no thinking", None),
    ("a</think>b<think>c</think>d", "bd", "ac"),
    ("x<think>y</think>z<think>w", "xz", "yw"),
    ("<think>a</think>b</think>c", "b</think>c", "a"),
    ("<think></think>", "", ""),
])
def test_thinking_is_split_off_exactly(text, visible, reasoning):
    ex = extract_tool_calls(text)
    assert (ex.content, ex.reasoning) == (visible, reasoning)


def test_openai_records_exactly():
    class Boom:
        def model_dump(self):
            raise RuntimeError("boom")

        def __repr__(self):
            return "B" * 300

    class Fn:
        def model_dump(self):
            return {"name": "g", "arguments": '{"x": "Ü"}'}

        def __str__(self):
            return "FN"

    entry = {"type": "function", "id": "c1", "function": {"name": "set_description", "arguments": '{"d": "Ü-link"}'}}
    unsortable = {"name": "f", 1: "x"}
    entries = [entry, 42, {"function": "show_vlan"}, {"function": {"arguments": {}}}, {"function": {"name": ""}},
               {"name": "f", "parameters": {"a": 1}}, {"function": {"name": "f", "arguments": "{bad"}},
               {"function": {"name": "f", "arguments": [1]}}, unsortable, Boom(), {"function": Fn()}]
    ex = extract_tool_calls(openai_tool_calls=entries).to_dict()
    assert ex["format"] == "openai"
    assert ex["calls"] == [
        _call("set_description", {"d": "Ü-link"},
              '{"function": {"arguments": "{\\"d\\": \\"Ü-link\\"}", "name": "set_description"}, "id": "c1", "type": "function"}', O),
        _call("f", {"a": 1}, '{"name": "f", "parameters": {"a": 1}}', O),
        _call("f", {}, "{'name': 'f', 1: 'x'}", O),
        _call("g", {"x": "Ü"}, '{"function": "FN"}', O),
    ]
    assert ex["malformed"] == [
        _mal("invalid_entry", "42", O, "tool call entry is a int"),
        _mal("invalid_entry", '{"function": "show_vlan"}', O, "'function' is not an object"),
        _mal("missing_name", '{"function": {"arguments": {}}}', O, "no function name"),
        _mal("missing_name", '{"function": {"name": ""}}', O, "no function name"),
        _mal("invalid_arguments", '{"function": {"arguments": "{bad", "name": "f"}}', O,
             "arguments string is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        _mal("invalid_arguments", '{"function": {"arguments": [1], "name": "f"}}', O, "arguments is a list, not an object"),
        _mal("invalid_entry", "B" * 200, O, "RuntimeError: boom"),
    ]


def test_openai_tool_calls_in_every_container():
    one = {"name": "f", "arguments": {}}
    raw = '{"arguments": {}, "name": "f"}'
    for value in ([one], (one,), one, json.dumps([one]), json.dumps([one]).encode(), bytearray(json.dumps(one).encode())):
        assert extract_tool_calls(openai_tool_calls=value).to_dict()["calls"] == [_call("f", {}, raw, O)], value

    class Sdk:
        def model_dump(self):
            return one

    assert extract_tool_calls(openai_tool_calls=Sdk()).to_dict()["calls"] == [_call("f", {}, raw, O)]
    ex = extract_tool_calls(openai_tool_calls=5).to_dict()
    assert (ex["calls"], ex["malformed"]) == ([], [_mal("invalid_entry", "5", O, "tool call entry is a int")])
    bad = "[" + "x" * 2500
    ex = extract_tool_calls(openai_tool_calls=bad).to_dict()
    assert (ex["format"], ex["calls"]) == ("openai", [])
    assert ex["malformed"] == [_mal("invalid_json", bad[:2000], O, "Expecting value: line 1 column 2 (char 1)")]
    ex = extract_tool_calls(openai_tool_calls=bytearray(b"\xff")).to_dict()
    assert ex["malformed"] == [_mal("invalid_json", "\ufffd", O, "Expecting value: line 1 column 1 (char 0)")]


def test_format_of_the_whole_extraction():
    assert extract_tool_calls(openai_tool_calls=[]).format == "openai"
    assert extract_tool_calls("").format == "none"
    both = extract_tool_calls(b"<function=g></function>", openai_tool_calls=[{"name": "f"}])
    assert (both.format, [c.name for c in both.calls]) == ("mixed", ["f", "g"])
    assert extract_tool_calls(TC("[1]")).format == J
    assert extract_tool_calls(bytearray(TC('{"name": "f"}').encode())).calls[0].name == "f"


def test_deeply_nested_json_is_refused_not_raised():
    body = "[" * 100_000
    assert [m.to_dict() for m in extract_tool_calls(TC(body)).malformed] == [
        _mal("invalid_json", TC(body), J, "maximum recursion depth exceeded while decoding a JSON array from a unicode string")]


def test_two_bare_functions_and_the_text_around_them():
    ex = extract_tool_calls("x <function=a></function> y <function=b>\n</function> z")
    assert [(c.name, c.raw) for c in ex.calls] == [("a", "<function=a></function>"), ("b", "<function=b>\n</function>")]
    assert ex.content == "x  z"  # text between bare functions belongs to neither call nor content


def test_openai_sdk_types_whole_or_listed():
    from openai.types.chat import ChatCompletionMessageToolCall

    call = ChatCompletionMessageToolCall(id="c1", type="function", function={"name": "f", "arguments": '{"a": 1}'})
    raw = '{"function": {"arguments": "{\\"a\\": 1}", "name": "f"}, "id": "c1", "type": "function"}'
    # a pydantic model iterates as (field, value) pairs: one passed alone is one call, not several
    for value in (call, [call]):
        assert extract_tool_calls(openai_tool_calls=value).to_dict()["calls"] == [_call("f", {"a": 1}, raw, O)]


def test_extraction_of_other_inputs_and_its_empty_fields():
    ex = extract_tool_calls(openai_tool_calls=[{"name": "f"}])
    assert (ex.content, ex.reasoning) == ("", None)  # no text: nothing visible, no thinking
    ex = extract_tool_calls(b"<function=g></function>\xff")
    assert ([c.name for c in ex.calls], ex.content) == (["g"], "\ufffd")  # bytes decoded, bad bytes replaced

    class Text:
        def __str__(self):
            return "<think>r</think>" + TC('{"name": "h"}')

    ex = extract_tool_calls(Text())
    assert ([c.name for c in ex.calls], ex.content, ex.reasoning) == (["h"], "", "r")


def test_a_parser_bug_becomes_a_malformed_entry(monkeypatch):
    import tensorverse.analysis.toolcalls as toolcalls

    def broken(text):
        raise RuntimeError("bug")

    monkeypatch.setattr(toolcalls, "_extract_from_text", broken)
    text = "a" * 2500
    ex = extract_tool_calls(text, openai_tool_calls=[{"name": "f"}])
    assert ([c.name for c in ex.calls], ex.content, ex.format) == (["f"], "", "mixed")
    assert [m.to_dict() for m in ex.malformed] == [_mal("invalid_entry", "a" * 2000, J, "RuntimeError: bug")]


def test_compare_accepts_every_kind_of_side():
    from tensorverse.analysis.toolcalls import Malformed

    f = ToolCall("f", {"a": 1})
    assert compare_tool_calls(f, [f]).verdict == "match"
    assert compare_tool_calls({"name": "f", "arguments": {"a": 1}}, f).verdict == "match"  # one dict is one call
    v = compare_tool_calls(5, None)  # neither a call nor a list of them
    assert [d.to_dict() for d in v.differences] == [{
        "kind": "malformed", "path": "$", "call_index": None, "candidate_index": None, "reference": "5",
        "detail": "reference: invalid_entry: tool call entry is a int"}]
    bad = Malformed("invalid_json", "<tool_call>{", J, "cut")
    v = compare_tool_calls([f], [bad, {"function": "x"}, f])
    assert (v.verdict, v.pairs, v.n_candidate) == ("malformed", [(0, 0)], 1)
    assert [(d.kind, d.candidate, d.detail) for d in v.differences] == [
        ("malformed", "<tool_call>{", "candidate: invalid_json: cut"),
        ("malformed", '{"function": "x"}', "candidate: invalid_entry: 'function' is not an object")]


D3 = [[1, 0, 0], [0, 1, 0], [0, 0, 1]]  # two best matchings, the cycles (1, 2, 0) and (2, 0, 1)


@pytest.mark.parametrize("cost,want", [
    # enumerated: ties go to the lexicographically first reference -> candidate assignment...
    (D3, [(0, 1), (1, 2), (2, 0)]),
    ([row + [9] * 6 for row in D3], [(0, 1), (1, 2), (2, 0)]),  # 504 assignments
    # ...or, with more references than candidates, the first candidate -> reference one
    ([row for row in D3] + [[9, 9, 9]] * 6, [(0, 2), (1, 0), (2, 1)]),
    # past 50,000 assignments scipy decides, and its tie differs
    ([row + [9] * 37 for row in D3], [(0, 2), (1, 0), (2, 1)]),  # 59,280 assignments
    ([row for row in D3] + [[9, 9, 9]] * 37, [(0, 1), (1, 2), (2, 0)]),
])
def test_ties_in_the_assignment_go_where_the_docstring_says(cost, want):
    from tensorverse.analysis.toolcalls import _assign

    assert _assign(cost, len(cost), len(cost[0])) == want
