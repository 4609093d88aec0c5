"""The soak: N concurrent streaming agents with tool calls through the proxy (its own process,
recording on, 3 shadows run by the real shadow runner) to the fake upstream (its own process).

Used by ``test_soak.py`` (shortened) and ``benchmarks/reliability.py`` (full length). Each agent
runs sessions of two turns (a tool call, then the answer after the tool result) with the real
`openai` client and a think time between turns. A probe alternates the same request direct and
through the proxy (added latency). Afterwards the proxy is stopped with SIGTERM and the store is
read back whole.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from tests.reliability import harness as H

TOOLS = [{"type": "function", "function": {"name": "get_interface", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}}}}}]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def _turn(client: Any, messages: list[dict], tools: int) -> tuple[dict | None, float, float]:
    """One streaming turn: (assistant message or None on failure, ttft s, total s)."""
    t0 = time.perf_counter()
    ttft = 0.0
    text, calls, finish = "", {}, None
    stream = await client.chat.completions.create(model="fake", messages=messages, tools=TOOLS, stream=True,
                                                  extra_headers={"X-Fake-Tools": str(tools)})
    async for chunk in stream:
        if not ttft:
            ttft = time.perf_counter() - t0
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                "function": {"name": "", "arguments": ""}})
                if tc.function and tc.function.name:
                    c["function"]["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    c["function"]["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
    total = time.perf_counter() - t0
    if finish is None or (tools and not calls):
        return None, ttft, total
    msg = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return msg, ttft, total


async def run_load(proxy_url: str, direct_url: str, agents: int, duration_s: float,
                   think_s: tuple[float, float] = (1.0, 3.0)) -> dict[str, Any]:
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=agents + 20, max_keepalive_connections=agents + 20)
    proxied = AsyncOpenAI(base_url=proxy_url + "/v1", api_key=H.CLIENT_KEY, max_retries=0, timeout=60,
                          http_client=httpx.AsyncClient(limits=limits, timeout=60))
    direct = AsyncOpenAI(base_url=direct_url + "/v1", api_key=H.CLIENT_KEY, max_retries=0, timeout=60)
    deadline = time.monotonic() + duration_s
    out: dict[str, Any] = {"ok": 0, "failed": 0, "errors": {}, "turns": 0, "sessions": 0, "totals": [],
                           "probe": {"direct": [], "proxy": [], "direct_ttft": [], "proxy_ttft": []}}
    rng = random.Random(0)

    async def agent(i: int) -> None:
        await asyncio.sleep(rng.uniform(0, think_s[1]))  # staggered start
        while time.monotonic() < deadline:
            out["sessions"] += 1
            messages: list[dict] = [{"role": "user", "content": f"agent {i}: state of Gi0/0/{i % 48}?"}]
            for tools in (1, 0):
                if time.monotonic() >= deadline:
                    return
                try:
                    msg, _, total = await _turn(proxied, messages, tools)
                except Exception as e:  # noqa: BLE001 - counted, the soak goes on
                    msg, total = None, 0.0
                    k = type(e).__name__
                    out["errors"][k] = out["errors"].get(k, 0) + 1
                out["turns"] += 1
                if msg is None:
                    out["failed"] += 1
                    break
                out["ok"] += 1
                out["totals"].append(total)
                messages.append(msg)
                if msg.get("tool_calls"):
                    messages.append({"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                                     "content": '{"status": "up", "mtu": 1500}'})
                await asyncio.sleep(rng.uniform(*think_s))

    async def probe() -> None:
        msgs = [{"role": "user", "content": "probe"}]
        while time.monotonic() < deadline:
            for name, client in (("direct", direct), ("proxy", proxied)):
                try:
                    msg, ttft, total = await _turn(client, msgs, 1)
                except Exception:  # noqa: BLE001 - a probe failure shows as a missing sample
                    continue
                if msg is not None:
                    out["probe"][name].append(total)
                    out["probe"][name + "_ttft"].append(ttft)
            await asyncio.sleep(0.2)

    await asyncio.gather(probe(), *(agent(i) for i in range(agents)))
    await proxied.close()
    await direct.close()
    return out


def memory_trend(samples: list[tuple[float, dict[str, int]]]) -> dict[str, Any]:
    """Heap (``anon``) and mapped-file (``file``) resident memory over the run, in MiB: first,
    middle and last sample, and the heap's growth rate over the second half (MiB per minute; a
    least-squares slope), which is ~0 once every bounded structure is full."""
    if len(samples) < 4:
        return {}
    mid = len(samples) // 2
    half = samples[mid:]
    ts = [t for t, _ in half]
    ys = [m.get("anon", m["rss"]) / 1024 for _, m in half]
    tm, ym = sum(ts) / len(ts), sum(ys) / len(ys)
    den = sum((t - tm) ** 2 for t in ts) or 1.0
    slope = sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / den * 60
    pick = {"start": samples[0][1], "middle": samples[mid][1], "end": samples[-1][1]}
    return {**{f"anon_mb_{k}": round(m.get("anon", 0) / 1024, 1) for k, m in pick.items()},
            **{f"file_mb_{k}": round(m.get("file", 0) / 1024, 1) for k, m in pick.items()},
            "anon_mb_per_min_second_half": round(slope, 2),
            "anon_mb_every_30s": [round(m.get("anon", 0) / 1024) for _, m in samples[::15]],
            "file_mb_every_30s": [round(m.get("file", 0) / 1024) for _, m in samples[::15]]}


def soak(workdir: Path, *, agents: int = 200, duration_s: float = 60.0, think_s: tuple[float, float] = (1.0, 3.0),
         queue_size: int = 256, drain_timeout_s: float = 180.0, max_tracked: int | None = None) -> dict[str, Any]:
    """Run the soak; returns its figures (see the module docstring). Processes are torn down.

    ``max_tracked`` caps the session tracker (`[sessions] max_tracked`, default 10,000) so that a
    run of a few minutes reaches the steady state in which every bounded structure is full."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    fakes = H.Fakes.spawn({"s1": None, "s2": None, "s3": None}, log=workdir / "fakes.log")
    store = workdir / "store"
    cfg = H.proxy_config(fakes.url("primary"), store, shadows={n: fakes.url(n) for n in ("s1", "s2", "s3")},
                         shadow={"queue_size": queue_size, "workers": 4},
                         **({"sessions": {"max_tracked": max_tracked}} if max_tracked else {}))
    for s in cfg["shadows"]:
        s.update(timeout_s=10, concurrency=2)
    proxy = H.ProxyProc(workdir / "proxy", cfg)
    try:
        proxy.start()
        mem_start = proxy.memory_kb()
        rss_start = mem_start["rss"]
        t0 = time.monotonic()
        rss_samples: list[int] = [rss_start]
        mem_samples: list[tuple[float, dict[str, int]]] = [(0.0, mem_start)]

        async def main() -> dict[str, Any]:
            async def sample() -> None:
                while time.monotonic() - t0 < duration_s:
                    await asyncio.sleep(2.0)
                    mem = proxy.memory_kb()
                    rss_samples.append(mem["rss"])
                    mem_samples.append((time.monotonic() - t0, mem))

            load, _ = await asyncio.gather(run_load(proxy.url, fakes.url("primary"), agents, duration_s, think_s),
                                           sample())
            return load

        load = asyncio.run(main())
        wall = time.monotonic() - t0
        rss_end_load = proxy.rss_kb()
        sessions_end = proxy.stats().get("sessions", {})
        st = proxy.wait_shadows_idle(drain_timeout_s)
        rss_end = proxy.rss_kb()
        rc = proxy.terminate(60)
        log = proxy.log()
    finally:
        proxy.stop()
        fakes.close()
    data = H.read_store(store)
    turns = data["turns"]
    probe_turns = len(load["probe"]["proxy"])
    # whole turns ("aborted" with its finish reason: a client that closed right after [DONE])
    complete = [t for t in turns if t.state in ("ok", "aborted") and t.finish_reason
                and t.output_token_ids and t.choices]
    with_runs = [t for t in turns if data["runs"][t.id]]
    sh = st["shadow"]
    runs_per = {}
    for t in with_runs:
        n = sum(1 for r in data["runs"][t.id] if r.backend in ("s1", "s2", "s3"))
        runs_per[n] = runs_per.get(n, 0) + 1
    totals = load["totals"]
    pr = load["probe"]
    return {
        "agents": agents, "duration_s": duration_s, "wall_s": round(wall, 1), "think_s": list(think_s),
        "requests_ok": load["ok"], "requests_failed": load["failed"], "errors": load["errors"],
        "sessions": load["sessions"], "requests_per_s": round((load["ok"] + load["failed"]) / wall, 1),
        "latency_ms": {"p50": round(pct(totals, 50) * 1e3, 1), "p99": round(pct(totals, 99) * 1e3, 1)},
        "probe": {"n": len(pr["proxy"]),
                  "direct_p50_ms": round(pct(pr["direct"], 50) * 1e3, 1),
                  "direct_p99_ms": round(pct(pr["direct"], 99) * 1e3, 1),
                  "proxy_p50_ms": round(pct(pr["proxy"], 50) * 1e3, 1),
                  "proxy_p99_ms": round(pct(pr["proxy"], 99) * 1e3, 1),
                  "added_p50_ms": round((pct(pr["proxy"], 50) - pct(pr["direct"], 50)) * 1e3, 1),
                  "added_p99_ms": round((pct(pr["proxy"], 99) - pct(pr["direct"], 99)) * 1e3, 1),
                  "added_ttft_p99_ms": round((pct(pr["proxy_ttft"], 99) - pct(pr["direct_ttft"], 99)) * 1e3, 1)},
        "rss_kb": {"start": rss_start, "end_of_load": rss_end_load, "after_drain": rss_end, "max": max(rss_samples)},
        "rss_mb_every_30s": [round(x / 1024) for x in rss_samples[::15]],
        "memory": memory_trend(mem_samples),
        "store_mb": round(sum(f.stat().st_size for f in store.glob("*.mdb")) / 2**20, 1),
        "tracked_sessions_end": sessions_end.get("tracked_sessions"),
        "turns_recorded": len(turns), "turns_complete": len(complete),
        "turns_aborted_after_done": sum(t.state == "aborted" for t in complete),
        "turns_expected": load["ok"] + probe_turns,
        "lost_flows": log.count("Cannot write to closing transport"),  # see harness.ProxyProc.lost_flows
        "shadow": {k: sh[k] for k in ("queued", "dropped_queue_full", "skipped", "turns_done", "backend")},
        "turns_with_runs": len(with_runs), "turns_without_runs": len(turns) - len(with_runs),
        "shadow_runs_per_turn": runs_per, "proxy_exit": rc,
        "proxy_stopped_line": next((ln for ln in log.splitlines() if ln.startswith("tensorverse proxy stopped")), None),
        "proxy_recorder": st["recorder"], "proxy_counters": st["proxy"],
    }
