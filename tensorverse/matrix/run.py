"""Capture one server configuration's runs of a corpus into a cached run directory.

``OUT/runs/<key>/`` (``key``: :func:`tensorverse.matrix.spec.settings_key` of the effective
settings, model, corpus and *basis*, so differently named points with the same settings, a
resumed matrix and a bisection all share one run):

``run.json``     status (``ok`` / ``start_failed`` / ``capture_failed``), settings, timings
                 (``start_s``, ``replay_s``, ``rows_wait_s``, ``stop_s``), cases, log excerpt;
                 written last, atomically: a directory without it is an unfinished run, redone
``index.json``   per case and turn: the store ids of its forced and free runs, the forced (basis)
                 tokens, the free tokens and text
``store/``       the LMDB store the capture plugin wrote the full-vocabulary rows into
``server.log``   the server's output

The basis. As in ``tensorverse replay`` (:mod:`tensorverse.replay.runner`), each turn's forced
tokens are the *reference configuration's* free output on the corpus prompt (scrubbing makes the
recorded output a poor stand-in), so the reference point runs first: free, then forced on its
own output. Every other point forces those same tokens (``basis``), so all forced rows align by
position and compare offline (:mod:`tensorverse.matrix.compare`): servers never need to run at
the same time (one GPU holds one model). When the reference cannot run, the recorded output is
the basis. Requests go through the shadow runner (:class:`tensorverse.shadow.runner.ShadowRunner`:
token-id prompts, the plugin's forced decoding and capture), one turn at a time per case, cases
in parallel (``replay.concurrency``); free runs use the recorded context of each turn.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from tensorverse.matrix.launcher import Launch, ServerProcess, StartError, cores_refusal
from tensorverse.matrix.layout import run_dir
from tensorverse.matrix.spec import MatrixSpec, server_settings, settings_key

if TYPE_CHECKING:
    from tensorverse.store.records import Run

__all__ = ["RunRequest", "run_config", "load_run", "run_dir", "BACKEND", "corpus_sha"]

BACKEND = "point"  # the backend name inside every cached run (its store and replay.json)


def corpus_sha(corpus_path: str | Path) -> str | None:
    m = Path(corpus_path) / "corpus.json"
    return hashlib.sha256(m.read_bytes()).hexdigest() if m.is_file() else None


def load_run(out: Path, key: str) -> dict[str, Any] | None:
    """The finished run of ``key``, or None."""
    p = run_dir(out, key) / "run.json"
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except ValueError:
        return None


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@dataclass
class RunRequest:
    spec: MatrixSpec
    corpus: str
    out: Path
    settings: dict[str, Any]  # the point's own settings (the base is added here)
    label: str
    cases: Sequence[str] | None = None  # None: the whole corpus
    basis: dict[str, dict[str, list[int]]] | None = None  # None: this is the reference (its own)

    @property
    def key(self) -> str:
        return settings_key(self.spec, self.settings, f"{corpus_sha(self.corpus)}|{basis_tag(self.basis)}")


def basis_tag(basis: Mapping[str, Any] | None) -> str:
    """``self`` for a reference run, else a hash of the forced tokens it decodes."""
    if basis is None:
        return "self"
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


def satisfies(run: Mapping[str, Any] | None, cases: Sequence[str] | None, all_cases: Sequence[str]) -> bool:
    """A recorded run serves a request when it finished (or failed to start: a recorded failure
    is not retried) and covers the requested cases."""
    if run is None:
        return False
    if run.get("status") == "start_failed":
        return True
    if run.get("status") != "ok":
        return False
    want = set(cases if cases is not None else all_cases)
    return want <= set(run.get("cases") or ())


def reference_basis(out: Path, run: Mapping[str, Any] | None, corpus: Any) -> dict[str, dict[str, list[int]]]:
    """The forced tokens every other point decodes: the reference run's (its free output), or
    the recorded output where the reference has none."""
    idx: dict[str, Any] = {}
    if run is not None and run.get("status") == "ok":
        idx = json.loads((run_dir(out, run["key"]) / "index.json").read_text(encoding="utf-8"))["cases"]
    basis: dict[str, dict[str, list[int]]] = {}
    for c in corpus.cases:
        per = {}
        for t in c["turns"]:
            got = (((idx.get(c["id"]) or {}).get(str(t["index"])) or {}).get("forced") or {}).get("tokens")
            per[str(t["index"])] = list(got) if got else list((t.get("reference") or {}).get("output_token_ids") or [])
        basis[c["id"]] = per
    return basis


def _entry(run: Run, tokens: list[int] | None = None) -> dict[str, Any]:
    return {"run_id": run.id, "status": run.status, "capture": run.capture,
            "method": run.method, "rows": run.rows, "error": run.error,
            "tokens": tokens, "token_ids": run.token_ids, "text": run.text,
            "finish_reason": run.finish_reason, "timings": run.timings,
            "retries": run.retries or None}


async def capture(req: RunRequest, url: str, store: Any, cases: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Free and forced runs of every turn of ``cases`` on the server at ``url``."""
    from tensorverse.replay.runner import case_turn_input, with_retries
    from tensorverse.shadow.backend import Backend
    from tensorverse.shadow.runner import ShadowRunner
    from tensorverse.shadow.turn import TurnInput

    spec = req.spec
    modes = spec.replay.modes
    from tensorverse.matrix.spec import CONCURRENCY
    from tensorverse.replay.batch_noise import forced_in_batch

    # the concurrency axis: cases one at a time, each forced run inside a batch of that size
    batch = spec.effective(req.settings).get(CONCURRENCY)
    backend = Backend(name=BACKEND, url=url, model=spec.served_name, capture="full",
                      concurrency=spec.replay.concurrency, timeout_s=spec.replay.timeout_s)
    index: dict[str, Any] = {}
    sem = asyncio.Semaphore(1 if batch else spec.replay.concurrency)
    async with ShadowRunner(store, [backend], rows_timeout_s=spec.replay.rows_timeout_s,
                            check_tokenizer=False, check_template=False) as runner:
        async def one(case: Mapping[str, Any]) -> None:
            async with sem:
                per: dict[str, Any] = {}
                for turn in case["turns"]:
                    rec = case_turn_input(case, turn, prefix="")
                    ent: dict[str, Any] = {}
                    free = None
                    if "free" in modes or req.basis is None:
                        t = TurnInput.from_dict(rec)
                        free = await with_retries(lambda: runner.run_free(t, backend), spec.replay.retries, 0.5)  # noqa: B023 - called in this iteration
                        ent["free"] = _entry(free)
                    if req.basis is None:
                        tokens = list(free.token_ids or []) if free and free.status == "ok" \
                            else list(rec["output_token_ids"])
                    else:
                        tokens = list(req.basis[case["id"]][str(turn["index"])])
                    tf = TurnInput.from_dict(dict(rec, output_token_ids=tokens))
                    if batch:
                        forced = await with_retries(lambda: forced_in_batch(runner, backend, tf, int(batch)),  # noqa: B023 - called in this iteration
                                                    spec.replay.retries, 0.5)
                    else:
                        forced = await with_retries(lambda: runner.run_forced(tf, backend), spec.replay.retries, 0.5)  # noqa: B023 - called in this iteration
                    ent["forced"] = _entry(forced, tokens)
                    per[str(turn["index"])] = ent
                index[case["id"]] = per

        await asyncio.gather(*(one(c) for c in cases))
    rows_wait = sum(float(((e.get("timings") or {}).get("rows_wait_s")) or 0.0)
                    for per in index.values() for ent in per.values() for e in ent.values())
    return {"basis": basis_tag(req.basis), "cases": index, "rows_wait_s": round(rows_wait, 3)}


def run_config(req: RunRequest, *, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Start the server of ``req``'s settings with capture into the run's store, run the corpus
    (or ``req.cases``), stop the server, record the run. Never raises for a server that cannot
    start or a capture that fails: the run says so (``status``, ``error``, ``log_excerpt``)."""
    from tensorverse.replay.corpus import load_corpus
    from tensorverse.store import Store

    spec = req.spec
    key = req.key
    d = run_dir(req.out, key)
    if d.exists():
        shutil.rmtree(d)  # an unfinished earlier attempt (run.json is written last)
    d.mkdir(parents=True)
    corpus = load_corpus(req.corpus)
    all_ids = [c["id"] for c in corpus.cases]
    case_ids = list(req.cases or spec.replay.cases or all_ids)
    missing = [c for c in case_ids if c not in all_ids]
    if missing:
        raise ValueError(f"cases not in the corpus: {missing}")
    effective = spec.effective(req.settings)
    store_path = d / "store"
    store_path.mkdir()
    launch = Launch(model=spec.model.path, served_name=spec.served_name, settings=server_settings(effective),
                    log_path=d / "server.log", sink=f"dir:{store_path}",
                    python=spec.server.python or sys.executable)
    rec: dict[str, Any] = {"key": key, "label": req.label, "settings": dict(req.settings),
                           "effective": effective, "basis": basis_tag(req.basis), "cases": [],
                           "status": None, "timings": {}}
    server = ServerProcess(launch)
    rec["command"] = server.command()
    why = cores_refusal(launch.settings)
    if why:  # a recorded result like a failed start, without starting anything
        rec.update(status="start_failed", error=why, exit_code=None, log_excerpt="", timings={"start_s": 0.0})
        _write_json(d / "run.json", rec)
        log(f"{req.label}: {why}")
        return rec
    t_start = time.monotonic()
    try:
        server.start()
        log(f"{req.label}: starting vLLM (port {server.port})")
        try:
            rec["timings"]["start_s"] = round(server.wait_ready(spec.server.ready_timeout_s), 3)
        except StartError as e:
            rec["timings"]["start_s"] = round(time.monotonic() - t_start, 3)
            rec.update(status="start_failed", error=str(e), exit_code=e.exit_code, log_excerpt=e.log_tail)
            log(f"{req.label}: start failed: {e}")
            return rec
        log(f"{req.label}: ready in {rec['timings']['start_s']:.0f} s; running {len(case_ids)} case(s)")
        t_rep = time.monotonic()
        try:
            with Store.open(store_path, durable=False) as st:
                cases = [c for c in corpus.cases if c["id"] in set(case_ids)]
                index = asyncio.run(capture(req, server.url, st, cases))
        except Exception as e:  # noqa: BLE001 - recorded, the matrix goes on
            rec["timings"]["replay_s"] = round(time.monotonic() - t_rep, 3)
            rec.update(status="capture_failed", error=f"{type(e).__name__}: {e}", log_excerpt=server.log_tail())
            return rec
        rec["timings"]["replay_s"] = round(time.monotonic() - t_rep, 3)
        rec["timings"]["rows_wait_s"] = index["rows_wait_s"]
        _write_json(d / "index.json", index)
        bad = [f"{c}.t{t}:{m}:{e.get('status')}" for c, per in index["cases"].items()
               for t, ent in per.items() for m, e in ent.items() if e.get("status") != "ok"]
        rec.update(status="ok", cases=case_ids, run_errors=bad[:20], n_run_errors=len(bad),
                   host=_host(), vllm=_server_version(server.url))
        return rec
    finally:
        t_stop = time.monotonic()
        server.stop(spec.server.stop_grace_s)
        rec["timings"]["stop_s"] = round(time.monotonic() - t_stop, 3)
        rec["timings"]["total_s"] = round(time.monotonic() - t_start, 3)
        if rec.get("status"):
            _write_json(d / "run.json", rec)


def _host() -> dict[str, Any]:
    import platform
    import subprocess

    gpus = None
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            out = subprocess.run([exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout
            rows = [r.split(", ") for r in out.strip().splitlines() if r.strip()]
            gpus = {"count": len(rows), "models": sorted({r[0] for r in rows}),
                    "driver": rows[0][1] if rows and len(rows[0]) > 1 else None}
        except (OSError, subprocess.SubprocessError):
            gpus = None
    return {"os": platform.platform(), "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "gpus": gpus}


def _server_version(url: str) -> str | None:
    import urllib.request

    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/version", timeout=5) as r:
            return json.loads(r.read()).get("version")
    except Exception:  # noqa: BLE001
        return None
