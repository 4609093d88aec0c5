"""The replay runner against fake vLLM servers (no model): flips found and reported, determinism,
the multi-turn branch policy, --fail-on exit codes, retries, resume, tokenizer refusal."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from tensorverse.testing.fake_vllm import FakeVLLM

from tensorverse.replay.corpus import load_corpus, write_corpus
from tensorverse.replay.report import check_thresholds, parse_threshold, render_summary
from tensorverse.replay.options import ReplayOptions
from tensorverse.replay.runner import replay, run_replay
from tensorverse.shadow import Backend

N = 8


def greedy(fake: FakeVLLM, prompt: list[int], n: int = N) -> list[int]:
    out: list[int] = []
    for i in range(n):
        out.append(int(np.argmax(fake.logits(prompt + out, i))))
    return out


def make_case(fake: FakeVLLM, cid: str, prompts: list[list[int]], *, fingerprint=None) -> dict:
    turns = []
    for i, p in enumerate(prompts):
        out = greedy(fake, p)
        turns.append({
            "index": i, "endpoint": "completions", "messages": None, "tools": None,
            "sampling": {"temperature": 0, "max_tokens": N}, "prompt_token_ids": p,
            "reference": {"backend": "prim", "output_token_ids": out,
                          "text": "".join(fake.decode_one(t) for t in out), "tool_calls": None,
                          "finish_reason": "length"},
            "tool_results": [],
        })
    return {"format": "tensorverse.case", "format_version": 1, "id": cid,
            "tokenizer": {"fingerprint": fingerprint}, "turns": turns,
            "provenance": {"source": "test", "reference_backend": "prim", "scrubbed": True}}


PROMPTS = {"c1": [[5, 6, 7, 8]], "c2": [[9, 10, 11], [9, 10, 11, 12, 13]], "c3": [[20, 21, 22, 23, 24]]}


@pytest.fixture
def corpus_dir(tmp_path):
    fake = FakeVLLM()
    cases = [make_case(fake, cid, prompts) for cid, prompts in PROMPTS.items()]
    return write_corpus(tmp_path / "corpus", cases, tokenizer={"fingerprint": None}, name="fake")


def expected_forced_flips(ref: FakeVLLM, cand: FakeVLLM) -> dict[str, list[list[int]]]:
    """Per case and turn, the positions where ``cand``, teacher-forced with ``ref``'s greedy
    output, prefers another token than ``ref`` does: computed from the two fakes' logits
    directly, not by the replay runner."""
    out: dict[str, list[list[int]]] = {}
    for cid, prompts in PROMPTS.items():
        out[cid] = []
        for p in prompts:
            ids = greedy(ref, p)
            out[cid].append([i for i in range(N) if int(np.argmax(cand.logits(p + ids[:i], i))) != ids[i]])
    return out


async def _servers(*fakes: FakeVLLM):
    for f in fakes:
        await f.start()
    return fakes


def _opts(fakes: dict[str, FakeVLLM], **kw) -> ReplayOptions:
    backends = [Backend(name, f.url, f.model, capture="topk", logprobs=5) for name, f in fakes.items()]
    kw.setdefault("progress", False)
    kw.setdefault("backoff_s", 0.01)
    return ReplayOptions(backends=backends, **kw)


def _replay(corpus_path, fakes: dict[str, FakeVLLM], **kw) -> dict:
    async def main():
        await _servers(*fakes.values())
        try:
            return await replay(load_corpus(corpus_path), _opts(fakes, **kw))
        finally:
            for f in fakes.values():
                await f.close()

    return asyncio.run(main())


def _strip(results: dict) -> dict:
    r = json.loads(json.dumps(results))
    for k in ("created", "wall_s", "rig"):
        r.pop(k, None)
    for c in r.get("cases") or ():
        c.pop("session", None)  # the run's own session id in its working store (time-stamped)
    return r


def test_flips_are_found_and_the_reference_has_none(corpus_dir):
    res = _replay(corpus_dir, {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=2.0)}, reference="ref")
    s = res["summary"]
    assert s["ref"]["reference"] and s["ref"]["departures"] == 0 and s["ref"]["errors"] == 0
    assert s["ref"]["diverged"] == 0 and s["ref"]["verdicts"] == {"match": 4}
    assert s["ref"]["branches"] == {"completed": 3}
    cand = s["cand"]
    assert cand["positions"] == 4 * N  # every forced position compared with the reference
    expected = expected_forced_flips(FakeVLLM(), FakeVLLM(perturb=2.0))
    n_expected = sum(len(t) for turns in expected.values() for t in turns)
    assert 0 < n_expected < 4 * N  # the perturbation flips some positions, not all
    assert cand["flips"] == n_expected and cand["flip_rate"] == pytest.approx(n_expected / (4 * N))
    got = {c["id"]: [((t["backends"].get("cand") or {}).get("forced") or {}).get("flips") for t in c["turns"]]
           for c in res["cases"]}
    assert got == expected
    lo, hi = cand["flip_rate_ci"]
    assert lo <= cand["flip_rate"] <= hi
    assert cand["same_top_p"]["p"] == pytest.approx(1 - cand["flip_rate"])
    # every forced flip has a class (issue 19); the per-class counts add up to the flips
    forced_classes = [k for c in res["cases"] for t in c["turns"]
                      for k in ((t["backends"].get("cand") or {}).get("forced") or {}).get("flip_classes") or ()]
    assert len(forced_classes) == cand["flips"] and set(forced_classes) <= {"tie", "near_tie", "noise", "runtime"}
    assert cand["runtime_flips"] == forced_classes.count("runtime")
    assert sum(cand["flips_by_class"].values()) >= cand["flips"]
    assert cand["runtime_flip_rate"] == pytest.approx(cand["runtime_flips"] / cand["positions"])
    assert cand["kl"]["mean"] > 0 and cand["kl"]["approximate"] is True
    assert cand["departures"] > 0 and cand["diverged"] > 0
    table = render_summary(res)
    assert "cand" in table and "ref (ref)" in table and "flip_rate" in table
    # shareable by default: no text anywhere in the results
    dumped = json.dumps(res)
    assert '"text"' not in dumped and "http://" not in dumped


def test_two_identical_runs_give_identical_results(corpus_dir):
    a = _replay(corpus_dir, {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=2.0)})
    b = _replay(corpus_dir, {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=2.0)})
    assert _strip(a)["summary"] == _strip(b)["summary"]
    assert _strip(a)["cases"] == _strip(b)["cases"]


def test_diverged_branch_stops_or_continues_with_a_simulator(corpus_dir):
    # cand writes a (malformed) tool call at position 0: its tool calls no longer match the
    # recorded ones (none) in turn 0 of c2, so its free branch stops there.
    fakes = {"ref": FakeVLLM(), "cand": FakeVLLM(flip_at={0: 62})}
    res = _replay(corpus_dir, fakes, cases=["c2"])
    case = res["cases"][0]
    assert case["branches"]["ref"]["status"] == "completed"
    br = case["branches"]["cand"]
    assert br["status"] == "diverged" and br["turn"] == 0 and br["verdict"] != "match"
    t1 = case["turns"][1]["backends"]["cand"]
    assert "forced" in t1 and "free" not in t1  # forced still runs on the recorded context
    assert "free" in case["turns"][1]["backends"]["ref"]

    calls = []

    def sim(call, ctx):
        calls.append((call, ctx["backend"]))
        return {"content": "ok"}

    from tensorverse.replay.tools import ToolSimulator

    fakes = {"ref": FakeVLLM(), "cand": FakeVLLM(flip_at={0: 62})}
    res = _replay(corpus_dir, fakes, cases=["c2"], simulator=ToolSimulator(sim))
    br = res["cases"][0]["branches"]["cand"]
    assert br["status"] == "simulated" and br["turn"] == 0
    assert br["simulated"] and br["simulated"][0]["step"] == 0
    # the fake's call is malformed (no JSON body): no call to answer, so the branch ends
    assert br["simulated"][0].get("stopped") == "no_tool_call" or calls


def test_fail_on_sets_the_exit_code(corpus_dir, tmp_path, capsys):
    async def up(fakes):
        await _servers(*fakes)

    fakes = {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=2.0)}
    # run_replay owns its event loop: serve the fakes from a thread with its own loop
    import threading

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(up(fakes.values()), loop).result(10)
    try:
        out = tmp_path / "res.json"
        code = run_replay(str(corpus_dir), _opts(fakes, out=out), fail_on=["flip_rate>0"])
        assert code == 1
        r = json.loads(out.read_text())
        assert r["thresholds"]["failed"][0]["backend"] == "cand"
        assert "FAIL cand: flip_rate" in capsys.readouterr().err
        assert run_replay(str(corpus_dir), _opts(fakes, out=out), fail_on=["flip_rate>1"]) == 0
        assert run_replay(str(corpus_dir), _opts(fakes, out=out),
                          fail_on=["ref:departure_rate>0", "toolcall_mismatch_rate>=0"]) == 1
        assert run_replay(str(corpus_dir), _opts(fakes, out=out), fail_on=["bogus>1"]) == 2
    finally:
        for f in fakes.values():
            asyncio.run_coroutine_threadsafe(f.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_thresholds_parse_and_apply():
    r = parse_threshold("fp8:toolcall_mismatch_rate >= 0.5")
    assert r == {"spec": "fp8:toolcall_mismatch_rate >= 0.5", "backend": "fp8",
                 "metric": "toolcall_mismatch_rate", "op": ">=", "value": 0.5}
    for bad in ("flip_rate", "flip_rate>>1", "nope>1", "flip_rate>x"):
        with pytest.raises(ValueError):
            parse_threshold(bad)
    results = {"summary": {"a": {"reference": True, "flip_rate": 0.5},
                           "b": {"reference": False, "flip_rate": 0.02, "kl": {"mean": 1e-3, "max": 0.2}},
                           "c": {"reference": False, "flip_rate": None}}}
    failed = check_thresholds(results, [parse_threshold("flip_rate>0.01"), parse_threshold("kl_max>0.1"),
                                        parse_threshold("zz:flip_rate>0")])
    assert [(f["backend"], f["metric"]) for f in failed] == [("b", "flip_rate"), ("b", "kl_max"),
                                                            ("zz", "flip_rate")]


def test_backend_errors_are_retried_then_recorded(corpus_dir):
    fakes = {"ref": FakeVLLM(), "bad": FakeVLLM(fail_status=500)}
    res = _replay(corpus_dir, fakes, retries=2, cases=["c1"])
    t = res["cases"][0]["turns"][0]["backends"]["bad"]
    assert t["forced"]["status"] == "failed" and t["forced"]["retries"] == 2
    assert res["summary"]["bad"]["errors"] == 2 and res["summary"]["ref"]["errors"] == 0
    assert res["cases"][0]["branches"]["bad"]["status"] == "error"


def test_interrupted_run_resumes_with_the_cases_not_done(corpus_dir, tmp_path):
    fakes = {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=2.0)}
    out = tmp_path / "res.json"
    first = _replay(corpus_dir, fakes, out=out, cases=None)
    journal = Path(str(out) + ".partial.jsonl")
    assert out.is_file() and not journal.exists()
    # fake an interruption after c1: the journal holds c1 only
    from tensorverse.replay.journal import journal_key as _journal_key

    opts = _opts(fakes, out=out)
    key = _journal_key(load_corpus(corpus_dir), opts)
    c1 = next(c for c in first["cases"] if c["id"] == "c1")
    journal.write_text(json.dumps({"key": key, "case": c1}) + "\n" + '{"key": "cut in ha')
    fakes2 = {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=2.0)}
    second = _replay(corpus_dir, fakes2, out=out)
    assert second["resumed"] == 1
    ran = {json.dumps(b.get("prompt")) for f in fakes2.values() for p, b in f.requests
           if p == "/v1/completions" and isinstance(b.get("prompt"), list) and len(b["prompt"]) > 1}
    assert json.dumps([5, 6, 7, 8]) not in ran  # c1 was not replayed again
    assert [c["id"] for c in second["cases"]] == ["c1", "c2", "c3"]
    assert second["summary"]["cand"]["flips"] == first["summary"]["cand"]["flips"]
    assert not journal.exists()


def test_a_backend_with_another_tokenizer_is_refused(tmp_path):
    fake = FakeVLLM()
    write_corpus(tmp_path / "c", [make_case(fake, "c1", [[5, 6, 7]], fingerprint="0123456789abcdef")],
                 tokenizer={"fingerprint": "0123456789abcdef"})
    res = _replay(tmp_path / "c", {"ref": FakeVLLM()})
    assert "ref" in res["refused"] and "tokenizer" in res["refused"]["ref"]
    assert res["cases"][0]["branches"]["ref"]["status"] == "refused"
    res = _replay(tmp_path / "c", {"ref": FakeVLLM()}, check_tokenizer=False)
    assert not res["refused"] and res["summary"]["ref"]["free_turns"] == 1


def test_ctrl_c_stops_the_run_and_starts_no_other_case(corpus_dir, tmp_path, monkeypatch, capsys):
    """SIGINT (Ctrl-C) during the first case: exit 130, no case started afterwards, no results
    written, and the message says how to resume. (`replay` also checks a flag of its own before
    each case and before writing the results, so a cancellation lost on the way, as
    asyncio.wait_for can lose one in Python 3.11, cannot let the run go on.)"""
    import os
    import signal
    import threading

    from tensorverse.replay import runner as R

    original = R._Replay.case
    calls: list[str] = []

    async def case(self, c):
        calls.append(c["id"])
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the case runs
            await asyncio.sleep(0.5)
        return await original(self, c)

    monkeypatch.setattr(R._Replay, "case", case)
    fakes = {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=2.0)}
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(_servers(*fakes.values()), loop).result(10)
    try:
        out = tmp_path / "res.json"
        assert run_replay(str(corpus_dir), _opts(fakes, out=out, concurrency=1)) == 130
        assert calls == ["c1"]  # no case started after the interruption
        assert not out.exists() and Path(str(out) + ".partial.jsonl").exists()
        assert "rerun the same command to resume" in capsys.readouterr().err
    finally:
        for f in fakes.values():
            asyncio.run_coroutine_threadsafe(f.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_with_retries_backs_off_and_counts():
    from tensorverse.replay.runner import with_retries
    from tensorverse.store.records import Run

    def rec(status, **kw):
        return Run(id="r", turn_id="t", backend="b", mode="free", status=status, **kw)

    outcomes = iter(["failed", "timeout", "ok", "failed"])
    calls = []

    async def run():
        calls.append(1)
        return rec(next(outcomes))

    out = asyncio.run(with_retries(run, 5, 0.001))
    assert out == rec("ok", retries=2) and len(calls) == 3
    failing = iter(["failed"] * 4)
    out = asyncio.run(with_retries(lambda: asyncio.sleep(0, rec(next(failing))), 2, 0.001))
    assert out == rec("failed", retries=2)


def test_a_tool_simulator_module_in_the_working_directory_loads_without_touching_sys_path(tmp_path, monkeypatch):
    import sys

    from tensorverse.replay.tools import load_simulator

    (tmp_path / "my_router_sim.py").write_text("def answer(call, context):\n    return 'up ' + call['name']\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    sim = load_simulator("my_router_sim:answer")
    assert sys.path == before
    assert sim is not None
    try:
        load_simulator("no_such_module_here:answer")
    except ValueError as e:
        assert "no_such_module_here" in str(e)
    else:
        raise AssertionError("a missing module must be refused")
