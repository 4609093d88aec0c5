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


# ------------------------------------------------------------------------------------------
# Exact labels of every character. Each case is written as (segment, region) pairs labelled by
# hand from the rules in the module docstring; the text is their concatenation and the expected
# label of every character is its segment's.
# ------------------------------------------------------------------------------------------

S, A, N, C, T = "tool_syntax", "tool_args", "tool_name", "content", "thinking"


def _check(segs, **kw):
    text = "".join(s for s, _ in segs)
    want = [r for s, r in segs for _ in s]
    assert len(want) == len(text)
    got = char_regions(text, **kw)
    assert len(got) == len(text)
    bad = [(i, text[i], want[i], got[i]) for i in range(len(text)) if got[i] != want[i]]
    assert not bad, (text, bad[:5])
    # one token per segment (each segment is one region) and one token per character agree
    assert tag_regions([s for s, _ in segs], **kw) == [r for _, r in segs]
    assert tag_regions(list(text), **kw) == want


def test_json_escapes_unknown_keys_parameters_and_literals():
    _check([
        ("Intro ", C), ("<tool_call>", S), ("\n ", S), ("{", S), ('"name"', S), (": ", S),
        ('"', S), ('do\\"it', N), ('"', S),  # an escaped quote does not end the name
        (", ", S), ('"id"', S), (":", S), ("42", S),  # a top-level key other than name/arguments
        (", ", S), ('"parameters"', S), (": ", S), ("{", S),  # "parameters" is "arguments"
        ('"', S), ("q", A), ('"', S), (":", S), ('"', S), ("x y", A), ('"', S), (",", S), (" ", S),
        ('"', S), ("k", A), ('"', S), (" : ", S), ("null", A), ("}", S),
        ("}", S), ("\n", S), ("</tool_call>", S), (" bye", C),
    ])


def test_json_stray_delimiters_and_non_object_arguments():
    # a stray delimiter where a value should be is one syntax character; scanning goes on after it
    _check([("<tool_call>", S), ('{"name": ', S), (",", S), (" ", S), ('"arguments"', S), (": ", S),
            ("5", A), ("}", S), ("</tool_call>", S)])
    # arguments as a list: every character of it, brackets included, is an argument
    _check([("<tool_call>", S), ('{"name": "', S), ("f", N), ('", "arguments": ', S),
            ('[1, "a", [2]]', A), ("}", S), ("</tool_call>", S)])
    # arguments as a JSON string: quotes are syntax, the content arguments
    _check([("<tool_call>", S), ('{"arguments": "', S), ('{\\"a\\": 1}', A), ('"', S), ("}", S),
            ("</tool_call>", S)])
    # garbage before the object in the body is syntax, one character at a time
    _check([("<tool_call>", S), ("x,", S), ('{"name": "', S), ("g", N), ('"}', S),
            ("</tool_call>", S)])


def test_json_nested_values_with_brackets_in_strings():
    _check([("<tool_call>", S), ('{"name": "', S), ("h", N), ('", "arguments": {"', S), ("v", A),
            ('": ', S), ('{"s": "]}", "t": [[1], [2]]}', A), (', "', S), ("w", A), ('": ', S),
            ("1", A), ("}}", S), ("</tool_call>", S)])
    # brackets are counted, other characters (X) are not
    _check([("<tool_call>", S), ('{"arguments": {"', S), ("v", A), ('": ', S), ("[X]", A), (', "', S),
            ("w", A), ('": ', S), ("1", A), ("}}", S), ("</tool_call>", S)])
    # a nested value that never closes runs to the end of the body
    _check([("<tool_call>", S), ('{"arguments": {"', S), ("v", A), ('": ', S), ('{"s": [1', A),
            ("</tool_call>", S)])


def test_xml_parameters_values_and_newlines():
    _check([
        ("<tool_call>", S), ("\n", S), ("<function=", S), ("get", N), (">", S), ("\n", S),
        ("<parameter=", S), ("a", A), (">", S), ("\n", S), ("v1\nv2", A), ("\n", S),
        ("</parameter>", S), ("\n", S),
        # a value cut short by the next parameter, then one cut short by </function>
        ("<parameter=", S), ("b", A), (">", S), ("x", A),
        ("<parameter=", S), ("c", A), (">", S), ("\n", S), ("y", A), ("\n", S),
        ("</function>", S), ("\n", S), ("</tool_call>", S), ("ok", C),
    ])
    # names ended by a newline or by '<' instead of '>'
    _check([("<tool_call>", S), ("<function=", S), ("f", N), ("\n", S), ("<parameter=", S), ("p", A),
            ("<parameter=", S), ("q", A), (">", S), ("z", A), ("</parameter>", S), ("</tool_call>", S)])
    # a body starting with blanks then '<' (not '<function=') is XML
    _check([("<tool_call>", S), (" ", S), ("<parameter=", S), ("p", A), (">", S), ("v", A),
            ("</parameter>", S), ("</tool_call>", S)])


def test_xml_value_truncated_at_the_end_keeps_its_trailing_newline():
    # the trailing newline is stripped only when a closing tag follows it
    _check([("<tool_call>", S), ("<function=", S), ("f", N), (">", S), ("<parameter=", S), ("p", A),
            (">", S), ("\n", S), ("val\n", A)])
    _check([("<tool_call>", S), ("<function=", S), ("f", N), (">", S), ("<parameter=", S), ("p", A),
            (">", S), ("\n", S)])
    _check([("<tool_call>", S), ("<function=", S), ("f", N), (">", S), ("<parameter=", S), ("p", A),
            (">", S)])
    _check([("<tool_call>", S), ("<function=", S), ("f", N), (">", S), ("<parameter=", S), ("ab", A)])


def test_tool_call_tags_at_top_level():
    # a second <tool_call> before the first one closes ends the first body
    _check([("<tool_call>", S), ('{"name": "', S), ("a", N), ('"', S), ("<tool_call>", S),
            ('{"name": "', S), ("b", N), ('"}', S), ("</tool_call>", S)])
    # a stray </tool_call> is syntax; other '<' are content
    _check([("x", C), ("</tool_call>", S), ("y<b>c<", C), ("<tool_call>", S), ('{"name": "', S),
            ("n", N), ('"}', S), ("</tool_call>", S)])
    # an unclosed call runs to the end
    _check([("<tool_call>", S), ('{"name": "', S), ("n", N)])


def test_bare_function_ends_at_its_close_or_the_next_tag():
    _check([("x", C), ("<function=", S), ("f", N), (">", S), ("</function>", S), (" z", C)])
    _check([("<function=", S), ("f", N), (">", S), ("<parameter=", S), ("p", A), (">", S), ("v", A),
            ("<think>hm</think>", T), (" z", C)])
    _check([("<function=", S), ("f", N), (">", S), ("<tool_call>", S), ('{"name": "', S), ("g", N),
            ('"}', S), ("</tool_call>", S)])
    _check([("<function=", S), ("f", N), (">", S), ("v", S)])


def test_thinking_boundaries():
    _check([("pre", C), ("<think>t<tool_call>{</think>", T), ("post", C)])
    _check([("a</think>", T), ("b", C), ("<think>c", T)])  # prefilled, then another unclosed
    _check([("a</think>", T), ("<think>b", T)])
    _check([("<", C), ("<think>t</think>", T)])  # a "<" that starts no tag is content
    _check([("a<tool_call>b", T)], start_in_thinking=True)  # forced, never closed
    _check([("a</think>", T), ("<tool_call>", S), ('{"name": "', S), ("n", N), ('"}', S),
            ("</tool_call>", S)], start_in_thinking=True)
    _check([("<think>", T), ("x", T), ("</think>", T), ("</think>", C)])
    _check([("a", C), ("</think>", C), ("<think>b</think>", T)], start_in_thinking=False)


def test_char_regions_of_odd_input():
    assert char_regions(None) == []
    assert char_regions(123) == [C, C, C]
    assert char_regions("") == []

    class Evil(str):  # str() keeps it; its find raises inside the scanner
        def __str__(self):
            return self

        def find(self, *a, **k):
            raise RuntimeError("boom")

    assert char_regions(Evil("<think>ab")) == [C] * 9


def test_empty_and_non_string_pieces():
    assert tag_regions(["", ""]) == [C, C]
    assert tag_regions(["", "<think>", "x</think>", "", "b", ""]) == [T, T, T, T, C, C]
    assert tag_regions([None, "<think>", None]) == [T, T, T]
    # non-strings are converted with str: 12 is two characters of content before the tag
    assert tag_regions([12, "</think>", "x"]) == [T, T, C]
    assert tag_regions(["a", "b"], start_in_thinking=False) == [C, C]


def test_region_at():
    from tensorverse.analysis.regions import UNKNOWN, region_at

    assert UNKNOWN == "unknown"
    pieces = ["<think>", "x", "</think>", "ok", "<tool_call>", '{"name": "', "f", '"}', "</tool_call>"]
    want = [T, T, T, C, S, S, N, S, S]
    assert [region_at(pieces, i) for i in range(len(pieces))] == want
    assert region_at(tuple(pieces), 6) == N
    for pos in (None, -1, len(pieces), len(pieces) + 1):
        assert region_at(pieces, pos) == UNKNOWN
    assert region_at(None, 0) == UNKNOWN
    assert region_at([], 0) == UNKNOWN

    class Bad:
        def __str__(self):
            raise RuntimeError("no text")

    assert region_at(["a", Bad()], 0) == UNKNOWN


def test_next_finder_remembers_only_forward():
    from tensorverse.analysis.regions import NextFinder

    nf = NextFinder("ab<x>cd<x>")
    assert nf.find("<x>", 0) == 2
    assert nf.find("<x>", 2) == 2  # the remembered hit, still ahead
    assert nf.find("<x>", 3) == 7  # past the remembered hit: searched again
    assert nf.find("<x>", 0) == 2  # behind the remembered start: searched again
    assert nf.find("<x>", 0, 4) == 4  # the hit does not fit before end: end
    assert nf.find("<x>", 0, 5) == 2  # exactly fits
    assert nf.find("<y>", 0) == 10 and nf.find("<y>", 3, 6) == 6  # never found: end
    nf = NextFinder("a<x>")
    assert nf.find("<x>", 2) == 4  # not after 2 -> remembered as absent from 2 on
    assert nf.find("<x>", 3) == 4
    assert nf.find("<x>", 0) == 1  # from 0 it is there
    assert nf.find("<x>", 1) == 1


def test_json_truncated_at_the_end_of_the_text():
    # every scanner stops at the end of the text, with one label per character
    _check([("<tool_call>", S), ("{", S)])
    _check([("<tool_call>", S), ('{"name": "', S), ("f", N), ('"}', S)])
    _check([("<tool_call>", S), ('{"name": "', S), ("f", N), ('",', S)])
    _check([("<tool_call>", S), ('{"name": "', S), ("f", N), ('", ', S)])
    _check([("<tool_call>", S), ('{"name": ', S)])
    _check([("<tool_call>", S), ('{"arguments": ', S)])
    _check([("<tool_call>", S), ('{"name": ', S), ("]", S)])  # a stray delimiter, last
    _check([("<tool_call>", S), ('{"name": "', S)])
    _check([("<tool_call>", S), ('{"arguments": {"', S), ("k", A), ('": ', S), ("12", A)])
    _check([("<tool_call>", S), ('{"arguments": {"', S), ("k", A), ('": ', S), ("[1", A)])
    _check([("<tool_call>", S), ("<function=", S), ("ab", N)])
    _check([("<tool_call>", S), ("<function=", S), ("ab", N), (">", S)])


def test_json_strings_empty_and_escaped_and_odd_members():
    # an empty value, a value ending in an escaped backslash, a value that is an escaped quote
    _check([("<tool_call>", S), ('{"name": "', S), ("f", N), ('", "arguments": {"', S), ("a", A),
            ('": ""', S), (', "', S), ("b", A), ('": "', S), ("C:\\\\", A), ('"', S), (', "', S),
            ("c", A), ('": "', S), ('\\"', A), ('"}}', S), ("</tool_call>", S)])
    # arguments before the name: the arguments object closes before "name"
    _check([("<tool_call>", S), ('{"arguments": {"', S), ("k", A), ('": "', S), ("v", A),
            ('"}, "name": "', S), ("f", N), ('"}', S), ("</tool_call>", S)])
    # a key with no colon and a stray delimiter for its value; scanning resumes after it
    _check([("<tool_call>", S), ('{"arguments"', S), (",", S), ("5", S), (', "name": "', S), ("f", N),
            ('"}', S), ("</tool_call>", S)])
    # a bare literal starting with X, and a key with no colon before its object
    _check([("<tool_call>", S), ('{"arguments": {"', S), ("k", A), ('": ', S), ("Xy", A), ("}}", S),
            ("</tool_call>", S)])
    _check([("<tool_call>", S), ('{"arguments"{"', S), ("k", A), ('": ', S), ("1", A), ("}}", S),
            ("</tool_call>", S)])


def test_xml_function_names():
    _check([("<tool_call>", S), ("<function=", S), ("showXcvr", N), (">", S), ("\n", S),
            ("</function>", S), ("</tool_call>", S)])
    _check([("<function=", S), ("f", N), ("<parameter=", S), ("p", A), (">", S), ("v", A),
            ("</parameter>", S)])
    _check([("<tool_call>", S), ("<function=", S), ("f", N), (">", S), ("<parameter=", S),
            ("maxX", A), (">", S), ("1", A), ("</parameter>", S), ("</function>", S), ("</tool_call>", S)])


def test_thinking_found_by_the_first_tags_and_closed_by_the_first_close():
    # prefilled (the first </think> before the first <think>), reopened and closed again
    _check([("a</think>", T), ("b", C), ("<think>c</think>", T), ("d", C)])
    # not prefilled: the first <think> comes before the first </think>, although a later one does not
    _check([("x", C), ("<think>a</think>", T), ("b", C), ("<think>c", T)])
    # a bare function after closed thinking, and a <think> inside a tool call's body (not thinking)
    _check([("<think>a</think>", T), ("\n", C), ("<function=", S), ("f", N), (">\n</function>", S)])
    _check([('<tool_call>{"name": "', S), ("f", N), ('"}<think>x</tool_call>', S), ("after", C)])


def test_next_finder_searches_each_tag_once_per_forward_scan():
    from tensorverse.analysis.regions import NextFinder

    class Counting(str):
        calls = 0

        def find(self, *a):
            Counting.calls += 1
            return str.find(self, *a)

    text = Counting("<a>" * 1000 + "</a>")
    nf = NextFinder(text)
    assert [nf.find("</a>", i) for i in range(0, 3000, 3)] == [3000] * 1000
    assert nf.find("</a>", 3000) == 3000  # the hit itself, at exactly the start
    assert Counting.calls == 1  # one search for the whole forward scan
    Counting.calls = 0
    nf = NextFinder(Counting("x" * 100))
    assert [nf.find("</b>", i) for i in (0, 0, 5, 50, 99)] == [100] * 5  # a miss, asked again and again
    assert Counting.calls == 1
    assert nf.find("</b>", 0) == 100 and nf.find("<c>", 0) == 100  # another tag has its own memory
    assert Counting.calls == 2
