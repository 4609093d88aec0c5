"""``tensorverse rig run``: one command that runs a standard suite on this machine and writes one
results bundle (docs/rigs.md).

1. **The corpus and the weights.** The suite's corpus (shipped) names its model by content hash;
   the model served here (default: the shipped demo model, expanded) is hashed first, and a
   model that hashes otherwise is refused before any server starts.
2. **The rig.** Its fingerprint (:mod:`tensorverse.rig.fingerprint`) names it.
3. **Every setting of the suite, one server at a time**, through the matrix's point runner
   (:func:`tensorverse.matrix.run.run_config`: the server starts with the capture plugin writing
   into the point's store, the corpus runs forced and free, the server stops). Every point,
   the reference included, forces the **corpus's recorded tokens**, so positions line up across
   rigs. A setting this machine cannot run is ``refused`` with the reason before its server
   starts (:meth:`tensorverse.rig.suite.Setting.refusal`); one whose server does not start, or
   whose capture fails, is ``failed`` with the reason and its log's last lines in the
   provenance. The suite's noise point (the reference's config on a second server start) gives
   each flip's ``noise`` class.
4. **Resume.** Each finished point is a cached run under ``--work`` (``run.json`` written last):
   an interrupted run, run again, redoes only the points not finished.
5. **The bundle** (:mod:`tensorverse.bundle`): per-position rows
   (:func:`tensorverse.rig.positions.turn_positions`), free runs, summaries, provenance; the
   same run on the same rig gives the same bytes but for the manifest's ``created``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from tensorverse.rig.suite import Setting, Suite

__all__ = ["RigRunOptions", "RigRunError", "rig_run", "point_settings", "PlannedPoint", "plan"]


class RigRunError(RuntimeError):
    """The run cannot start (wrong weights, unknown setting, unreadable corpus)."""


@dataclass
class RigRunOptions:
    out: Path
    suite: Suite
    settings: Sequence[str] | None = None  # a subset (the reference is always run)
    work: Path | None = None  # cached point runs (default: OUT.work)
    model_dir: Path | None = None  # default: default_model's
    # where the model comes from without model_dir (``tensorverse rig run``: the demo model, wired
    # by tensorverse/cli.py; rig imports no demo): called with a log function, returns a directory
    default_model: Callable[[Callable[[str], None]], Path] | None = None
    label: str | None = None
    corpus: Path | None = None  # default: the suite's shipped corpus (a suite without one needs it)
    noise: bool = True
    ready_timeout_s: float = 900.0
    created: str | None = None
    # where the points run: None, here, one server after another; an executor of
    # tensorverse.matrix.executor (--executor ray: the points as Ray tasks, the fingerprint and the
    # refusals taken on a node where the reference would run)
    executor: Any = None

    @property
    def work_dir(self) -> Path:
        return self.work or self.out.with_name(self.out.name + ".work")


@dataclass
class RigRunResult:
    path: Path
    outcomes: list[Any] = field(default_factory=list)
    summaries: dict[str, Any] = field(default_factory=dict)


def point_settings(s: Setting) -> dict[str, Any]:
    """The matrix point settings of a suite setting (its options and environment)."""
    return {**dict(s.options), **dict(s.env)}


def _corpus_dir(suite: Suite, given: Path | None) -> Path:
    d = given if given is not None else suite.corpus_dir
    if d is None:
        raise RigRunError(f"suite {suite.name} ships no corpus: record one from your checkpoint (its greedy "
                          "reference outputs, named by the weights' content hash) and give it with --corpus DIR")
    return Path(d)


@dataclass(frozen=True)
class PlannedPoint:
    """What ``rig run`` would start for one setting: the exact command line (the port shown as
    PORT), the environment the settings give the server, and why it would be refused here."""

    name: str
    axis: str
    value: str
    command: list[str]
    env: dict[str, str]
    refusal: str | None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _refusal(s: Setting, settings: dict[str, Any]) -> str | None:
    from tensorverse.matrix.launcher import cores_refusal

    return s.refusal() or cores_refusal(settings)


def plan(suite: Suite, names: Sequence[str] | None = None, *, noise: bool = True, model_dir: Path | None = None,
         served_name: str = "MODEL") -> list[PlannedPoint]:
    """``rig run --dry-run``: every chosen setting's server as it would start on this machine,
    refusals included; starts nothing and needs neither the model nor the corpus."""
    from tensorverse.matrix.launcher import build_command, build_env
    from tensorverse.matrix.spec import server_settings

    chosen = _chosen(suite, names, noise)
    spec = _spec(suite, chosen, model_dir or Path("MODEL"), served_name, 900.0)
    out = []
    for s in chosen:
        settings = server_settings(spec.effective(point_settings(s)))
        cmd = _portless(build_command("python", spec.model.path, spec.served_name, 0, settings))
        out.append(PlannedPoint(s.name, s.axis, s.value, cmd, build_env(settings, None, base={}),
                                _refusal(s, settings)))
    return out


def _chosen(suite: Suite, names: Sequence[str] | None, noise: bool) -> list[Setting]:
    if names:
        unknown = [n for n in names if n not in {s.name for s in suite.settings}]
        if unknown:
            raise RigRunError(f"suite {suite.name} has no setting {', '.join(unknown)}; "
                              f"it has {', '.join(s.name for s in suite.settings)}")
    want = set(names or [s.name for s in suite.settings]) | {suite.reference}
    if noise:
        want.add(suite.noise)
    else:
        want.discard(suite.noise)
    ordered = [suite.setting(suite.reference)] + [s for s in suite.settings if s.name != suite.reference]
    return [s for s in ordered if s.name in want]


def _spec(suite: Suite, chosen: Sequence[Setting], model_dir: Path, served: str, ready_timeout_s: float):
    from tensorverse.matrix.spec import MatrixSpec, ModelSection, PointSection, ReplaySection, ServerSection

    return MatrixSpec(model=ModelSection(path=str(model_dir), served_name=served),
                      points=[PointSection(name=s.name, settings=point_settings(s)) for s in chosen],
                      server=ServerSection(options=dict(suite.base_options), env=dict(suite.base_env),
                                           ready_timeout_s=ready_timeout_s),
                      # one request at a time: on some CPUs a request that shares a step with
                      # another's prefill gets other rows (docs/replay.md, "Batch noise"), and a
                      # bundle measures its setting, not the batches it happened to meet
                      replay=ReplaySection(modes=["forced", "free"], concurrency=1))


def _prefixed(log: Callable[[str], None], prefix: str, message: str) -> None:
    log(f"{prefix} {message}")


def _portless(cmd: Sequence[str]) -> list[str]:
    out = list(cmd)
    for i, a in enumerate(out[:-1]):
        if a == "--port":
            out[i + 1] = "PORT"  # a free port differs per run; the bundle must not
    return out


def _tail(text: str | None, lines: int = 12) -> str | None:
    if not text:
        return None
    return "\n".join(text.splitlines()[-lines:])[-3000:]


def _free_row(setting: str, cid: str, turn: int, rec_tokens: list[int], rec_text: str,
              run: dict[str, Any] | None) -> dict[str, Any]:
    from tensorverse.replay.entries import free_turn

    f = free_turn(rec_tokens, rec_text, run, "recorded")
    if f is None or f.get("status") != "ok":
        st = (f or {}).get("status") or "missing"
        return {"setting": setting, "case": cid, "turn": turn, "status": re.sub(r"[^A-Za-z0-9._-]", "_", st),
                "tokens": None, "diverged": None, "first_divergence": None, "verdict": None}
    return {"setting": setting, "case": cid, "turn": turn, "status": "ok", "tokens": int(f["tokens"]),
            "diverged": bool(f["diverged"]), "first_divergence": f["first_flip"] if f["diverged"] else None,
            "verdict": f["verdict"]}


def _model(opts: RigRunOptions, corpus: Any, log: Callable[[str], None]) -> Path:
    from tensorverse.rig.models import file_weights_hash

    if opts.model_dir is not None:
        mdir = Path(opts.model_dir)
    elif opts.default_model is not None:
        mdir = Path(opts.default_model(lambda m: log("  " + m)))
    else:
        raise RigRunError("no model: give its directory (--model DIR)")
    want = corpus.model["content_hash"]
    log(f"hashing the weights of {mdir} ...")
    try:
        got = file_weights_hash(mdir)
    except (OSError, ValueError) as e:
        raise RigRunError(f"cannot hash the model's weights in {mdir}: {e}") from None
    if got != want:
        raise RigRunError(f"refused: the model in {mdir} hashes to {got[:16]}..., corpus {corpus.name} was "
                          f"recorded from {corpus.model['name']} {want[:16]}...; every rig must run the same weights")
    return mdir


def _other_hardware(fp: dict[str, Any], host: dict[str, Any] | None) -> str | None:
    """Why a point's host (its run record's ``host``) is not the rig ``fp`` describes (its GPU
    models and count), or None: with ``--executor ray`` the points run on cluster nodes."""
    want, got = fp.get("gpus") or None, (host or {}).get("gpus") or None
    if want is None and got is None:
        return None
    if want is None or got is None or want.get("models") != got.get("models") or want.get("count") != got.get("count"):
        return f"GPUs {got and got.get('models')} x {got and got.get('count')}, the rig's {want and want.get('models')}" \
               f" x {want and want.get('count')}"
    return None


def rig_run(opts: RigRunOptions, log: Callable[[str], None] = print) -> RigRunResult:
    from tensorverse.bundle.known import known_corpus
    from tensorverse.bundle.make import SettingOutcome, make_bundle, rig_id
    from tensorverse.matrix.compare import TurnRows
    from tensorverse.matrix.launcher import build_command
    from tensorverse.matrix.run import RunRequest, load_run, run_config
    from tensorverse.matrix.spec import is_option, server_settings
    from tensorverse.replay.corpus import load_corpus
    from tensorverse.rig.fingerprint import rig_fingerprint
    from tensorverse.rig.positions import flips_of, turn_positions

    suite = opts.suite
    chosen = _chosen(suite, opts.settings, opts.noise)
    corpus_dir = _corpus_dir(suite, opts.corpus)
    try:
        kc = known_corpus(corpus_dir)
        corpus = load_corpus(corpus_dir)
    except (OSError, ValueError) as e:
        raise RigRunError(f"suite {suite.name}'s corpus {corpus_dir}: {e}") from None
    mdir = _model(opts, kc, log)
    spec = _spec(suite, chosen, mdir, kc.model["name"], opts.ready_timeout_s)
    basis = {c["id"]: {str(t["index"]): list(t["reference"]["output_token_ids"]) for t in c["turns"]}
             for c in corpus.cases}
    work = opts.work_dir
    work.mkdir(parents=True, exist_ok=True)
    reqs = {s.name: RunRequest(spec=spec, corpus=str(corpus_dir), out=work, settings=point_settings(s),
                               label=s.name, basis=basis) for s in chosen}

    def probe() -> tuple[dict[str, Any], dict[str, str | None]]:
        """The rig's fingerprint and each setting's refusal, taken where the points run."""
        return rig_fingerprint(), {s.name: _refusal(s, server_settings(spec.effective(reqs[s.name].settings)))
                                   for s in chosen}

    ex = opts.executor
    fp, refusals = ex.call(probe, reqs[suite.reference]) if ex is not None else probe()
    label = opts.label or (", ".join(fp["gpus"]["models"]) if fp.get("gpus") else None) or fp["cpu"]["model"] or "cpu"
    log(f"rig {rig_id(fp, label)} ({label}); suite {suite.name}: {len(chosen)} settings over {kc.cases} cases, "
        f"{kc.positions} positions; work in {work}" + (f"; points on {ex.describe()}" if ex is not None
                                                        and hasattr(ex, "describe") else ""))
    from tensorverse import __version__

    provenance: dict[str, Any] = {"tensorverse": __version__, "suite": suite.name, "model_dir_name": mdir.name,
                                  "points": {}}
    bases: dict[str, dict[str, Any]] = {}
    recs: dict[str, dict[str, Any]] = {}
    pending: list[tuple[int, Setting]] = []
    for i, s in enumerate(chosen, 1):
        req = reqs[s.name]
        eff = spec.effective(req.settings)
        # the server's options after model, name, host and port (the same on every rig)
        argv = build_command("python", "MODEL", spec.served_name, 0, server_settings(eff))[11:]
        bases[s.name] = dict(name=s.name, axis=s.axis, value=s.value, vllm_args=tuple(argv),
                             env={k: str(v) for k, v in eff.items() if not is_option(k)})
        why = refusals[s.name]
        if why:
            if s.name == suite.reference:
                raise RigRunError(f"the reference setting {s.name} cannot run here: {why}")
            log(f"[{i}/{len(chosen)}] {s.name}: {why}")
            continue
        rec = load_run(work, req.key)
        if rec is not None and rec.get("status") in ("ok", "start_failed"):
            log(f"[{i}/{len(chosen)}] {s.name}: done in an earlier run (resumed)")
            recs[s.name] = rec
        else:
            pending.append((i, s))
    if ex is None:  # here, one server at a time
        for i, s in pending:
            log(f"[{i}/{len(chosen)}] {s.name} ({s.axis} = {s.value}) ...")
            recs[s.name] = run_config(reqs[s.name], log=functools.partial(_prefixed, log, f"[{i}/{len(chosen)}]"))
    elif pending:  # every point at once: the executor places them
        by_key = {reqs[s.name].key: s.name for _, s in pending}
        log(f"{len(pending)} setting(s) to run: {', '.join(s.name for _, s in pending)}")
        ex.run([reqs[s.name] for _, s in pending], lambda req, rec: recs.__setitem__(by_key[req.key], rec),
               log=log, parallel=len(pending))
    outcomes: list[SettingOutcome] = []
    runs: dict[str, dict[str, Any]] = {}
    for s in chosen:
        base = bases[s.name]
        if refusals[s.name]:
            outcomes.append(SettingOutcome(status="refused", reason=refusals[s.name], **base))
            continue
        rec = recs[s.name]
        eff = spec.effective(reqs[s.name].settings)
        provenance["points"][s.name] = {"status": rec.get("status"), "command": _portless(rec.get("command") or [])[3:],
                                        "effective": eff, "vllm": rec.get("vllm"), "host": rec.get("host"),
                                        "error": rec.get("error"), "log_tail": _tail(rec.get("log_excerpt"))}
        if rec.get("status") != "ok":
            outcomes.append(SettingOutcome(status="failed", reason=f"{rec.get('status')}: {rec.get('error')}"[:2000], **base))
            if s.name == suite.reference:
                raise RigRunError(f"the reference setting {s.name} did not run ({rec.get('error')}); "
                                  f"see {work}")
            continue
        other = _other_hardware(fp, rec.get("host"))
        if other:
            raise RigRunError(f"setting {s.name} ran on other hardware than the rig's ({other}); a bundle is one "
                              "rig: pin the points to one kind of node (--ray-resource)")
        runs[s.name] = rec
        outcomes.append(SettingOutcome(status="ran", **base))

    positions: list[dict[str, Any]] = []
    free: list[dict[str, Any]] = []
    log(f"building the bundle from {len(runs)} point(s) ...")
    with contextlib.ExitStack() as stack:
        opened = {n: stack.enter_context(TurnRows(work, r["key"])) for n, r in runs.items()}
        for c in corpus.cases:
            for t in c["turns"]:
                idx = int(t["index"])
                toks = list(t["reference"]["output_token_ids"])
                rows = {n: tr.forced_rows(c["id"], idx) for n, tr in opened.items()}
                ref = rows.get(suite.reference)
                if ref is None:
                    raise RigRunError(f"the reference setting has no full rows for {c['id']} turn {idx}")
                nrows = rows.get(suite.noise)
                nf = flips_of(nrows, toks) if nrows is not None else None
                for n in opened:
                    r = rows[n]
                    if r is None or r.shape[0] != len(toks):
                        continue  # the setting is marked failed below
                    positions += turn_positions(n, c["id"], idx, toks, r, None if n == suite.reference else ref,
                                                noise_flips=nf if n != suite.noise else None)
                    free.append(_free_row(n, c["id"], idx, toks, t["reference"].get("text") or "",
                                          opened[n].entry(c["id"], idx, "free")))
    have: dict[str, int] = {}
    for row in positions:
        have[row["setting"]] = have.get(row["setting"], 0) + 1
    for k, o in enumerate(outcomes):
        if o.status == "ran" and have.get(o.name, 0) != kc.positions:
            outcomes[k] = dataclasses.replace(o, status="failed", reason=f"capture incomplete: "
                                              f"{have.get(o.name, 0)} of {kc.positions} full rows")
    ran = {o.name for o in outcomes if o.status == "ran"}
    positions = [r for r in positions if r["setting"] in ran]
    free = [r for r in free if r["setting"] in ran]
    noise = suite.noise if suite.noise in ran else None
    path = make_bundle(opts.out, suite={"name": suite.name, "version": suite.version}, corpus=kc, rig_label=label,
                       fingerprint=fp, settings=outcomes, reference=suite.reference, noise=noise,
                       positions=positions, free=free, provenance=provenance, created=opts.created)
    from tensorverse.bundle.summary import summarize

    return RigRunResult(path=path, outcomes=outcomes,
                        summaries=summarize(positions, free, [o.name for o in outcomes if o.status == "ran"]))
