"""Run every benchmark to the end and gate on its targets (``make bench``).

    python benchmarks/_run_all.py [--only a,b] [--skip c] [--timeout S] [--results FILE]
                                  [--table FILE] [--logs DIR] [--targets FILE]

Every ``benchmarks/*.py`` except ``_*.py`` and ``*_cuda.py`` (GPU only), one after the other in
its own process (its own process group, stopped with SIGINT then SIGKILL past ``--timeout``),
whatever the earlier ones did. Each benchmark's last stdout line (one JSON object) is checked
against ``benchmarks/targets.toml`` (``benchmarks/_targets.py``, the same check the benchmark
makes for its own exit code). At the end one table: benchmark / figure / target / measured /
verdict. ``--results FILE`` writes that table, with the machine, the date and the load
average, between the ``<!-- bench-table:start -->`` and ``<!-- bench-table:end -->`` lines of
FILE (benchmarks/RESULTS.md). Exit status: 0 only when every benchmark exited 0 and met every
target; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchmarks._targets import evaluate, load_targets  # noqa: E402

START = "<!-- bench-table:start -->"
END = "<!-- bench-table:end -->"


def benchmarks(only: list[str] | None = None, skip: list[str] | None = None) -> list[Path]:
    found = sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_") and not p.stem.endswith("_cuda"))
    names = {p.stem for p in found}
    for n in (only or []) + (skip or []):
        if n not in names:
            raise SystemExit(f"no benchmark {n!r} (have: {', '.join(sorted(names))})")
    return [p for p in found if (not only or p.stem in only) and p.stem not in (skip or [])]


@dataclass
class Outcome:
    name: str
    rc: int | None = None          # None: timed out
    seconds: float = 0.0
    result: dict | None = None     # the last stdout line, when it is a JSON object
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # figure, target, measured, verdict
    ok: bool = False


def _last_json(lines: list[str]) -> dict | None:
    for line in reversed(lines):
        if line.strip():
            try:
                obj = json.loads(line)
            except ValueError:
                return None
            return obj if isinstance(obj, dict) else None
    return None


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    return str(v)


def run_one(path: Path, timeout: float, log_dir: Path | None, targets: str | None) -> Outcome:
    out = Outcome(path.stem)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if log_dir is not None:  # where a benchmark that writes files besides its JSON line puts them
        env["TENSORVERSE_BENCH_OUT"] = str(log_dir.resolve())
    if targets:
        env["TENSORVERSE_BENCH_TARGETS"] = str(Path(targets).resolve())
    log = open(log_dir / f"{path.stem}.log", "w") if log_dir else None
    lines: list[str] = []
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT if log is None else subprocess.PIPE, text=True,
                         errors="replace", start_new_session=True)

    def pump(stream, keep: bool) -> None:
        for line in stream:
            if keep:
                lines.append(line)
            sys.stdout.write(f"  {path.stem}: {line}" if keep else f"  {path.stem}! {line}")
            sys.stdout.flush()
            if log is not None:
                log.write(line)
                log.flush()

    threads = [threading.Thread(target=pump, args=(p.stdout, True), daemon=True)]
    if log is not None:
        threads.append(threading.Thread(target=pump, args=(p.stderr, False), daemon=True))
    for t in threads:
        t.start()
    try:
        out.rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        _stop(p)
    except KeyboardInterrupt:
        _stop(p)
        raise
    for t in threads:
        t.join(10)
    out.seconds = time.monotonic() - t0
    if log is not None:
        log.close()
    out.result = _last_json(lines)
    verdicts = evaluate(path.stem, out.result, targets)
    for v in verdicts:
        word = v.word if out.result is not None else "not measured"
        out.rows.append((v.figure, v.target, _fmt(v.measured), word))
    if out.rc is None:
        out.rows.append(("(run)", "finishes", f"stopped after {out.seconds:.0f} s", "TIMEOUT"))
    elif out.result is None:
        how = f"killed by signal {-out.rc}" if out.rc < 0 else f"exit {out.rc}"
        out.rows.append(("(run)", "exit 0, JSON last line", f"{how}, no JSON", "CRASHED"))
    elif out.rc != 0 and all(v.met for v in verdicts):
        out.rows.append(("(run)", "exit 0", f"exit {out.rc}", "FAILED"))
    elif not verdicts:
        out.rows.append(("(run)", "exit 0", f"exit {out.rc} in {out.seconds:.0f} s", "ran"))
    out.ok = out.rc == 0 and out.result is not None and all(v.met for v in verdicts)
    return out


def _stop(p: subprocess.Popen) -> None:
    """SIGINT to the benchmark's process group (its `finally` blocks stop its servers), then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except OSError:
        mem = 0.0
    return (f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, "
            f"Python {platform.python_version()}")


def table(outcomes: list[Outcome]) -> str:
    head = ["| benchmark | figure | target | measured | verdict |", "| --- | --- | --- | --- | --- |"]
    body = [f"| `{o.name}.py` | {fig} | {tgt} | {meas} | {'**' + word + '**' if word not in ('met', 'ran') else word} |"
            for o in outcomes for fig, tgt, meas, word in o.rows]
    return "\n".join(head + body)


def report(outcomes: list[Outcome], started: str, load_start: tuple[float, ...], wall: float) -> str:
    failed = [o.name for o in outcomes if not o.ok]
    load_end = os.getloadavg()
    lines = [
        f"`make bench` ({len(outcomes)} benchmarks, {wall / 60:.1f} min): started {started}; machine: {machine()}; "
        f"load average (1/5/15 min) {' / '.join(f'{x:.2f}' for x in load_start)} at the start, "
        f"{' / '.join(f'{x:.2f}' for x in load_end)} at the end.",
        "",
        table(outcomes),
        "",
        "Verdict: " + ("every target met." if not failed else
                       f"**{len(failed)} of {len(outcomes)} benchmarks failed their gate**: "
                       + ", ".join(f"`{n}`" for n in failed) + "."),
        "",
        "Seconds per benchmark: " + ", ".join(f"{o.name} {o.seconds:.0f}" for o in outcomes) + ".",
    ]
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    """Replace what lies between the START and END marker lines of ``path`` with ``text``."""
    src = path.read_text()
    if START not in src or END not in src or src.index(START) > src.index(END):
        raise SystemExit(f"{path}: no {START} ... {END} section to rewrite")
    head, rest = src.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated benchmark names (default: all)")
    ap.add_argument("--skip", help="comma-separated benchmark names to leave out")
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("TENSORVERSE_BENCH_TIMEOUT", 3600)),
                    help="seconds per benchmark before it is stopped (default 3600)")
    ap.add_argument("--results", type=Path, help="rewrite the marked section of this file (benchmarks/RESULTS.md)")
    ap.add_argument("--table", type=Path, default=ROOT / "out" / "bench" / "table.md",
                    help="write the report here too, after every benchmark (default out/bench/table.md)")
    ap.add_argument("--logs", type=Path, default=ROOT / "out" / "bench", help="one log per benchmark (default out/bench)")
    ap.add_argument("--targets", help="targets file (default benchmarks/targets.toml or $TENSORVERSE_BENCH_TARGETS)")
    a = ap.parse_args(argv)
    load_targets(a.targets)  # a broken targets file fails before anything runs

    def split(s: str | None) -> list[str] | None:
        return [x for x in s.split(",") if x] if s else None

    paths = benchmarks(split(a.only), split(a.skip))
    a.logs.mkdir(parents=True, exist_ok=True)
    a.table.parent.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    for path in paths:
        print(f"== {path.relative_to(ROOT)}", flush=True)
        o = run_one(path, a.timeout, a.logs, a.targets)
        outcomes.append(o)
        print(f"== {path.stem}: {'ok' if o.ok else 'FAILED'} in {o.seconds:.0f} s", flush=True)
        a.table.write_text(report(outcomes, started, load_start, time.monotonic() - t0) + "\n")
    text = report(outcomes, started, load_start, time.monotonic() - t0)
    print()
    print(text)
    if a.results is not None:
        write_section(a.results, text)
    return 0 if outcomes and all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
