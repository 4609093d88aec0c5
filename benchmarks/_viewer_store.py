"""A long recorded turn for the viewer benchmark (``benchmarks/viewer.py``), written with the real
Store API in the shapes the proxy (the turn), the shadow runner (runs and logits rows) and
:mod:`tensorverse.shadow.compare` (comparisons, when asked) write; the same shapes as
``tests/viz/conftest.py``, at benchmark size.

    from benchmarks._viewer_store import build_long_turn
    info = build_long_turn(path, tokens=2000, vocab=32768)   # then compare_turn(store, info.turn_id)

One session, one turn of ``tokens`` output tokens, five backends:

``primary``    the recorded answer: a Qwen3 chat answer (``<think>`` about 45 %, content, three
               ``<tool_call>`` JSON calls, ``<|im_end|>``), its top-5 logprobs, no rows; the
               chat API's split (``text`` = content, ``reasoning``, OpenAI ``tool_calls``).
``secondary``  the primary's config on another server (role secondary: the forced reference and
               the noise floor): rows in both modes, no flips, free output = the primary's.
``fa2``, ``sdpa``, ``fp8``  shadows with rows in forced mode; ``fa2`` and ``sdpa`` also in free
               mode, ``fp8`` free has top-k logprobs only.

Forced flips (every region): ``fp8`` about 1.2 % of positions, ``fa2`` 0.6 %, ``sdpa`` 0.4 %,
mostly near ties of the reference, a fifth where it was confident. Each shadow's first forced
flip is where its free run leaves the primary's (greedy decoding: the same context up to there):

* ``fp8`` at ~15 % (thinking), then its own thinking and content, and a first call to another
  function (``wrong_func_name``);
* ``fa2`` and ``sdpa`` together at ~60 % (content, a near tie): a shared branch, with calls equal
  to the primary's; inside the first call's interface value ``fa2`` splits from ``sdpa``
  (``GigabitEthernet0/1/4`` vs ``GigabitEthernet0/0/1.201``: ``value_mismatch``).

So the free view is a tree of seven nodes with three branch points and four distinct outputs.
``fp8`` also flips the first call's ``vlan`` (``201`` -> ``200``) where the reference was
confident (a suspicious flip, in ``tool_args``).

Logits rows are synthetic (no recorded rows of this size exist here): bf16-exact float32 of
width ``vocab``, a pooled N(0, 1.5) background, the emitted token at 12, a contested runner-up
where the reference was close; shadows add per-backend noise (a bf16 ulp on about a third of the
entries), so the codec sees near-identical rows as from real runtimes. A position's row of a free
run is its forced row while the contexts agree (blobs reused, as the runner's rows would be equal).
"""

from __future__ import annotations

import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks._logits import round_to_bf16
from tensorverse.store import Store
from tensorverse.store.codec import encode_row
from tensorverse.store.records import BackendInfo, Run, Session, Turn

__all__ = ["build_long_turn", "LongTurn", "BACKENDS"]

BACKENDS = ("primary", "secondary", "fa2", "fp8", "sdpa")
TOP = 12.0  # the emitted token's logit
POOL = 61  # background rows (a prime, so neighbouring positions differ)
CHUNK = 64  # positions generated, encoded and committed together
K = 5  # top-k logprobs per position

WORDS = ("the router interface vlan sub needs a configure first check that uplink port trunk "
         "allowed list is on core switch then add address mask gateway route static for this "
         "site and we must keep existing config so verify running state before saving it "
         "after change user asked to create tagged frames encapsulation dot1q id matches "
         "description lab rack two link speed duplex auto negotiation mtu size default "
         "ospf area zero neighbor adjacency should stay up while applying changes carefully").split()

CALLS = [
    ("configure_subinterface", {"interface": "GigabitEthernet0/0/1.201", "vlan": 201,
                                "description": "uplink to core", "encapsulation": "dot1q"}),
    ("set_ip_address", {"interface": "GigabitEthernet0/0/1.201", "address": "10.20.1.1",
                        "prefix": 24}),
    ("save_config", {"target": "startup", "confirm": True}),
]


def _calls_with(first_name: str | None = None, first_iface: str | None = None) -> list:
    calls = [(n, dict(a)) for n, a in CALLS]
    if first_name:
        calls[0] = (first_name, calls[0][1])
    if first_iface:
        calls[0][1]["interface"] = first_iface
    return calls


_SPLIT = re.compile(r"\s*\w+|\s*[^\w\s]+|\s+")


def _tokenize(text: str) -> list[str]:
    """Token-like pieces whose concatenation is ``text`` (words cut into <= 4 characters)."""
    out: list[str] = []
    for m in _SPLIT.findall(text):
        lead = len(m) - len(m.lstrip())
        word = m[lead:]
        if word and (word[0].isalnum() or word[0] == "_") and len(word) > 4:
            out.append(m[:lead] + word[:4])
            out.extend(word[i:i + 4] for i in range(4, len(word), 4))
        else:
            out.append(m)
    assert "".join(out) == text
    return out


def _call_pieces(calls: list) -> list[str]:
    out: list[str] = []
    for i, (name, args) in enumerate(calls):
        if i:
            out.append("\n")
        out += ["<tool_call>", "\n"]
        out += _tokenize(json.dumps({"name": name, "arguments": args}))
        out += ["\n", "</tool_call>"]
    return out


def _words(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` pieces of prose: words with a leading space, sentences, a newline now and then."""
    out: list[str] = []
    since = 0
    while len(out) < n:
        since += 1
        if since > 8 and rng.random() < 0.12:
            out.append("." if rng.random() < 0.8 else ".\n")
            since = 0
        else:
            out.append(" " + WORDS[int(rng.integers(len(WORDS)))])
    return out[:n]


def _openai_calls(calls: list) -> list[dict]:
    return [{"id": f"call_{i}", "type": "function",
             "function": {"name": n, "arguments": json.dumps(a)}} for i, (n, a) in enumerate(calls)]


class _Vocab:
    def __init__(self, size: int) -> None:
        self.size = size
        self.ids: dict[str, int] = {}

    def encode(self, pieces: list[str]) -> list[int]:
        out = []
        for p in pieces:
            if p not in self.ids:
                self.ids[p] = 10 + len(self.ids)
                if self.ids[p] >= self.size:
                    raise ValueError(f"vocab {self.size} too small for the text")
            out.append(self.ids[p])
        return out


@dataclass
class LongTurn:
    path: str
    session_id: str
    turn_id: str
    tokens: int
    vocab: int
    backends: tuple = BACKENDS
    forced_flips: dict = field(default_factory=dict)  # backend -> positions
    divergence: dict = field(default_factory=dict)  # backend -> free divergence (None: same)
    free_lengths: dict = field(default_factory=dict)
    rows_written: int = 0
    rows_encoded: int = 0
    build_s: float = 0.0


class _Rows:
    """Synthetic rows: a pooled background (per backend: with its noise), the emitted token at
    TOP and the contenders of a position. The top-k logprobs of a position are computed from the
    pool row's exp-sum and best entries plus the overrides, without building the row."""

    def __init__(self, vocab: int, seed: int, shadows: list[int]) -> None:
        rng = np.random.default_rng(seed)
        bg = round_to_bf16(rng.normal(0.0, 1.5, (POOL, vocab)).astype(np.float32))
        noise = rng.normal(0.0, 0.01, (POOL, vocab)).astype(np.float32)
        self.pools: dict[int | None, np.ndarray] = {None: bg}
        for sh in shadows:
            self.pools[sh] = round_to_bf16(bg + noise[(np.arange(POOL) * 7 + sh * 13) % POOL])
        self.stats: dict[int | None, tuple[np.ndarray, np.ndarray]] = {}
        for sh, pool in self.pools.items():
            x64 = pool.astype(np.float64)
            best = np.argsort(-pool, axis=1, kind="stable")[:, : K + 8]
            self.stats[sh] = (np.exp(x64).sum(axis=1), best)

    @staticmethod
    def _over(tokens: list[int], p: int, extra: dict) -> dict[int, float]:
        out = {tokens[p]: TOP}
        for tok, logit in extra.get(p, ()):
            out[tok] = logit
        return out

    def make(self, tokens: list[int], s: int, e: int, *, shadow: int | None, extra: dict) -> np.ndarray:
        x = self.pools[shadow][np.arange(s, e) % POOL]  # a copy (fancy indexing)
        for p in range(s, e):
            for tok, v in self._over(tokens, p, extra).items():
                x[p - s, tok] = v
        return x

    def topk(self, tokens: list[int], s: int, e: int, *, shadow: int | None,
             extra: dict) -> list[list[list[float]]]:
        """Per position ``[[id, logprob], ...]`` best first (the runner's normalised top-k)."""
        pool = self.pools[shadow]
        sumexp, best = self.stats[shadow]
        out = []
        for p in range(s, e):
            i = p % POOL
            over = self._over(tokens, p, extra)
            total = float(sumexp[i])
            for t, v in over.items():
                total += math.exp(v) - math.exp(float(pool[i, t]))
            lse = math.log(total)
            vals = dict(over)
            for t in best[i].tolist():
                vals.setdefault(t, float(pool[i, t]))
            ids = sorted(vals, key=lambda t: (-vals[t], t))[:K]
            out.append([[int(t), vals[t] - lse] for t in ids])
        return out


def _bf(v: float) -> float:
    return float(round_to_bf16(np.array([v], np.float32))[0])


def build_long_turn(path: str | Path, *, tokens: int = 2000, vocab: int = 32768, seed: int = 0,
                    encoders: int = 2, durable: bool = False) -> LongTurn:
    """Write the store (see the module docstring); comparisons are left to the caller.
    ``durable=False``: no fsync per commit (a throwaway benchmark store)."""
    t_start = time.perf_counter()
    if tokens < 200:
        raise ValueError("tokens must be >= 200")
    rng = np.random.default_rng(seed)
    V = _Vocab(vocab)
    end = ["<|im_end|>"]

    # ---- the texts
    calls_a = _call_pieces(CALLS)
    n_think = int(round(tokens * 0.45))
    n_content = tokens - n_think - len(calls_a) - len(end) - 1  # "\n\n" before the calls
    if n_content < 40:
        raise ValueError("tokens too few for the tool calls")
    think = ["<think>", "\n"] + _words(rng, n_think - 5) + ["\n", "</think>", "\n\n"]
    content = _words(rng, n_content)
    primary = think + content + ["\n\n"] + calls_a + end
    assert len(primary) == tokens
    p_ids = V.encode(primary)

    d_fp8 = max(3, int(tokens * 0.15))
    d_shared = len(think) + int(len(content) * 0.35)
    alt_fp8_piece = " verify" if primary[d_fp8] != " verify" else " check"
    alt_shared_piece = " then" if primary[d_shared] != " then" else " so"
    alt_fp8, alt_shared = V.encode([alt_fp8_piece, alt_shared_piece])
    # fp8: its own thinking from d_fp8 on, other content, a different first function
    fp8_rest = _words(np.random.default_rng(seed + 11), max(0, len(think) - d_fp8 - 4))
    fp8 = (primary[:d_fp8] + [alt_fp8_piece] + fp8_rest
           + ["\n", "</think>", "\n\n"] + _words(np.random.default_rng(seed + 12), n_content)
           + ["\n\n"] + _call_pieces(_calls_with(first_name="show_running_config")) + end)
    # fa2 + sdpa: together from d_shared, other content, the same calls; fa2 then another value
    x_len = max(10, tokens - d_shared - 1 - len(calls_a) - len(end) - 1)
    x_words = _words(np.random.default_rng(seed + 13), x_len)
    shared_head = primary[:d_shared] + [alt_shared_piece] + x_words + ["\n\n"]
    sdpa = shared_head + calls_a + end
    fa2 = shared_head + _call_pieces(_calls_with(first_iface="GigabitEthernet0/1/4")) + end
    free_pieces = {"secondary": primary, "fa2": fa2, "sdpa": sdpa, "fp8": fp8}
    free_ids = {b: V.encode(p) for b, p in free_pieces.items()}
    d_fa2 = next(i for i, (a, b) in enumerate(zip(free_ids["fa2"], free_ids["sdpa"])) if a != b)

    # ---- forced flips: contested positions (the reference had a runner-up), some flipped
    words_at = [p for p in range(2, tokens - len(end)) if primary[p].strip() and p not in (d_fp8, d_shared)]
    contested = sorted(rng.choice(words_at, size=min(len(words_at), max(8, tokens // 20)), replace=False).tolist())
    gap: dict[int, float] = {}
    alt: dict[int, int] = {}
    for p in contested:
        gap[p] = float(rng.uniform(1.5, 3.0)) if rng.random() < 0.2 else float(rng.uniform(0.05, 0.6))
        a = int(rng.integers(len(WORDS)))
        alt[p] = V.encode([" " + WORDS[a]])[0]
        if alt[p] == p_ids[p]:
            alt[p] = V.encode([" " + WORDS[(a + 1) % len(WORDS)]])[0]
    gap[d_fp8], alt[d_fp8] = 0.3, alt_fp8
    gap[d_shared], alt[d_shared] = 0.08, alt_shared
    # the DESIGN example's suspicious flip: the vlan 201 -> 200, the reference confident
    p_vlan = primary.index(" 201", len(think) + len(content))
    gap[p_vlan], alt[p_vlan] = 2.0, V.encode([" 200"])[0]
    rate = {"fp8": 0.012, "fa2": 0.006, "sdpa": 0.004}
    first = {"fp8": d_fp8, "fa2": d_shared, "sdpa": d_shared}
    flips: dict[str, list[int]] = {"secondary": []}
    for i, (b, r) in enumerate(rate.items()):
        later = [p for p in contested if p > first[b]]
        n = min(len(later), max(2, int(round(tokens * r))) - 1)
        pick = np.random.default_rng(seed + 100 + i).choice(later, size=n, replace=False).tolist() if n > 0 else []
        flips[b] = sorted({first[b], *pick, *([p_vlan] if b == "fp8" else [])})
    for b in ("fa2", "sdpa"):
        assert d_shared in flips[b]

    def forced_extra(b: str | None) -> dict[int, list[tuple[int, float]]]:
        """Contenders per position in forced mode (None: the reference / the primary)."""
        mine = set(flips.get(b, ())) if b else set()
        out = {}
        for p in gap:
            up = 0.05 + 0.35 * ((p * 31 + len(b or "")) % 97) / 97
            out[p] = [(alt[p], _bf(TOP + up) if p in mine else _bf(TOP - gap[p]))]
        return out

    shadow_no = {"secondary": 1, "fa2": 2, "fp8": 3, "sdpa": 4}
    rows = _Rows(vocab, seed, list(shadow_no.values()))
    sid, tid = "bench-viewer-s0", "bench-viewer-s0-t0"
    t0 = 1_760_000_000_000_000_000
    info = LongTurn(path=str(path), session_id=sid, turn_id=tid, tokens=tokens, vocab=vocab)
    info.forced_flips = {b: list(v) for b, v in flips.items()}
    divergences = {b: (None if free_ids[b] == p_ids else
                       next((i for i, (a, c) in enumerate(zip(p_ids, free_ids[b])) if a != c),
                            min(len(p_ids), len(free_ids[b])))) for b in free_ids}
    info.divergence = divergences
    info.free_lengths = {b: len(v) for b, v in free_ids.items()}

    with Store.open(path, durable=durable) as store, ThreadPoolExecutor(encoders) as pool:
        store.put_backend("primary", BackendInfo(name="primary", url="http://primary:8000", role="primary",
                                                 model="qwen3")).result()
        store.put_backend("secondary", BackendInfo(name="secondary", url="http://sec:8000", role="secondary",
                                                   capture="full")).result()
        for b, att in (("fa2", "FLASH_ATTN"), ("sdpa", "TORCH_SDPA"), ("fp8", "FLASH_ATTN")):
            settings = {"attention": att, **({"kv_cache_dtype": "fp8"} if b == "fp8" else {})}
            store.put_backend(b, BackendInfo(name=b, url=f"http://{b}:8000", role="shadow", capture="full",
                                             settings=settings)).result()
        store.put_session(Session(id=sid, created_ns=t0, tags={"agent": "netops", "bench": "viewer"})).result()

        # the primary: top-k from the reference-shaped rows (no noise), no rows stored
        prim_topk: list = []
        ref_extra = forced_extra(None)
        for s in range(0, tokens, CHUNK):
            prim_topk += rows.topk(p_ids, s, min(tokens, s + CHUNK), shadow=None, extra=ref_extra)
        reasoning = "".join(think[2:-3])
        text = "".join(content) + "\n\n"
        store.put_turn(Turn(
            id=tid, session_id=sid, index=0, created_ns=t0 + 1,
            endpoint="chat.completions", backend="primary", state="ok",
            request={"model": "qwen3", "temperature": 0, "messages": [
                {"role": "system", "content": "You configure routers. Think, then call tools."},
                {"role": "user", "content": "Create subinterface 0/0/1.201 for VLAN 201, address it and save."}]},
            prompt_token_ids=list(range(1, 180)), output_token_ids=p_ids, text=text,
            reasoning=reasoning, tool_calls=_openai_calls(CALLS), finish_reason="tool_calls",
            choices=[{"index": 0, "text": text, "token_ids": p_ids, "logprobs": [
                {"token": p_ids[p], "logprob": prim_topk[p][0][1] if prim_topk[p][0][0] == p_ids[p] else
                 dict(map(tuple, prim_topk[p])).get(p_ids[p], -20.0), "top": prim_topk[p]}
                for p in range(tokens)]}],
        )).result()
        store.put_run(Run(
            id=f"{tid}~primary", turn_id=tid, session_id=sid, backend="primary", role="primary",
            mode="recorded", status="ok", capture="topk", approximate=True, method="recorded",
            token_ids=p_ids, text=text, top_logprobs=prim_topk, pieces=primary,
            tool_calls=_openai_calls(CALLS), created_ns=t0 + 2,
        )).result()

        pending: list = []

        def flush(rid: str, start: int, blobs_f) -> None:
            pending.append(store.write_rows(rid, [(start + j, blob) for j, blob in enumerate(blobs_f)]))

        def run_record(b: str, mode: str, ids: list[int], pieces: list[str], topk: list,
                       with_rows: bool) -> None:
            store.put_run(Run(
                id=f"{tid}-{b}-{mode}", turn_id=tid, session_id=sid, backend=b,
                role="secondary" if b == "secondary" else "shadow", mode=mode, status="ok",
                capture="full" if with_rows else "topk", approximate=not with_rows,
                method="forced_decode" if mode == "forced" else "generate",
                token_ids=ids, text="".join(pieces), finish_reason="stop", top_logprobs=topk,
                k=K, created_ns=t0 + 10 + shadow_no[b], error=None,
                rows=({"expected": len(ids), "present": len(ids), "complete": True} if with_rows else None),
            )).result()

        free_rows = {"secondary": True, "fa2": True, "sdpa": True, "fp8": False}
        for b in ("secondary", "fa2", "fp8", "sdpa"):
            extra = forced_extra(b)
            f_topk: list = []
            div = divergences[b]
            share = tokens if div is None else div + 1  # free rows equal to the forced ones
            for s in range(0, tokens, CHUNK):
                e = min(tokens, s + CHUNK)
                x = rows.make(p_ids, s, e, shadow=shadow_no[b], extra=extra)
                f_topk += rows.topk(p_ids, s, e, shadow=shadow_no[b], extra=extra)
                blobs = list(pool.map(encode_row, x))
                info.rows_encoded += len(blobs)
                flush(f"{tid}-{b}-forced", s, blobs)
                info.rows_written += len(blobs)
                if free_rows[b] and s < share:
                    flush(f"{tid}-{b}-free", s, blobs[: share - s])
                    info.rows_written += len(blobs[: share - s])
            run_record(b, "forced", p_ids, primary, f_topk, True)
            # free: the forced rows up to the divergence, then rows of its own tokens
            ids = free_ids[b]
            fr_topk = f_topk[:share]
            if len(ids) > share:
                own: dict[int, list[tuple[int, float]]] = {}
                if b in ("fa2", "sdpa"):  # the near tie where fa2 leaves sdpa
                    other = free_ids["sdpa" if b == "fa2" else "fa2"][d_fa2]
                    own[d_fa2] = [(other, _bf(TOP - 0.12))]
                for s in range(share, len(ids), CHUNK):
                    e = min(len(ids), s + CHUNK)
                    fr_topk += rows.topk(ids, s, e, shadow=shadow_no[b], extra=own)
                    if free_rows[b]:
                        x = rows.make(ids, s, e, shadow=shadow_no[b], extra=own)
                        blobs = list(pool.map(encode_row, x))
                        info.rows_encoded += len(blobs)
                        flush(f"{tid}-{b}-free", s, blobs)
                        info.rows_written += len(blobs)
            run_record(b, "free", ids, free_pieces[b], fr_topk, free_rows[b])
            while pending:
                pending.pop().result()
    info.build_s = time.perf_counter() - t_start
    return info


if __name__ == "__main__":  # a quick look: python -m benchmarks._viewer_store DIR
    import sys

    i = build_long_turn(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tv-viewer-store")
    print({k: v for k, v in i.__dict__.items() if k != "forced_flips"},
          {b: len(v) for b, v in i.forced_flips.items()})
