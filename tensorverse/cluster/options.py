"""The ``--executor`` flags of ``tensorverse matrix``, ``bisect`` and ``replay``, and what they
parse into: where each point (or replay) runs, here or as Ray tasks, and what each task asks Ray
for."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["ExecutorOptions", "ExecutorUnavailable", "RAY_MISSING", "add_executor_arguments", "executor_options",
           "parse_resources"]

RAY_MISSING = ("--executor ray needs Ray, which is not installed in this environment: "
               "pip install 'tensorverse[ray]' (or pip install 'ray[default]'), "
               "then run the same command again")


class ExecutorUnavailable(RuntimeError):
    """The executor asked for cannot run here (Ray not installed, no cluster at the address)."""


@dataclass
class ExecutorOptions:
    """The ``--executor`` flags (see :func:`add_executor_arguments`)."""

    name: str = "local"
    ray_address: str | None = None
    cpus_per_point: float = 1.0
    gpus_per_point: str = "auto"  # "auto": tensor x pipeline x data parallel when the cluster has GPUs
    resources: dict[str, float] = field(default_factory=dict)
    max_retries: int = 2
    shared_dir: str | None = None
    progress: bool = True


def add_executor_arguments(p: argparse.ArgumentParser, *, what: str = "point") -> None:
    g = p.add_argument_group("executor (docs/matrix.md, \"Run the hypercube on a Ray cluster\")")
    g.add_argument("--executor", choices=("local", "ray"), default="local",
                   help=f"where each {what} runs: here (local, the default) or as Ray tasks on a "
                   "cluster (ray; needs pip install 'tensorverse[ray]')")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="the Ray cluster: auto (the one this host belongs to), HOST:PORT, "
                   "ray://HOST:10001 (Ray Client) or local (a new one on this machine); default: "
                   "$RAY_ADDRESS, else a new local cluster")
    g.add_argument("--ray-cpus-per-point", type=float, default=1.0, metavar="N",
                   help=f"CPUs each {what}'s task asks Ray for (1; on CPU-only rigs, the cores one "
                   "vLLM-CPU server should have)")
    g.add_argument("--ray-gpus-per-point", default="auto", metavar="N|auto",
                   help="GPUs each task asks for; auto (default): tensor x pipeline x data parallel "
                   "size of the point when the cluster has GPUs, else 0")
    g.add_argument("--ray-resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="a custom Ray resource every task asks for (repeatable), e.g. "
                   "accelerator_type:H200=0.001 or node:10.0.0.7=0.01")
    g.add_argument("--ray-max-retries", type=int, default=2, metavar="N",
                   help="times Ray reruns a task whose worker or node died (2)")
    g.add_argument("--ray-shared-dir", metavar="DIR",
                   help="a directory every node and the driver see at the same path: run "
                   "directories are written there and moved into OUT instead of travelling "
                   "through Ray's object store as tar bytes")


def parse_resources(items: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for it in items:
        name, sep, amount = it.rpartition("=")
        if not sep or not name:
            raise ValueError(f"--ray-resource {it!r}: expected NAME=AMOUNT")
        try:
            out[name] = float(amount)
        except ValueError:
            raise ValueError(f"--ray-resource {it!r}: {amount!r} is not a number") from None
    return out


def executor_options(args: argparse.Namespace, *, progress: bool = True) -> ExecutorOptions:
    gpus = str(args.ray_gpus_per_point)
    if gpus != "auto":
        try:
            float(gpus)
        except ValueError:
            raise ValueError(f"--ray-gpus-per-point {gpus!r}: a number or auto") from None
    return ExecutorOptions(name=args.executor, ray_address=args.ray_address,
                           cpus_per_point=args.ray_cpus_per_point, gpus_per_point=gpus,
                           resources=parse_resources(args.ray_resource), max_retries=max(0, args.ray_max_retries),
                           shared_dir=args.ray_shared_dir, progress=progress)


