"""``tensorverse rig run`` without servers: the weights are checked before anything starts, the
shipped corpus is a known corpus, a bad suite or setting is a usage error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tensorverse.cli import main as cli_main
from tensorverse.rig.suite import CPU_V1, DEFAULT_SUITE, known_corpora, suite


def test_the_shipped_corpus_is_known_and_names_the_shipped_demo_model():
    from tensorverse.demo import shipped

    k = known_corpora()[suite(DEFAULT_SUITE).corpus]
    assert k.model == {"name": "netops-demo", "content_hash": shipped.content_hash()}
    # the earlier suites' corpus keeps naming the model it was recorded from (1,500 steps)
    assert known_corpora()[CPU_V1.corpus].model["content_hash"].startswith("4195492058")
    assert k.cases == 8 and k.positions == sum(len(v) for v in k.tokens.values()) > 200
    ident = k.identity()
    assert ident["manifest_sha256"] == __import__("hashlib").sha256((k.path / "corpus.json").read_bytes()).hexdigest()


def test_weights_of_another_model_are_refused_before_any_server_starts(tmp_path, capsys, monkeypatch):
    from tensorverse.rig.models import build_model
    from tensorverse.matrix import run as matrix_run

    started = []
    monkeypatch.setattr(matrix_run, "run_config", lambda *a, **k: started.append(a) or {})
    other = build_model("tiny-a")
    code = cli_main(["rig", "run", "--out", str(tmp_path / "b.tvbundle"), "--model", str(other)])
    err = capsys.readouterr().err
    assert code == 2 and not started and not (tmp_path / "b.tvbundle").exists()
    assert "every rig must run the same weights" in err and "refused" in err


def test_unknown_suite_or_setting_is_a_usage_error(tmp_path, capsys):
    assert cli_main(["rig", "run", "--out", str(tmp_path / "b"), "--suite", "gpu-v9"]) == 2
    assert "no suite 'gpu-v9'" in capsys.readouterr().err
    assert cli_main(["rig", "run", "--out", str(tmp_path / "b"), "--settings", "fp9"]) == 2
    assert "no setting fp9" in capsys.readouterr().err


def test_rig_suites_lists_every_setting(capsys):
    assert cli_main(["rig", "suites"]) == 0
    out = capsys.readouterr().out
    for s in CPU_V1.settings:
        assert s.name in out


def test_fingerprint_reads_the_cpu_flags_vllm_cpu_depends_on():
    from tensorverse.rig.fingerprint import rig_fingerprint

    fp = rig_fingerprint("model name\t: Test CPU\nflags\t\t: fpu avx2 avx512f amx_tile sse\n")
    assert fp["cpu"]["model"] == "Test CPU" and fp["cpu"]["flags"] == ["amx_tile", "avx2", "avx512f"]
    assert json.loads(json.dumps(fp)) == fp  # JSON-ready, as the manifest needs


def test_bundle_commands_say_which_extra_to_install_when_pyarrow_is_missing(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("pyarrow", "duckdb") else real(n, *a))
    for argv in (["rig", "run", "--out", str(tmp_path / "b")], ["report", "check", str(tmp_path / "b")],
                 ["hypercube", "build", str(tmp_path / "b"), "--site", str(tmp_path / "s")]):
        assert cli_main(argv) == 2
        assert "pip install 'tensorverse[rig]'" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_cpu_v2_adds_the_parallel_axis_refusing_what_this_machine_cannot_run(monkeypatch, capsys):
    from tensorverse.matrix import launcher
    from tensorverse.rig.suite import CPU_V2, PP_REFUSAL

    assert [s.name for s in CPU_V2.settings] == [s.name for s in CPU_V1.settings] + ["tp2", "pp2"]
    assert CPU_V2.corpus == CPU_V1.corpus and CPU_V2.setting("tp2").options == {"--tensor-parallel-size": 2}
    monkeypatch.setattr(launcher, "_cores", lambda: [0, 1])
    assert CPU_V2.setting("tp2").refusal() is None
    monkeypatch.setattr(launcher, "_cores", lambda: [0])
    assert "2 ranks" in CPU_V2.setting("tp2").refusal()
    assert CPU_V2.setting("pp2").refusal() == PP_REFUSAL
    assert cli_main(["rig", "suites"]) == 0
    assert "tp2" in capsys.readouterr().out


def test_cpu_v4_is_the_default_cpu_v3s_settings_over_the_shipped_models_corpus():
    from tensorverse.rig.suite import CPU_V3, CPU_V4

    assert DEFAULT_SUITE == "cpu-v4" and CPU_V4.settings == CPU_V3.settings
    assert CPU_V4.corpus == "demo-netops-v2" != CPU_V3.corpus
    assert (CPU_V4.reference, CPU_V4.noise, CPU_V4.base_options) == (CPU_V3.reference, CPU_V3.noise, CPU_V3.base_options)


def test_cpu_v3_starts_tp2_twice_for_its_own_noise(monkeypatch):
    from tensorverse.matrix import launcher
    from tensorverse.rig.suite import CPU_V2, CPU_V3

    assert CPU_V3.corpus == CPU_V1.corpus
    assert [s.name for s in CPU_V3.settings] == [s.name for s in CPU_V2.settings] + ["tp2_noise"]
    tp2, noise = CPU_V3.setting("tp2"), CPU_V3.setting("tp2_noise")
    assert noise.options == tp2.options and noise.axis == tp2.axis == "parallel"
    # another server start of the same layout (vLLM ignores the variable; the rig runs it apart)
    assert dict(noise.env) == {"TENSORVERSE_RIG_REPLICA": "2"} and not tp2.env
    monkeypatch.setattr(launcher, "_cores", lambda: [0])
    assert "2 ranks" in noise.refusal()


def test_record_corpus_refuses_a_model_directory_without_a_checkpoint_or_a_name(tmp_path, capsys):
    from tensorverse.demo import record_corpus

    for argv in (["--model", str(tmp_path), "--out", str(tmp_path / "c"), "--name", "mine-v1"],
                 ["--model", str(tmp_path)]):
        (tmp_path / "config.json").unlink(missing_ok=True)
        if "--name" not in argv:
            (tmp_path / "config.json").write_text("{}")
        with pytest.raises(SystemExit) as e:
            record_corpus.main(argv)
        assert e.value.code == 2
    assert not (tmp_path / "c").exists()


def test_gpu_v1_dry_run_prints_every_point_and_refuses_each_without_its_gpus(monkeypatch, capsys):
    from tensorverse.rig import suite as S
    from tensorverse.rig.run import plan

    monkeypatch.setattr("tensorverse.replay.rig._gpus", lambda: None)  # a machine without nvidia-smi
    points = plan(S.GPU_V1, model_dir=Path("/models/qwen3-8b"))
    assert [p.name for p in points][:2] == ["bf16", "bf16_noise"] and len(points) == len(S.GPU_V1.settings)
    assert all(p.refusal == S.gpus_refusal(int(S.GPU_V1.setting(p.name).options.get("--tensor-parallel-size", 1)), 0)
               for p in points)
    tp8 = next(p for p in points if p.name == "tp8")
    assert tp8.command[tp8.command.index("--tensor-parallel-size") + 1] == "8"
    assert tp8.command[tp8.command.index("--model") + 1] == "/models/qwen3-8b" and "PORT" in tp8.command
    ring = next(p for p in points if p.name == "tp2_nccl_ring")
    assert ring.env["NCCL_ALGO"] == "Ring" and ring.env["VLLM_ATTENTION_BACKEND"] == "FLASH_ATTN"
    assert next(p for p in points if p.name == "attn_triton").env["VLLM_ATTENTION_BACKEND"] == "TRITON_ATTN"
    noise = next(p for p in points if p.name == "tp2_noise")
    assert noise.env["TENSORVERSE_RIG_REPLICA"] == "2" and "--tensor-parallel-size" in noise.command
    # a rig with 4 GPUs runs everything up to TP4
    monkeypatch.setattr("tensorverse.replay.rig._gpus", lambda: {"count": 4, "models": ["H100"]})
    monkeypatch.setattr("tensorverse.matrix.launcher.on_cpu", lambda: False)  # it has nvidia-smi
    refused = [p.name for p in plan(S.GPU_V1) if p.refusal]
    assert refused == ["tp8"]

    assert cli_main(["rig", "run", "--dry-run", "--suite", "gpu-v1", "--settings", "tp2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in out["points"]] == ["bf16", "bf16_noise", "tp2"]


def test_a_suite_without_a_shipped_corpus_asks_for_one(tmp_path, capsys):
    assert cli_main(["rig", "run", "--suite", "gpu-v1", "--out", str(tmp_path / "b.tvbundle")]) == 2
    assert "--corpus" in capsys.readouterr().err
    assert not (tmp_path / "b.tvbundle").exists()
