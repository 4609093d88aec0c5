"""View models built from a recorded store (tests/viz/conftest.py describes the store)."""

from __future__ import annotations

import msgspec
import numpy as np
import orjson
import pytest

from tensorverse.store import Store
from tensorverse.store.codec import encode_row
from tensorverse.viz.data import NotFound, ViewData
from tensorverse.store.records import Turn
from tensorverse.testing.records import tcomparison, trun, tsession



@pytest.fixture()
def view(ro_store) -> ViewData:
    return ViewData(ro_store)




# ---------------------------------------------------------------- sessions list


def test_sessions_newest_first_and_paged(view):
    page = view.list_sessions(limit=4)
    assert page["total"] == 9
    assert [s["id"] for s in page["items"]] == ["s-xss", "s-net", "s-06", "s-05"]
    nxt = view.list_sessions(limit=4, offset=8)
    assert [s["id"] for s in nxt["items"]] == ["s-00"]
    asc = view.list_sessions(limit=2, order="asc")
    assert [s["id"] for s in asc["items"]] == ["s-00", "s-01"]


def test_session_summary_counts(view):
    s = next(i for i in view.list_sessions()["items"] if i["id"] == "s-net")
    assert s["turns"] == 2
    assert s["backends"] == ["primary", "secondary", "fa2", "fp8"]
    assert s["worst"] == "value_mismatch"
    assert s["flips"] == 2  # fa2 and fp8 diverged (free) in turn 1
    assert s["forced_flips"] == 3  # from the comparison records (hints)
    assert s["first_divergence_turn"] == 1
    assert s["tags"] == {"agent": "netops", "site": "lab"}


def test_sessions_filter_and_sort(view):
    assert [s["id"] for s in view.list_sessions(q="agent=netops")["items"]] == ["s-net"]
    assert [s["id"] for s in view.list_sessions(q="SITE=LAB")["items"]] == ["s-net"]
    assert view.list_sessions(q="filler")["total"] == 7
    assert {s["id"] for s in view.list_sessions(verdict="value_mismatch")["items"]} == {"s-net", "s-xss"}
    assert [s["id"] for s in view.list_sessions(backend="fa2")["items"]] == ["s-net"]
    by_flips = view.list_sessions(sort="flips", limit=2)["items"]
    assert by_flips[0]["id"] == "s-net"
    worst = view.list_sessions(sort="verdict", order="desc", limit=2)["items"]
    assert {s["worst"] for s in worst} == {"value_mismatch"}
    assert view.list_sessions(sort="turns", limit=1)["items"][0]["id"] == "s-net"
    with pytest.raises(ValueError):
        view.list_sessions(sort="nope")
    with pytest.raises(ValueError):
        view.list_sessions(order="sideways")


def test_unknown_ids(view):
    with pytest.raises(NotFound):
        view.session_view("nope")
    with pytest.raises(NotFound):
        view.turn_view("nope")
    with pytest.raises(NotFound):
        view.turn_view("bad\x00id")


# ---------------------------------------------------------------- session + timeline


def test_session_timeline(view, vz):
    sv = view.session_view("s-net")
    assert [t["index"] for t in sv["turns"]] == [0, 1]
    assert sv["timeline"]["backends"] == ["primary", "secondary", "fa2", "fp8"]
    assert sv["timeline"]["first_divergence"] == {"secondary": None, "fa2": 1, "fp8": 1}
    t1 = sv["turns"][1]["backends"]
    assert t1["fa2"] == {"divergence": vz.FA2_FLIP, "verdict": "value_mismatch", "forced_flips": 1, "status": "ok"}
    assert t1["fp8"]["divergence"] == vz.FP8_FLIP and t1["fp8"]["verdict"] == "match"
    assert t1["secondary"]["divergence"] is None
    assert sv["turns"][0]["worst"] == "match"


# ---------------------------------------------------------------- turn: forced mode


def test_forced_reference_and_flips(view, vz):
    tv = view.turn_view("s-net-t1")
    f = tv["forced"]
    assert f["available"] and tv["default_mode"] == "forced"
    assert f["reference"] == "secondary"  # the comparisons' reference, with full rows
    assert f["members"] == ["primary", "secondary", "fa2", "fp8"]
    assert f["tokens"] == vz.VOCAB.encode(vz.PRIMARY)
    assert f["lanes"]["fa2"]["flips"] == [vz.FA2_FLIP]
    assert f["lanes"]["fp8"]["flips"] == [vz.FP8_FLIP, vz.FP8_VLAN_FLIP]
    assert f["lanes"]["primary"]["flips"] == []
    assert f["lanes"]["primary"]["approximate"] is True  # the primary has top-k logprobs only
    assert f["lanes"]["fa2"]["approximate"] is False
    assert [x["position"] for x in f["flips"]] == sorted([vz.FA2_FLIP, vz.FP8_FLIP, vz.FP8_VLAN_FLIP])
    flip = next(x for x in f["flips"] if x["position"] == vz.FA2_FLIP)
    assert flip["backends"] == ["fa2"]
    assert flip["top1"]["fa2"] == vz.tok("1") and flip["token"] == vz.tok("0")
    assert flip["region"] == "tool_args"
    # the flip inside the interface name was a near tie, the vlan flip was not
    assert flip["margin"] < 0.3
    vlan = next(x for x in f["flips"] if x["position"] == vz.FP8_VLAN_FLIP)
    assert vlan["margin"] > 0.5 and vlan["kl"]["fp8"] > flip["kl"]["fa2"]
    assert f["regions"][vz.FP8_FLIP] == "thinking"
    s = f["lanes"]["fa2"]["summary"]
    assert s["flips"] == 1 and s["first_flip"] == vz.FA2_FLIP and s["n"] == len(vz.PRIMARY)
    assert s["flips_by_region"]["tool_args"] == 1
    assert s["same_top_p"] == pytest.approx(1 - 1 / len(vz.PRIMARY), abs=1e-6)
    assert all(v is not None and v >= 0 for v in f["lanes"]["fa2"]["kl"])


def test_forced_topk_panel(view, vz):
    tv = view.turn_view("s-net-t1")
    names = [b["name"] for b in tv["backends"]]
    panel = tv["forced"]["panels"][vz.FA2_FLIP]
    members = [names[i] for i in panel["m"]]
    assert members[0] == "secondary"  # the reference first
    assert set(members) == {"primary", "secondary", "fa2", "fp8"}
    ids = panel["ids"]
    assert ids[:2] == [vz.tok("0"), vz.tok("1")]
    col = {m: j for j, m in enumerate(members)}
    p = lambda m, t: panel["p"][col[m]][ids.index(t)]  # noqa: E731
    r = lambda m, t: panel["r"][col[m]][ids.index(t)]  # noqa: E731
    assert p("fa2", vz.tok("1")) > p("fa2", vz.tok("0"))
    assert r("fa2", vz.tok("1")) == 0 and r("fa2", vz.tok("0")) == 1
    assert p("secondary", vz.tok("0")) > p("secondary", vz.tok("1"))
    # full rows: exact probabilities (softmax of the stored row)
    assert p("fa2", vz.tok("1")) + p("fa2", vz.tok("0")) < 1.0
    # the primary's top-5 does not hold every token of the union: unknown, not zero
    assert any(v is None for v in panel["p"][col["primary"]])
    assert tv["vocab"][str(vz.tok("1"))] == "1"


# ---------------------------------------------------------------- turn: free mode


def test_free_tree(view, vz):
    fr = view.turn_view("s-net-t1")["free"]
    bps = fr["branch_points"]
    assert [b["position"] for b in bps] == [vz.FP8_FLIP, vz.FA2_FLIP]
    opts = {tuple(o["backends"]) for o in bps[0]["options"]}
    assert opts == {("primary", "secondary", "fa2"), ("fp8",)}
    assert {tuple(o["backends"]) for o in bps[1]["options"]} == {("primary", "secondary"), ("fa2",)}
    assert bps[1]["reference"] == "secondary" and bps[1]["margin"] < 0.3
    assert bps[1]["kl"]["fa2"] > bps[1]["kl"]["primary"]
    nodes = {n["id"]: n for n in fr["nodes"]}
    # shared prefixes drawn once: every output position appears once per distinct branch
    root = nodes[fr["root"]]
    assert root["tokens"] == vz.VOCAB.encode(vz.PRIMARY[:vz.FP8_FLIP])
    leaves = [n for n in fr["nodes"] if n["ended"]]
    assert sorted(map(tuple, (n["ended"] for n in leaves))) == [("fa2",), ("fp8",), ("primary", "secondary")]
    # panels: one per position of each node; the branch position compares the parent's group
    fa2_node = next(n for n in fr["nodes"] if n["backends"] == ["fa2"])
    assert len(fa2_node["panels"]) == len(fa2_node["tokens"])
    first = fa2_node["panels"][0]
    names = [b["name"] for b in view.turn_view("s-net-t1")["backends"]]
    assert {names[i] for i in first["m"]} == {"primary", "secondary", "fa2"}
    later = fa2_node["panels"][1]
    assert {names[i] for i in later["m"]} == {"fa2"}
    # fp8's free run has top-k logprobs only: its panels still exist
    fp8_node = next(n for n in fr["nodes"] if n["backends"] == ["fp8"])
    assert all(p is not None for p in fp8_node["panels"][1:])
    assert fp8_node["regions"][0] == "thinking"


def test_toolcall_panel_value_mismatch(view):
    calls = view.turn_view("s-net-t1")["free"]["toolcalls"]
    assert calls[0]["reference"] and calls[0]["backends"] == ["primary", "secondary"]
    assert calls[0]["extraction"]["calls"][0]["arguments"] == {"interface": "GigabitEthernet0/0/1.201", "vlan": 201}
    fa2 = next(c for c in calls if c["backends"] == ["fa2"])
    v = fa2["verdict"]
    assert v["verdict"] == "value_mismatch"
    assert v["differences"] == [{
        "kind": "value_mismatch", "path": "$.arguments.interface", "call_index": 0, "candidate_index": 0,
        "reference": "GigabitEthernet0/0/1.201", "candidate": "GigabitEthernet0/1/4", "detail": "",
    }]
    fp8 = next(c for c in calls if c["backends"] == ["fp8"])
    assert fp8["verdict"]["verdict"] == "match"


def test_turn_view_is_json_and_cached(view):
    a = view.turn_view("s-net-t1")
    assert view.turn_view("s-net-t1") is a
    body = orjson.dumps(a)
    assert len(body) < 200_000
    assert "warnings" in a and a["warnings"] == []


def test_agreeing_turn_has_no_flips(view):
    tv = view.turn_view("s-net-t0")
    assert tv["forced"]["flips"] == []
    assert tv["free"]["branch_points"] == []
    assert len(tv["free"]["nodes"]) == 1
    assert tv["prompt"]["messages"][0]["content"] == "You configure routers."


def test_export_bundle_holds_every_turn(view):
    b = view.export_bundle("s-net")
    assert set(b["turns"]) == {"s-net-t0", "s-net-t1"}
    assert b["session"]["session"]["id"] == "s-net"


# ---------------------------------------------------------------- edge cases on a private store


def test_rebuilt_when_a_run_lands(tmp_path, vz):
    built = vz.build_store(tmp_path / "s")
    with Store.open(built.path) as store:
        view = ViewData(store)
        first = view.turn_view("s-00-t0")
        assert first["forced"]["available"] is False and first["default_mode"] == "free"
        assert first["free"]["branch_points"] == []
        ids = vz.VOCAB.encode(["Hello", "!", " Bye"])
        store.put_run(trun("late", "s-00-t0", "late", "free", token_ids=ids, pieces=["Hello", "!", " Bye"],
                           status="ok")).result()
        second = view.turn_view("s-00-t0")
        assert second is not first
        assert [b["position"] for b in second["free"]["branch_points"]] == [2]
        assert view.session_view("s-00")["turns"][0]["backends"]["late"]["divergence"] == 2


def test_cached_view_checked_without_parsing_runs(tmp_path, vz, monkeypatch):
    """A cached view (and a panel) is known to be current from the stamp alone: the run records
    are not read and parsed again while nothing changed."""
    built = vz.build_store(tmp_path / "s")
    with Store.open(built.path) as store:
        view = ViewData(store, inline_rows=0)
        tid = built.turns["net"]
        first = view.turn_view(tid)
        view.session_view("s-net")
        calls = []
        real = store.iter_runs
        monkeypatch.setattr(store, "iter_runs", lambda t: calls.append(t) or real(t))
        assert view.turn_view(tid) is first
        if first["forced"]["available"]:
            view.panel(tid, "forced", 0)
        view.session_view("s-net")
        assert calls == []
        # the cache is still checked: a run stored now is read and shown
        ids = vz.VOCAB.encode(["Hello", "!"])
        store.put_run(trun("late2", tid, "late", "free", token_ids=ids, status="ok")).result()
        again = view.turn_view(tid)
        assert again is not first and calls
        assert "late" in [b["name"] for b in again["backends"]]


def test_replaced_run_and_new_comparison_rebuild(tmp_path, vz):
    """A run replaced in place (same id and created_ns) or a comparison stored later changes
    the stamp; a read-only handle on the same store sees a write made through another."""
    built = vz.build_store(tmp_path / "s")
    with Store.open(built.path) as store, Store.open(built.path, readonly=True) as ro:
        view = ViewData(ro)
        ids = vz.VOCAB.encode(["Hello", "!", " Bye"])
        run = trun("swap", "s-00-t0", "late", "free", token_ids=ids, status="error", error="boom", created_ns=5)
        store.put_run(run).result()
        first = view.turn_view("s-00-t0")
        brief = view.session_view("s-00")["turns"][0]["backends"]["late"]
        assert brief["status"] == "error"
        store.put_run(msgspec.structs.replace(run, status="ok", error=None)).result()
        second = view.turn_view("s-00-t0")
        assert second is not first
        assert [b["position"] for b in second["free"]["branch_points"]] == [2]
        assert view.session_view("s-00")["turns"][0]["backends"]["late"]["status"] == "ok"
        assert view.turn_view("s-00-t0") is second
        store.put_comparison("swap", "s-00-t0~primary", tcomparison("swap", "s-00-t0~primary", status="ok")).result()
        assert view.turn_view("s-00-t0") is not second


def test_failed_runs_and_bad_rows_are_reported(tmp_path, vz):
    built = vz.build_store(tmp_path / "s")
    with Store.open(built.path) as store:
        store.put_run(trun("dead", "s-01-t0", "broken", "free", status="error", error="connection refused")).result()
        hello = vz.VOCAB.encode(["Hello", "!", " How", " can", " I", " help", "?", "<|im_end|>"])
        store.put_run(trun("nanrun", "s-01-t0", "nan", "forced", token_ids=hello, status="ok")).result()
        bad = np.zeros(160, np.float32)
        bad[3] = np.nan
        store.write_rows("nanrun", [(0, encode_row(bad)), (1, b"garbage")]).result()
        view = ViewData(store)
        tv = view.turn_view("s-01-t0")
        broken = next(b for b in tv["backends"] if b["name"] == "broken")
        assert broken["errors"] == ["free: error: connection refused"]
        assert any("NaN" in w for w in tv["warnings"])
        assert any("nan (forced)" in w for w in tv["warnings"])
        assert view.session_view("s-01")["turns"][0]["worst"] == "error"


def test_full_vocabulary_rows(tmp_path):
    """Rows at the real width (151,936) decode and give exact top-k."""
    vocab = 151_936
    with Store.open(tmp_path / "s") as store:
        store.put_session(tsession("s", created_ns=1)).result()
        store.put_turn(Turn(id="t", session_id="s", index=0, output_token_ids=[5, 6], pieces=["a", "b"])).result()
        rng = np.random.default_rng(0)
        rows = {}
        for be in ("ref", "cand"):
            store.put_run(trun(be, "t", be, "forced", token_ids=[5, 6],
                               role="reference" if be == "ref" else "shadow")).result()
            rows[be] = [rng.normal(0, 1, vocab).astype(np.float32) for _ in range(2)]
            rows[be][0][5] = rows[be][1][6] = 12.0
            if be == "cand":
                rows[be][1][99_999] = 12.5  # a flip at position 1
            store.write_rows(be, [(p, encode_row(r)) for p, r in enumerate(rows[be])]).result()
        tv = ViewData(store).turn_view("t")
    f = tv["forced"]
    assert f["reference"] == "ref"
    assert f["lanes"]["cand"]["flips"] == [1]
    panel = f["panels"][1]
    assert 99_999 in panel["ids"] and 6 in panel["ids"]
    x = rows["cand"][1].astype(np.float64)
    p = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    names = [b["name"] for b in tv["backends"]]
    col = [names[i] for i in panel["m"]].index("cand")
    assert panel["p"][col][panel["ids"].index(99_999)] == pytest.approx(p[99_999], rel=1e-3)


def test_stored_comparisons_match_recomputation(ro_store, monkeypatch):
    """Forced metrics read from tensorverse.shadow.compare's records equal the ones the viewer
    computes from the rows itself."""
    fast = ViewData(ro_store).turn_view("s-net-t1")["forced"]
    assert any(c.metrics for c in ro_store.iter_comparisons("s-net-t1-fa2-forced"))
    monkeypatch.setattr(ViewData, "_comparisons", lambda self, run_id: [])
    slow = ViewData(ro_store).turn_view("s-net-t1")["forced"]
    for k in ("fa2", "fp8", "primary"):
        assert fast["lanes"][k]["flips"] == slow["lanes"][k]["flips"]
        assert fast["lanes"][k]["approximate"] == slow["lanes"][k]["approximate"]
        for a, b in zip(fast["lanes"][k]["kl"], slow["lanes"][k]["kl"]):
            assert a == pytest.approx(b, rel=1e-3, abs=1e-9)
    assert fast["margin"] == pytest.approx(slow["margin"], rel=1e-3)
    # flip classes come from the stored comparisons only (issue 19): without them, none
    assert all(c in ("tie", "near_tie", "noise", "runtime") for f in fast["flips"] for c in f["classes"].values())
    assert all(c is None for f in slow["flips"] for c in f["classes"].values())
    strip = lambda fl: [{k: v for k, v in f.items() if k != "classes"} for f in fl]  # noqa: E731
    assert strip(fast["flips"]) == strip(slow["flips"])


def test_lazy_panels_equal_inline_panels(ro_store):
    lazy = ViewData(ro_store, inline_rows=0)
    view = lazy.turn_view("s-net-t1")
    assert view["lazy_panels"] is True
    assert view["forced"]["panels"] is None
    assert all(n["panels"] is None for n in view["free"]["nodes"])
    inline = ViewData(ro_store).turn_view("s-net-t1")
    assert inline["lazy_panels"] is False
    for p in range(len(inline["forced"]["tokens"])):
        assert lazy.panel("s-net-t1", "forced", p)["panel"] == inline["forced"]["panels"][p]
    for node in inline["free"]["nodes"]:
        for i, p in enumerate(range(node["start"], node["end"])):
            assert lazy.panel("s-net-t1", "free", p, node["id"])["panel"] == node["panels"][i]
    # the export always carries every panel
    assert lazy.turn_view("s-net-t1", inline_panels=True)["lazy_panels"] is False
    with pytest.raises(ValueError):
        lazy.panel("s-net-t1", "free", 3)
    with pytest.raises(ValueError):
        lazy.panel("s-net-t1", "free", 999, 0)
    with pytest.raises(ValueError):
        lazy.panel("s-net-t1", "forced", 999)
    with pytest.raises(ValueError):
        lazy.panel("s-net-t1", "sideways", 1)
    with pytest.raises(NotFound):
        lazy.panel("nope", "forced", 0)


def test_primary_from_the_proxy_turn_alone(tmp_path, vz):
    """Without the shadow runner's recorded run, the primary's top-k and tool calls come from
    the proxy's turn record (choices[0].logprobs, OpenAI tool_calls)."""
    ids = vz.VOCAB.encode(["Hello", "!"])
    with Store.open(tmp_path / "s") as store:
        store.put_session(tsession("s", created_ns=1)).result()
        store.put_turn(Turn(id="t", session_id="s", index=0, backend="prim", output_token_ids=ids, text="",
                            request={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                     "system": "be brief"},
                            tool_calls=[{"id": "c", "type": "function",
                                         "function": {"name": "f", "arguments": '{"a": 1}'}}],
                            choices=[{"logprobs": [{"token": "token_id:%d" % ids[0], "logprob": -0.1,
                                                    "top": [["token_id:%d" % ids[0], -0.1], ["token_id:7", -2.5]]},
                                                   {"token": "token_id:%d" % ids[1], "logprob": -0.2, "top": []}]}])).result()
        store.put_run(trun("r", "t", "b", "free", status="ok", token_ids=ids[:1] + [8],
                           text='<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>')).result()
        tv = ViewData(store).turn_view("t")
    assert tv["turn"]["primary"] == "prim"
    assert [m["role"] for m in tv["prompt"]["messages"]] == ["system", "user"]
    assert tv["prompt"]["messages"][1]["content"] == "hi"
    calls = tv["free"]["toolcalls"]
    assert calls[0]["extraction"]["calls"][0]["arguments"] == {"a": 1}
    assert calls[1]["verdict"]["verdict"] == "value_mismatch"
    panel = tv["free"]["nodes"][0]["panels"][0]
    assert panel["ids"] == [ids[0], 7]


def test_infer_pieces_from_text():
    from tensorverse.viz.pieces import infer_pieces as _infer_pieces

    vocab = {1: "Gig", 2: "abit", 3: "0", 4: "/", 5: "<|im_end|>", 6: "1"}
    # one unknown token (9 = "4"): exact, even with <|im_end|> left out of the text
    pieces, exact = _infer_pieces([1, 2, 3, 4, 6, 4, 9, 5], "Gigabit0/1/4", vocab)
    assert pieces == ["Gig", "abit", "0", "/", "1", "/", "4", "<|im_end|>"] and all(exact)
    # two unknown tokens in a row share their span, marked inexact
    pieces, exact = _infer_pieces([1, 8, 9, 3], "Gig.2010", vocab)
    assert pieces == ["Gig", ".201", "", "0"] and exact == [True, False, False, True]
    # a text that is not these tokens' never yields an "exact" piece for a known token
    pieces, exact = _infer_pieces([1, 3], "Hello", vocab)
    assert exact[0] is False
    assert _infer_pieces([], "", vocab) == ([], [])


def test_free_runs_without_pieces(tmp_path, vz):
    """The shadow runner stores a free run's text, not its pieces: branch tokens still read."""
    built = vz.build_store(tmp_path / "s")
    with Store.open(built.path) as store:
        fa2 = store.get_run("s-net-t1-fa2-free")
        assert fa2.pieces is None and fa2.text
        tv = ViewData(store).turn_view("s-net-t1")
    fa2_node = next(n for n in tv["free"]["nodes"] if n["backends"] == ["fa2"])
    texts = [tv["vocab"].get(str(t)) for t in fa2_node["tokens"]]
    assert texts[:3] == ["1", "/", "4"]
    fp8_node = next(n for n in tv["free"]["nodes"] if n["backends"] == ["fp8"])
    assert tv["vocab"][str(fp8_node["tokens"][0])] == "Set"


def test_turn_without_output_and_unknown_token_texts(tmp_path):
    with Store.open(tmp_path / "s") as store:
        store.put_session(tsession("s", created_ns=1)).result()
        store.put_turn(Turn(id="t", session_id="s", index=0, state="upstream_error", output_token_ids=None,
                            text=None)).result()
        store.put_turn(Turn(id="u", session_id="s", index=1, output_token_ids=[5, 6],
                            token_texts={"5": "a", "6": "b", "7": "c"})).result()
        store.put_run(trun("r", "u", "x", "free", status="ok", token_ids=[5, 7], text="ac")).result()
        store.put_run(trun("r2", "u", "x", "forced", status="timeout", error="no answer in 120 s")).result()
        view = ViewData(store)
        tv = view.turn_view("t")
        assert tv["turn"]["tokens"] == 0 and tv["turn"]["state"] == "upstream_error"
        assert tv["default_mode"] == "free" and tv["free"]["branch_points"] == []
        tu = view.turn_view("u")
        assert tu["vocab"] == {"5": "a", "6": "b", "7": "c"}
        assert tu["forced"]["available"] is False
        assert next(b for b in tu["backends"] if b["name"] == "x")["errors"] == ["forced: timeout: no answer in 120 s"]
        brief = view.session_view("s")["turns"][1]["backends"]["x"]
        assert brief["divergence"] == 1 and brief["verdict"] == "match" and brief["status"] == "timeout"
        assert brief["error"] == "forced: timeout: no answer in 120 s"


def test_parser_mismatch_shown_per_turn(tmp_path, vz):
    """Issue 19: a recorded run whose parser check found a mismatch marks the turn (turn view and
    the session's turn list); a later check replaces an earlier one."""
    built = vz.build_store(tmp_path / "s")
    with Store.open(built.path) as store:
        view = ViewData(store)
        assert view.turn_view("s-net-t1")["parser_check"]["mismatch"] is False
        assert view.session_view("s-net")["turns"][1]["parser_mismatch"] is False
        rec = store.get_run("s-net-t1~primary")
        pc = vz.parser_check("".join(rec.pieces), rec.text, [
            {"id": "c", "type": "function", "function": {"name": "configure_subinterface",
                                                         "arguments": '{"interface": "Gi0/0/1.201"}'}}])
        assert pc.mismatch
        store.put_run(msgspec.structs.replace(rec, id="s-net-t1~primary2", parser_check=pc.as_dict(),
                                              created_ns=rec.created_ns + 1)).result()
        tv = view.turn_view("s-net-t1")
        assert tv["parser_check"]["mismatch"] is True and tv["parser_check"]["differences"]
        assert view.session_view("s-net")["turns"][1]["parser_mismatch"] is True


def test_positions_compared_on_compact_rows_are_marked_approximate(tmp_path):
    """Evidence at the source: the reference's rows arrive compact where they are not evidence;
    the stored comparison names those positions and the viewer marks the lane approximate there,
    with the flip where full capture has it."""
    from tensorverse.shadow.compare import compare_turn
    from tensorverse.shadow.runs import primary_run_id
    from tensorverse.store.compact import compact_row, encode_compact

    vocab = 300
    rng = np.random.default_rng(1)
    with Store.open(tmp_path / "s") as store:
        store.put_session(tsession("s", created_ns=1)).result()
        store.put_turn(Turn(id="t", session_id="s", index=0, output_token_ids=[5, 6, 7],
                            pieces=["a", "b", "c"])).result()
        store.put_run(trun(primary_run_id("t"), "t", "prim", "recorded", role="primary", token_ids=[5, 6, 7],
                           capture="topk")).result()
        for be, role in (("ref", "reference"), ("cand", "shadow")):
            store.put_run(trun(be, "t", be, "forced", token_ids=[5, 6, 7], role=role, capture="full",
                               status="ok")).result()
            rows = [rng.normal(0, 1, vocab).astype(np.float32) for _ in range(3)]
            for p, tok in enumerate((5, 6, 7)):
                rows[p][tok] = 12.0
            if be == "cand":
                rows[1][99] = 12.5  # the candidate flips at 1: its row travels in full
                store.write_rows(be, [(p, encode_row(r)) for p, r in enumerate(rows)]).result()
            else:  # the reference agrees everywhere: compact rows, one full (the sample)
                store.write_rows(be, [(0, encode_row(rows[0]))]
                                 + [(p, encode_compact(compact_row(rows[p])), None, True) for p in (1, 2)]).result()
        cmp = next(c for c in compare_turn(store, "t") if c.run_id == "cand" and c.ref_run_id == "ref")
        assert cmp.compact_positions == [1, 2] and cmp.flips == [1]
        f = ViewData(store).turn_view("t")["forced"]
    assert f["reference"] == "ref"
    assert f["lanes"]["cand"]["flips"] == [1]
    assert f["lanes"]["cand"]["approximate"] is True
