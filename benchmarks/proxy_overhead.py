"""What the recording proxy costs the agent: added TTFT/latency, throughput, CPU per request.

    python benchmarks/proxy_overhead.py [--requests 2000] [--events 32] [--quick]

A fast fake OpenAI-protocol streaming upstream (`tensorverse.testing.fake_upstream`, its own process)
is called, in the same run:
  direct              the upstream itself
  proxy               through the Tensorverse proxy (its own process, on uvloop through
                      `tensorverse.proxy.loop.run`; recording on, store on disk, 3 shadows
                      attached whose runner sleeps 50 ms per turn)
  proxy-no-shadows    the same proxy without shadows (for shadow_slowdown_ratio)
  proxy-top0          the proxy with ``recording.top_logprobs = 0`` (token ids only: what the
                      default top-5 logprobs cost)
  proxy-asgi          the same core and addons as ``proxy`` served as a raw ASGI application by
                      uvicorn (httptools + uvloop; `benchmarks/_asgi.py`) instead of the
                      hand-written server: the server decision of docs/proxy.md
  nginx               through nginx (Debian nginx-light; proxy_buffering off, upstream
                      keepalive), when installed; skipped otherwise
  proxy-baseline      with ``--baseline DIR``: the proxy of another checkout (e.g. ``git worktree
                      add /tmp/base <commit>``), same configuration, same upstream: a before/after
                      in one run (``baseline_*`` keys)
``--upstream-ttft-ms`` makes the upstream wait that long before its first event, as a model
does (default 0: the upstream answers at once, so any work of the proxy's that follows the
forwarded request, session grouping among it, shows in the TTFT).
At concurrency 1 (TTFT and total latency p50/p99, back to back and, as ``*_spaced``, with a pause
of ``--think-ms`` between requests as an agent runs its tool between turns; the targets take
turns in rounds, so that a change of the machine's load affects them alike) and 200 (throughput; in rounds too). The load generator is
aiohttp in this process; it checks every stream after timing it (``check_stream``: HTTP 200, every
event parses, every token's event, ``data: [DONE]`` last): a stream that is not whole is an error,
not a fast request (``errors``, ``invalid_streams``), and any error fails the run. On a small
machine the generator, the upstream and the proxy share the CPU: compare ratios, not absolute
numbers. The targets are those of ``benchmarks/targets.toml`` (exit 1 when one is missed). The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._targets import finish  # noqa: E402
from tensorverse.ports import free_port  # noqa: E402

#: the server decision (docs/proxy.md): uvicorn replaces the hand-written server only if its added
#: TTFT p50 is within this of the hand-written one's, and its c=200 throughput within this ratio
ASGI_TTFT_MARGIN_MS = 0.1
ASGI_THROUGHPUT_MARGIN = 0.05

UPSTREAM = """
import asyncio, sys
from tensorverse.testing.fake_upstream import FakeUpstream
async def main():
    f = await FakeUpstream().start(int(sys.argv[1]))
    f.requests = type("Drop", (), {"append": lambda self, x: None, "__len__": lambda self: 0})()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""

PROXY = """
import asyncio, json, sys
from tensorverse.config import parse_config
from tensorverse.proxy.loop import run
from tensorverse.proxy.server import Proxy, tune_runtime
from tensorverse.proxy.tee import TeeBackend
cfg = parse_config(json.loads(sys.argv[1]))
shadows = int(sys.argv[2])
asgi = len(sys.argv) > 3 and sys.argv[3] == "asgi"
class SlowShadow:
    async def __call__(self, turn, backends, store, *, modes):
        await asyncio.sleep(0.05)
async def main():
    backends = [TeeBackend(f"shadow{i}", f"shadow{i}", concurrency=8, timeout_s=5) for i in range(shadows)]
    p = Proxy(cfg, runner=SlowShadow() if shadows else None, tee_backends=backends)
    if asgi:  # the same proxy, its core served by uvicorn (benchmarks/_asgi.py)
        import _asgi
        async def start_on_uvicorn(host, port):
            await _asgi.serve(p.core, host, port)
            return port
        p.core.start = start_on_uvicorn
    await p.start()
    tune_runtime()  # as `tensorverse proxy` (tensorverse.proxy.server.serve) does
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await p.close()
run(main())  # on uvloop: the proxy's loop (tensorverse.proxy.loop)
"""

NGINX = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fcgi; uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
  upstream up {{ server 127.0.0.1:{up}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""


def spawn(args: list[str], env: dict | None = None, cwd: Path = ROOT) -> subprocess.Popen:
    """Start a helper process (its cwd comes first on ``sys.path`` for ``-c``: the code it runs
    is ``cwd``'s) and wait for its "ready" line."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                         start_new_session=True)
    line = p.stdout.readline().decode() if p.stdout else ""
    if "ready" not in line:
        err = p.stderr.read().decode() if p.stderr else ""
        p.kill()
        raise RuntimeError(f"{args[:3]} did not start: {line} {err[-2000:]}")
    return p


def wait_port(port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    if not xs:  # no request came back whole (the run has failed: see its errors)
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def check_stream(status: int, body: bytes, events: int) -> str | None:
    """Why a chat stream did not arrive whole; None when it did: HTTP 200, every SSE event a
    ``data:`` line whose JSON parses into a chunk, ``events`` content deltas (the fake upstream
    sends one per output token), one ``finish_reason``, and ``data: [DONE]`` last. A proxy that
    cut, dropped or garbled events would otherwise look faster than one that relays them all."""
    if status != 200:
        return f"HTTP {status}"
    if b"\r" in body:
        body = body.replace(b"\r\n", b"\n")
    frames = body.split(b"\n\n")
    if frames[-1].strip():
        return "stream ends inside an event"
    frames = [f for f in frames if f.strip()]
    if not frames or frames[-1].strip() != b"data: [DONE]":
        return "no final data: [DONE]"
    content = finished = 0
    for i, frame in enumerate(frames[:-1]):
        for line in frame.split(b"\n"):
            if not line or line.startswith(b":"):  # an SSE comment
                continue
            if not line.startswith(b"data:"):
                return f"event {i}: not a data line: {line[:60]!r}"
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return f"event {i}: [DONE] before the end"
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError as e:
                return f"event {i}: JSON does not parse ({e})"
            if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
                return f"event {i}: not a chat chunk"
            for ch in chunk["choices"]:
                delta = ch.get("delta") or {}
                content += bool(delta.get("content"))
                finished += ch.get("finish_reason") is not None
    if content != events:
        return f"{content} content events, {events} sent"
    if finished != 1:
        return f"{finished} finish_reason events"
    return None


async def load(url: str, n: int, concurrency: int, events: int, think_s: float = 0.0, first_s: float = 0.0) -> dict:
    """``n`` streamed chat requests at ``concurrency``; every stream is checked (`check_stream`)
    after its timing is taken: ``errors`` counts the requests that failed or arrived incomplete,
    ``invalid`` those of them that came back with a stream that is not whole."""
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    headers = {"Content-Type": "application/json", "X-Fake-Events": str(events), "Authorization": "Bearer bench",
               "X-Fake-First-Delay": str(first_s)}
    ttft: list[float] = []
    total: list[float] = []
    errors = invalid = 0
    why: list[str] = []
    conn = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        todo = iter(range(n))

        async def worker() -> None:
            nonlocal errors, invalid
            for _ in todo:
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                        first = None
                        chunks = []
                        async for chunk in r.content.iter_any():
                            if first is None:
                                first = time.perf_counter()
                            chunks.append(chunk)
                        status = r.status
                    t1 = time.perf_counter()
                    bad = check_stream(status, b"".join(chunks), events)
                    if bad is not None:
                        errors += 1
                        invalid += status == 200
                        if len(why) < 3:
                            why.append(bad)
                        continue
                    ttft.append(((first or t1) - t0) * 1000)
                    total.append((t1 - t0) * 1000)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    errors += 1
                    if len(why) < 3:
                        why.append(f"{type(e).__name__}: {e}")
                if think_s:
                    await asyncio.sleep(think_s)

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t
    return {"n": len(total), "errors": errors, "invalid": invalid, "why": why, "rps": len(total) / wall,
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "total_p50": pct(total, 0.5), "total_p99": pct(total, 0.99),
            "ttft": ttft, "total": total}


def pooled(runs: list[dict]) -> dict:
    """Several c=1 runs of one target as one."""
    ttft = [x for r in runs for x in r["ttft"]]
    total = [x for r in runs for x in r["total"]]
    return {"n": len(total), "errors": sum(r["errors"] for r in runs), "invalid": sum(r["invalid"] for r in runs),
            "why": [w for r in runs for w in r["why"]][:3], "ttft_p50": pct(ttft, 0.5),
            "ttft_p99": pct(ttft, 0.99), "total_p50": pct(total, 0.5), "total_p99": pct(total, 0.99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per concurrency-200 run")
    ap.add_argument("--latency-requests", type=int, default=400, help="requests per concurrency-1 run")
    ap.add_argument("--events", type=int, default=32, help="SSE events per stream")
    ap.add_argument("--rounds", type=int, default=8, help="c=1 runs are split into this many interleaved rounds")
    ap.add_argument("--throughput-rounds", type=int, default=4, help="the same for the c=200 runs")
    ap.add_argument("--think-ms", type=float, default=5.0,
                    help="pause between requests of the spaced c=1 runs (added_ttft_p50_ms_spaced)")
    ap.add_argument("--upstream-ttft-ms", type=float, default=0.0,
                    help="the upstream's time to first event, as a model's (default 0)")
    ap.add_argument("--quick", action="store_true", help="small runs (smoke test)")
    ap.add_argument("--baseline", type=Path, help="another checkout whose proxy runs as one more target")
    ap.add_argument("--no-asgi", action="store_true", help="skip the uvicorn (ASGI) target")
    args = ap.parse_args()
    if args.baseline is not None and not (args.baseline / "tensorverse" / "proxy" / "server.py").is_file():
        ap.error(f"--baseline {args.baseline}: not a Tensorverse checkout (no tensorverse/proxy/server.py)")
    if args.quick:
        args.requests, args.latency_requests = 300, 100
    tmp = Path(tempfile.mkdtemp(prefix="tv-bench-"))
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        up_port = free_port()
        procs.append(spawn([sys.executable, "-c", UPSTREAM, str(up_port)], env))
        upstream = f"http://127.0.0.1:{up_port}"
        targets: dict[str, tuple[str, int | None]] = {"direct": (upstream, None)}
        proxies = [("proxy", 3, ROOT, {}), ("proxy-no-shadows", 0, ROOT, {}),
                   ("proxy-top0", 3, ROOT, {"recording": {"top_logprobs": 0}})]
        if not args.no_asgi:
            proxies.append(("proxy-asgi", 3, ROOT, {}))
        if args.baseline is not None:
            proxies.append(("proxy-baseline", 3, args.baseline.resolve(), {}))
        for name, shadows, tree, extra in proxies:
            port, admin = free_port(), free_port()
            cfg = {"proxy": {"listen": f"127.0.0.1:{port}"}, "admin": {"listen": f"127.0.0.1:{admin}"},
                   "primary": {"url": upstream}, "store": {"path": str(tmp / name), "durable": False},
                   "shadow": {"queue_size": 4096, "workers": 16}, **extra}
            pythonpath = f"{tree}:{ROOT / 'benchmarks'}" if name == "proxy-asgi" else str(tree)
            p = spawn([sys.executable, "-c", PROXY, json.dumps(cfg), str(shadows)]
                      + (["asgi"] if name == "proxy-asgi" else []),
                      {**env, "PYTHONPATH": pythonpath}, cwd=tree)
            procs.append(p)
            targets[name] = (f"http://127.0.0.1:{port}", p.pid)
        nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
        if nginx:
            port = free_port()
            (tmp / "nginx.conf").write_text(textwrap.dedent(NGINX.format(dir=tmp, up=up_port, port=port)))
            p = subprocess.Popen([nginx, "-c", str(tmp / "nginx.conf"), "-p", str(tmp)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
            procs.append(p)
            wait_port(port)
            targets["nginx"] = (f"http://127.0.0.1:{port}", None)  # CPU: its worker is a child

        load_avg = os.getloadavg()[0]
        if load_avg > (os.cpu_count() or 1):
            print(f"warning: load average {load_avg:.1f} on {os.cpu_count()} CPUs: figures will be noisy", flush=True)
        results: dict[str, dict] = {}
        first_s = args.upstream_ttft_ms / 1000
        # c=1 (latency): the targets take turns, in rounds, so that a change of the machine's
        # load in the meantime (other processes) affects them alike; then each at c=200.
        rounds = max(1, min(args.rounds, args.latency_requests))
        c1_runs: dict[str, list[dict]] = {name: [] for name in targets}
        spaced_runs: dict[str, list[dict]] = {name: [] for name in targets}
        warm: dict[str, dict] = {}
        for name, (url, _pid) in targets.items():
            warm[name] = asyncio.run(load(url, 50, 8, args.events, first_s=first_s))  # warm up (checked too)
        for _ in range(rounds):
            for name, (url, _pid) in targets.items():
                c1_runs[name].append(asyncio.run(load(url, args.latency_requests // rounds, 1, args.events, first_s=first_s)))
                # the same with a pause between requests, as an agent runs its tool between turns:
                # the proxy has finished recording the previous turn when the next one arrives
                spaced_runs[name].append(asyncio.run(load(url, args.latency_requests // rounds, 1, args.events,
                                                          think_s=args.think_ms / 1000, first_s=first_s)))
        # c=200 (throughput): in rounds too (throughput = requests / time over a target's rounds)
        c200_rounds = max(1, min(args.throughput_rounds, args.requests // 200))
        done = {name: {"n": 0, "errors": 0, "invalid": 0, "why": [], "wall": 0.0, "cpu": 0.0} for name in targets}
        for _ in range(c200_rounds):
            for name, (url, pid) in targets.items():
                cpu0 = cpu_ms(pid) if pid else 0.0
                r = asyncio.run(load(url, args.requests // c200_rounds, 200, args.events, first_s=first_s))
                acc = done[name]
                acc["cpu"] += (cpu_ms(pid) - cpu0) if pid else 0.0
                acc["n"] += r["n"]
                acc["errors"] += r["errors"]
                acc["invalid"] += r["invalid"]
                acc["why"] += r["why"]
                acc["wall"] += r["n"] / r["rps"] if r["rps"] else 0.0
        for name, (_url, pid) in targets.items():
            c1 = pooled(c1_runs[name])
            acc = done[name]
            c200 = {"n": acc["n"], "errors": acc["errors"], "invalid": acc["invalid"], "why": acc["why"][:3],
                    "rps": acc["n"] / acc["wall"] if acc["wall"] else 0.0}
            cpu = acc["cpu"] / max(1, acc["n"]) if pid else None
            results[name] = {"c1": c1, "c1_spaced": pooled(spaced_runs[name]), "c200": c200, "cpu_ms_per_request": cpu,
                             "warm": warm[name]}
            print(f"{name:17s} c=1 ttft p50 {c1['ttft_p50']:.3f} ms p99 {c1['ttft_p99']:.3f} ms "
                  f"(spaced {results[name]['c1_spaced']['ttft_p50']:.3f}), total p50 "
                  f"{c1['total_p50']:.3f} ms | c=200 {c200['rps']:.0f} req/s (errors {c200['errors']})"
                  + (f" | cpu {cpu:.2f} ms/req" if cpu is not None else ""), flush=True)

        d, p, ps = results["direct"], results["proxy"], results["proxy-no-shadows"]

        def added(name: str, key: str = "c1") -> float:
            return results[name][key]["ttft_p50"] - d[key]["ttft_p50"]

        def vs_nginx(name: str) -> dict:
            """The targets of docs/proxy.md: added TTFT over nginx's (<= 0.5 ms) and throughput
            at c=200 as a fraction of nginx's (>= 0.6), both in this run."""
            if "nginx" not in results:
                return {"added_ttft_vs_nginx_ms": None, "added_ttft_vs_nginx_ms_spaced": None,
                        "throughput_vs_nginx_c200": None}
            n = results["nginx"]
            return {"added_ttft_vs_nginx_ms": round(added(name) - added("nginx"), 3),
                    "added_ttft_vs_nginx_ms_spaced": round(added(name, "c1_spaced") - added("nginx", "c1_spaced"), 3),
                    "throughput_vs_nginx_c200": round(results[name]["c200"]["rps"] / n["c200"]["rps"], 3)}

        asgi: dict = {}
        if "proxy-asgi" in results:
            a = results["proxy-asgi"]
            ttft_gap = added("proxy-asgi") - added("proxy")
            tput = a["c200"]["rps"] / p["c200"]["rps"]
            cpu = a["cpu_ms_per_request"] / p["cpu_ms_per_request"]
            asgi = {"asgi_added_ttft_p50_ms": round(added("proxy-asgi"), 3),
                    "asgi_throughput_ratio_c200": round(a["c200"]["rps"] / d["c200"]["rps"], 3),
                    "asgi_cpu_ms_per_request": round(a["cpu_ms_per_request"], 3),
                    "asgi_minus_handwritten_ttft_p50_ms": round(ttft_gap, 3),
                    "asgi_over_handwritten_throughput_c200": round(tput, 3),
                    "asgi_over_handwritten_cpu_per_request": round(cpu, 3),
                    # CPU per request is the capacity that wall-clock throughput shows only on an
                    # idle machine: on a loaded one, whoever gets the cores wins the round
                    "server_decision": "uvicorn" if ttft_gap <= ASGI_TTFT_MARGIN_MS
                    and tput >= 1 - ASGI_THROUGHPUT_MARGIN and cpu <= 1 + ASGI_THROUGHPUT_MARGIN
                    else "hand-written"}
        out = {
            "events_per_stream": args.events,
            "upstream_ttft_ms": args.upstream_ttft_ms,
            "added_ttft_p50_ms": round(p["c1"]["ttft_p50"] - d["c1"]["ttft_p50"], 3),
            "added_ttft_p99_ms": round(p["c1"]["ttft_p99"] - d["c1"]["ttft_p99"], 3),
            "added_total_p50_ms": round(p["c1"]["total_p50"] - d["c1"]["total_p50"], 3),
            "added_total_p99_ms": round(p["c1"]["total_p99"] - d["c1"]["total_p99"], 3),
            "added_ttft_p50_ms_spaced": round(p["c1_spaced"]["ttft_p50"] - d["c1_spaced"]["ttft_p50"], 3),
            "added_ttft_p99_ms_spaced": round(p["c1_spaced"]["ttft_p99"] - d["c1_spaced"]["ttft_p99"], 3),
            "throughput_ratio_c200": round(p["c200"]["rps"] / d["c200"]["rps"], 3),
            "nginx_throughput_ratio_c200": round(results["nginx"]["c200"]["rps"] / d["c200"]["rps"], 3)
            if "nginx" in results else None,
            "nginx_added_ttft_p50_ms": round(results["nginx"]["c1"]["ttft_p50"] - d["c1"]["ttft_p50"], 3)
            if "nginx" in results else None,
            "nginx_added_ttft_p50_ms_spaced": round(results["nginx"]["c1_spaced"]["ttft_p50"] - d["c1_spaced"]["ttft_p50"], 3)
            if "nginx" in results else None,
            "cpu_ms_per_request": round(p["cpu_ms_per_request"], 3),
            "shadow_slowdown_ratio": round(p["c1"]["total_p50"] / ps["c1"]["total_p50"], 3),
            "direct_rps_c200": round(d["c200"]["rps"], 1),
            **vs_nginx("proxy"),
            **{f"{k}_top0": v for k, v in vs_nginx("proxy-top0").items()},
            "added_ttft_p50_ms_top0": round(added("proxy-top0"), 3),
            "throughput_ratio_c200_top0": round(results["proxy-top0"]["c200"]["rps"] / d["c200"]["rps"], 3),
            **asgi,
            **({"baseline_throughput_ratio_c200": round(results["proxy-baseline"]["c200"]["rps"] / d["c200"]["rps"], 3),
                "baseline_cpu_ms_per_request": round(results["proxy-baseline"]["cpu_ms_per_request"], 3),
                "baseline_added_ttft_p50_ms": round(results["proxy-baseline"]["c1"]["ttft_p50"] - d["c1"]["ttft_p50"], 3),
                "baseline_added_ttft_p50_ms_spaced": round(results["proxy-baseline"]["c1_spaced"]["ttft_p50"]
                                                           - d["c1_spaced"]["ttft_p50"], 3)}
               if "proxy-baseline" in results else {}),
            "load_average": round(load_avg, 2),
            "errors": sum(r[k]["errors"] for r in results.values() for k in ("warm", "c1", "c1_spaced", "c200")),
            "invalid_streams": sum(r[k]["invalid"] for r in results.values() for k in ("warm", "c1", "c1_spaced", "c200")),
            "errors_by_target": {n: {"errors": sum(r[k]["errors"] for k in ("warm", "c1", "c1_spaced", "c200")),
                                     "why": [w for k in ("warm", "c1", "c1_spaced", "c200") for w in r[k]["why"]][:3]}
                                 for n, r in results.items()
                                 if any(r[k]["errors"] for k in ("warm", "c1", "c1_spaced", "c200"))},
        }
        return finish("proxy_overhead", out)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
