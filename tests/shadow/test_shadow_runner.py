"""The shadow runner without vLLM: exact request bodies, turn parsing, and every failure path
(against the fake vLLM in conftest.py) ending as a run record, never as an exception."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tensorverse.testing.fake_vllm import FakeVLLM

from tensorverse.shadow import Backend, ShadowRunner, shadow_turn
from tensorverse.shadow.cache import SHARED_CACHE, RunnerCache
from tensorverse.shadow.completions import (
    forced_body,
    free_body,
    parse_completion,
    parse_prompt_logprobs,
    scoring_body,
)
from tensorverse.shadow.runs import primary_run_id
from tensorverse.shadow.turn import TurnInput
from tensorverse.store.codec import decode_row
from tensorverse.store.records import BackendInfo, Run

PROMPT = [5, 6, 7, 8]


def run(coro):
    return asyncio.run(coro)


def make_turn(fake: FakeVLLM, n: int = 6, tid: str = "t1", **extra) -> dict:
    """A turn recorded from ``fake`` as the primary: greedy output, top-5 logprobs."""
    out, tops = [], []
    for i in range(n):
        x = fake.logits(PROMPT + out, i)
        lp = fake.logprobs(x)
        t = int(np.argmax(x))
        order = np.argsort(-lp)[:5]
        tops.append({f"token_id:{int(j)}": float(lp[j]) for j in order})
        out.append(t)
    return {"id": tid, "session_id": "s1", "prompt_token_ids": PROMPT, "output_token_ids": out,
            "text": "".join(fake.decode_one(t) for t in out), "top_logprobs": tops,
            "backend": "prim", **extra}


# --------------------------------------------------------------------------- bodies


def test_forced_body_is_exactly_what_vllm_needs():
    t = TurnInput.from_dict({"id": "t", "prompt_token_ids": [1, 2, 3], "output_token_ids": [9, 8],
                             "model": "m-from-turn"})
    b = Backend("b", "http://h:1/v1", model="served", logprobs=7)
    assert forced_body(t, b, "run-1") == {
        "model": "served",
        "prompt": [1, 2, 3],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "n": 1,
        "stream": False,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "vllm_xargs": {"tv_force": [9, 8], "tv_capture": "run-1"},
        "logprobs": 20,  # captured: `captured_logprobs` (the rows carry the distribution)
    }
    assert forced_body(t, b, "r", capture=False)["logprobs"] == 7  # not captured: the API's top-k is all
    assert forced_body(t, Backend("b", "http://h:1", captured_logprobs=5), "r")["logprobs"] == 5
    assert "logprobs" not in forced_body(t, Backend("b", "http://h:1", captured_logprobs=0), "r")
    body = forced_body(t, Backend("b", "http://h:1", logprobs=0), "r", capture=False)
    assert body["model"] == "m-from-turn"  # the turn's model when the backend names none
    assert body["vllm_xargs"] == {"tv_force": [9, 8]} and "logprobs" not in body
    assert "stop" not in body and "stop_token_ids" not in body
    pos = forced_body(t, b, "r", positions="every:4")
    assert pos["vllm_xargs"]["tv_positions"] == "every:4"


def test_free_body_greedy_by_default_and_mirrors_a_seeded_primary():
    t = TurnInput.from_dict({"id": "t", "prompt_token_ids": [1], "output_token_ids": [2, 3, 4],
                             "request": {"messages": [], "temperature": 0.7, "top_p": 0.9,
                                         "stop": ["\n\n"], "max_completion_tokens": 50}})
    b = Backend("b", "http://h:1", model="m", logprobs=3)
    assert free_body(t, b, "r2") == {
        "model": "m", "prompt": [1], "temperature": 0, "max_tokens": 50, "stop": ["\n\n"],
        "n": 1, "stream": False, "return_token_ids": True, "return_tokens_as_token_ids": True,
        "logprobs": 20, "vllm_xargs": {"tv_capture": "r2"},
    }
    assert free_body(t, b, "r2", capture=False)["logprobs"] == 3
    seeded = TurnInput.from_dict({"id": "t", "prompt_token_ids": [1], "output_token_ids": [2],
                                  "sampling": {"temperature": 0.7, "top_p": 0.9, "seed": 42}})
    body = free_body(seeded, b, "r3", margin=10)
    assert (body["temperature"], body["top_p"], body["seed"], body["max_tokens"]) == (0.7, 0.9, 42, 11)
    # penalties change the row before capture: mirrored, and capture is left out
    pen = TurnInput.from_dict({"id": "t", "prompt_token_ids": [1], "output_token_ids": [2],
                               "sampling": {"repetition_penalty": 1.1, "presence_penalty": 0.0}})
    body = free_body(pen, b, "r4")
    assert body["repetition_penalty"] == 1.1 and "presence_penalty" not in body
    assert "vllm_xargs" not in body and body["logprobs"] == 3  # not captured: the API's top-k


def test_scoring_body_scores_prompt_plus_output():
    t = TurnInput.from_dict({"id": "t", "prompt_token_ids": [1, 2], "output_token_ids": [3, 4]})
    assert scoring_body(t, Backend("b", "http://h:1", model="m", logprobs=5)) == {
        "model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0, "n": 1,
        "stream": False, "prompt_logprobs": 5, "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


def test_parse_answers():
    resp = {"choices": [{"text": "ab", "token_ids": [7, 9], "finish_reason": "length",
                         "logprobs": {"token_logprobs": [-0.1, -0.2],
                                      "top_logprobs": [{"token_id:7": -0.1, "token_id:3": -2.5},
                                                       {"token_id:9": -0.2}]}}]}
    got = parse_completion(resp)
    assert got["token_ids"] == [7, 9] and got["text"] == "ab"
    assert got["top_logprobs"] == [[[7, -0.1], [3, -2.5]], [[9, -0.2]]]
    pl = {"choices": [{"prompt_logprobs": [None, {"5": {"logprob": -1.0}},
                                           {"6": {"logprob": -0.5}, "2": {"logprob": -1.5}}]}]}
    got = parse_prompt_logprobs(pl, 1, [5, 6])
    assert got["top_logprobs"] == [[[5, -1.0]], [[6, -0.5], [2, -1.5]]]
    assert got["token_logprobs"] == [-1.0, -0.5]
    from tensorverse.shadow.client import BackendError

    with pytest.raises(BackendError):
        parse_completion({"choices": [{"text": "x"}]})


def test_normalize_topk_reads_completions_answers_exactly_as_the_general_parser():
    """The fast path for ``{"token_id:N": logprob}`` gives what the general parser gives, ties
    (lower id first), duplicates, the -9999 sentinel, positive, NaN and bad keys included."""
    import math
    import random

    from tensorverse.shadow import turn as turn_mod

    general = turn_mod._general_topk

    rng = random.Random(7)
    odd = [-9999.0, -1e6, 0.0, -0.0, 1e-7, 2.0, math.nan, -math.inf, -0.5]
    entries = [{"token_id:3": -0.5, "token_id:1": -0.5, "token_id:2": -0.25},  # a tie: lower id first
               {"token_id:7": -0.1, "token_id:07": -0.3},  # one id twice: the last wins
               {"token_id:x": -0.1}, {"7": -0.1}, {5: -0.1}, {"token_id:4": "-0.1"}, {}]
    for _ in range(400):
        entries.append({f"token_id:{rng.randrange(50)}": (rng.choice(odd) if rng.random() < 0.1
                                                           else -rng.random() * 20)
                        for _ in range(rng.randrange(1, 8))})
    fast_hits = 0
    for e in entries:
        assert turn_mod.normalize_topk(e) == general(e), e
        fast_hits += turn_mod._completions_topk(e) is not None
    assert fast_hits > 100  # the fast path is taken for the common case


def test_turn_from_the_proxys_record():
    turn = {"id": "t9", "session_id": "s", "backend": "primary", "prompt_token_ids": [1, 2],
            "output_token_ids": [5, 6], "text": "hi", "tool_calls": [],
            "request": {"model": "m", "messages": [{"role": "user", "content": "x"}],
                        "temperature": 0, "max_tokens": 9},
            "choices": [{"logprobs": [
                {"token": 5, "logprob": -0.5, "top": [[5, -0.5], [8, -1.0]]},
                {"token": 6, "logprob": -0.1, "top": [[6, -0.1]]}]}]}
    t = TurnInput.from_dict(turn)
    assert t.primary == "primary" and t.model == "m"
    assert t.sampling == {"temperature": 0, "max_tokens": 9}
    assert t.top_logprobs == [[[5, -0.5], [8, -1.0]], [[6, -0.1]]]
    assert t.pieces is None  # token ids, not text
    turn["choices"][0]["logprobs"] = [{"token": "he", "logprob": -0.5, "top": [["he", -0.5]]},
                                      {"token": "llo", "logprob": -0.1, "top": []}]
    t = TurnInput.from_dict(turn)
    assert t.pieces == ["he", "llo"] and t.top_logprobs is None
    # straight from the proxy, before the store: the logprobs as vLLM's stream sent them
    from tensorverse.jsonbytes import RawJSON

    raw = (b'[{"content":[{"token":"token_id:5","logprob":-0.5,"bytes":[1],"top_logprobs":['
           b'{"token":"token_id:5","logprob":-0.5,"bytes":[1]},{"token":"token_id:8","logprob":-1.0,"bytes":[2]}]}]},'
           b'null,{"content":[{"token":"token_id:6","logprob":-0.1,"top_logprobs":[{"token":"token_id:6","logprob":-0.1}]}]}]')
    turn["choices"][0] = {"logprobs": None, "upstream_logprobs": RawJSON(raw)}
    t = TurnInput.from_dict(turn)
    assert t.top_logprobs == [[[5, -0.5], [8, -1.0]], [[6, -0.1]]] and t.pieces is None
    for bad in ({"id": "x", "prompt_token_ids": None, "output_token_ids": [1]},
                {"id": "x", "prompt_token_ids": [1], "output_token_ids": None},
                {"prompt_token_ids": [1], "output_token_ids": [1]}):
        with pytest.raises(ValueError):
            TurnInput.from_dict(bad)


# --------------------------------------------------------------------------- against the fake


def test_forced_and_free_with_plugin_store_full_rows(store):
    async def main():
        prim = await FakeVLLM().start()
        shadow = await FakeVLLM(store=store, flip_at={2: 40}).start()
        try:
            turn = make_turn(prim)
            backends = [Backend("prim", prim.url, role="primary", logprobs=5),
                        Backend("cand", shadow.url, logprobs=5)]
            runs = await shadow_turn(turn, backends, store, cache=RunnerCache())
            return prim, shadow, turn, runs
        finally:
            await prim.close()
            await shadow.close()

    prim, shadow, turn, runs = run(main())
    assert all(type(r) is Run for r in runs)  # the typed records, as the store reads them back
    rec, forced, free = runs
    assert rec.id == primary_run_id("t1") and rec.mode == "recorded" and rec.backend == "prim"
    assert rec.pieces == [prim.decode_one(t) for t in turn["output_token_ids"]]
    assert forced.status == "ok" and forced.method == "forced_decode"
    assert forced.token_ids == turn["output_token_ids"]
    assert forced.capture == "full" and forced.approximate is False
    assert forced.rows["complete"] and forced.rows["present"] == 6
    assert forced.tokenizer["same_dictionary"] is True
    # the exact JSON the shadow received for the forced run
    sent = [b for p, b in shadow.requests if p == "/v1/completions" and "tv_force" in
            (b.get("vllm_xargs") or {}) and len(b["vllm_xargs"]["tv_force"]) == 6]
    assert sent[0]["vllm_xargs"] == {"tv_force": turn["output_token_ids"], "tv_capture": forced.id}
    assert sent[0]["ignore_eos"] is True and sent[0]["max_tokens"] == 6
    # rows in the store are the shadow's own rows (unmasked)
    rows = store.read_rows(forced.id)
    assert [p for p, _ in rows] == list(range(6))
    assert int(np.argmax(decode_row(rows[2][1]))) == 40
    # the free run branches at the flip
    assert free.status == "ok" and free.token_ids[2] == 40
    assert free.token_ids[:2] == turn["output_token_ids"][:2]
    assert free.capture == "full"
    # stored
    assert {r.id for r in store.iter_runs("t1")} == {rec.id, forced.id, free.id}
    comps = {c.mode: c for c in store.iter_comparisons(free.id)}
    assert comps["free"].divergence["position"] == 2
    fc = list(store.iter_comparisons(forced.id))
    assert fc and fc[0].kind == "topk" and 2 in fc[0].flips  # vs the primary's top-k


def test_with_evidence_at_the_source_the_forced_run_asks_for_the_primarys_positions_and_the_free_run_for_the_sample(store):
    from tensorverse.capture.optin import Positions, parse_extra_args
    from tensorverse.shadow.evidence import SourceEvidence
    from tensorverse.store.compaction import sampled

    ev = SourceEvidence(sample=0.3, seed=5, close_share=1.0)

    async def main():
        prim = await FakeVLLM().start()
        shadow = await FakeVLLM(store=store).start()
        try:
            turn = make_turn(prim)
            out = turn["output_token_ids"]
            turn["top_logprobs"][2] = {f"token_id:{out[2]}": -0.5, "token_id:7": -0.51}  # a close call
            backends = [Backend("prim", prim.url, role="primary", logprobs=5), Backend("cand", shadow.url)]
            runs = await shadow_turn(turn, backends, store, cache=RunnerCache(), evidence=ev)
            return shadow, runs
        finally:
            await prim.close()
            await shadow.close()

    shadow, (_, forced, free) = run(main())
    sent = {b["vllm_xargs"]["tv_capture"]: b for p, b in shadow.requests
            if p == "/v1/completions" and "tv_capture" in (b.get("vllm_xargs") or {})}
    want = {forced.id: sorted({2} | {p for p in range(6) if sampled(5, "t1", p, 0.3)}),
            free.id: [p for p in range(sent[free.id]["max_tokens"]) if sampled(5, "t1", p, 0.3)]}
    assert sent[free.id]["max_tokens"] == 6 + 64  # the free margin: the sample reaches past the primary's end
    assert want[free.id] and any(p >= 6 for p in want[free.id])
    for run_id, positions in want.items():
        opt = parse_extra_args(sent[run_id]["vllm_xargs"])
        assert opt.full == Positions.parse(positions) and opt.compact == 20, run_id
    assert (forced.evidence["requested"], free.evidence["requested"]) == (len(want[forced.id]), len(want[free.id]))


def test_plugin_missing_falls_back_to_prompt_logprobs(store):
    async def main():
        shadow = await FakeVLLM(plugin=False, flip_at={1: 33}).start()
        try:
            turn = make_turn(shadow, tid="t2")
            turn["output_token_ids"][1] = 7  # the primary took another token than this backend's greedy
            b = Backend("cand", shadow.url, capture="full", logprobs=4)
            async with ShadowRunner(store, [b], rows_timeout_s=0.5) as r:
                runs = await r.run_turn(turn, modes=("forced",))
                caps = r.cache.get_caps(b)
            return shadow, turn, runs, caps
        finally:
            await shadow.close()

    shadow, turn, runs, caps = run(main())
    forced = runs[1]
    assert forced.status == "ok" and forced.method == "prompt_logprobs"
    assert forced.approximate is True and forced.capture == "topk"
    assert forced.token_ids == turn["output_token_ids"]
    assert "did not emit the forced tokens" in forced.attempts[0]["error"]
    assert "position 1" in forced.attempts[0]["error"]
    assert len(forced.top_logprobs) == len(turn["output_token_ids"])
    assert caps.forcing is False  # remembered: the next turn scores directly
    scoring = [b for p, b in shadow.requests if p == "/v1/completions" and b.get("prompt_logprobs")]
    assert scoring[0]["prompt"] == PROMPT + turn["output_token_ids"]


def test_auto_probe_without_sink_forces_without_capture(store):
    async def main():
        shadow = await FakeVLLM(store=None).start()  # plugin, but no sink
        try:
            turn = make_turn(shadow, tid="t3")
            b = Backend("cand", shadow.url, capture="auto")
            async with ShadowRunner(store, [b], rows_timeout_s=0.5) as r:
                runs = await r.run_turn(turn)
            return shadow, runs
        finally:
            await shadow.close()

    shadow, runs = run(main())
    forced, free = runs[1], runs[2]
    assert forced.status == "ok" and forced.method == "forced_decode"
    assert forced.capture == "topk" and forced.approximate is True
    assert free.status == "ok" and "vllm_xargs" not in free.sampling
    # the runs never asked for capture (the probe found no sink)
    runs_sent = [b for p, b in shadow.requests if p == "/v1/completions" and b.get("max_tokens", 0) > 1]
    assert all("tv_capture" not in (b.get("vllm_xargs") or {}) for b in runs_sent)


def test_sink_refusal_is_retried_without_capture(store):
    async def main():
        shadow = await FakeVLLM(store=None).start()
        try:
            turn = make_turn(shadow, tid="t4")
            # configured full, but no sink
            b = Backend("cand", shadow.url, capture="full", captured_logprobs=3)
            async with ShadowRunner(store, [b], rows_timeout_s=0.5) as r:
                return await r.run_turn(turn)
        finally:
            await shadow.close()

    runs = run(main())
    for r in runs[1:]:
        assert r.status == "ok" and r.capture == "topk"
        assert any("needs a sink" in a["error"] for a in r.attempts)
        # asked again without capture, for the top-k the API alone now gives
        assert r.sampling["logprobs"] == 20 and r.k == 20
        assert "tv_capture" not in (r.sampling.get("vllm_xargs") or {})
        assert all(len(e) == 20 for e in r.top_logprobs)


def test_backend_errors_become_run_records(store):
    async def main():
        failing = await FakeVLLM(fail_status=500).start()
        slow = await FakeVLLM(delay_s=2.0).start()
        try:
            turn = make_turn(failing, tid="t5")
            backends = [Backend("failing", failing.url, capture="full"),
                        Backend("slow", slow.url, capture="full", timeout_s=0.3),
                        Backend("down", "http://127.0.0.1:9/v1", capture="full", timeout_s=2)]
            return await shadow_turn(turn, backends, store, check_tokenizer=False)
        finally:
            await failing.close()
            await slow.close()

    runs = run(main())
    by = {(r.backend, r.mode): r for r in runs[1:]}
    assert by[("failing", "forced")].status == "failed"
    assert "HTTP 500" in by[("failing", "forced")].error
    assert by[("failing", "free")].status == "failed"
    assert by[("slow", "forced")].status == "timeout"
    assert by[("slow", "free")].status == "timeout"
    assert by[("down", "forced")].status == "failed" and "connect" in by[("down", "forced")].error
    stored = {r.id: r for r in store.iter_runs("t5")}
    assert all(r.id in stored for r in runs)


def test_different_tokenizer_is_refused(store):
    async def main():
        prim = await FakeVLLM(tokenizer="a").start()
        other = await FakeVLLM(tokenizer="b").start()
        try:
            turn = make_turn(prim, tid="t6")
            backends = [Backend("prim", prim.url, role="primary"), Backend("other", other.url)]
            runs = await shadow_turn(turn, backends, store, cache=RunnerCache())
            return other, runs
        finally:
            await prim.close()
            await other.close()

    other, runs = run(main())
    for r in runs[1:]:
        assert r.status == "refused"
        assert "does not use prim's dictionary" in r.error
        assert "<|im_end|>" in r.error
    # never run: no completion longer than the one-token probes reached it
    assert not [b for p, b in other.requests if p == "/v1/completions" and b.get("max_tokens", 0) > 1]


def test_template_mismatch_is_recorded_not_a_failure(store):
    async def main():
        prim = await FakeVLLM(template="a").start()
        other = await FakeVLLM(template="b", store=store).start()
        try:
            msgs = [{"role": "user", "content": "show vlan 201"}]
            prompt = prim.encode(prim.render(msgs, None, True))
            turn = make_turn(prim, tid="t7") | {"prompt_token_ids": prompt, "request": {"messages": msgs}}
            backends = [Backend("prim", prim.url, role="primary"), Backend("other", other.url)]
            return await shadow_turn(turn, backends, store, cache=RunnerCache())
        finally:
            await prim.close()
            await other.close()

    runs = run(main())
    for r in runs[1:]:
        assert r.status == "ok"
        assert r.template["status"] == "template_mismatch"
        assert "template_mismatch" in r.template["message"]
    free = [c for c in (runs[1], runs[2]) if c.mode == "free"][0]
    comps = list(store.iter_comparisons(free.id))
    assert comps and comps[0].template_mismatch is True


def test_unusable_turn_returns_nothing(store):
    assert run(shadow_turn({"id": "x", "prompt_token_ids": None}, [], store)) == []


def test_shared_cache_probes_once(store):
    async def main():
        shadow = await FakeVLLM(store=store).start()
        try:
            b = Backend("cand", shadow.url)
            SHARED_CACHE.clear()
            for i in range(3):
                await shadow_turn(make_turn(shadow, n=3, tid=f"c{i}"), [b], store, compare=False)
            return shadow
        finally:
            SHARED_CACHE.clear()
            await shadow.close()

    shadow = run(main())
    probes = [b for p, b in shadow.requests if p == "/v1/completions" and b.get("max_tokens") == 1
              and "tv_force" in (b.get("vllm_xargs") or {}) and len(b["vllm_xargs"]["tv_force"]) == 1]
    assert len(probes) == 1


def test_turn_shadowed_backend_by_backend_like_the_proxy_tee(store):
    """The proxy's tee calls shadow_turn once per backend, concurrently: the comparisons end up
    complete (candidate vs the secondary's full rows, noise floor) whichever call finishes last."""
    async def main():
        prim = await FakeVLLM().start()
        sec = await FakeVLLM(store=store, delay_s=0.2).start()
        cand = await FakeVLLM(store=store, flip_at={3: 11}).start()
        try:
            turn = make_turn(prim, tid="tee")
            store.put_backend("prim", BackendInfo(name="prim", url=prim.url, role="primary")).result()
            b_sec = Backend("sec", sec.url, role="secondary", logprobs=5)
            b_cand = Backend("cand", cand.url, logprobs=5)
            SHARED_CACHE.clear()
            await asyncio.gather(shadow_turn(turn, [b_sec], store), shadow_turn(turn, [b_cand], store))
            return turn
        finally:
            SHARED_CACHE.clear()
            for f in (prim, sec, cand):
                await f.close()

    run(main())
    runs = {(r.backend, r.mode): r for r in store.iter_runs("tee")}
    cf, sf = runs[("cand", "forced")], runs[("sec", "forced")]
    assert cf.tokenizer["same_dictionary"] is True  # the primary found through the store
    assert "uses prim's dictionary" in cf.tokenizer["message"]
    full = store.get_comparison(cf.id, sf.id)
    assert full.kind == "full" and full.flips == [3]
    vs_prim = store.get_comparison(cf.id, primary_run_id("tee"))
    assert vs_prim.noise["floor_backend"] == "sec"
    free = store.get_comparison(runs[("cand", "free")].id, primary_run_id("tee"))
    assert free.divergence["position"] == 3 and free.confirms_forced is True


def test_backend_records_never_hold_the_key(store):
    async def main():
        shadow = await FakeVLLM(store=store).start()
        try:
            b = Backend("cand", shadow.url, api_key="sk-shadow-own", logprobs=3)
            async with ShadowRunner(store, [b], cache=RunnerCache()) as r:
                await r.run_turn(make_turn(shadow, n=2, tid="k1"))
            return shadow
        finally:
            await shadow.close()

    shadow = run(main())
    rec = store.get_backend("cand")
    assert rec.has_api_key is True and "sk-shadow-own" not in str(rec)
    assert rec.capabilities["forcing"] is True and rec.tokenizer["fingerprint"]
    for r in store.iter_runs("k1"):
        assert "sk-shadow-own" not in str(r)
    # the shadow's own key is what the shadow received
    assert shadow.auth and all(a == "Bearer sk-shadow-own" for a in shadow.auth)


def test_parser_check_of_the_primary_runs_in_the_shadow_worker(store):
    """Issue 19, item 5: the primary's output ids, decoded, are re-parsed and compared with the
    tool calls it emitted; the result is stored on the turn's recorded run."""
    pieces = ['<tool_call>', '{"name": "show_vlan", ', '"arguments": ', '{"vlan": 201}', '}', '</tool_call>']
    good = [{"id": "c1", "type": "function", "function": {"name": "show_vlan", "arguments": '{"vlan": 201}'}}]
    broken = [{"id": "c1", "type": "function", "function": {"name": "show_vlan", "arguments": '{"vlan": 21}'}}]

    async def main():
        prim = await FakeVLLM().start()
        shadow = await FakeVLLM(store=store).start()
        try:
            backends = [Backend("prim", prim.url, role="primary", logprobs=5),
                        Backend("cand", shadow.url, logprobs=5)]
            out = []
            for tid, calls in (("ok", good), ("bad", broken)):
                turn = make_turn(prim, tid=tid, pieces=pieces, tool_calls=calls, text="")
                out.append(await shadow_turn(turn, backends, store, cache=RunnerCache(), modes=("forced",)))
            plain = await shadow_turn(make_turn(prim, tid="plain"), backends, store, cache=RunnerCache(),
                                      modes=("forced",))
            return out, plain
        finally:
            await prim.close()
            await shadow.close()

    (ok, bad), plain = run(main())
    assert ok[0].parser_check["mismatch"] is False and ok[0].parser_check["parsed_calls"] == 1
    pc = bad[0].parser_check
    assert pc["mismatch"] is True and pc["verdict"] == "value_mismatch"
    assert pc["differences"][0]["path"] == "$.arguments.vlan"
    assert store.get_run(primary_run_id("bad")).parser_check == pc  # stored per turn
    # pieces from /detokenize: no tool calls on either side is a match
    assert plain[0].parser_check == {"mismatch": False, "verdict": "match", "parsed_calls": 0,
                                     "emitted_calls": 0, "differences": []}


# --------------------------------------------------------------------------- token pieces


def test_token_pieces_are_asked_once_per_id_and_a_backend_without_detokenize_once(store):
    """The text of a token id does not change: a second turn asks ``/detokenize`` only for ids no
    earlier turn asked for, and gets the same pieces. A backend that answers 404 there is not asked
    again (within the cache's ttl); the next backend gives the pieces."""
    async def main(store):
        fake = await FakeVLLM().start()
        gone = await FakeVLLM(fail_status=404).start()
        try:
            b = Backend(name="b", url=fake.url)
            nod = Backend(name="nod", url=gone.url)
            async with ShadowRunner(store, [nod, b], cache=RunnerCache()) as r:
                got = []
                for tid, out in (("t1", [3, 4, 3, 5]), ("t2", [5, 4, 6, 6])):
                    t = TurnInput(id=tid, prompt_token_ids=PROMPT, output_token_ids=out)
                    got.append(await r._pieces(t, [nod, b]))
            asked = [body["tokens"] for path, body in fake.requests if path == "/detokenize"]
            asked_gone = [p for p, _ in gone.requests if p == "/detokenize"]
            return got, asked, asked_gone, fake
        finally:
            await fake.close()
            await gone.close()

    got, asked, asked_gone, fake = run(main(store))
    assert got == [[fake.decode_one(t) for t in (3, 4, 3, 5)], [fake.decode_one(t) for t in (5, 4, 6, 6)]]
    assert sorted(asked) == [[3], [4], [5], [6]]  # 6 is the only new id of the second turn
    assert 1 <= len(asked_gone) <= 3  # the first turn's requests, in flight together; none after


def test_wait_rows_wakes_on_announced_rows_without_reading_the_store(store, monkeypatch):
    reads = []
    real = store.read_row
    monkeypatch.setattr(store, "read_row", lambda *a: reads.append(a) or real(*a))

    async def main():
        async with ShadowRunner(store, [], rows_timeout_s=10) as r:
            # the plugin's batches: the first one in before the run's response, the last one later
            await asyncio.wrap_future(store.write_rows("run1", [(0, b"a")]))

            async def later():
                await asyncio.sleep(0.5)
                await asyncio.wrap_future(store.write_rows("run1", [(1, b"b")]))
            task = asyncio.create_task(later())
            out = await r.wait_rows("run1", [0, 1])
            await task
            return out

    out = run(main())
    assert out["complete"] and out["present"] == 2
    assert out["waited_s"] < 5.0
    assert reads == []  # the store announced its commits; no poll read a row


def test_wait_rows_finds_rows_another_process_wrote_by_polling(store, tmp_path):
    other = type(store).open(store.path, durable=False)  # another writer: its commits are not announced here
    try:
        other.write_rows("run2", [(0, b"a"), (1, b"b"), (2, b"c")]).result()

        async def main():
            async with ShadowRunner(store, [], rows_timeout_s=5) as r:
                return await r.wait_rows("run2", [0, 1, 2])

        out = run(main())
    finally:
        other.close()
    assert out["complete"] and out["present"] == 3


def test_wait_rows_reports_the_positions_still_missing_at_its_deadline(store):
    store.write_rows("run3", [(0, b"a")]).result()

    async def main():
        async with ShadowRunner(store, [], rows_timeout_s=0.3) as r:
            return await r.wait_rows("run3", [0, 1, 2])

    out = run(main())
    assert (out["complete"], out["present"], out["missing"]) == (False, 1, [1, 2])
