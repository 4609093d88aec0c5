"""One vLLM launcher (matrix/launcher.py): the rig's servers and the matrix's points build their
command line and environment through it, so the same configuration starts the same way."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tensorverse.matrix.launcher import Launch, ServerProcess
from tensorverse.matrix.spec import MatrixSpec, ModelSection, PointSection, ReplaySection, ServerSection, server_settings
from tensorverse.rig.servers import BASE_ENV, VLLMServer, parse_options


def _portless(cmd):
    return [("PORT" if i and cmd[i - 1] == "--port" else a) for i, a in enumerate(cmd)]


def test_a_rig_server_and_a_matrix_point_of_the_same_config_start_with_the_same_argv(tmp_path):
    rig = VLLMServer("fp8", "/models/tiny-a", "bfloat16", ("--kv-cache-dtype", "fp8"), served_model_name="tiny-a",
                     log_dir=tmp_path)
    opts = {"--dtype": "bfloat16", "--max-model-len": 2048, "--max-logprobs": -1, "--max-num-seqs": 8, "--seed": 0,
            "--enforce-eager": True, "--kv-cache-memory-bytes": 64 * 1024 * 1024}
    spec = MatrixSpec(model=ModelSection(path="/models/tiny-a", served_name="tiny-a"),
                      points=[PointSection(name="fp8", settings={"--kv-cache-dtype": "fp8"})],
                      server=ServerSection(options=opts, env=dict(BASE_ENV)), replay=ReplaySection())
    point = ServerProcess(Launch(model=spec.model.path, served_name=spec.served_name,
                                 settings=server_settings(spec.effective({"--kv-cache-dtype": "fp8"})),
                                 log_path=tmp_path / "p.log", python=rig.python))
    assert _portless(rig.command()) == _portless(point.command())
    env = rig.environment()
    assert all(env[k] == v for k, v in BASE_ENV.items())


def test_rig_server_environment_removes_a_variable_given_none_and_follows_later_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("GONE", "1")
    s = VLLMServer("x", "/m", "float32", env={"GONE": None}, log_dir=tmp_path)
    s.extra_env["TENSORVERSE_CAPTURE_SINK"] = "dir:/tmp/store"  # as the on-demand rig sets it
    env = s.environment()
    assert "GONE" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env  # the flag's value wins
    assert env["TENSORVERSE_CAPTURE_SINK"] == "dir:/tmp/store"
    assert "--dtype" in s.command() and s.command()[s.command().index("--dtype") + 1] == "float32"


def test_parse_options_reads_vllm_argv_forms():
    assert parse_options(["--a", "1", "--flag", "--b=x", "--c", "p", "q", "--max-logprobs", "-1"]) == {
        "--a": "1", "--flag": True, "--b": "x", "--c": ["p", "q"], "--max-logprobs": "-1"}
    with pytest.raises(ValueError):
        parse_options(["stray", "--a", "1"])


def test_a_parallel_point_gets_the_mp_executor_and_one_core_share_per_rank(monkeypatch):
    from tensorverse.matrix import launcher as L

    monkeypatch.setattr(L, "_cores", lambda: [0, 1])
    tp2 = {"--tensor-parallel-size": 2, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cmd = L.build_command("py", "m", "m", 1, tp2)
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "mp"
    assert L.build_env(tp2, None, base={})["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    # a binding the settings give, or an executor they name, is theirs; one rank is left alone
    assert L.build_env({**tp2, "VLLM_CPU_OMP_THREADS_BIND": "1|0"}, None, base={})["VLLM_CPU_OMP_THREADS_BIND"] == "1|0"
    ray = L.build_command("py", "m", "m", 1, {**tp2, "--distributed-executor-backend": "ray"})
    assert ray[ray.index("--distributed-executor-backend") + 1] == "ray"
    assert "--distributed-executor-backend" not in L.build_command("py", "m", "m", 1, {"--dtype": "bfloat16"})
    assert L.build_env({}, None, base={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_rank_binding_splits_the_cores_into_equal_contiguous_shares():
    from tensorverse.matrix.launcher import rank_binding

    assert rank_binding(2, [0, 1]) == "0|1"
    assert rank_binding(2, list(range(16))) == "0-7|8-15"
    assert rank_binding(2, [0, 1, 2, 4, 5, 6, 9]) == "0-2|4-6"  # the odd core left over
    assert rank_binding(1, [3, 5, 6]) == "3,5-6"
    with pytest.raises(ValueError):
        rank_binding(4, [0, 1])


def test_a_point_with_more_ranks_than_cores_is_refused_with_the_count():
    from tensorverse.matrix.launcher import cores_refusal, parallel_ranks

    assert parallel_ranks({}) == 1 and parallel_ranks({"--tensor-parallel-size": 2, "--pipeline-parallel-size": 2}) == 4
    assert cores_refusal({"--tensor-parallel-size": 2}, cores=2) is None
    why = cores_refusal({"--tensor-parallel-size": 2, "--pipeline-parallel-size": 2}, cores=2)
    assert why is not None and "4 ranks" in why and "has 2" in why
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ValueError):
            parallel_ranks({"--tensor-parallel-size": bad})


def _fake_vllm(tmp_path):
    """An executable that stands for the server's Python: it leaves a socket-like file in
    ``$VLLM_RPC_BASE_PATH``, as vLLM's ZMQ sockets do, and runs until it is stopped."""
    exe = tmp_path / "python"
    exe.write_text('#!/bin/sh\ntouch "$VLLM_RPC_BASE_PATH/ipc-socket"\nexec sleep 60\n')
    exe.chmod(0o755)
    return str(exe)


def _started(tmp_path, name, ipc_dir=None):
    """A server of the stand-in, once its socket file is in ``ipc_dir`` (default: its own)."""
    s = ServerProcess(Launch(model="m", served_name="m", settings={}, log_path=tmp_path / f"{name}.log",
                             python=_fake_vllm(tmp_path)))
    s.start()
    where = Path(ipc_dir or s.ipc_dir)
    deadline = time.monotonic() + 10
    while not (where / "ipc-socket").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return s


def test_each_server_keeps_its_ipc_sockets_in_a_directory_of_its_own_removed_when_it_stops(tmp_path, monkeypatch):
    """vLLM leaves its ZMQ sockets in the temporary directory when it is killed; each server
    started here gets a private ``VLLM_RPC_BASE_PATH`` instead, removed once it has stopped."""
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    a, b = _started(tmp_path, "a"), _started(tmp_path, "b")
    try:
        dirs = [Path(a.ipc_dir), Path(b.ipc_dir)]
        assert dirs[0] != dirs[1] and all((d / "ipc-socket").exists() for d in dirs)
    finally:
        a.stop(grace_s=2)
        b.stop(grace_s=2)
    assert a.ipc_dir is None and not any(d.exists() for d in dirs)


def test_a_vllm_rpc_base_path_the_user_set_is_kept(tmp_path, monkeypatch):
    mine = tmp_path / "my-ipc"
    mine.mkdir()
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(mine))
    s = _started(tmp_path, "c", ipc_dir=mine)
    try:
        assert s.ipc_dir is None
        assert (mine / "ipc-socket").exists()
    finally:
        s.stop(grace_s=2)
    assert (mine / "ipc-socket").exists()  # not ours to remove
