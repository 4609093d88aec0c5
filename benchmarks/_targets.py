"""The benchmarks' targets (``benchmarks/targets.toml``) and the verdicts on a run's figures.

A benchmark ends with ``return finish("NAME", result)``: it prints ``result`` as its last stdout
line (one JSON object, with ``targets`` and ``targets_met`` added) and returns the exit code:
0 when every target of its section is met, 1 when one is missed or its figure is missing.
``benchmarks/_run_all.py`` (``make bench``) checks the same JSON lines against the same file
with :func:`evaluate`.
"""

from __future__ import annotations

import json
import math
import operator
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Target", "TARGETS_FILE", "Verdict", "evaluate", "finish", "load_targets", "lookup", "targets_for"]

TARGETS_FILE = Path(__file__).resolve().with_name("targets.toml")
ENV = "TENSORVERSE_BENCH_TARGETS"

_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}
_MISSING = object()


@dataclass(frozen=True)
class Target:
    figure: str   # a key of the benchmark's JSON object; dots walk into nested objects
    op: str
    value: Any
    text: str     # as written: "<= 1.4"

    def met(self, measured: Any) -> bool:
        if measured is None or measured is _MISSING:
            return False
        if isinstance(self.value, bool) or isinstance(measured, bool):
            return self.op == "==" and measured is self.value
        if isinstance(self.value, (int, float)):
            if not isinstance(measured, (int, float)) or math.isnan(measured):
                return False
        elif type(measured) is not type(self.value):
            return False
        return bool(_OPS[self.op](measured, self.value))


@dataclass(frozen=True)
class Verdict:
    benchmark: str
    figure: str
    target: str
    measured: Any       # None when the run did not produce the figure
    met: bool

    @property
    def word(self) -> str:
        if self.met:
            return "met"
        return "MISSED" if self.measured is not None else "MISSED (not measured)"


def _parse(figure: str, text: Any, where: str) -> Target:
    if not isinstance(text, str):
        raise ValueError(f"{where}: target of {figure!r} must be a string like '<= 1.4', got {text!r}")
    s = text.strip()
    op = next((o for o in ("<=", ">=", "==", "<", ">") if s.startswith(o)), None)
    if op is None:
        raise ValueError(f"{where}: target of {figure!r} must start with <=, <, >=, > or ==: {text!r}")
    raw = s[len(op):].strip()
    if raw in ("true", "false"):
        value: Any = raw == "true"
    elif raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
        value = raw[1:-1]
    else:
        try:
            value = int(raw) if raw.lstrip("-").isdigit() else float(raw)
        except ValueError:
            raise ValueError(f"{where}: target of {figure!r}: {raw!r} is not a number, true, false or a string") from None
    if isinstance(value, (bool, str)) and op != "==":
        raise ValueError(f"{where}: target of {figure!r}: only == applies to {raw}")
    return Target(figure, op, value, f"{op} {raw}")


def load_targets(path: str | Path | None = None) -> dict[str, list[Target]]:
    """Every benchmark's targets, from ``path``, $TENSORVERSE_BENCH_TARGETS or targets.toml."""
    p = Path(path or os.environ.get(ENV) or TARGETS_FILE)
    data = tomllib.loads(p.read_text())
    out: dict[str, list[Target]] = {}
    for bench, section in data.items():
        if not isinstance(section, dict):
            raise ValueError(f"{p}: [{bench}] must be a table of figure = \"OP VALUE\"")
        out[bench] = [_parse(fig, t, f"{p} [{bench}]") for fig, t in section.items()]
    return out


def targets_for(benchmark: str, path: str | Path | None = None) -> list[Target]:
    return load_targets(path).get(benchmark, [])


def lookup(result: Any, figure: str) -> Any:
    """``result``'s value at ``figure`` (dots walk into nested objects); None when absent."""
    cur = result
    for part in figure.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def evaluate(benchmark: str, result: dict | None, path: str | Path | None = None) -> list[Verdict]:
    """One verdict per target of ``benchmark`` on its JSON object (None: nothing measured)."""
    out = []
    for t in targets_for(benchmark, path):
        measured = lookup(result, t.figure) if result is not None else None
        out.append(Verdict(benchmark, t.figure, t.text, measured, t.met(measured)))
    return out


def finish(benchmark: str, result: dict, *, extra_ok: bool = True) -> int:
    """Print ``result`` (with its verdicts) as the last stdout line; the benchmark's exit code.

    ``extra_ok`` False fails the run whatever the targets say (e.g. the benchmark saw errors)."""
    verdicts = evaluate(benchmark, result)
    result["targets"] = {v.figure: {"target": v.target, "measured": v.measured, "met": v.met} for v in verdicts}
    result["targets_met"] = all(v.met for v in verdicts) and extra_ok
    for v in verdicts:
        if not v.met:
            print(f"{benchmark}: {v.figure} {v.measured!r}: target {v.target} {v.word}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    print(json.dumps(result, default=str), flush=True)
    return 0 if result["targets_met"] else 1
