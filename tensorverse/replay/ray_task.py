"""``tensorverse replay --executor ray``: the replay as one Ray task on a cluster node.

A replay talks to servers that are already running (``--backend NAME=URL``), so what Ray adds is
*where* the client runs, not how many: inside the cluster, next to the backends (URLs that only
resolve there, ``127.0.0.1`` on the node that serves them: pin the task with
``--ray-resource node:IP=0.01``), while the driver can be a laptop connected with
``--ray-address ray://HEAD:10001``. The corpus travels to the node through Ray's object store;
the results file (and its ``.partial.jsonl`` journal), ``--store`` and ``--html`` are written at
the same paths on the node and, when the node is another host, come back through the object store
as tar bytes and are written at those paths here. The summary and messages the replay printed on
the node are printed here; the exit status is the replay's.

A lost node is retried by Ray (``--ray-max-retries``) from the start of the replay. Ctrl-C cancels
the task (the node's partial results are not brought back).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from tensorverse.cluster.options import RAY_MISSING, ExecutorOptions, ExecutorUnavailable
from tensorverse.cluster.transfer import pack_dir, unpack_dir

__all__ = ["run_replay_on_ray", "replay_task"]


def _outputs(opts: Any) -> list[Path]:
    paths = []
    if opts.out:
        paths += [Path(opts.out), Path(str(opts.out) + ".partial.jsonl")]
    if opts.store:
        paths.append(Path(opts.store))
    if opts.html:
        paths.append(Path(opts.html))
    return paths


def _pack_path(p: Path) -> bytes | None:
    if p.is_dir():
        return pack_dir(p)
    if p.is_file():
        return p.read_bytes()
    return None


def replay_task(corpus_blob: bytes, corpus_name: str, corpus_is_dir: bool, opts: Any, fail_on: Sequence[str],
                as_json: bool, driver_host: str) -> dict[str, Any]:
    """The body of the replay's Ray task."""
    import ray

    from tensorverse.replay.runner import run_replay

    host = socket.gethostname()
    work = Path(tempfile.mkdtemp(prefix="tv-replay-"))
    try:
        if corpus_is_dir:
            corpus = unpack_dir(corpus_blob, work / corpus_name)
        else:
            corpus = work / corpus_name
            corpus.write_bytes(corpus_blob)
        for p in _outputs(opts):
            p.parent.mkdir(parents=True, exist_ok=True)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = run_replay(str(corpus), dataclasses.replace(opts, progress=False), fail_on=fail_on, as_json=as_json)
        files = {}
        if host != driver_host:  # another machine: bring the outputs back
            files = {str(p): (p.is_dir(), _pack_path(p)) for p in _outputs(opts) if p.exists()}
        return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(), "host": host,
                "node_ip": ray.util.get_node_ip_address(), "files": files}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_replay_on_ray(corpus_path: str, opts: Any, *, fail_on: Sequence[str], as_json: bool,
                      ex: ExecutorOptions) -> int:
    """Run the replay as a Ray task; print what it printed; return its exit status."""
    try:
        import ray
    except ImportError:
        print(f"tensorverse replay: {RAY_MISSING}", file=sys.stderr)
        return 2
    corpus = Path(corpus_path)
    if not corpus.exists():
        print(f"tensorverse replay: {corpus_path}: no such corpus", file=sys.stderr)
        return 2
    # the same absolute paths on the node
    opts = dataclasses.replace(opts, out=Path(opts.out).resolve() if opts.out else None,
                               store=Path(opts.store).resolve() if opts.store else None,
                               html=Path(opts.html).resolve() if opts.html else None)
    owns = False
    if not ray.is_initialized():
        try:
            ray.init(address=ex.ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            print(f"tensorverse replay: {ExecutorUnavailable(f'cannot reach a Ray cluster: {e}')}", file=sys.stderr)
            return 2
        owns = True
    try:
        blob = pack_dir(corpus) if corpus.is_dir() else corpus.read_bytes()
        task = ray.remote(replay_task).options(
            name="tensorverse-replay", num_cpus=ex.cpus_per_point,
            num_gpus=0 if ex.gpus_per_point == "auto" else float(ex.gpus_per_point),
            resources=dict(ex.resources), max_retries=ex.max_retries, retry_exceptions=False)
        ref = task.remote(blob, corpus.name, corpus.is_dir(), opts, list(fail_on), as_json, socket.gethostname())
        if ex.progress:
            print("replay: running as a Ray task", file=sys.stderr)
        try:
            while True:
                ready, _ = ray.wait([ref], timeout=1.0)
                if ready:
                    break
            got = ray.get(ref)
        except KeyboardInterrupt:
            ray.cancel(ref, force=False)
            print("tensorverse replay: interrupted; the Ray task was cancelled", file=sys.stderr)
            return 130
        except ray.exceptions.RayError as e:
            cause = getattr(e, "cause", None) or e
            print(f"tensorverse replay: the Ray task failed: {type(cause).__name__}: {cause}", file=sys.stderr)
            return 1
        for path, (is_dir, data) in got["files"].items():
            if data is None:
                continue
            p = Path(path)
            if is_dir:
                if p.exists():
                    shutil.rmtree(p)
                unpack_dir(data, p)
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
        sys.stdout.write(got["stdout"])
        sys.stderr.write(got["stderr"])
        if ex.progress:
            print(f"replay: ran on {got['host']} ({got['node_ip']})", file=sys.stderr)
        return int(got["rc"])
    finally:
        if owns:
            ray.shutdown()

