"""Real vLLM (CPU) servers for integration tests and the demo.

    from tensorverse.rig.servers import VLLMServer, standard_rig, start_many

    with VLLMServer("primary", model_dir, "bfloat16") as s:
        s.wait_ready(600)
        ... s.url ...   # http://127.0.0.1:PORT/v1

Each server is started by the project's one launcher (:mod:`tensorverse.matrix.launcher`, which
``tensorverse matrix`` and ``rig run`` use too): ``python -m vllm.entrypoints.openai.api_server``
in its own process group (so ``stop()`` reaches the engine-core and worker processes too), on a
free loopback port, with its output in ``log_path``. The environment keeps several servers on a 2-core machine from fighting:

* ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``OMP_NUM_THREADS=1``: vLLM's default ("auto") pins
  every server's worker to the same core (core 0; it reserves the last core for the engine
  process), so several servers would queue on one core while the other idles. Unpinned
  single-threaded workers let the kernel spread them. One thread also makes a model's numerics
  independent of the machine's core count.
* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the CPU platform then keeps the "uni" executor, so the
  model runs inside the engine-core process instead of a third process (API server + engine core
  only). Measured: ready in ~40 s instead of ~54 s, ~0.6 GB less RSS. (A GPU vLLM with TP=1 also
  runs the uni executor; logits processors load the same way.)
* ``--enforce-eager``: no torch.compile warm-up (ready in ~40 s instead of ~85 s, even with a warm
  compile cache); the tokens were the same on the probe prompts.
* ``--kv-cache-memory-bytes 64MiB`` (and ``VLLM_CPU_KVCACHE_SPACE`` removed from the environment,
  since it would override the flag): a small, explicit KV cache. ``VLLM_CPU_KVCACHE_SPACE=1``
  (its minimum) made each server ~1 GB bigger (3.15 GB RSS instead of 2.15 GB).
* ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``: nothing is fetched from a hub.

Start servers from the main thread: each child gets ``PR_SET_PDEATHSIG`` (SIGTERM) so it goes away
if the test process dies without cleaning up, and Linux delivers that when the *thread* that
started it ends.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from tensorverse.matrix.launcher import Launch, ServerProcess, StartError, build_env, group_pids

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_NUM_SEQS = 8
# 64 MiB of KV cache: 131k tokens of tiny-a in bf16 (43k for 3-layer tiny-b in float32), far more
# than max_num_seqs x max_model_len. VLLM_CPU_KVCACHE_SPACE counts whole GiB (1 GiB minimum, and
# it is resident): the explicit flag saves ~1 GB RSS per server.
DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024
DEFAULT_READY_TIMEOUT = float(os.environ.get("TENSORVERSE_RIG_READY_TIMEOUT", "900"))

BASE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


class RigError(RuntimeError):
    pass


def _log_dir() -> Path:
    d = os.environ.get("TENSORVERSE_RIG_LOGS")
    p = Path(d) if d else Path(tempfile.gettempdir()) / f"tensorverse-rig-{os.getpid()}"
    p.mkdir(parents=True, exist_ok=True)
    return p



def _mem_kib(pid: int, key: str) -> int:
    src = "smaps_rollup" if key == "Pss" else "status"
    field_name = "Pss:" if key == "Pss" else "VmRSS:"
    try:
        for line in Path(f"/proc/{pid}/{src}").read_text().splitlines():
            if line.startswith(field_name):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


_live: "weakref.WeakSet[VLLMServer]" = weakref.WeakSet()


def stop_many(servers, grace: float = 8.0) -> None:
    """Stop several servers at once: SIGTERM all groups, then reap (SIGKILL after ``grace``)."""
    servers = list(servers)
    for s in servers:
        try:
            s._terminate()
        except Exception:  # noqa: BLE001 - best effort
            pass
    deadline = time.monotonic() + grace
    for s in servers:
        try:
            s._reap(deadline)
        except Exception:  # noqa: BLE001 - best effort
            pass


def stop_all() -> None:
    """Stop every server this process started that may still run (atexit guard)."""
    stop_many(list(_live))


atexit.register(stop_all)


def parse_options(argv: Sequence[str]) -> dict[str, Any]:
    """vLLM command-line options as launcher settings: ``--x v`` -> ``{"--x": "v"}``, ``--x=v``
    likewise, ``--flag`` -> ``True``, ``--x a b`` -> ``["a", "b"]``. Tokens before the first
    option are refused."""
    out: dict[str, Any] = {}
    key: str | None = None
    for tok in argv:
        tok = str(tok)
        if tok.startswith("--"):
            name, eq, val = tok.partition("=")
            key = name
            out[key] = val if eq else True
        elif key is None:
            raise ValueError(f"vLLM argument {tok!r} before any --option")
        elif out[key] is True:
            out[key] = tok
        elif isinstance(out[key], list):
            out[key].append(tok)
        else:
            out[key] = [out[key], tok]
    return out


class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process group, started by the project's one
    launcher (:class:`tensorverse.matrix.launcher.ServerProcess`: the command line, the
    environment, readiness and stopping): this class only says what the rig's servers run with
    (the options and environment above), so a rig server and a matrix point with the same settings
    start with the same argv."""

    def __init__(
        self,
        name: str,
        model_dir: str | os.PathLike,
        dtype: str,
        extra_args: tuple[str, ...] | list[str] = (),
        env: Mapping[str, str | None] | None = None,
        *,
        served_model_name: str | None = None,
        port: int | None = None,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        enforce_eager: bool = True,
        kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES,
        log_dir: str | os.PathLike | None = None,
        python: str | None = None,
    ) -> None:
        self.name = name
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(env or {})
        self.model = served_model_name or self.model_dir.name
        self.host = "127.0.0.1"
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.enforce_eager = enforce_eager
        self.kv_cache_bytes = kv_cache_bytes
        self.python = python or sys.executable
        self.log_path = Path(log_dir or _log_dir()) / f"{name}.log"
        self._server = ServerProcess(self._launch(), port=port)
        self.ready_after_s: float | None = None

    # -- what the server runs with ----------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The launcher's settings: options (sorted by name, as a matrix point's) then the
        environment (``BASE_ENV`` and this server's variables; None removes one)."""
        opts: dict[str, Any] = {"--dtype": self.dtype, "--max-model-len": self.max_model_len, "--max-logprobs": -1,
                                "--max-num-seqs": self.max_num_seqs, "--seed": 0}
        if self.enforce_eager:
            opts["--enforce-eager"] = True
        if self.kv_cache_bytes is not None:
            opts["--kv-cache-memory-bytes"] = self.kv_cache_bytes
        opts.update(parse_options(self.extra_args))
        env = {**BASE_ENV, **{k: ("" if v is None else v) for k, v in self.extra_env.items()}}
        return {**dict(sorted(opts.items())), **env}

    def _launch(self) -> Launch:
        return Launch(model=str(self.model_dir), served_name=self.model, settings=self.settings(),
                      log_path=self.log_path, python=self.python)

    # -- addresses -------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._server.port

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """OpenAI base URL (``.../v1``)."""
        return self.base + "/v1"

    @property
    def proc(self) -> subprocess.Popen | None:
        return self._server.proc

    @property
    def started_at(self) -> float | None:
        return self._server.started_at

    def command(self) -> list[str]:
        self._server.launch = self._launch()
        return self._server.command()

    def environment(self) -> dict[str, str]:
        return build_env(self.settings(), None)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "VLLMServer":
        if self.running():
            return self
        self._server.launch = self._launch()  # extra_env may have changed since construction
        self._server.start()
        _live.add(self)
        return self

    def running(self) -> bool:
        return self._server.running()

    def _get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """GET ``path`` on the server: (status, body); (0, b"") when nothing answers."""
        return self._server._get(path, timeout=timeout)

    def wait_ready(self, timeout: float = DEFAULT_READY_TIMEOUT) -> "VLLMServer":
        """Poll ``/health`` then ``/v1/models``; raise with the log tail if the process exits
        first or ``timeout`` passes (the server is then stopped)."""
        if self.proc is None:
            raise RigError(f"{self.name}: not started")
        try:
            self.ready_after_s = self._server.wait_ready(timeout)
        except StartError as e:
            raise RigError(f"vLLM server {self.name!r}: {e}; log {self.log_path}:\n{e.log_tail}") from None
        return self

    def stop(self, grace: float = 8.0) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after ``grace`` seconds."""
        self._terminate()
        self._reap(time.monotonic() + grace)

    def _terminate(self) -> None:
        self._server.terminate()

    def _reap(self, deadline: float) -> None:
        self._server.reap(deadline)
        _live.discard(self)

    def __enter__(self) -> "VLLMServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- diagnostics -----------------------------------------------------------------------
    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the log, without health polls and the route listing."""
        return self._server.log_tail(lines)

    def pids(self) -> list[int]:
        return group_pids(self.proc.pid) if self.proc is not None else []

    def memory(self) -> dict[str, int]:
        """RSS and PSS (bytes) summed over the server's processes (PSS splits shared pages)."""
        pids = self.pids()
        return {
            "processes": len(pids),
            "rss": 1024 * sum(_mem_kib(p, "VmRSS") for p in pids),
            "pss": 1024 * sum(_mem_kib(p, "Pss") for p in pids),
        }

    def __repr__(self) -> str:
        return f"VLLMServer({self.name!r}, model={self.model!r}, dtype={self.dtype!r}, url={self.url!r})"


def start_many(servers: list[VLLMServer], timeout: float = DEFAULT_READY_TIMEOUT, *,
               on_ready: Callable[[VLLMServer], None] | None = None,
               on_wait: Callable[[list[VLLMServer], float], None] | None = None,
               note_every_s: float = 20.0) -> list[VLLMServer]:
    """Start all servers (from this thread), wait for all concurrently; on any failure stop all.
    ``on_ready(server)`` is called as each becomes ready, in the order they do; ``on_wait(pending,
    elapsed_s)`` whenever ``note_every_s`` pass with none ready (progress for a person waiting)."""
    try:
        for s in servers:
            s.start()
        t0 = time.monotonic()
        # No `with`: on Ctrl-C the pool must not wait for the pollers; stopping the servers below
        # makes their processes exit, and the pollers then return at once.
        pool = ThreadPoolExecutor(max_workers=max(1, len(servers)), thread_name_prefix="vllm-ready")
        try:
            futures = {pool.submit(s.wait_ready, timeout): s for s in servers}
            errors: list[Exception] = []
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=note_every_s, return_when=FIRST_COMPLETED)
                for f in sorted(done, key=lambda f: servers.index(futures[f])):
                    try:
                        f.result()
                    except Exception as e:  # noqa: BLE001 - collect every server's failure
                        errors.append(e)
                    else:
                        if on_ready is not None:
                            on_ready(futures[f])
                if pending and not done and on_wait is not None:
                    on_wait([futures[f] for f in futures if f in pending], time.monotonic() - t0)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if errors:
            raise RigError("\n\n".join(str(e) for e in errors))
    except BaseException:
        stop_many(servers)
        raise
    return servers


# -- the standard rig ----------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    name: str
    model: str  # a key of rig.models.SPECS
    dtype: str
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def standard_rig() -> list[ServerSpec]:
    """The servers every integration test shares: one model in three dtypes, plus another model."""
    return [
        ServerSpec("primary", "tiny-a", "bfloat16"),
        ServerSpec("fp32", "tiny-a", "float32"),
        ServerSpec("fp16", "tiny-a", "float16"),
        ServerSpec("model_b", "tiny-b", "bfloat16"),
    ]


# Servers started only by the tests that ask for them (the ``rig_extra`` fixture), each with the
# capture plugin writing into its own store. bfloat16 twice (the noise floor: rows must be
# bit-identical) and the quantizations vLLM-CPU 0.32 runs on this model without a pre-quantized
# checkpoint (measured in docs/matrix.md, "What changes numerics on vLLM-CPU").
FP8_KV_REFUSAL = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"  # vLLM-CPU 0.32's own words


def cpu_has_fp8_kv_cache(cpuinfo: str | None = None) -> bool:
    """Whether vLLM-CPU 0.32 can store an FP8 KV cache here: only on x86 CPUs with AVX-512 or AMX
    (an AVX2-only CPU, e.g. some AMD EPYC machines, refuses with ``FP8_KV_REFUSAL`` at engine start;
    FP8 *weights* work there). ``cpuinfo``: the text of /proc/cpuinfo (read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return "avx512f" in flags or "amx_tile" in flags


QUANT_SERVERS: dict[str, ServerSpec] = {
    s.name: s
    for s in (
        ServerSpec("bf16", "tiny-a", "bfloat16"),
        ServerSpec("bf16_b", "tiny-a", "bfloat16"),
        # FP8 (e4m3) KV cache: keys and values stored as fp8 with scale 1.0; the decode path's
        # attention reads them back. "fp8" and "fp8_e4m3" are the same thing on vLLM-CPU.
        ServerSpec("fp8_kv", "tiny-a", "bfloat16", ("--kv-cache-dtype", "fp8")),
        ServerSpec("fp8_e5m2_kv", "tiny-a", "bfloat16", ("--kv-cache-dtype", "fp8_e5m2")),
        # online FP8 weights (per-output-channel scales, quantized at load time from bf16)
        ServerSpec("fp8_weights", "tiny-a", "bfloat16", ("--quantization", "fp8_per_channel")),
    )
}


# Servers that ship their rows over the capture plugin's HTTP sink, as a production recorder
# receives them, to one address that the test of the moment serves (the ``capture_rig`` fixture):
# the plugin's tests (a small ingest endpoint), the shadow runner's (the recorder's own ingest) and
# the turnstone test (the proxy's admin listener). A context of 8,192 tokens (turnstone's prompts
# need it); the bf16 server prefills at most 1,024 tokens a step (an explicit budget, which vLLM
# logs at start: "Chunked prefill is enabled with max_num_batched_tokens=1024"), so a longer prompt
# is prefilled in chunks, while every prompt of the shadow-runner tests (under 200 tokens) fits in one.
CAPTURE_MAX_MODEL_LEN = 8192
CAPTURE_PREFILL_CHUNK = 1024
CAPTURE_SERVERS: dict[str, ServerSpec] = {
    s.name: s
    for s in (
        ServerSpec("bf16", "tiny-a", "bfloat16", ("--max-num-batched-tokens", str(CAPTURE_PREFILL_CHUNK))),
        # the row reduction on the engine's device (the host here), as a GPU shadow would run it
        ServerSpec("fp32", "tiny-a", "float32", env={"TENSORVERSE_CAPTURE_REDUCE": "device"}),
    )
}


def make_servers(specs: list[ServerSpec], **kwargs) -> list[VLLMServer]:
    """Build the models (cached) and create (not start) a server per spec.

    The served model name is the model spec's name (``tiny-a``, ``tiny-b``): backends that serve
    the same weights answer to the same name, as a production primary and its shadows do.
    """
    from tensorverse.rig.models import build_model

    out = []
    for sp in specs:
        out.append(
            VLLMServer(
                sp.name,
                build_model(sp.model),
                sp.dtype,
                sp.extra_args,
                sp.env,
                served_model_name=sp.model,
                **kwargs,
            )
        )
    return out


class OnDemandRig:
    """Servers of ``specs`` (default ``QUANT_SERVERS``), each started the first time a test asks
    for it and kept for the session. Without ``sink``, the capture plugin of each writes its rows
    to ``server.store`` (an LMDB store of its own, ``dir:`` sink); with ``sink`` (an ingest URL and
    its token), every server ships its rows there over HTTP, and whoever serves that address
    receives them. At most ``max_live`` of them run at once: asking for another stops the one used
    least recently (its store stays readable). ``close()`` stops all."""

    def __init__(self, root: str | os.PathLike, max_live: int = 2, *, specs: Mapping[str, ServerSpec] | None = None,
                 sink: tuple[str, str] | None = None, **server_kwargs) -> None:
        self.root = Path(root)
        self.max_live = max(1, int(max_live))
        self.specs = dict(QUANT_SERVERS if specs is None else specs)
        self.sink = sink
        self.server_kwargs = server_kwargs
        self.servers: dict[str, VLLMServer] = {}  # every server started, running or not
        self._used: list[str] = []  # running servers, least recently used first
        self.starts = 0

    def spec(self, name: str) -> ServerSpec:
        """The spec of one of this rig's servers; the error lists the names."""
        try:
            return self.specs[name]
        except KeyError:
            raise RigError(f"no on-demand rig server {name!r}; known: {', '.join(self.specs)}") from None

    def get(self, name: str, timeout: float = DEFAULT_READY_TIMEOUT) -> VLLMServer:
        spec = self.spec(name)
        s = self.servers.get(name)
        if s is not None and s.running():
            self._used.remove(name)
            self._used.append(name)
            return s
        if name in self._used:  # it exited on its own: start it again
            self._used.remove(name)
        while len(self._used) >= self.max_live:
            self.stop(self._used[0])
        if s is None:
            (s,) = make_servers([spec], log_dir=self.root / "logs", **self.server_kwargs)
            if self.sink is None:
                store = self.root / name / "store"
                s.extra_env["TENSORVERSE_CAPTURE_SINK"] = f"dir:{store}"
                s.store = store  # type: ignore[attr-defined]
            else:
                s.extra_env["TENSORVERSE_CAPTURE_SINK"], s.extra_env["TENSORVERSE_CAPTURE_TOKEN"] = self.sink
            self.servers[name] = s
        s.start()
        self.starts += 1
        try:
            s.wait_ready(timeout)
        except BaseException:
            s.stop()
            raise
        self._used.append(name)
        return s

    def running(self) -> list[str]:
        return [n for n in self._used if self.servers[n].running()]

    def stop(self, name: str) -> None:
        s = self.servers.get(name)
        if s is not None:
            s.stop()
        if name in self._used:
            self._used.remove(name)

    def close(self) -> None:
        stop_many([self.servers[n] for n in self._used])
        self._used.clear()

    def __iter__(self):
        return iter(self.servers.values())


def main(argv: list[str]) -> int:
    """``python -m tensorverse.rig.servers [name ...]``: start servers of the standard rig (or the
    named ones, on-demand servers included), print their URLs, and keep them until Ctrl-C."""
    known = {s.name: s for s in standard_rig()} | QUANT_SERVERS
    unknown = [a for a in argv if a not in known]
    if unknown:
        print(f"unknown server(s) {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    specs = [known[a] for a in argv] if argv else standard_rig()
    servers = make_servers(specs)
    t0 = time.monotonic()
    start_many(servers)
    for s in servers:
        print(f"{s.name}\t{s.model}\t{s.dtype}\t{s.url}\tready {s.ready_after_s:.0f} s\t{s.log_path}")
    print(f"all ready in {time.monotonic() - t0:.0f} s; Ctrl-C stops them", flush=True)
    try:
        while all(s.running() for s in servers):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        stop_many(servers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
