"""Regions of output positions, from token pieces that split tags and keys across tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tensorverse.analysis.regions import REGIONS, char_regions, tag_regions

# A Qwen3-style output, cut the way a BPE tokenizer might cut it (tags split, keys split).
QWEN3_PIECES = [
    ("<think>", "thinking"),
    ("\nThe", "thinking"),
    (" user", "thinking"),
    (" wants", "thinking"),
    (" <tool_call>", "thinking"),  # tool-call text inside thinking is thinking
    ("</th", "thinking"),
    ("ink>", "thinking"),
    ("\n\n", "content"),
    ("Setting", "content"),
    (" it.\n", "content"),
    ("<tool", "tool_syntax"),
    ("_call", "tool_syntax"),
    (">\n", "tool_syntax"),
    ('{"', "tool_syntax"),
    ("na", "tool_syntax"),
    ('me":', "tool_syntax"),
    (' "', "tool_syntax"),
    ("configure", "tool_name"),
    ("_interface", "tool_name"),
    ("_description", "tool_name"),
    ('",', "tool_syntax"),
    (' "', "tool_syntax"),
    ("arg", "tool_syntax"),
    ("uments", "tool_syntax"),
    ('":', "tool_syntax"),
    (' {"', "tool_syntax"),
    ("inter", "tool_args"),
    ("face", "tool_args"),
    ('":', "tool_syntax"),
    (' "', "tool_syntax"),
    ("Gig", "tool_args"),
    ("abitEthernet", "tool_args"),
    ("0", "tool_args"),
    ("/", "tool_args"),
    ("0", "tool_args"),
    ("/", "tool_args"),
    ("1", "tool_args"),
    (".", "tool_args"),
    ("201", "tool_args"),
    ('",', "tool_syntax"),
    (' "description', "tool_args"),  # first non-syntax character decides
    ('": "', "tool_syntax"),
    ("uplink", "tool_args"),
    (" to core", "tool_args"),
    ('",', "tool_syntax"),
    (' "mtu":', "tool_args"),
    (" ", "tool_syntax"),
    ("9000", "tool_args"),
    (',', "tool_syntax"),
    (' "vlans": [', "tool_args"),
    ("10, ", "tool_args"),
    ("20]", "tool_args"),
    ("}}\n", "tool_syntax"),
    ("</", "tool_syntax"),
    ("tool_call", "tool_syntax"),
    (">", "tool_syntax"),
    ("<|im_end|>", "content"),
]


def test_qwen3_json_with_split_tags_and_keys():
    pieces = [p for p, _ in QWEN3_PIECES]
    got = tag_regions(pieces)
    assert len(got) == len(pieces)
    for (piece, want), have in zip(QWEN3_PIECES, got):
        assert have == want, (piece, want, have)


def test_nested_argument_value_is_all_args():
    text = '<tool_call>{"name": "apply_acl", "arguments": {"acl": {"rules": [{"permit": "10.0.0.0/8"}]}}}</tool_call>'
    r = char_regions(text)
    start = text.index('{"rules"')
    end = text.index("]}") + 2
    assert set(r[start:end]) == {"tool_args"}
    assert r[text.index("apply_acl")] == "tool_name"
    assert r[text.index('"acl"')] == "tool_syntax" and r[text.index('"acl"') + 1] == "tool_args"


def test_arguments_as_json_string():
    text = '<tool_call>{"name": "show_vlan", "arguments": "{\\"vlan_id\\": 201}"}</tool_call>'
    r = char_regions(text)
    i = text.index("vlan_id")
    assert r[i] == "tool_args" and r[text.index("201")] == "tool_args"


XML_PIECES = [
    ("<tool_call>", "tool_syntax"),
    ("\n", "tool_syntax"),
    ("<function", "tool_syntax"),
    ("=", "tool_syntax"),
    ("configure", "tool_name"),
    ("_vlan", "tool_name"),
    (">\n", "tool_syntax"),
    ("<parameter", "tool_syntax"),
    ("=vlan", "tool_args"),
    ("_id", "tool_args"),
    (">\n", "tool_syntax"),
    ("20", "tool_args"),
    ("1", "tool_args"),
    ("\n</", "tool_syntax"),
    ("parameter>\n", "tool_syntax"),
    ("<parameter=", "tool_syntax"),
    ("ports", "tool_args"),
    (">\n", "tool_syntax"),
    ('["Gi0/0/1"', "tool_args"),
    (', "Gi0/0/2"]', "tool_args"),
    ("\n", "tool_syntax"),
    ("</parameter>", "tool_syntax"),
    ("\n</function>", "tool_syntax"),
    ("\n", "tool_syntax"),
    ("</tool_call>", "tool_syntax"),
]


def test_qwen3_coder_xml():
    pieces = [p for p, _ in XML_PIECES]
    got = tag_regions(pieces)
    for (piece, want), have in zip(XML_PIECES, got):
        assert have == want, (piece, want, have)


def test_bare_function_without_tool_call_wrapper():
    r = tag_regions(["Sure.", "<function=", "show_version", ">\n", "</function>"])
    assert r == ["content", "tool_syntax", "tool_name", "tool_syntax", "tool_syntax"]


def test_prefilled_think_and_override():
    pieces = ["The", " user", "</think>", "\n\n", "Done", "."]
    assert tag_regions(pieces) == ["thinking", "thinking", "thinking", "content", "content", "content"]
    assert tag_regions(["a", "b"], start_in_thinking=True) == ["thinking", "thinking"]
    assert tag_regions(["a", "</think>", "b"], start_in_thinking=False) == ["content", "content", "content"]


def test_unclosed_think_runs_to_end():
    assert tag_regions(["<think>", "hmm", "<tool_call>", "{"]) == ["thinking"] * 4


def test_truncated_tool_call():
    pieces = ["<tool_call>", '{"name": "', "show", "_vlan", '", "argu']
    assert tag_regions(pieces) == ["tool_syntax", "tool_syntax", "tool_name", "tool_name", "tool_syntax"]


def test_empty_pieces_and_empty_input():
    assert tag_regions([]) == []
    assert tag_regions([""]) == ["content"]
    # an empty piece takes the previous character's region (the first character's at the start)
    assert tag_regions(["", "<think>", "", "x", "</think>", "", "hi"]) == [
        "thinking", "thinking", "thinking", "thinking", "thinking", "thinking", "content"]


def test_odd_pieces_do_not_raise():
    assert len(tag_regions([None, 3, "\ufffd", "<tool_call>", "}}}]]]", '"', "</tool_call>", "</tool_call>"])) == 8


FRAGMENTS = list('<>/{}[]":,= \n\\ab01') + [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<function=", "</function>", "<parameter=",
    "</parameter>", '"name"', '"arguments"', "<tool", "_call>", "</th", "ink>",
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=50))
def test_tag_regions_total_and_never_raises(pieces):
    got = tag_regions(pieces)
    assert len(got) == len(pieces)
    assert set(got) <= set(REGIONS)
    assert len(char_regions("".join(pieces))) == len("".join(pieces))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=30))
def test_regions_do_not_depend_on_tokenization(pieces):
    """Re-cutting the same text into single characters gives the same per-character regions."""
    text = "".join(pieces)
    per_char = tag_regions(list(text))
    assert per_char == char_regions(text)
