"""What ``tensorverse replay`` costs over sending the same requests yourself.

    python benchmarks/replay.py [--cases 24] [--turns 3] [--tokens 64] [--concurrency 4]
                                [--ms-per-token 5] [--repeats 3] [--quick]

Same corpus, same backends, same concurrency, in the same run:

  direct   the requests replay sends, built with the runner's own body builders and sent with the
           runner's own client (one aiohttp session, ``tensorverse.shadow.client.BackendClient``;
           the ``openai`` client until 2026-12-02): per turn the reference's free run (the basis), then
           every backend's forced run and every other backend's free run at once; the turns of a
           case in order; ``--concurrency`` cases and requests per backend in flight
  replay   ``tensorverse.replay.runner.replay`` on the corpus (top-k capture: no capture writes),
           which also probes each backend (capabilities, tokenizer, ``doctor``), stores every run,
           compares every turn, journals every case and builds the results

``wall_ratio`` = median replay wall time / median direct wall time (target <= 1.1).

The backends are fake vLLM servers (``tensorverse/testing/fake_vllm.py``: vLLM's completions
protocol with the capture plugin's forcing, ``/tokenize``, ``/version``), three of them (``ref``, ``same``,
``cand`` with perturbed logits) in one separate process. ``testing/fake_upstream.py`` is not used: it ignores
forcing, so forced runs would take the scoring fallback and not send the same requests. The model's
time is emulated by ``--ms-per-token`` of sleep per generated token on the completions endpoint
only (5 ms: a small model on one GPU; 0 measures the pure overhead, with no model time at all).
Everything shares the machine's CPUs: compare the ratio, not absolute times. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, and its tests package

from benchmarks._targets import finish  # noqa: E402

SERVERS = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[2])
from tensorverse.testing.fake_vllm import FakeVLLM
MS = float(sys.argv[1]) / 1000.0

class Timed(FakeVLLM):
    # the model's time: MS per generated token, on completions only
    async def h_completions(self, request):
        resp = await super().h_completions(request)
        try:
            n = len(json.loads(resp.body)["choices"][0].get("token_ids") or [])
        except Exception:
            n = 0
        if MS:
            await asyncio.sleep(MS * n)
        self.requests.clear()  # keep memory flat
        return resp

async def main():
    # vocab 60: the fake's tool-call tags (ids 60-63) never come out, so no branch leaves the
    # recorded path and replay sends exactly the requests that `direct` sends
    fakes = {"ref": Timed(vocab=60), "same": Timed(vocab=60), "cand": Timed(vocab=60, perturb=2.0)}
    for f in fakes.values():
        await f.start()
    print(json.dumps({k: f.url for k, f in fakes.items()}), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def make_corpus(path: Path, cases: int, turns: int, tokens: int, prompt: int) -> Path:
    """Synthetic multi-turn cases in the fake's 64-token vocabulary (the recorded outputs are
    arbitrary: replay re-runs the reference for the basis anyway)."""
    import random

    from tensorverse.replay.corpus import write_corpus

    rnd = random.Random(7)
    out = []
    for c in range(cases):
        ctx = [rnd.randrange(2, 58) for _ in range(prompt)]
        tl = []
        for t in range(turns):
            rec = [rnd.randrange(2, 58) for _ in range(tokens)]
            tl.append({"index": t, "endpoint": "completions", "messages": None, "tools": None,
                       "sampling": {"temperature": 0, "max_tokens": tokens}, "prompt_token_ids": list(ctx),
                       "reference": {"backend": "ref", "output_token_ids": rec, "text": None,
                                     "tool_calls": None, "finish_reason": "length"},
                       "tool_results": []})
            ctx = ctx + rec + [rnd.randrange(2, 58) for _ in range(16)]
        out.append({"format": "tensorverse.case", "format_version": 1, "id": f"bench{c:03d}",
                    "tokenizer": {"fingerprint": None}, "turns": tl,
                    "provenance": {"source": "benchmark", "reference_backend": "ref", "scrubbed": True}})
    return write_corpus(path, out, tokenizer={"fingerprint": None}, name="bench")


def _backends(urls: dict[str, str], concurrency: int) -> list[Any]:
    from tensorverse.shadow import Backend

    return [Backend(n, u, "fake-model", capture="topk", logprobs=5, concurrency=concurrency)
            for n, u in urls.items()]


async def direct(corpus: Any, urls: dict[str, str], concurrency: int) -> float:
    """The same requests with the client the replay runner uses (one shared aiohttp session,
    ``tensorverse.shadow.client.BackendClient``, as ``tensorverse.shadow.runner`` builds it), the
    same dependencies and concurrency. (Before 2026-12-02 this baseline used the ``openai``
    client, whose own CPU per request, httpx plus pydantic, made the replay look faster.)"""
    import aiohttp

    from tensorverse.replay.runner import case_turn_input
    from tensorverse.shadow.client import BackendClient
    from tensorverse.shadow.completions import forced_body, free_body
    from tensorverse.shadow.turn import TurnInput

    backends = _backends(urls, concurrency)
    session = aiohttp.ClientSession()
    clients = {b.name: BackendClient(b, session) for b in backends}
    sems = {b.name: asyncio.Semaphore(concurrency) for b in backends}

    async def send(b: Any, body: dict[str, Any]) -> dict[str, Any]:
        async with sems[b.name]:
            return await clients[b.name].completions(body)

    ref, others = backends[0], backends[1:]

    async def one(case: dict[str, Any]) -> None:
        for turn in case["turns"]:
            t = TurnInput.from_dict(case_turn_input(case, turn))
            got = await send(ref, free_body(t, ref, "x", capture=False))
            t.output_token_ids = list(got["choices"][0]["token_ids"])
            await asyncio.gather(*(send(b, forced_body(t, b, "x", capture=False)) for b in backends),
                                 *(send(b, free_body(t, b, "x", capture=False)) for b in others))

    cases = asyncio.Semaphore(concurrency)

    async def gated(c: dict[str, Any]) -> None:
        async with cases:
            await one(c)

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(gated(c) for c in corpus.cases))
        wall = time.perf_counter() - t0
    finally:
        await session.close()
    return wall


async def replayed(corpus: Any, urls: dict[str, str], concurrency: int) -> tuple[float, dict[str, Any]]:
    from tensorverse.replay.options import ReplayOptions
    from tensorverse.replay.runner import replay

    opts = ReplayOptions(backends=_backends(urls, concurrency), reference="ref", concurrency=concurrency,
                         progress=False, check_tokenizer=False)
    t0 = time.perf_counter()
    res = await replay(corpus, opts)
    return time.perf_counter() - t0, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per turn")
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens of a case's first turn")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--ms-per-token", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8 cases, 2 repeats")
    a = ap.parse_args()
    if a.quick:
        a.cases, a.repeats = 8, 2
    from tensorverse.replay.corpus import load_corpus

    with tempfile.TemporaryDirectory(prefix="tv-bench-replay-") as tmp:
        corpus = load_corpus(make_corpus(Path(tmp) / "corpus", a.cases, a.turns, a.tokens, a.prompt))
        proc = subprocess.Popen([sys.executable, "-c", SERVERS, str(a.ms_per_token), str(ROOT)],
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            urls = json.loads(proc.stdout.readline())
            asyncio.run(direct(corpus, urls, a.concurrency))  # warm-up (connections, imports)
            d_walls, r_walls = [], []
            res: dict[str, Any] = {}
            for _ in range(a.repeats):  # interleaved, so load changes hit both alike
                d_walls.append(asyncio.run(direct(corpus, urls, a.concurrency)))
                w, res = asyncio.run(replayed(corpus, urls, a.concurrency))
                r_walls.append(w)
        finally:
            proc.terminate()
            proc.wait(10)
    errors = sum(s.get("errors", 0) for s in res["summary"].values())
    branches = {n: s.get("branches") for n, s in res["summary"].items()}
    if any(set(b or {}) - {"completed"} for b in branches.values()):
        raise SystemExit(f"a branch left the recorded path, so the requests differ: {branches}")
    requests = a.cases * a.turns * (1 + 3 + 2)
    d, r = statistics.median(d_walls), statistics.median(r_walls)
    out = {
        "benchmark": "replay", "cases": a.cases, "turns": a.turns, "tokens": a.tokens,
        "concurrency": a.concurrency, "ms_per_token": a.ms_per_token, "requests_per_run": requests,
        "direct_s": round(d, 3), "replay_s": round(r, 3), "wall_ratio": round(r / d, 3),
        "overhead_ms_per_request": round((r - d) / requests * 1000, 2),
        "direct_runs_s": [round(x, 3) for x in d_walls], "replay_runs_s": [round(x, 3) for x in r_walls],
        "replay_errors": errors, "load_avg": list(os.getloadavg()),
        "cpus": os.cpu_count(), "direct_client": "aiohttp (BackendClient), as the runner",
    }
    return finish("replay", out)


if __name__ == "__main__":
    sys.exit(main())
