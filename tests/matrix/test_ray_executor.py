"""The executor seam and the Ray executor without vLLM: resources per point, run directories as
bytes, the output lock, the missing-Ray path, the cluster progress, and a whole matrix on a local
Ray cluster whose points cannot start (their interpreter is ``/bin/false``: the executor, the
transfer and the report are what is tested, in seconds; real servers are in test_ray_vllm.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tensorverse.testing.matrix_specs import base_spec, make_corpus, to_toml
from tensorverse.cli import main as cli_main
from tensorverse.matrix.cluster_progress import ClusterProgress, PointState
from tensorverse.cluster.options import RAY_MISSING, ExecutorOptions, parse_resources
from tensorverse.matrix.outlock import OutputBusy, output_lock
from tensorverse.matrix.ray_executor import fits_a_node, point_resources
from tensorverse.cluster.transfer import install_run_dir, pack_dir, unpack_dir

ROOT = Path(__file__).resolve().parents[2]


# -- resources ------------------------------------------------------------------------------------

def test_point_resources_gpus_are_parallel_sizes():
    opts = ExecutorOptions(name="ray")
    eff = {"--tensor-parallel-size": 4, "--pipeline-parallel-size": 2, "--dtype": "bfloat16"}
    assert point_resources(eff, opts, cluster_has_gpus=True) == {"num_cpus": 1.0, "num_gpus": 8, "resources": {}}
    assert point_resources({"--dtype": "bfloat16"}, opts, cluster_has_gpus=True)["num_gpus"] == 1
    assert point_resources({"--data-parallel-size": 2, "--tensor-parallel-size": 2}, opts,
                           cluster_has_gpus=True)["num_gpus"] == 4
    # a CPU-only cluster: no GPU asked for, whatever the point says; CPUs from the flag, and at
    # least one per rank (vLLM-CPU binds each rank to its own cores)
    cpu = point_resources({"--dtype": "bfloat16"}, ExecutorOptions(name="ray", cpus_per_point=2), cluster_has_gpus=False)
    assert cpu == {"num_cpus": 2, "num_gpus": 0, "resources": {}}
    assert point_resources(eff, ExecutorOptions(name="ray", cpus_per_point=2), cluster_has_gpus=False)["num_cpus"] == 8
    assert point_resources({"--tensor-parallel-size": 2}, ExecutorOptions(name="ray", cpus_per_point=4),
                           cluster_has_gpus=False)["num_cpus"] == 4
    # an explicit number wins
    assert point_resources(eff, ExecutorOptions(name="ray", gpus_per_point="1"), cluster_has_gpus=True)["num_gpus"] == 1.0


def test_point_resources_custom():
    opts = ExecutorOptions(name="ray", resources=parse_resources(["node:10.0.0.7=0.01"]))
    eff = {"--dtype": "bfloat16", "TENSORVERSE_RAY_RESOURCES": "accelerator_type:H200=0.001, big_mem=1"}
    r = point_resources(eff, opts, cluster_has_gpus=True)
    assert r["resources"] == {"node:10.0.0.7": 0.01, "accelerator_type:H200": 0.001, "big_mem": 1.0}
    with pytest.raises(ValueError, match="TENSORVERSE_RAY_RESOURCES"):
        point_resources({"TENSORVERSE_RAY_RESOURCES": "H200"}, opts, cluster_has_gpus=True)
    with pytest.raises(ValueError, match="NAME=AMOUNT"):
        parse_resources(["H200"])


def test_fits_a_node():
    nodes = [{"CPU": 64.0, "GPU": 8.0, "accelerator_type:H200": 1.0}, {"CPU": 2.0}]
    assert fits_a_node({"num_cpus": 1, "num_gpus": 8, "resources": {"accelerator_type:H200": 0.001}}, nodes)
    assert not fits_a_node({"num_cpus": 1, "num_gpus": 16, "resources": {}}, nodes)  # TP 16 needs 2 nodes' worth
    assert not fits_a_node({"num_cpus": 1, "num_gpus": 1, "resources": {"accelerator_type:B200": 0.001}}, nodes)
    assert fits_a_node({"num_cpus": 2, "num_gpus": 0, "resources": {}}, nodes[1:])


# -- run directories as bytes ---------------------------------------------------------------------

def test_pack_unpack_install(tmp_path):
    src = tmp_path / "src"
    (src / "store").mkdir(parents=True)
    (src / "run.json").write_text('{"status": "ok"}')
    (src / "store" / "data.mdb").write_bytes(os.urandom(70_000))
    blob = pack_dir(src)
    runs = tmp_path / "out" / "runs"
    (runs / "k1").mkdir(parents=True)
    (runs / "k1" / "half-written").write_text("x")  # an unfinished earlier attempt is replaced
    got = install_run_dir(runs, "k1", blob=blob)
    assert sorted(p.relative_to(got).as_posix() for p in got.rglob("*")) == ["run.json", "store", "store/data.mdb"]
    assert (got / "store" / "data.mdb").read_bytes() == (src / "store" / "data.mdb").read_bytes()
    assert sorted(p.name for p in runs.iterdir()) == ["k1"]  # no staging leftovers
    # from a shared directory: moved, not copied
    install_run_dir(runs, "k2", src=src)
    assert not src.exists() and (runs / "k2" / "run.json").is_file()


def test_unpack_refuses_paths_out_of_the_directory(tmp_path):
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.TarError):
        unpack_dir(buf.getvalue(), tmp_path / "d")
    assert not (tmp_path / "escape.txt").exists()


def test_sweep_scratch_removes_only_dead_workers_dirs(tmp_path):
    import subprocess as sp

    from tensorverse.matrix.ray_executor import OWNER, sweep_scratch

    dead = sp.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for name, pid in (("tv-point-aa-1", int(dead.stdout)), ("tv-point-bb-2", os.getpid())):
        (tmp_path / name / "out").mkdir(parents=True)
        (tmp_path / name / OWNER).write_text(str(pid))
    (tmp_path / "tv-point-cc-3").mkdir()  # no owner file (being made): left alone
    assert sweep_scratch(tmp_path) == [tmp_path / "tv-point-aa-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tv-point-bb-2", "tv-point-cc-3"]


# -- one driver per output directory --------------------------------------------------------------

def test_second_driver_refuses(tmp_path):
    out = tmp_path / "results"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from tensorverse.matrix.outlock import output_lock
        with output_lock({str(out)!r}):
            print("locked", flush=True)
            time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputBusy, match=rf"in use by another tensorverse driver \(pid {holder.pid} on "):
            with output_lock(out):
                pass
        spec = tmp_path / "m.toml"
        spec.write_text(to_toml(base_spec(axes={"--dtype": ["bfloat16", "float32"]})))
        corpus = make_corpus(tmp_path / "corpus", n_cases=1, n_tokens=4)
        for cmd in (["matrix"], ["bisect", "--good", "dtype=bfloat16", "--bad", "dtype=float32", "--case", "case-0"]):
            r = subprocess.run([sys.executable, "-m", "tensorverse", *cmd, "--spec", str(spec), "--corpus",
                                str(corpus), "--out", str(out)], capture_output=True, text=True, timeout=120)
            assert r.returncode == 2, r.stderr
            assert f"is in use by another tensorverse driver (pid {holder.pid}" in r.stderr
            assert not (out / "runs").exists()  # nothing started
    finally:
        holder.kill()
        holder.wait()
    with output_lock(out):  # the holder is gone: the kernel released its lock
        pass


# -- without Ray ----------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", [
    ["matrix", "--spec", "S", "--corpus", "C", "--out", "O"],
    ["bisect", "--spec", "S", "--corpus", "C", "--out", "O", "--good", "a", "--bad", "b", "--case", "x"],
    ["replay", "C", "--backend", "a=http://127.0.0.1:9/v1"],
])
def test_executor_ray_without_ray_says_how_to_install(tmp_path, cmd):
    spec = tmp_path / "m.toml"
    spec.write_text(to_toml(base_spec(axes={"--dtype": ["bfloat16", "float32"]})))
    corpus = make_corpus(tmp_path / "corpus", n_cases=1, n_tokens=4)
    argv = [{"S": str(spec), "C": str(corpus), "O": str(tmp_path / "out")}.get(a, a) for a in cmd]
    # sys.modules["ray"] = None: `import ray` raises ImportError, as where Ray is not installed
    code = ("import sys; sys.modules['ray'] = None; from tensorverse.cli import main; "
            f"sys.exit(main({[*argv, '--executor', 'ray']!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert RAY_MISSING in r.stderr
    assert "pip install 'tensorverse[ray]'" in r.stderr
    assert not (tmp_path / "out" / "runs").exists()


# -- progress -------------------------------------------------------------------------------------

def test_cluster_progress_lines():
    lines: list[str] = []
    p = ClusterProgress(["a", "b"], log=lines.append, enabled=True, console=None)
    p.update({"a": PointState("running", "worker-1", "10.0.0.7", 11, 1)})
    p.update({"a": PointState("running", "worker-1", "10.0.0.7", 11, 1, note="ready in 60 s")})  # no new line
    p.update({"a": PointState("running", "worker-2", "10.0.0.8", 12, 2)})  # a retry, elsewhere
    p.finished("a", "ok")
    p.finished("b", "task_failed", "NodeDiedError: node lost")
    p.close()
    assert lines == [
        "a: running on worker-1 (10.0.0.7) [1 queued, 1 running, 0 done, 0 failed]",
        "a: running on worker-2 (10.0.0.8), attempt 2 [1 queued, 1 running, 0 done, 0 failed]",
        "a: done: ok on worker-2 (10.0.0.8) [1 queued, 0 running, 1 done, 0 failed]",
        "b: failed: task_failed on ? (NodeDiedError: node lost) [0 queued, 0 running, 1 done, 1 failed]",
    ]


def test_cluster_progress_rich_display():
    from rich.console import Console

    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=120, color_system=None)
    p = ClusterProgress(["dtype=float32", "broken"], log=lambda s: None, console=con)
    p.update({"dtype=float32": PointState("running", "worker-3", "10.0.0.9", 5, 2)})
    p._live.refresh()
    shown = buf.getvalue()
    assert "matrix (ray)" in shown and "0/2" in shown
    assert "dtype=float32: running on worker-3 (10.0.0.9), attempt 2" in shown
    assert "broken: queued" in shown
    p.finished("dtype=float32", "ok")
    p.finished("broken", "start_failed")
    p.close()
    assert "2/2" in buf.getvalue()


# -- a whole matrix on a local Ray cluster (no vLLM) -----------------------------------------------

@pytest.mark.ray
def test_ray_matrix_of_points_that_cannot_start(tmp_path, capsys):
    """The Ray executor end to end, in seconds: every point's interpreter exits at once, so each is
    ``start_failed``; the report equals the local executor's, run directories came back through
    the object store (and, second run, through a shared directory), and a rerun is all cached."""
    import ray

    corpus = make_corpus(tmp_path / "corpus", n_cases=2, n_tokens=4)
    spec = base_spec(axes={"--dtype": ["bfloat16", "float32"]},
                     points=[{"name": "h200", "settings": {"TENSORVERSE_RAY_RESOURCES": "h200=1"}}])
    spec["server"]["python"] = "/bin/false"
    (tmp_path / "m.toml").write_text(to_toml(spec))
    common = ["matrix", "--spec", str(tmp_path / "m.toml"), "--corpus", str(corpus), "--json"]
    assert cli_main([*common, "--out", str(tmp_path / "local")]) == 0
    ray.init(address="local", num_cpus=2, resources={"h200": 1}, include_dashboard=False, log_to_driver=False)
    try:
        assert cli_main([*common, "--out", str(tmp_path / "ray"), "--executor", "ray"]) == 0
        shared = tmp_path / "shared"
        shared.mkdir()
        assert cli_main([*common, "--out", str(tmp_path / "ray-shared"), "--executor", "ray",
                         "--ray-shared-dir", str(shared)]) == 0
        assert cli_main([*common, "--out", str(tmp_path / "ray"), "--executor", "ray"]) == 0  # all cached
        # bisect through the same seam: the good point runs as a task, cannot start, bisect says so
        bis = ["bisect", "--spec", str(tmp_path / "m.toml"), "--corpus", str(corpus), "--out", str(tmp_path / "bis"),
               "--good", "dtype=bfloat16", "--bad", "dtype=float32", "--case", "case-0", "--executor", "ray"]
        assert cli_main(bis) == 2
        assert "point 'dtype=bfloat16' did not run: start_failed" in capsys.readouterr().err
        bis_runs = [json.loads(p.read_text()) for p in (tmp_path / "bis" / "runs").glob("*/run.json")]
        assert bis_runs and all(r["placement"]["executor"] == "ray" for r in bis_runs)
        # Ray assigns GPUs: a spec that pins devices is refused before anything runs
        pinned = dict(spec, server=dict(spec["server"], env=dict(spec["server"]["env"], CUDA_VISIBLE_DEVICES="0")))
        (tmp_path / "pinned.toml").write_text(to_toml(pinned))
        assert cli_main(["matrix", "--spec", str(tmp_path / "pinned.toml"), "--corpus", str(corpus),
                         "--out", str(tmp_path / "pinned"), "--executor", "ray"]) == 2
        assert "CUDA_VISIBLE_DEVICES is set by the spec" in capsys.readouterr().err
        assert not (tmp_path / "pinned" / "runs").exists()
    finally:
        ray.shutdown()
    loc = json.loads((tmp_path / "local" / "matrix.json").read_text())
    for d in ("ray", "ray-shared"):
        rep = json.loads((tmp_path / d / "matrix.json").read_text())
        assert [(p["name"], p["status"], p["key"], p["error"]) for p in rep["points"]] == \
            [(p["name"], p["status"], p["key"], p["error"]) for p in loc["points"]]
        for p in rep["points"]:
            run = json.loads((tmp_path / d / "runs" / p["key"] / "run.json").read_text())
            assert run["placement"]["executor"] == "ray" and run["placement"]["attempt"] == 1
            assert "/bin/false -m vllm.entrypoints.openai.api_server" in (tmp_path / d / "runs" / p["key"] / "server.log").read_text()
        assert sorted(x.name for x in (tmp_path / d / "runs").iterdir()) == sorted(p["key"] for p in rep["points"])
    assert list((shared / ".tensorverse-tasks").iterdir()) == []  # moved into OUT, scratch removed
    assert [p["status"] for p in loc["points"]] == ["start_failed"] * 3
