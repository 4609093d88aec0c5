"""What typed records cost readers: decoding a stored record into its msgspec Struct
(`tensorverse.store.records`) against reading it from the store, and the shadow runner's
`TurnInput.from_dict` (which decodes the turn) per turn.

    python benchmarks/records.py [--messages 40] [--tokens 256] [--top 5] [--repeats 7]

The records are shaped as the writers write them, written to and read back from a real store
(throwaway, on /dev/shm when there is room): a turn with a ``--messages`` message history and
``--tokens`` output tokens with top-``--top`` logprobs in ``choices[0].logprobs``, a forced run with
per-position top-k, and a forced comparison with its per-position metric columns.

Figures (medians over ``--repeats`` rounds, microseconds per record): ``read_us`` (the store's
``get_*``, JSON parse and, for turns, zstd and the logprobs' canonical shape; since the reads
return the typed records, their decode too), ``decode_us`` (``records.<kind>(dict)`` on the stored
dict, as ``Store.records`` gives it), and their ratio ``decode_vs_read``. ``turn_input_us``: the
shadow runner's ``TurnInput.from_dict`` on the stored turn's dict (works with the code before typed records
too, where it lived in ``tensorverse.shadow.runner``: run this file with that tree on PYTHONPATH
for a before/after).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._targets import finish


def _turn(messages: int, tokens: int, top: int) -> dict:
    hist = [{"role": "system", "content": "You are a network automation agent. " * 20}]
    for i in range(messages - 1):
        if i % 3 == 0:
            hist.append({"role": "user", "content": f"check interface Gi0/{i} on core-sw{i % 7}"})
        elif i % 3 == 1:
            hist.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{i}", "type": "function",
                 "function": {"name": "show", "arguments": json.dumps({"cmd": f"show int Gi0/{i}"})}}]})
        else:
            hist.append({"role": "tool", "tool_call_id": f"c{i - 1}", "content": "up/up, 0 errors\n" * 30})
    lps = [{"token": 1000 + t, "logprob": -0.1, "top": [[1000 + t + j, -0.1 - j] for j in range(top)]}
           for t in range(tokens)]
    return {"id": "t1", "session_id": "s1", "index": 0, "endpoint": "chat.completions", "method": "POST",
            "path": "/v1/chat/completions", "backend": "primary", "request_headers": {"content-type": "application/json"},
            "state": "ok", "status": 200, "error": None, "timings": {"ttfb_ms": 20.0, "ttft_ms": 21.0, "total_ms": 900.0},
            "injected": {"logprobs": True}, "retried_without_injection": False, "kind": "main",
            "grouping": {"evidence": "prefix", "score": 3},
            "request": {"model": "qwen3", "messages": hist, "temperature": 0, "max_tokens": 512, "stream": True},
            "model": "qwen3", "stream": True, "tools_offered": True, "prompt_token_ids": list(range(20_000)),
            "output_token_ids": [1000 + t for t in range(tokens)],
            "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": lps}],
            "text": "x" * tokens, "reasoning": None, "tool_calls": [], "finish_reason": "tool_calls",
            "usage": {"prompt_tokens": 20_000, "completion_tokens": tokens}, "response_id": "r1", "events": tokens}


def _run(tokens: int, top: int) -> dict:
    return {"id": "r1", "turn_id": "t1", "session_id": "s1", "backend": "fp8", "role": "shadow", "mode": "forced",
            "status": "ok", "capture": "full", "approximate": False, "method": "forced_decode",
            "token_ids": [1000 + t for t in range(tokens)], "text": "x" * tokens, "finish_reason": "length",
            "top_logprobs": [[[1000 + t + j, -0.1 - j] for j in range(top)] for t in range(tokens)],
            "token_logprobs": [-0.1] * tokens, "k": top, "rows": {"expected": tokens, "present": tokens, "complete": True},
            "timings": {"request_s": 1.0, "total_s": 1.2}, "sampling": {"max_tokens": tokens}, "prompt_tokens": 20_000,
            "attempts": [], "error": None}


def _comparison(tokens: int) -> dict:
    cols = {k: [0.01 * (i % 7) for i in range(tokens)] for k in ("kl", "delta_p", "margin", "entropy")}
    cols.update(top1_agree=[True] * tokens, rank=[0] * tokens, ref_top1=list(range(tokens)), cand_top1=list(range(tokens)))
    return {"run_id": "r1", "ref_run_id": "r0", "turn_id": "t1", "mode": "forced", "kind": "full", "backend": "fp8", "ref_backend": "secondary",
            "role": "shadow", "ref_role": "secondary", "approximate": False, "noise_floor": False, "n": tokens,
            "positions": None, "incomplete": False, "summary": {"kl": {"mean": 0.01}}, "flips": [3, 9],
            "flip_classes": ["runtime", "tie"], "first_flip": 3, "metrics": cols, "regions": ["content"] * tokens,
            "status": "ok"}


def _median_us(fn, n: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--n", type=int, default=50, help="records per round")
    args = ap.parse_args()

    from tensorverse.store import Store

    try:
        from tensorverse.shadow.turn import TurnInput
    except ImportError:  # the tree before the shadow runner was split
        from tensorverse.shadow.runner import TurnInput
    try:
        from tensorverse.store import records
    except ImportError:  # the tree before typed records
        records = None

    base = "/dev/shm" if shutil.disk_usage("/dev/shm").free > 1 << 30 else None
    tmp = Path(tempfile.mkdtemp(prefix="tv-records-", dir=base))
    out: dict = {"benchmark": "records", "messages": args.messages, "tokens": args.tokens, "top": args.top,
                 "typed": records is not None, "load": os.getloadavg()[0]}
    try:
        with Store.open(tmp / "store", durable=False) as store:
            written = ({"id": "s1", "created_ns": 1}, _turn(args.messages, args.tokens, args.top),
                       _run(args.tokens, args.top), _comparison(args.tokens))
            if records is not None:  # the writes take the typed records only
                written = tuple(cls(**d) for cls, d in zip(
                    (records.Session, records.Turn, records.Run, records.ForcedComparison), written))
            session, turn, run, comparison = written
            store.put_session(session).result()
            store.put_turn(turn).result()
            store.put_run(run).result()
            store.put_comparison("r1", "r0", comparison).result()
            reads = {"turn": lambda: store.get_turn("t1"), "run": lambda: store.get_run("r1"),
                     "comparison": lambda: store.get_comparison("r1", "r0")}
            # the stored dicts: what the reads return before typed records, ``Store.records`` since
            # (the reads decode them: their figure includes the decode then)
            stored: dict = {}
            for kind, get in reads.items():
                rec = get()
                stored[kind] = rec if isinstance(rec, dict) else next(iter(store.records(kind)))
            for kind, rec in stored.items():
                read = _median_us(reads[kind], args.n, args.repeats)
                out[f"{kind}_read_us"] = round(read, 1)
                if records is not None:
                    decode = getattr(records, kind)
                    d = _median_us(lambda: decode(rec), args.n, args.repeats)  # noqa: B023 - called in this iteration
                    out[f"{kind}_decode_us"] = round(d, 1)
                    out[f"{kind}_decode_vs_read"] = round(d / read, 3)
            turn = stored["turn"]
            out["turn_input_us"] = round(_median_us(lambda: TurnInput.from_dict(turn), args.n, args.repeats), 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return finish("records", out)


if __name__ == "__main__":
    sys.exit(main())
