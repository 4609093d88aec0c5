"""What recording costs per stream, in-process: stripping (on the relay path) and folding into the
turn (in the background), the fast path against the general path in the same run.

    python benchmarks/recording_path.py [--events 32] [--repeat 2000]

The stream is a real response of the fake vLLM-protocol upstream (`tensorverse.testing.fake_upstream`) to
the request the proxy sends: token ids and top-5 logprobs injected, as in `proxy_overhead.py`.
Both paths run over it, cut as it arrives at concurrency 1 (one event per read) and as one
read (events coalesced, as at high concurrency):

  general   each event parsed with orjson, the injected fields nulled for the serialisation
            (`inject.strip_stream`), the dicts folded in (`ChatAccumulator.add_event`)
  fast      the run decoded into typed structs and the injected values cut out of the bytes
            (`inject.strip_run`), the structs folded in, logprobs kept as vLLM wrote them (put in
            the record's shape only when the turn is read: `tensorverse.store.turns`)

Both produce the same relayed JSON and the same turn as readers see it
(tests/proxy/test_fastpath.py); this measures time only. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from benchmarks._targets import finish  # noqa: E402
from tensorverse.proxy import inject  # noqa: E402
from tensorverse.testing.fake_upstream import FakeUpstream  # noqa: E402
from tensorverse.proxy.accumulate import ChatAccumulator  # noqa: E402
from tensorverse.proxy.protocol import CHAT  # noqa: E402

STRIP = {"token_ids": True, "logprobs": "drop"}


async def fetch_stream(events: int) -> bytes:
    fake = await FakeUpstream().start(0)
    try:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "return_token_ids": True, "logprobs": True, "top_logprobs": 5, "return_tokens_as_token_ids": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(fake.url + "/v1/chat/completions", json=body, headers={"X-Fake-Events": str(events)}) as r:
                return await r.read()
    finally:
        await fake.close()


def record(strip, chunks: list[bytes]) -> float:
    """Strip each read with ``strip`` (timed: the relay path) and fold it into a turn; the
    seconds spent on the relay path."""
    acc = ChatAccumulator()
    relay = 0.0
    for c in chunks:
        t = time.perf_counter()
        _out, parsed, _ = strip(CHAT, c, STRIP)
        relay += time.perf_counter() - t
        acc.feed_raw(c, 0.0, parsed)
    acc.result()
    return relay


def general(chunks: list[bytes]) -> float:
    return record(inject.strip_stream, chunks)


def fast(chunks: list[bytes]) -> float:
    return record(inject.strip_run, chunks)


def timed(fn, chunks: list[bytes], repeat: int) -> dict[str, float]:
    for _ in range(max(10, repeat // 10)):
        fn(chunks)
    relay = 0.0
    t = time.perf_counter()
    for _ in range(repeat):
        relay += fn(chunks)
    total = (time.perf_counter() - t) / repeat * 1e6
    return {"total_us": round(total, 1), "relay_us": round(relay / repeat * 1e6, 1),
            "background_us": round(total - relay / repeat * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    stream = asyncio.run(fetch_stream(args.events))
    per_event = [b + b"\n\n" for b in stream.split(b"\n\n") if b]
    out: dict = {"events": args.events, "stream_bytes": len(stream), "load_average": round(os.getloadavg()[0], 2)}
    for cut, chunks in (("per_event", per_event), ("one_read", [stream])):
        g = timed(general, chunks, args.repeat)
        f = timed(fast, chunks, args.repeat)
        out[cut] = {"general": g, "fast": f, "total_ratio": round(f["total_us"] / g["total_us"], 3),
                    "relay_ratio": round(f["relay_us"] / g["relay_us"], 3)}
        print(f"{cut:9s} general {g['total_us']:7.1f} us (relay {g['relay_us']:6.1f})  "
              f"fast {f['total_us']:7.1f} us (relay {f['relay_us']:6.1f})  ratio {out[cut]['total_ratio']}", flush=True)
    return finish("recording_path", out)


if __name__ == "__main__":
    sys.exit(main())
