"""The multiverse tree over the backends' output token sequences."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorverse.analysis.multiverse import END, BranchPoint, build_tree, branch_points

# Token ids as a Qwen3 tokenizer might emit for `{"name": "show_vlan", ...`; only equality matters.
PRIMARY = [151657, 198, 4913, 606, 788, 330, 3445, 71296, 497, 330, 16370, 788, 5212, 151658]
FA2 = PRIMARY[:3] + [1234, 788, 330, 3445, 71296, 497, 151658]  # flips at position 3
FP8 = PRIMARY[:8] + [9999, 330, 16370, 151658]  # follows the primary past 3, flips at 8
KV8 = PRIMARY[:3] + [1234, 788, 330, 7777]  # follows FA2 at 3, then flips at 6


def test_three_backends_branch_at_3_and_sub_branch():
    tree = build_tree({"primary": PRIMARY, "fa2": FA2, "fp8": FP8})
    root = tree.root
    assert root.tokens == PRIMARY[:3] and root.start == 0 and root.end == 3
    assert root.backends == ["primary", "fa2", "fp8"]
    assert [c.backends for c in root.children] == [["primary", "fp8"], ["fa2"]]  # primary's child first
    left, right = root.children
    assert left.start == 3 and left.tokens == PRIMARY[3:8]
    assert right.tokens == FA2[3:] and right.ended == ["fa2"]
    assert [c.backends for c in left.children] == [["primary"], ["fp8"]]
    bps = branch_points(tree)
    assert bps == [
        BranchPoint(3, {PRIMARY[3]: ["primary", "fp8"], FA2[3]: ["fa2"]}),
        BranchPoint(8, {PRIMARY[8]: ["primary"], FP8[8]: ["fp8"]}),
    ]
    pos, options = bps[0]  # unpacks as a plain 2-tuple
    assert pos == 3 and set(options) == {PRIMARY[3], FA2[3]}
    assert tree.divergence("primary", "fa2") == 3
    assert tree.divergence("primary", "fp8") == 8
    assert tree.divergence("primary", "primary") is None
    assert [n.id for n in tree.nodes()] == list(range(5))


def test_sub_branch_under_the_minority_child():
    tree = build_tree({"primary": PRIMARY, "fa2": FA2, "kv8": KV8})
    assert [(bp.position, sorted(map(sorted, bp.options.values()))) for bp in tree.branch_points()] == [
        (3, [["fa2", "kv8"], ["primary"]]),
        (6, [["fa2"], ["kv8"]]),
    ]


def test_prefix_case_has_explicit_end():
    short = PRIMARY[:5]  # stopped early (max_tokens)
    tree = build_tree({"primary": PRIMARY, "short": short})
    assert tree.root.tokens == short
    assert tree.root.ended == ["short"]
    assert [c.backends for c in tree.root.children] == [["primary"]]
    assert branch_points(tree) == [(5, {PRIMARY[5]: ["primary"], END: ["short"]})]
    assert tree.divergence("short", "primary") == 5
    assert tree.sequence("short") == short


def test_identical_sequences_single_node():
    tree = build_tree({"primary": PRIMARY, "secondary": list(PRIMARY), "fa2": tuple(PRIMARY)})
    assert tree.root.tokens == PRIMARY
    assert tree.root.children == []
    assert tree.root.ended == ["primary", "secondary", "fa2"]
    assert branch_points(tree) == []
    assert len(list(tree.nodes())) == 1


def test_differ_at_position_0_and_empty_sequences():
    tree = build_tree({"a": [5, 6], "b": [7], "c": []})
    assert tree.root.tokens == [] and tree.root.ended == ["c"]
    assert branch_points(tree) == [(0, {5: ["a"], 7: ["b"], END: ["c"]})]
    both_empty = build_tree({"a": [], "b": []})
    assert both_empty.root.tokens == [] and both_empty.root.children == [] and branch_points(both_empty) == []


def test_single_branch_and_validation():
    tree = build_tree({"primary": [1, 2, 3]})
    assert tree.sequence("primary") == [1, 2, 3] and branch_points(tree) == []
    with pytest.raises(ValueError):
        build_tree({})
    with pytest.raises(ValueError):
        build_tree({"a": [1, -1]})
    with pytest.raises(ValueError):
        build_tree({"a": [1, "x"]})
    with pytest.raises(ValueError):
        build_tree({"": [1]})
    with pytest.raises(KeyError):
        tree.sequence("nope")


def test_numpy_ints_accepted():
    import numpy as np
    tree = build_tree({"a": np.array([1, 2, 3]), "b": [1, 2, 4]})
    assert tree.sequence("a") == [1, 2, 3]
    assert all(type(t) is int for t in tree.root.tokens)
    json.dumps(tree.to_dict())


def test_to_dict_for_viewer():
    tree = build_tree({"primary": PRIMARY, "fa2": FA2, "fp8": FP8, "short": PRIMARY[:2]})
    d = json.loads(json.dumps(tree.to_dict()))
    assert d["backends"] == ["primary", "fa2", "fp8", "short"]
    assert d["lengths"]["short"] == 2
    root = d["root"]
    assert root["start"] == 0 and root["tokens"] == PRIMARY[:2] and root["ended"] == ["short"]
    assert set(root) == {"id", "start", "end", "tokens", "backends", "ended", "children"}
    assert [bp["position"] for bp in d["branch_points"]] == [2, 3, 8]
    assert {"token": END, "backends": ["short"]} in d["branch_points"][0]["options"]


branches_strategy = st.dictionaries(
    keys=st.sampled_from(["primary", "secondary", "fa2", "fp8", "kv_fp8", "tp2", "h100"]),
    # a small alphabet makes shared prefixes and branch points common
    values=st.lists(st.integers(min_value=0, max_value=3), max_size=12),
    min_size=1,
    max_size=5,
)


@settings(max_examples=200, deadline=None)
@given(branches_strategy)
def test_round_trip_and_invariants(branches):
    tree = build_tree(branches)
    for name, seq in branches.items():
        assert tree.sequence(name) == seq
    for node in tree.nodes():
        # children partition the backends that go on; ended + children cover the node's backends
        covered = list(node.ended) + [b for c in node.children for b in c.backends]
        assert sorted(covered) == sorted(node.backends)
        assert len({c.tokens[0] for c in node.children}) == len(node.children)
        for c in node.children:
            assert c.start == node.end and c.tokens
        # compression: a node with a single continuation and nothing ending is never left in place
        assert node.children == [] or node.is_branch_point
    for pos, options in branch_points(tree):
        assert len(options) >= 2
        members = [b for bs in options.values() for b in bs]
        assert len(members) == len(set(members))
        for tok, bs in options.items():
            for b in bs:
                seq = branches[b]
                assert (len(seq) == pos) if tok == END else seq[pos] == tok
    json.dumps(tree.to_dict())
    names = list(branches)
    for a in names:
        for b in names:
            d = tree.divergence(a, b)
            sa, sb = branches[a], branches[b]
            if sa == sb:
                assert d is None
            else:
                k = 0
                while k < len(sa) and k < len(sb) and sa[k] == sb[k]:
                    k += 1
                assert d == k


# ------------------------------------------------------------------------------------------
# Exact trees, records and messages
# ------------------------------------------------------------------------------------------

# p and s agree, q goes on past them, r stops after the first token:
#   root [1] (ended r) -> [2] -> [3] (ended p, s)
#                             -> [4, 5] (ended q)
FOUR = {"p": [1, 2, 3], "q": [1, 2, 4, 5], "r": [1], "s": [1, 2, 3]}


def test_tree_of_four_in_full():
    tree = build_tree(FOUR)
    assert END == -1
    leaf_ps = {"id": 2, "start": 2, "end": 3, "tokens": [3], "backends": ["p", "s"],
               "ended": ["p", "s"], "children": []}
    leaf_q = {"id": 3, "start": 2, "end": 4, "tokens": [4, 5], "backends": ["q"], "ended": ["q"],
              "children": []}
    mid = {"id": 1, "start": 1, "end": 2, "tokens": [2], "backends": ["p", "q", "s"], "ended": [],
           "children": [leaf_ps, leaf_q]}
    root = {"id": 0, "start": 0, "end": 1, "tokens": [1], "backends": ["p", "q", "r", "s"],
            "ended": ["r"], "children": [mid]}
    assert tree.to_dict() == {
        "backends": ["p", "q", "r", "s"],
        "lengths": {"p": 3, "q": 4, "r": 1, "s": 3},
        "root": root,
        "branch_points": [
            {"position": 1, "options": [{"token": 2, "backends": ["p", "q", "s"]},
                                        {"token": END, "backends": ["r"]}]},
            {"position": 2, "options": [{"token": 3, "backends": ["p", "s"]},
                                        {"token": 4, "backends": ["q"]}]},
        ],
    }
    nodes = list(tree.nodes())
    assert [n.id for n in nodes] == [0, 1, 2, 3]
    assert [n.end for n in nodes] == [1, 2, 3, 4]
    # one child and an end is a branch point; ends without children, or one child alone, are not
    assert [n.is_branch_point for n in nodes] == [True, True, False, False]
    assert nodes[0].options() == {2: ["p", "q", "s"], END: ["r"]}
    assert nodes[2].options() == {END: ["p", "s"]}
    assert [n.id for n in tree.path("q")] == [0, 1, 3]
    assert [n.id for n in tree.path("r")] == [0]
    assert tree.sequence("q") == [1, 2, 4, 5] and tree.sequence("r") == [1]
    bps = tree.branch_points()
    assert [(bp.position, bp.options) for bp in bps] == [
        (1, {2: ["p", "q", "s"], END: ["r"]}), (2, {3: ["p", "s"], 4: ["q"]})]


def test_divergence_of_every_pair():
    tree = build_tree(FOUR)
    want = {("p", "s"): None, ("p", "q"): 2, ("p", "r"): 1, ("q", "r"): 1, ("q", "s"): 2,
            ("r", "s"): 1}
    for (a, b), d in want.items():
        assert tree.divergence(a, b) == d, (a, b)
        assert tree.divergence(b, a) == d, (b, a)
    for b in FOUR:
        assert tree.divergence(b, b) is None
    with pytest.raises(KeyError, match="nope"):
        tree.divergence("p", "nope")
    with pytest.raises(KeyError, match="nope"):
        tree.path("nope")


def test_records_are_copies():
    tree = build_tree(FOUR)
    root = tree.root
    opts = root.options()
    opts[2].append("x")
    opts[END].append("y")
    d = root.to_dict()
    d["tokens"].append(9)
    d["backends"].append("z")
    d["ended"].append("z")
    t = tree.to_dict()
    t["backends"].append("z")
    t["lengths"]["z"] = 0
    assert root.children[0].backends == ["p", "q", "s"] and root.ended == ["r"]
    assert root.tokens == [1] and root.backends == ["p", "q", "r", "s"]
    assert tree.backends == ["p", "q", "r", "s"] and "z" not in tree.lengths


def test_branch_points_at_the_same_position_keep_tree_order():
    # two subtrees branch at position 2; the first backend's subtree comes first, even though
    # the second's tokens are smaller
    tree = build_tree({"a": [5, 6, 9], "b": [5, 6, 8], "c": [2, 3, 1], "d": [2, 3, 0]})
    assert [(bp.position, bp.options) for bp in branch_points(tree)] == [
        (0, {5: ["a", "b"], 2: ["c", "d"]}),
        (2, {9: ["a"], 8: ["b"]}),
        (2, {1: ["c"], 0: ["d"]}),
    ]
    assert [n.id for n in tree.nodes()] == list(range(7))
    # a deep branch point in the first subtree comes after a shallow one in the second
    deep = build_tree({"a": [1, 1, 1, 1, 1, 9], "b": [1, 1, 1, 1, 1, 8], "c": [2, 3, 4], "d": [2, 3, 5]})
    assert [(bp.position, bp.options) for bp in branch_points(deep)] == [
        (0, {1: ["a", "b"], 2: ["c", "d"]}), (2, {4: ["c"], 5: ["d"]}), (5, {9: ["a"], 8: ["b"]})]
    assert [n.tokens for n in tree.nodes()] == [[], [5, 6], [9], [8], [2, 3], [1], [0]]


def test_validation_messages():
    with pytest.raises(TypeError, match="^branches must be a mapping of backend name -> token ids$"):
        build_tree([[1, 2]])
    with pytest.raises(ValueError, match="^build_tree needs at least one branch$"):
        build_tree({})
    with pytest.raises(ValueError, match="^backend name must be a non-empty string, got ''$"):
        build_tree({"": [1]})
    with pytest.raises(ValueError, match="^backend name must be a non-empty string, got 3$"):
        build_tree({3: [1]})
    with pytest.raises(ValueError, match="^a: token id must be an integer, got True$"):
        build_tree({"a": [1, True]})
    with pytest.raises(ValueError, match="^a: token id must be an integer, got 1.5$"):
        build_tree({"a": [1.5]})
    with pytest.raises(ValueError, match="^b: token id must be >= 0, got -2$"):
        build_tree({"a": [1], "b": [0, -2]})
    import numpy as np
    with pytest.raises(ValueError, match="^a: token id must be >= 0, got -3$"):
        build_tree({"a": np.array([-3])})
    # token 0 is valid; None is an empty sequence
    tree = build_tree({"a": [0, 0], "b": None})
    assert tree.lengths == {"a": 2, "b": 0}
    assert tree.root.tokens == [] and tree.root.ended == ["b"]
    assert [c.tokens for c in tree.root.children] == [[0, 0]]
    assert branch_points(tree) == [(0, {0: ["a"], END: ["b"]})]
