"""The proxy at production rates: three shadows at Qwen3's vocabulary behind the real proxy, the
offered load stepped up to saturation, full capture against evidence at the source in one run.

    python benchmarks/production_load.py [--quick] [--secondary] [--levels 1,2,4,8] [--seconds 15]

What runs, each in its own process:

* the primary: :class:`~tensorverse.testing.fake_upstream.FakeUpstream` (a streaming chat model:
  ``--first-ms`` to its first token, ``--tokens`` output tokens ``--token-ms`` apart), recording
  the top logprobs of the model the shadows stand for (its close calls), with its ``/tokenize``;
* three shadows: :class:`~tensorverse.testing.fake_engine.FakeEngine` with ``agree_base`` rows at
  151,936 ids (the primary's tokens are their argmax; near ties at a seeded 4 % of positions, where
  a runtime flips or not: with 48-token turns the ties fall at positions 19, 39 and 46, and shadow-2
  and shadow-3 flip at all three, shadow-1 at none: 2.1 % of a turn's rows are flips), speaking the
  capture plugin's protocol: forced and free runs with the plugin's ``vllm_xargs``, rows through
  the real :class:`~tensorverse.capture.tap.Tap` (the reduction at the source included) to the
  proxy's ``/ingest``. With ``--secondary``, shadow-1 (the primary's runtime: it flips nowhere) is
  the line-up's secondary, the reference lane the other shadows' forced runs are compared against
  too, as in the demo and a typical deployment; by default the line-up has none;
* the proxy: ``python -m tensorverse proxy --config FILE``
  (:class:`~tensorverse.testing.proxy_process.ProxyProc`), as a user starts it (``[capture]
  per_minute = 0``: every turn is shadowed, forced and free, on all three shadows; an analysis
  worker process and the ingest worker process);
* the agents: this process, ``c`` concurrent streams (each checked whole), ``c`` stepped through
  ``--levels``.

Per level: the proxy's own CPU-seconds (its process and its workers, analysis and ingest; the
engines and the primary share the machine, so a rate per wall second would measure the machine),
``shadowed_tokens`` (output tokens of the turns the tee finished: a turn run on three shadows,
forced and free, counts its tokens once), the bytes the plugins posted, the primary's TTFT p99,
shadow turns shed (the tee's queue was full: counted), the proxy's memory. The level is run until its
shadow backlog has drained, so the CPU it took is all in the window. Past saturation the proxy
also relays (and records) turns the tee shed; their cost is not shadow work, so the rate is taken
net of it, at the CPU a turn cost the proxy without shadows in the same run
(``relay_cpu_ms_per_turn``, from the detached rounds below): the shadowed turns' own relays stay
in, so it is what one core gives with every turn shadowed (``gross_...``: the rate on all the
proxy's CPU, kept beside it).

Figures (``targets.toml``): ``shadowed_tokens_per_s_per_core`` at the highest level with evidence
at the source; ``wire_bytes_per_shadowed_token`` against ``full_wire_bytes_per_shadowed_token``
(full capture, same levels, same run); ``primary_ttft_p99_ratio``: the agents' TTFT p99 at the
highest level with the shadows attached and saturated against a second proxy without shadows on
the same machine at the same time, in alternating rounds (the engines stay busy with the first
one's backlog, so the ratio measures what the shadow work does to the relay in its process, not the
machine); ``rows_lost_silently``: rows the taps captured that are neither stored nor counted as
dropped anywhere (target 0); ``heap_growth_ratio``: the proxy's anonymous memory (``RssAnon``: the
heap, what a leak grows; the store's LMDB map is file pages the kernel can drop) at the end over
after the first level. ``turn_length``: evidence at the source run once more at one level (2
agents) with turns of ``--long-tokens``: the proxy's CPU per shadowed token with short and with
long turns (:func:`turn_length`). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._targets import finish  # noqa: E402
from benchmarks.proxy_overhead import check_stream, cpu_ms, pct, spawn  # noqa: E402
from tensorverse.ports import free_port  # noqa: E402
from tensorverse.testing.proxy_process import ProxyProc, proxy_config  # noqa: E402

VOCAB = 151_936
TOKEN_BASE = 1000  # the primary's token i is TOKEN_BASE + i (FakeUpstream), the shadows' argmax
PROMPT_IDS = list(range(20_000, 20_300))  # a 300-token prompt
SHADOWS = ("shadow-1", "shadow-2", "shadow-3")
ADMIN_TOKEN = "production-load-admin-token"  # the proxy's admin API and /ingest

PRIMARY = """
import asyncio, functools, json, sys
from tensorverse.testing.fake_engine import FakeEngine
from tensorverse.testing.fake_upstream import FakeUpstream
base, prompt = int(sys.argv[1]), json.loads(sys.argv[2])
# the model the shadows stand for, at the primary's runtime (0: no flips): its dictionary
# (/tokenize, /detokenize) and its top logprobs, so the primary records the close calls they meet
d = FakeEngine(vocab=int(sys.argv[4]), agree_base=base, prompt_ids=prompt)

@functools.lru_cache(maxsize=4096)
def tops(i, k):
    return d.top_logprobs(prompt, [base + j for j in range(i)], max(k, 1))

class Primary(FakeUpstream):
    def _chat_lp(self, i, top, as_ids):
        pairs = tops(i, top or 1)
        name = lambda t: f"token_id:{t}" if as_ids else d.piece(t)
        return {"token": name(pairs[0][0]), "logprob": pairs[0][1], "bytes": [116],
                "top_logprobs": [{"token": name(t), "logprob": lp, "bytes": [116]} for t, lp in pairs[: top or 0]]}

async def main():
    f = await Primary(token_base=base, prompt_ids=prompt, tokenizer=d).start(int(sys.argv[3]))
    f.requests = type("Drop", (), {"append": lambda self, x: None, "__len__": lambda self: 0})()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""

ENGINES = """
import asyncio, json, sys
from tensorverse.testing.fake_engine import FakeEngine
cfg = json.loads(sys.argv[1])
async def main():
    engines = []
    for i, name in enumerate(cfg["names"]):
        engines.append(await FakeEngine(sink=cfg["sink"], vocab=cfg["vocab"], agree_base=cfg["base"],
                                        runtime=i + 1, step_s=cfg["step_s"], model=name, seed=0,
                                        max_rows=cfg["max_rows"], prompt_ids=cfg["prompt"]).start())
    print("ready", json.dumps({e.model: e.port for e in engines}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().split():
        if line[0] == "stats":
            for e in engines:
                await asyncio.to_thread(e.flush, 60)
            print(json.dumps({e.model: e.tap.stats() for e in engines}), flush=True)
    for e in engines:
        await e.close()
asyncio.run(main())
"""


@contextlib.contextmanager
def primary() -> Iterator[str]:
    """The fake primary in its own process; its URL."""
    port = free_port()
    proc = spawn([sys.executable, "-c", textwrap.dedent(PRIMARY), str(TOKEN_BASE), json.dumps(PROMPT_IDS), str(port),
                  str(VOCAB)])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


class Engines:
    """The three shadow engines in their own process; ``stats`` (over stdin) flushes their taps and
    answers their counters."""

    def __init__(self, sink: str, token: str, step_s: float, log: Path) -> None:
        cfg = {"names": list(SHADOWS), "sink": sink, "vocab": VOCAB, "base": TOKEN_BASE, "step_s": step_s,
               "max_rows": 4096, "prompt": PROMPT_IDS}
        env = {**os.environ, "TENSORVERSE_CAPTURE_TOKEN": token, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINES, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(log, "ab"), env=env, cwd=ROOT,
                                     start_new_session=True, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("ready"):
            raise RuntimeError(f"engines did not start: {line!r} (rc {self.proc.poll()})")
        self.ports: dict[str, int] = json.loads(line.split(" ", 1)[1])

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stats(self) -> dict[str, dict[str, Any]]:
        return json.loads(self.ask("stats"))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def family_cpu_ms(pid: int) -> float:
    """CPU of ``pid`` and every living descendant (the proxy's fork server and its workers)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_ms(p)
        except OSError:
            continue
        todo += kids.get(p, [])
    return total


async def agents(url: str, seconds: float, concurrency: int, tokens: int, first_s: float,
                 token_s: float) -> dict[str, Any]:
    """``concurrency`` agents streaming chat turns with tools for ``seconds``; every stream is
    checked whole (``check_stream``)."""
    headers = {"Content-Type": "application/json", "X-Fake-Events": str(tokens), "Authorization": "Bearer bench",
               "X-Fake-First-Delay": str(first_s), "X-Fake-Delay": str(token_s)}
    tools = [{"type": "function", "function": {"name": "show_interface", "parameters": {"type": "object"}}}]
    ttft: list[float] = []
    errors: list[str] = []
    n = 0
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def agent(a: int) -> None:
            nonlocal n
            k = 0
            while time.monotonic() < deadline:
                k += 1
                body = json.dumps({"model": "fake", "stream": True, "tools": tools, "max_tokens": tokens,
                                   "messages": [{"role": "user", "content": f"agent {a} turn {k} {time.time_ns()}"}]})
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                        first, chunks = None, []
                        async for chunk in r.content.iter_any():
                            if first is None:
                                first = time.perf_counter()
                            chunks.append(chunk)
                        bad = check_stream(r.status, b"".join(chunks), tokens)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    bad = f"{type(e).__name__}: {e}"
                if bad is not None:
                    errors.append(bad)
                    continue
                ttft.append(((first or time.perf_counter()) - t0) * 1000)
                n += 1

        await asyncio.gather(*(agent(a) for a in range(concurrency)))
    return {"turns": n, "errors": len(errors), "why": errors[:3], "ttft_ms": ttft}


def flipped_comparisons(store_path: Path) -> dict[str, Any]:
    """Comparisons in the store (read-only, after the proxy stopped) that found a flip, and per
    compared turn: the engines flip the same positions of every turn (the turns' tokens are the
    same), so the rate is the same in both modes when the numbers are, whatever number of turns
    each shadowed (the evidence proxy also shadows during the TTFT rounds)."""
    from tensorverse.store import Store
    from tensorverse.store.records import ForcedComparison

    st = Store.open(store_path, readonly=True)
    try:
        turns = flipped = 0
        for ses in st.iter_sessions():
            for t in st.iter_turns(ses.id):
                cmps = [c for r in st.iter_runs(t.id) for c in st.iter_comparisons(r.id)]
                turns += bool(cmps)
                flipped += sum(1 for c in cmps if isinstance(c, ForcedComparison) and c.flips)
        return {"flipped": flipped, "turns": turns, "per_turn": round(flipped / turns, 4) if turns else None}
    finally:
        st.close()


def run_mode(mode: str, levels: list[int], seconds: float, a: argparse.Namespace, work: Path,
             primary_url: str, *, detached: bool = True, sections: dict[str, Any] | None = None) -> dict[str, Any]:
    """One proxy (``[capture] logits = mode``) through every level; a row of figures per level.
    With ``detached`` (evidence only) the agents then alternate, in rounds at the highest level,
    between this proxy and a second one without shadows (``primary_ttft_p99_ratio``)."""
    admin_port = free_port()
    engines = Engines(f"http://127.0.0.1:{admin_port}/ingest", ADMIN_TOKEN, a.engine_step_ms / 1000,
                      work / f"engines-{mode}.log")
    shadows = {n: f"http://127.0.0.1:{p}/v1" for n, p in engines.ports.items()}
    cfg = proxy_config(primary_url, work / f"store-{mode}", admin_token=ADMIN_TOKEN, shadows=shadows,
                       admin_port=admin_port,
                       capture={"sample": 1.0, "per_minute": 0, "modes": ["forced", "free"], "logits": mode},
                       shadow={"queue_size": a.queue, "workers": 4, "analysis_workers": 1},
                       recording={"top_logprobs": 5}, **(sections or {}))
    for sh in cfg["shadows"]:
        sh.update(capture="full", timeout_s=60, concurrency=a.shadow_concurrency)
        if a.secondary and sh["name"] == SHADOWS[0]:
            sh["role"] = "secondary"
    proxy = ProxyProc(work / f"proxy-{mode}", cfg).start()
    rows: list[dict[str, Any]] = []
    try:
        for c in levels:
            s0, cpu0 = proxy.stats(), family_cpu_ms(proxy.pid)
            t0 = time.monotonic()
            load = asyncio.run(agents(proxy.url, seconds, c, a.tokens, a.first_ms / 1000, a.token_ms / 1000))
            proxy.wait_shadows_idle(timeout=600)
            s1, cpu1 = proxy.stats(), family_cpu_ms(proxy.pid)
            turns_shadowed = (s1.get("shadow") or {}).get("turns_done", 0) - (s0.get("shadow") or {}).get("turns_done", 0)
            ing0, ing1 = s0.get("ingest") or {}, s1.get("ingest") or {}
            cpu_s = (cpu1 - cpu0) / 1000
            tokens = turns_shadowed * a.tokens
            row = {"concurrency": c, "turns": load["turns"], "errors": load["errors"], "why": load["why"],
                   "ttft_p50_ms": round(pct(load["ttft_ms"], 0.5), 2), "ttft_p99_ms": round(pct(load["ttft_ms"], 0.99), 2),
                   "shadowed_turns": turns_shadowed,
                   "shed_turns": (s1.get("shadow") or {}).get("dropped_queue_full", 0)
                   - (s0.get("shadow") or {}).get("dropped_queue_full", 0),
                   "shadowed_tokens": tokens, "wall_s": round(time.monotonic() - t0, 2),
                   "proxy_cpu_s": round(cpu_s, 3),
                   # what /metrics reads as tensorverse:shadow_headroom (1 - busy worker time over
                   # workers x wall time): near 0 where the tee sheds
                   "shadow_headroom": round(max(0.0, 1 - ((s1.get("shadow") or {}).get("busy_s", 0.0)
                                                          - (s0.get("shadow") or {}).get("busy_s", 0.0))
                                                / (max(1, (s1.get("shadow") or {}).get("workers", 0))
                                                   * (time.monotonic() - t0))), 3),
                   "shadowed_tokens_per_s_per_core": round(tokens / cpu_s, 1) if cpu_s > 0 else None,
                   "wire_bytes": ing1.get("bytes", 0) - ing0.get("bytes", 0),
                   "rows": ing1.get("rows", 0) - ing0.get("rows", 0),
                   "rows_compact": ing1.get("rows_compact", 0) - ing0.get("rows_compact", 0),
                   "ingest_batches": ing1.get("batches", 0) - ing0.get("batches", 0),  # POSTs taken
                   # sessions the grouping keeps in memory (every agent turn here is a new one;
                   # at most [sessions] max_tracked): one of the heap's bounded parts
                   "tracked_sessions": (s1.get("sessions") or {}).get("tracked_sessions"),
                   **{f"{k}_kb": v for k, v in proxy.memory_kb().items()}}
            row["wire_bytes_per_shadowed_token"] = round(row["wire_bytes"] / tokens, 1) if tokens else None
            rows.append(row)
            print(f"{mode:8s} c={c:<3d} {row['turns']:5d} turns, {turns_shadowed:7.1f} shadowed, "
                  f"{row['shed_turns']} shed, proxy {cpu_s:6.2f} CPU-s -> "
                  f"{row['shadowed_tokens_per_s_per_core']} shadowed tokens/s/core, "
                  f"{row['wire_bytes_per_shadowed_token']} B/token, headroom {row['shadow_headroom']}, "
                  f"TTFT p99 {row['ttft_p99_ms']} ms, "
                  f"heap {row['anon_kb'] / 1024:.0f} MiB (RSS {row['rss_kb'] / 1024:.0f})", file=sys.stderr, flush=True)
        taps = engines.stats()
        final = proxy.stats()
        # the agents' TTFT with the shadows attached and saturated, against a second proxy without
        # shadows on the same machine at the same time (the engines busy with the first one's
        # backlog): in alternating rounds, so that a change of the machine's load hits both alike
        idle_rows = None
        if mode == "evidence" and detached:
            cfg2 = {**cfg, "proxy": {"listen": f"127.0.0.1:{free_port()}"}, "shadows": [],
                    "admin": {**cfg["admin"], "listen": f"127.0.0.1:{free_port()}"},
                    "store": {"path": str(work / "store-detached")}}
            other = ProxyProc(work / "proxy-detached", cfg2).start()
            att: list[float] = []
            det: list[float] = []
            det_cpu_ms, det_turns = 0.0, 0
            errors = 0
            try:
                for _ in range(a.rounds):
                    for target, into in ((proxy, att), (other, det)):
                        cpu0 = family_cpu_ms(other.pid) if target is other else 0.0
                        load = asyncio.run(agents(target.url, a.round_s, levels[-1], a.tokens, a.first_ms / 1000,
                                                  a.token_ms / 1000))
                        into += load["ttft_ms"]
                        errors += load["errors"]
                        if target is other:  # what relaying and recording a turn costs without shadows
                            det_cpu_ms += family_cpu_ms(other.pid) - cpu0
                            det_turns += load["turns"]
                shed = (proxy.stats().get("shadow") or {}).get("dropped_queue_full", 0) - \
                    (final.get("shadow") or {}).get("dropped_queue_full", 0)
            finally:
                other.stop()
            idle_rows = {"concurrency": levels[-1], "rounds": a.rounds, "round_s": a.round_s, "errors": errors,
                         "attached_turns": len(att), "detached_turns": len(det), "attached_shed_turns": shed,
                         "attached_ttft_p50_ms": round(pct(att, 0.5), 2), "detached_ttft_p50_ms": round(pct(det, 0.5), 2),
                         "attached_ttft_p99_ms": round(pct(att, 0.99), 2), "detached_ttft_p99_ms": round(pct(det, 0.99), 2),
                         "relay_cpu_ms_per_turn": round(det_cpu_ms / det_turns, 3) if det_turns else None}
            print(f"rounds   c={levels[-1]:<3d} TTFT p99 attached {idle_rows['attached_ttft_p99_ms']} ms "
                  f"({len(att)} turns, {shed} shed), detached {idle_rows['detached_ttft_p99_ms']} ms ({len(det)} turns)",
                  file=sys.stderr, flush=True)
    finally:
        proxy.stop()
        engines.close()
    return {"levels": rows, "taps": taps, "ingest": final.get("ingest") or {}, "detached": idle_rows,
            "flipped_comparisons": flipped_comparisons(Path(cfg["store"]["path"]))}


def net_of_unshadowed(rows: list[dict[str, Any]], relay_ms_per_turn: float | None) -> None:
    """Each level's rate net of the relays of the turns the tee shed (``turns - shadowed_turns``:
    relayed and recorded, never shadowed), at what a turn cost the detached proxy in the same run:
    the shadowed turns' own relays stay charged, so the figure is what one core gives with every
    turn shadowed."""
    for r in rows:
        unshadowed = max(0.0, r["turns"] - r["shadowed_turns"])
        cpu = r["proxy_cpu_s"] - (relay_ms_per_turn or 0.0) * unshadowed / 1000
        r["unshadowed_relay_cpu_s"] = round(r["proxy_cpu_s"] - cpu, 3)
        r["gross_shadowed_tokens_per_s_per_core"] = r["shadowed_tokens_per_s_per_core"]
        r["shadowed_tokens_per_s_per_core"] = (round(r["shadowed_tokens"] / cpu, 1)
                                               if relay_ms_per_turn is not None and cpu > 0 else None)


def turn_length(short: dict[str, Any], long: dict[str, Any]) -> dict[str, Any]:
    """One level run with short and with long turns: the proxy's CPU per shadowed token at each
    (net of the relays of shed turns, as the rate). A cost per turn would make the long turns'
    tokens cheaper; equal figures say the proxy's work goes with the tokens (their captured rows,
    their answers' logprobs) and with time (ingest batches: each engine posts up to 20 a second,
    whatever they hold), not with turns."""
    def per_token(r: dict[str, Any]) -> float:
        return (r["proxy_cpu_s"] - r.get("unshadowed_relay_cpu_s", 0.0)) * 1000 / r["shadowed_tokens"]

    a, b = per_token(short), per_token(long)
    return {"concurrency": short["concurrency"],
            "tokens_per_turn": [short["shadowed_tokens"] / short["shadowed_turns"],
                                long["shadowed_tokens"] / long["shadowed_turns"]],
            "cpu_ms_per_shadowed_token": [round(a, 3), round(b, 3)], "long_over_short": round(b / a, 3)}


def lost_silently(taps: dict[str, dict[str, Any]], ingest: dict[str, Any]) -> dict[str, int]:
    """Rows the taps captured that are neither stored by the proxy nor counted as dropped."""
    captured = sum(t.get("rows_captured", 0) for t in taps.values())
    dropped_at_tap = sum(t.get(k, 0) for t in taps.values() for k in ("dropped_no_buffer", "dropped_sink",
                                                                        "dropped_encode", "rows_discarded"))
    stored = ingest.get("rows", 0)
    counted = (ingest.get("duplicates", 0) + ingest.get("rows_dropped_store_full", 0)
               + ingest.get("rows_dropped_store_error", 0))
    return {"captured": captured, "dropped_at_tap": dropped_at_tap, "stored": stored, "counted_at_proxy": counted,
            "lost_silently": captured - dropped_at_tap - stored - counted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,2,4,8", help="agent concurrency levels, stepped up")
    ap.add_argument("--seconds", type=float, default=15.0, help="agent load per level")
    ap.add_argument("--tokens", type=int, default=48, help="output tokens per turn")
    ap.add_argument("--first-ms", type=float, default=50.0, help="the primary's time to first token")
    ap.add_argument("--token-ms", type=float, default=5.0, help="the primary's time between tokens")
    ap.add_argument("--engine-step-ms", type=float, default=1.0, help="a shadow engine's decode step")
    ap.add_argument("--shadow-concurrency", type=int, default=4, help="requests in flight per shadow")
    ap.add_argument("--queue", type=int, default=64, help="[shadow] queue_size: past it turns are shed")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the attached / detached TTFT comparison")
    ap.add_argument("--round-s", type=float, default=10.0, help="agent load per side and round")
    ap.add_argument("--long-tokens", type=int, default=192,
                    help="output tokens of the long turns run once more at one level (the proxy's CPU per token "
                         "with short and long turns); 0: not run")
    ap.add_argument("--secondary", action="store_true",
                    help=f"{SHADOWS[0]} (it flips nowhere: the primary's runtime) is the line-up's secondary, the "
                         "reference lane the other shadows' forced runs are compared against too, as in the demo")
    ap.add_argument("--quick", action="store_true", help="levels 1,4 for 6 s each, 2 rounds of 4 s")
    ap.add_argument("--evidence-only", action="store_true",
                    help="no full-capture run and no long turns: evidence at the source through the levels "
                         "(with many levels at one concurrency, the proxy's heap level by level: the plateau run)")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    seconds = a.seconds
    if a.quick:
        levels, seconds, a.rounds, a.round_s = [1, 4], 6.0, 2, 4.0
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tv-prodload-") as tmp:
        work = Path(tmp)
        with primary() as primary_url:
            full = None if a.evidence_only else run_mode("full", levels, seconds, a, work, primary_url)
            ev = run_mode("evidence", levels, seconds, a, work, primary_url)
            long_c = 2 if 2 in levels else levels[0]
            long = None
            if a.long_tokens and a.long_tokens != a.tokens and not a.evidence_only:
                a_long = argparse.Namespace(**{**vars(a), "tokens": a.long_tokens})
                (work / "long").mkdir()
                long = run_mode("evidence", [long_c], seconds, a_long, work / "long", primary_url, detached=False)
    relay_ms = (ev["detached"] or {}).get("relay_cpu_ms_per_turn")
    net_of_unshadowed(ev["levels"], relay_ms)
    if full is not None:
        net_of_unshadowed(full["levels"], relay_ms)
    if long is not None:
        net_of_unshadowed(long["levels"], relay_ms)
    lengths = None
    if long is not None and long["levels"][0]["shadowed_turns"]:
        lengths = turn_length(next(r for r in ev["levels"] if r["concurrency"] == long_c), long["levels"][0])
        print(f"lengths  c={long_c:<3d} {lengths['cpu_ms_per_shadowed_token']} CPU-ms per shadowed token at "
              f"{lengths['tokens_per_turn']} tokens a turn", file=sys.stderr, flush=True)
    top_e = ev["levels"][-1]
    top_f = full["levels"][-1] if full is not None else {}  # --evidence-only: no full-capture figures
    lost_e = lost_silently(ev["taps"], ev["ingest"])
    lost_f = lost_silently(full["taps"], full["ingest"]) if full is not None else {"lost_silently": 0}
    det = ev["detached"] or {}
    errors = sum(r["errors"] for r in ev["levels"] + (full["levels"] if full else []) + (long["levels"] if long else [])) \
        + det.get("errors", 0)
    lost_l = lost_silently(long["taps"], long["ingest"]) if long else {"lost_silently": 0}
    heap = [r["anon_kb"] for r in ev["levels"]]
    result = {
        "benchmark": "production_load",
        "vocab": VOCAB, "shadows": len(SHADOWS), "secondary": SHADOWS[0] if a.secondary else None,
        "modes": ["forced", "free"], "levels": levels,
        "seconds_per_level": seconds, "tokens_per_turn": a.tokens,
        "shadowed_tokens_per_s_per_core": top_e["shadowed_tokens_per_s_per_core"],
        "full_shadowed_tokens_per_s_per_core": top_f.get("shadowed_tokens_per_s_per_core"),
        "gross_shadowed_tokens_per_s_per_core": top_e["gross_shadowed_tokens_per_s_per_core"],
        "relay_cpu_ms_per_turn": relay_ms,
        "turn_length": lengths,
        "wire_bytes_per_shadowed_token": top_e["wire_bytes_per_shadowed_token"],
        "full_wire_bytes_per_shadowed_token": top_f.get("wire_bytes_per_shadowed_token"),
        "wire_ratio": round(top_e["wire_bytes_per_shadowed_token"] / top_f["wire_bytes_per_shadowed_token"], 5)
        if top_e["wire_bytes_per_shadowed_token"] and top_f.get("wire_bytes_per_shadowed_token") else None,
        "primary_ttft_p99_ms": det.get("attached_ttft_p99_ms"), "detached_ttft_p99_ms": det.get("detached_ttft_p99_ms"),
        "primary_ttft_p99_ratio": round(det["attached_ttft_p99_ms"] / det["detached_ttft_p99_ms"], 3)
        if det.get("detached_ttft_p99_ms") else None,
        "rows_lost_silently": lost_e["lost_silently"] + lost_f["lost_silently"] + lost_l["lost_silently"],
        "rows": {"evidence": lost_e, "full": lost_f, "long": lost_l},
        "rows_sent_in_full_by_reason": {r: sum((t.get("rows_evidence") or {}).get(r, 0) for t in ev["taps"].values())
                                        for r in sorted({k for t in ev["taps"].values()
                                                         for k in (t.get("rows_evidence") or {})})},
        "shed_turns": sum(r["shed_turns"] for r in ev["levels"]),
        "flipped_comparisons": {"evidence": ev["flipped_comparisons"],
                                "full": full["flipped_comparisons"] if full is not None else None},
        "heap_growth_ratio": round(heap[-1] / heap[0], 3) if len(heap) > 1 else 1.0,
        "heap_mib": [round(h / 1024, 1) for h in heap],
        "tracked_sessions": [r.get("tracked_sessions") for r in ev["levels"]],
        "errors": errors,
        "per_level": {"evidence": ev["levels"], "full": full["levels"] if full is not None else None, "detached": det,
                      "long": long["levels"] if long is not None else None},
        "seconds": round(time.monotonic() - t_start, 1),
    }
    return finish("production_load", result, extra_ok=errors == 0)


if __name__ == "__main__":
    sys.exit(main())
