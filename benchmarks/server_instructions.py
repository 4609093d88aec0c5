"""Instructions per request of the proxy process, for each client-facing server: the hand-written
one (`tensorverse.proxy.http`) and the same core as a raw ASGI app on uvicorn (`_asgi.py`).

    python benchmarks/server_instructions.py [--requests 300] [--concurrency 8]

Wall-clock comparisons swing 2-4x on this shared 2-core VM (RESULTS.md); an instruction count
does not: each proxy (configured as in `proxy_overhead.py`: recording on, 3 slow shadows) runs
under ``valgrind --tool=callgrind``, is warmed up, its counters are zeroed, it relays
``--requests`` 32-event streams at ``--concurrency``, and its counters are dumped. Instructions in
user space, all threads. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_overhead import PROXY, ROOT, UPSTREAM, load, spawn

from benchmarks._targets import finish
from tensorverse.ports import free_port


def _total(dump: Path) -> int:
    text = dump.read_text(errors="replace")
    m = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
    if not m:
        raise RuntimeError(f"no totals in {dump}")
    return int(m.group(1))


def measure(server: str, upstream: str, tmp: Path, requests: int, concurrency: int, tree: Path = ROOT) -> dict:
    port, admin = free_port(), free_port()
    cfg = {"proxy": {"listen": f"127.0.0.1:{port}"}, "admin": {"listen": f"127.0.0.1:{admin}"},
           "primary": {"url": upstream}, "store": {"path": str(tmp / server), "durable": False},
           "shadow": {"queue_size": 4096, "workers": 16}}
    out = tmp / f"callgrind.{server}"
    args = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p", sys.executable, "-c", PROXY,
            json.dumps(cfg), "3"] + (["asgi"] if server == "uvicorn" else [])
    env = {**os.environ, "PYTHONPATH": f"{tree}:{ROOT / 'benchmarks'}"}
    p = spawn(args, env, cwd=tree)
    try:
        url = f"http://127.0.0.1:{port}"
        warm = asyncio.run(load(url, 50, concurrency, 32))
        time.sleep(2)  # the shadows' queued work of the warm-up is done
        subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, capture_output=True)
        r = asyncio.run(load(url, requests, concurrency, 32))
        time.sleep(2)  # and of the measured requests (their recording, their shadow work)
        before = set(tmp.glob(f"callgrind.{server}.*"))
        subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, capture_output=True)
        deadline = time.monotonic() + 60
        dumps: set[Path] = set()
        while time.monotonic() < deadline and not dumps:
            time.sleep(0.5)
            dumps = set(tmp.glob(f"callgrind.{server}.*")) - before
        if not dumps:
            raise RuntimeError("callgrind wrote no dump")
        time.sleep(1)
        total = sum(_total(d) for d in dumps)
        return {"requests": r["n"], "errors": r["errors"] + warm["errors"], "instructions": total,
                "instructions_per_request": round(total / max(1, r["n"]))}
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--baseline", type=Path, help="another checkout whose hand-written server is measured too")
    ap.add_argument("--no-uvicorn", action="store_true", help="measure the hand-written server only")
    args = ap.parse_args()
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        print("valgrind (Debian's valgrind package) is needed: `make bench` installs it", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="tv-callgrind-"))
    up = None
    try:
        up_port = free_port()
        up = spawn([sys.executable, "-c", UPSTREAM, str(up_port)], {**os.environ, "PYTHONPATH": str(ROOT)})
        upstream = f"http://127.0.0.1:{up_port}"
        results = {s: measure(s, upstream, tmp, args.requests, args.concurrency)
                   for s in ("hand-written",) + (() if args.no_uvicorn else ("uvicorn",))}
        if args.baseline is not None:
            results["baseline"] = measure("baseline", upstream, tmp, args.requests, args.concurrency,
                                          args.baseline.resolve())
        for s, r in results.items():
            print(f"{s:13s} {r['instructions_per_request'] / 1e6:.3f} M instructions per request "
                  f"({r['requests']} requests, {r['errors']} errors)", flush=True)
        hw = results["hand-written"]
        out = {"requests": args.requests, "concurrency": args.concurrency,
               "handwritten_instructions_per_request": hw["instructions_per_request"]}
        for name, key in (("uvicorn", "uvicorn"), ("baseline", "baseline")):
            if name in results:
                out[f"{key}_instructions_per_request"] = results[name]["instructions_per_request"]
                out[f"{key}_over_handwritten"] = round(results[name]["instructions_per_request"]
                                                       / hw["instructions_per_request"], 3)
        out["errors"] = sum(r["errors"] for r in results.values())
        return finish("server_instructions", out)
    finally:
        if up is not None:
            os.killpg(up.pid, signal.SIGTERM)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
