"""A small recorded store for the viewer tests, written with the Store API in the shape the
proxy (turns) and the shadow runner (runs, comparisons) write.

Session ``s-net`` (tags agent=netops), turn 1 is the DESIGN example:

* ``primary`` answers with a Qwen3 tool call ``configure_subinterface(interface=
  "GigabitEthernet0/0/1.201", vlan=201)``; its top-5 logprobs are recorded (no rows).
* ``secondary`` (role secondary: the primary's config, the noise floor) has full logits rows in
  both modes and emits the same tokens: it is the reference distribution.
* ``fa2`` flips ``0`` -> ``1`` inside the interface name (a near tie) and, running free, writes
  ``GigabitEthernet0/1/4``: a ``value_mismatch``. Rows in both modes.
* ``fp8`` flips ``Configure`` -> ``Set`` in the thinking (forced and free) and, forced, also
  flips the vlan ``201`` -> ``200`` (a confident reference: margin wide); free, its call matches.
  Forced: rows; free: top-k logprobs only.

Turn 1 has the comparisons tensorverse.shadow.compare stores; turn 0 (all backends agree) has
none, so its metrics are computed from the rows. Sessions ``s-00`` .. ``s-06``: primary-only
fillers for paging. Session ``s-xss``: hostile text everywhere (prompt, tags, tokens, tool
arguments, a backend name).
"""

from __future__ import annotations

import math
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest


from tensorverse.store import Store
from tensorverse.store.codec import encode_row
from tensorverse.store.records import BackendInfo, Turn
from tensorverse.testing.records import trun, tsession

V = 160  # a small vocabulary keeps the tests fast; the codec and metrics do not care
XSS_IMG = "<img src=x onerror=alert(1)>"
XSS_SCRIPT = "</script><script>alert(1)</script>"
XSS_BACKEND = "<img src=x onerror=alert(2)>"

THINK = ["<think>", "\n", "Configure", " the", " sub", "interface", " on", " the", " router", ".", "\n",
         "</think>", "\n\n"]
CALL_HEAD = ["<tool_call>", "\n", '{"', "name", '":', ' "', "configure", "_sub", "interface", '",', ' "',
             "arguments", '":', ' {"', "interface", '":', ' "', "Gig", "abit", "Ethernet", "0", "/"]
IFACE_PRIMARY = ["0", "/", "1", ".", "201"]
IFACE_FA2 = ["1", "/", "4"]
CALL_TAIL = ['",', ' "', "vlan", '":', " ", "201", "}}", "\n", "</tool_call>", "<|im_end|>"]

PRIMARY = THINK + CALL_HEAD + IFACE_PRIMARY + CALL_TAIL
FA2 = THINK + CALL_HEAD + IFACE_FA2 + CALL_TAIL
FP8 = THINK[:2] + ["Set"] + THINK[3:] + CALL_HEAD + IFACE_PRIMARY + CALL_TAIL

FA2_FLIP = len(THINK) + len(CALL_HEAD)  # the "0" -> "1"
FP8_FLIP = 2  # "Configure" -> "Set"
FP8_VLAN_FLIP = len(PRIMARY) - 5  # "201" (vlan) -> "200", forced only

HELLO = ["Hello", "!", " How", " can", " I", " help", "?", "<|im_end|>"]

XSS_OUT = ["Sure", " ", XSS_IMG, " ", XSS_SCRIPT, "\n", "<tool_call>", "\n", '{"', "name", '":', ' "', "run",
           '",', ' "', "arguments", '":', ' {"', "cmd", '":', ' "', "echo", " ", "ok", '"}}', "\n",
           "</tool_call>", "<|im_end|>"]
XSS_BRANCH = XSS_OUT[:22] + [XSS_SCRIPT, '"}}', "\n", "</tool_call>", "<|im_end|>"]


class Vocab:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def id(self, piece: str) -> int:
        if piece not in self.ids:
            self.ids[piece] = 10 + len(self.ids)
            assert self.ids[piece] < V
        return self.ids[piece]

    def encode(self, pieces: list[str]) -> list[int]:
        return [self.id(p) for p in pieces]


VOCAB = Vocab()


def tok(piece: str) -> int:
    return VOCAB.id(piece)

for _p in PRIMARY + FA2 + FP8 + HELLO + XSS_OUT + XSS_BRANCH + ["200"]:
    VOCAB.id(_p)


def base_logits(seq: list[int], pos: int, *, alt: int | None = None, alt_gap: float = 0.4) -> np.ndarray:
    """The 'true' distribution at ``pos`` after ``seq[:pos]``: its token at 8, an optional
    runner-up ``alt`` at ``8 - alt_gap``, the rest noise (seeded by the context)."""
    rng = np.random.default_rng(zlib.crc32(repr((seq[:pos], pos)).encode()))
    x = rng.normal(0.0, 1.0, V).astype(np.float32)
    x[seq[pos]] = 8.0
    if alt is not None:
        x[alt] = 8.0 - alt_gap
    return x


def jitter(x: np.ndarray, backend: str, pos: int, scale: float = 0.02) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(f"{backend}:{pos}".encode()))
    return (x + rng.normal(0.0, scale, x.shape)).astype(np.float32)


def topk_entry(x: np.ndarray, k: int = 5) -> dict[str, float]:
    """vLLM completions-style top-k: {"token_id:N": logprob}."""
    x = x.astype(np.float64)
    lse = x.max() + math.log(float(np.exp(x - x.max()).sum()))
    idx = np.argsort(-x, kind="stable")[:k]
    return {f"token_id:{int(i)}": float(x[i] - lse) for i in idx}


@dataclass
class Built:
    path: object
    sessions: list[str] = field(default_factory=list)
    turns: dict[str, str] = field(default_factory=dict)
    vocab: Vocab = VOCAB


def topk_pairs(x: np.ndarray, k: int = 5) -> list[list[float]]:
    """The shadow runner's normalised top-k: ``[[id, logprob], ...]``, best first."""
    return [[int(t.split(":")[1]), lp] for t, lp in topk_entry(x, k).items()]


def _run(store: Store, rid: str, tid: str, backend: str, mode: str, pieces: list[str], *,
         rows: list[np.ndarray] | None = None, topk: list | None = None, role: str = "shadow",
         created_ns: int = 0, status: str = "ok") -> None:
    """A run record as tensorverse.shadow.runner writes it (the API's top-k comes with rows too)."""
    if topk is None and rows is not None:
        topk = [topk_pairs(r) for r in rows]
    rec = trun(rid, tid, backend, mode, role=role,
               status=status, capture="full" if rows is not None else "topk",
               approximate=rows is None, method="forced_decode" if mode == "forced" else "generate",
               token_ids=VOCAB.encode(pieces), text="".join(pieces), finish_reason="stop",
               top_logprobs=topk, k=5, created_ns=created_ns, error=None,
               rows=None if rows is None else {"expected": len(rows), "present": len(rows), "complete": True})
    store.put_run(rec).result()
    if rows is not None:
        store.write_rows(rid, [(p, encode_row(r)) for p, r in enumerate(rows)]).result()


def _turn(store: Store, sid: str, tid: str, index: int, pieces: list[str], *, prompt: list[dict],
          created_ns: int, ctx=None, text: str | None = None, reasoning: str | None = None,
          tool_calls: list | None = None) -> None:
    """A turn as the proxy records it (chat API: content, reasoning and tool calls split out, the
    logprobs per position as ``{"token", "logprob", "top"}``), plus the shadow runner's
    ``recorded`` run of the primary's answer."""
    ids = VOCAB.encode(pieces)
    ctx = ctx or (lambda p: base_logits(ids, p))
    logits = [ctx(p) for p in range(len(ids))]
    choice_lps = [{"token": ids[p], "logprob": dict(topk_pairs(logits[p])).get(ids[p], -20.0),
                   "top": topk_pairs(logits[p])} for p in range(len(ids))]
    text = "".join(pieces) if text is None else text
    store.put_turn(Turn(id=tid, session_id=sid, index=index, created_ns=created_ns,
                        endpoint="chat.completions", backend="primary", state="ok",
                        request={"model": "qwen3", "messages": prompt, "temperature": 0},
                        prompt_token_ids=list(range(1, 40)), output_token_ids=ids, text=text,
                        reasoning=reasoning, tool_calls=tool_calls or [], finish_reason="stop",
                        choices=[{"index": 0, "text": text, "token_ids": ids, "logprobs": choice_lps}])).result()
    store.put_run(trun(
        f"{tid}~primary", tid, "primary", "recorded", session_id=sid, role="primary", status="ok", capture="topk",
        approximate=True, method="recorded", token_ids=ids, text=text, top_logprobs=[topk_pairs(x) for x in logits],
        pieces=pieces, tool_calls=tool_calls or None, created_ns=created_ns,
        # the shadow runner's parser check: the ids (pieces) re-parsed against what was sent
        parser_check=parser_check("".join(pieces), text, tool_calls).as_dict())).result()


def parser_check(decoded: str, text: str | None, tool_calls: list | None) -> Any:
    from tensorverse.analysis.attribution import parser_check as check

    return check(decoded, text, tool_calls)


def _compare(store: Store, tid: str) -> None:
    """The shadow runner's comparisons, when that module is there."""
    try:
        from tensorverse.shadow.compare import compare_turn
    except ImportError:  # pragma: no cover - the viewer works without comparisons
        return
    compare_turn(store, tid)


def build_store(path) -> Built:
    b = Built(path=path)
    t0 = 1_760_000_000_000_000_000
    with Store.open(path) as store:
        store.put_backend("primary", BackendInfo(name="primary", url="http://primary:8000", role="primary",
                                                 model="qwen3")).result()
        store.put_backend("secondary", BackendInfo(name="secondary", url="http://sec:8000", role="secondary",
                                                   capture="full")).result()
        store.put_backend("fa2", BackendInfo(name="fa2", url="http://fa2:8000", role="shadow", capture="full",
                                             settings={"attention": "FLASH_ATTN"})).result()
        store.put_backend("fp8", BackendInfo(name="fp8", url="http://fp8:8000", role="shadow", capture="full")).result()

        # fillers, oldest first
        for i in range(7):
            sid = f"s-{i:02d}"
            store.put_session(tsession(sid, created_ns=t0 + i, tags={"agent": "filler"})).result()
            _turn(store, sid, f"{sid}-t0", 0, HELLO, prompt=[{"role": "user", "content": "hi"}], created_ns=t0 + i)
            b.sessions.append(sid)

        # the DESIGN example
        sid = "s-net"
        store.put_session(tsession(sid, created_ns=t0 + 100, tags={"agent": "netops", "site": "lab"})).result()
        b.sessions.append(sid)
        prompt = [{"role": "system", "content": "You configure routers."},
                  {"role": "user", "content": "Create subinterface 0/0/1.201 for VLAN 201."}]
        # turn 0: everyone agrees
        tid0 = "s-net-t0"
        _turn(store, sid, tid0, 0, HELLO, prompt=prompt[:1], created_ns=t0 + 101)
        ids0 = VOCAB.encode(HELLO)
        for be in ("secondary", "fa2", "fp8"):
            rows = [jitter(base_logits(ids0, p), be, p) for p in range(len(ids0))]
            role = "secondary" if be == "secondary" else "shadow"
            _run(store, f"{tid0}-{be}-forced", tid0, be, "forced", HELLO, rows=rows, role=role, created_ns=t0 + 102)
            _run(store, f"{tid0}-{be}-free", tid0, be, "free", HELLO, rows=rows, role=role, created_ns=t0 + 102)
        # turn 1: the flip
        tid = "s-net-t1"
        b.turns.update(net0=tid0, net=tid)
        p_ids, fa2_ids, fp8_ids = VOCAB.encode(PRIMARY), VOCAB.encode(FA2), VOCAB.encode(FP8)
        one, zero, set_, configure = VOCAB.id("1"), VOCAB.id("0"), VOCAB.id("Set"), VOCAB.id("Configure")
        v200 = VOCAB.id("200")

        def ref_alt(pos: int) -> int | None:
            return {FA2_FLIP: one, FP8_FLIP: set_, FP8_VLAN_FLIP: v200}.get(pos)

        def primary_ctx(pos: int) -> np.ndarray:
            gap = 2.0 if pos == FP8_VLAN_FLIP else 0.4
            return base_logits(p_ids, pos, alt=ref_alt(pos), alt_gap=gap)

        def forced_rows(be: str) -> list[np.ndarray]:
            rows = []
            for p in range(len(p_ids)):
                x = jitter(primary_ctx(p), be, p)
                if be == "fa2" and p == FA2_FLIP:
                    x[one], x[zero] = 8.1, 7.9
                if be == "fp8" and p == FP8_FLIP:
                    x[set_], x[configure] = 8.2, 7.8
                if be == "fp8" and p == FP8_VLAN_FLIP:
                    x[v200] = 8.3
                rows.append(x)
            return rows

        def free_rows(be: str, ids: list[int], forced: list[np.ndarray], div: int) -> list[np.ndarray]:
            return [forced[p] if p <= div else jitter(base_logits(ids, p), be, p) for p in range(len(ids))]

        call = {"id": "call_1", "type": "function", "function": {
            "name": "configure_subinterface",
            "arguments": '{"interface": "GigabitEthernet0/0/1.201", "vlan": 201}'}}
        _turn(store, sid, tid, 1, PRIMARY, prompt=prompt, created_ns=t0 + 110, ctx=primary_ctx,
              text="", reasoning="".join(THINK[1:11]), tool_calls=[call])
        sec_forced = forced_rows("secondary")
        fa2_forced = forced_rows("fa2")
        fp8_forced = forced_rows("fp8")
        _run(store, f"{tid}-secondary-forced", tid, "secondary", "forced", PRIMARY, rows=sec_forced,
             role="secondary", created_ns=t0 + 111)
        _run(store, f"{tid}-secondary-free", tid, "secondary", "free", PRIMARY, rows=sec_forced,
             role="secondary", created_ns=t0 + 111)
        _run(store, f"{tid}-fa2-forced", tid, "fa2", "forced", PRIMARY, rows=fa2_forced, created_ns=t0 + 112)
        _run(store, f"{tid}-fa2-free", tid, "fa2", "free", FA2,
             rows=free_rows("fa2", fa2_ids, fa2_forced, FA2_FLIP), created_ns=t0 + 112)
        _run(store, f"{tid}-fp8-forced", tid, "fp8", "forced", PRIMARY, rows=fp8_forced, created_ns=t0 + 113)
        fp8_free = free_rows("fp8", fp8_ids, fp8_forced, FP8_FLIP)
        _run(store, f"{tid}-fp8-free", tid, "fp8", "free", FP8, topk=[topk_pairs(x) for x in fp8_free],
             created_ns=t0 + 113)
        _compare(store, tid)

        # hostile text
        sid = "s-xss"
        store.put_session(tsession(sid, created_ns=t0 + 200, tags={"agent": XSS_IMG, XSS_SCRIPT: "x"})).result()
        b.sessions.append(sid)
        tid = "s-xss-t0"
        _turn(store, sid, tid, 0, XSS_OUT, prompt=[{"role": "user", "content": XSS_IMG + " and " + XSS_SCRIPT}],
              created_ns=t0 + 201)
        x_ids, xb_ids = VOCAB.encode(XSS_OUT), VOCAB.encode(XSS_BRANCH)
        rows = [jitter(base_logits(x_ids, p), "sec", p) for p in range(len(x_ids))]
        _run(store, f"{tid}-secondary-forced", tid, "secondary", "forced", XSS_OUT, rows=rows, role="secondary",
             created_ns=t0 + 202)
        brows = [jitter(base_logits(x_ids, p, alt=VOCAB.id(XSS_SCRIPT) if p == 22 else None), XSS_BACKEND, p)
                 for p in range(len(x_ids))]
        brows[22][VOCAB.id(XSS_SCRIPT)] = 8.5
        _run(store, f"{tid}-evil-forced", tid, XSS_BACKEND, "forced", XSS_OUT, rows=brows, created_ns=t0 + 203)
        _run(store, f"{tid}-evil-free", tid, XSS_BACKEND, "free", XSS_BRANCH,
             rows=[brows[p] if p <= 22 else jitter(base_logits(xb_ids, p), "e", p) for p in range(len(xb_ids))],
             created_ns=t0 + 203)
        b.turns["xss"] = tid
    return b


@pytest.fixture(scope="session")
def vz():
    """This module: the store's constants and builders (test files cannot import conftest)."""
    return sys.modules[__name__]


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Built:
    return build_store(tmp_path_factory.mktemp("vizstore") / "store")


@pytest.fixture()
def ro_store(built):
    with Store.open(built.path, readonly=True) as store:
        yield store
