"""Where a replay ran: this machine (OS, Python, GPUs when ``nvidia-smi`` answers) and each backend
as ``tensorverse doctor`` sees it, stored with the results so that rigs' results can be merged and
told apart (`tensorverse report merge`)."""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import subprocess
from typing import Any, Sequence

from tensorverse.shadow.backend import Backend

__all__ = ["rig_fingerprint"]


def _gpus() -> dict[str, Any] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        cuda = subprocess.run([exe], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [r.split(", ") for r in out.stdout.strip().splitlines() if r.strip()]
    cv = None
    for line in cuda.splitlines():
        if "CUDA Version" in line:
            cv = line.split("CUDA Version:")[1].split()[0]
    return {"count": len(rows), "models": sorted({r[0] for r in rows}),
            "driver": rows[0][1] if rows and len(rows[0]) > 1 else None, "cuda": cv}


async def rig_fingerprint(backends: Sequence[Backend]) -> dict[str, Any]:
    """Where the replay ran: this machine (OS, Python, GPUs when ``nvidia-smi`` answers) and each
    backend as ``tensorverse doctor`` sees it (vLLM version, model, capture, tokenizer)."""
    from tensorverse.shadow.doctor import doctor

    async def one(b: Backend) -> tuple[str, dict[str, Any]]:
        try:
            r = await doctor(b.url, b.model, api_key=b.api_key, timeout_s=min(b.timeout_s, 30))
        except Exception as e:  # noqa: BLE001
            return b.name, {"error": f"{type(e).__name__}: {e}"}
        keep = ("version", "model", "max_model_len", "max_logprobs", "vocab_size", "plugin",
                "forcing", "capture_sink", "capture", "problems")
        info = {k: r.get(k) for k in keep}
        info["tokenizer"] = (r.get("tokenizer") or {}).get("fingerprint")
        info["launch_options"] = None  # not exposed by vLLM's API; see docs/replay.md
        return b.name, info

    got = dict(await asyncio.gather(*(one(b) for b in backends)))
    try:  # the installed version, without importing vllm (that costs seconds)
        import importlib.metadata as md

        local_vllm: str | None = md.version("vllm")
    except Exception:  # noqa: BLE001 - not installed
        local_vllm = None
    return {
        "host": {"os": platform.platform(), "python": platform.python_version(),
                 "machine": platform.machine(), "cpus": os.cpu_count(), "gpus": _gpus(),
                 "vllm": local_vllm},
        "backends": got,
    }
