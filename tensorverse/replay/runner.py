"""``tensorverse replay``: run a corpus's cases on a set of backends and report the divergence.

Replay is shadowing from a corpus instead of live traffic: every case turn becomes a
:class:`~tensorverse.shadow.turn.TurnInput` (the case's prompt ids and reference output ids) and
goes through the same :class:`~tensorverse.shadow.runner.ShadowRunner` (forced + free runs, the
chat-template check, capture) and :func:`~tensorverse.shadow.compare.compare_turn` as live turns.
Runs and rows land in a working store (``--store DIR`` keeps it for ``tensorverse view``).

The basis of each turn. Scrubbing changes the prompt, so the corpus's recorded output is not
the reference runtime's own continuation of the *scrubbed* prompt. Each case turn therefore
starts with the *reference backend* (``--reference NAME``, default the first ``--backend``)
generating freely on the scrubbed prompt (the case's sampling: greedy unless seeded). Its output
is the turn's **basis**: every backend's forced run (the reference's included) decodes the basis
ids, and every other backend's free run is compared with it. The reference's forced run is the P
of the others' forced runs (``kind: full`` when both capture full rows, else ``topk``);
``departures`` are forced positions where a backend's top-1 is not the basis token (zero for the
reference on a deterministic runtime with greedy sampling). The recorded output is kept as what
the session actually did: the reference's free run is compared with it (``basis.vs_recorded``,
and the reference's own free row), which shows what scrubbing changed. When the reference cannot
run (refused, or failed after the retries) the recorded output is the basis
(``basis.source: recorded``).

Multi-turn cases. Forced runs always use the recorded context. A backend's free *branch* goes on
to the next turn (on the recorded context and recorded tool results) while its tool calls match
the *recorded* ones (the recorded tool results answer only those); at the first turn where they
do not, the branch stops there (``diverged``),
or, with a tool simulator (:mod:`tensorverse.replay.tools`), continues on its own conversation:
the branch's answer and the simulator's results are rendered by the backend's chat template
(``/tokenize``) and generated freely, up to the case's remaining turns (``simulated``).

Robustness. Backend failures are retried with exponential backoff (``retries``), then recorded in
the case's results, never aborting the run. Each finished case is appended to a journal
(``RESULTS.partial.jsonl``); an interrupted run (Ctrl-C) keeps them, and rerunning the same
command resumes with the cases not yet done. The results file is written at the end, then the
HTML report (``--html DIR``, :mod:`tensorverse.replay.html`) from the working store, whose session
and turn records (the basis as each turn's answer) are what ``tensorverse view`` shows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

from tensorverse.replay.corpus import Corpus, load_corpus
from tensorverse.replay.journal import journal_key, read_journal
from tensorverse.replay.options import ReplayOptions
from tensorverse.store.records import RECORDED, Comparison, ForcedComparison, FreeComparison, Run, Session, Turn
from tensorverse.replay.rig import rig_fingerprint
from tensorverse.shadow.backend import Backend

__all__ = ["replay", "run_replay", "case_turn_input", "with_retries"]

log = logging.getLogger("tensorverse.replay")

def case_turn_input(case: Mapping[str, Any], turn: Mapping[str, Any], *, prefix: str = "") -> dict[str, Any]:
    """A case turn in the dict form :class:`~tensorverse.shadow.turn.TurnInput` reads."""
    ref = turn.get("reference") or {}
    req = None
    if turn.get("messages"):
        req = {"messages": turn["messages"]}
        if turn.get("tools"):
            req["tools"] = turn["tools"]
    return {
        "id": _turn_id(prefix, case["id"], turn["index"]),
        "session_id": _safe(prefix + case["id"]),
        "prompt_token_ids": turn["prompt_token_ids"],
        "output_token_ids": ref.get("output_token_ids") or [],
        "text": ref.get("text"),
        "sampling": dict(turn.get("sampling") or {}),
        "request": req,
        "endpoint": turn.get("endpoint") or ("chat.completions" if req else None),
        "tool_calls": None,  # the verdict compares text with text (both parsed the same way)
        "backend": RECORDED,  # whose answer the basis is
        "finish_reason": ref.get("finish_reason"),
    }


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in s)[:120]


def _turn_id(prefix: str, case_id: str, index: int) -> str:
    return _safe(f"{prefix}{case_id}.t{index}")


# ----------------------------------------------------------------------------------- the runner


def _vs_recorded(run: Run | None, rec: Mapping[str, Any]) -> FreeComparison:
    """A free run against the case's recorded output: divergence and tool-call verdict."""
    from tensorverse.shadow.compare import compare_free

    recorded = Run(id=f"{rec['id']}~recorded", turn_id=rec["id"], backend=RECORDED, mode=RECORDED,
                   token_ids=list(rec.get("output_token_ids") or []), text=rec.get("text") or "",
                   finish_reason=rec.get("finish_reason"))
    cand = run if run is not None else Run(id=f"{rec['id']}~none", turn_id=rec["id"], backend="?", mode="free")
    return compare_free(cand, recorded)


def _departures(run: Run, tokens: Sequence[int]) -> list[int] | None:
    """Forced positions where the run's top-1 is not the forced (basis) token (None: no top-k)."""
    tl = run.top_logprobs
    if not isinstance(tl, list) or len(tl) < len(tokens):
        return None
    out = []
    for p, t in enumerate(tokens):
        e = tl[p]
        if not e:
            return None
        if int(e[0][0]) != int(t):
            out.append(p)
    return out


class _Replay:
    def __init__(self, corpus: Corpus, opts: ReplayOptions, store: Any, runner: Any) -> None:
        self.corpus = corpus
        self.opts = opts
        self.store = store
        self.runner = runner
        self.refused: dict[str, str] = {}
        self.prefix = ""
        self._pieces: dict[int, asyncio.Future[str]] = {}  # token id -> its text, for the whole run

    async def token_pieces(self, ids: Sequence[int], backend: Backend) -> list[str] | None:
        """The text of each token (``/detokenize`` once per distinct id for the whole replay, not
        once per turn as live shadowing does: a corpus shares one dictionary). None on failure
        (the shadow runner then fetches them itself)."""
        from tensorverse.shadow.client import BackendError

        client = self.runner._client(backend)
        sem = asyncio.Semaphore(8)

        async def fetch(tid: int) -> str:
            async with sem:
                body: dict[str, Any] = {"tokens": [tid], **({"model": backend.model} if backend.model else {})}
                out = await client.post("/detokenize", body, root=True)
                return (out.get("prompt") if isinstance(out, dict) else "") or ""

        for tid in set(ids):
            if tid not in self._pieces:
                self._pieces[tid] = asyncio.ensure_future(fetch(tid))
        try:
            got = {tid: await self._pieces[tid] for tid in set(ids)}
        except (BackendError, OSError, asyncio.TimeoutError):
            for tid in set(ids):
                f = self._pieces.get(tid)
                if f is not None and f.done() and f.exception() is not None:
                    del self._pieces[tid]
            return None
        return [got[t] for t in ids]

    async def vet_backends(self) -> dict[str, Any]:
        """Compare each backend's tokenizer fingerprint with the corpus's."""
        want = (self.corpus.tokenizer or {}).get("fingerprint")
        out: dict[str, Any] = {}
        for b in self.opts.backends:
            fp = await self.runner.fingerprint_of(b)
            got = fp.get("fingerprint") if fp.get("available") else None
            ok = (not self.opts.check_tokenizer or want is None or got is None or got == want)
            out[b.name] = {"fingerprint": got, "corpus": want, "same_dictionary": ok if got else None}
            if not ok:
                self.refused[b.name] = (f"refused: {b.name}'s tokenizer ({got}) is not the corpus's "
                                        f"({want}); token ids would mean different text")
        return out

    async def _run(self, t: dict[str, Any], modes: Sequence[str], backends: Sequence[Backend]) -> list[Run]:
        """``run_turn`` with retries (backoff) for runs that failed or timed out."""
        runs: list[Run] = await self.runner.run_turn(t, modes=modes, backends=list(backends))
        latest = {(r.backend, r.mode): r for r in runs if r.mode != RECORDED}
        delay = self.opts.backoff_s
        for attempt in range(self.opts.retries):
            bad = [(b, m) for (b, m), r in latest.items() if r.status in ("failed", "timeout")]
            if not bad:
                break
            await asyncio.sleep(delay)
            delay *= 2
            by_name = {b.name: b for b in backends}
            for name, mode in bad:
                again = await self.runner.run_turn(t, modes=[mode], backends=[by_name[name]])
                for r in again:
                    if r.mode != RECORDED:
                        r.retries = attempt + 1
                        latest[(r.backend, r.mode)] = r
        return list(latest.values())

    async def _basis(self, rec: dict[str, Any], ref: Backend | None) -> tuple[dict[str, Any], Run | None, dict]:
        """The turn's basis: the reference backend's free run on the scrubbed prompt (retried
        like any run), stored under the turn. Returns ``(turn input, that run, basis info)``;
        the recorded output stands in when the reference cannot run."""
        from tensorverse.shadow.turn import TurnInput

        run: Run | None = None
        if ref is not None:
            ti = TurnInput.from_dict(rec)
            run = await with_retries(lambda: self.runner.run_free(ti, ref), self.opts.retries, self.opts.backoff_s)
            run.role = ref.role
            await asyncio.to_thread(lambda: self.store.put_run(run).result())
        if run is None or run.status != "ok":
            info = {"source": RECORDED, "tokens": len(rec["output_token_ids"]),
                    "why": "reference refused" if run is None else f"reference free run {run.status}"}
            return dict(rec, backend=RECORDED), run, info
        assert ref is not None  # its run is the basis
        t = dict(rec, output_token_ids=list(run.token_ids or []), text=run.text,
                 finish_reason=run.finish_reason, backend=ref.name)
        vs = _vs_recorded(run, rec)
        return t, run, {"source": "reference", "backend": ref.name, "tokens": len(t["output_token_ids"]),
                        "vs_recorded": {"diverged": vs.diverged, "first_flip": vs.first_flip, "verdict": vs.verdict}}

    async def _put_case_records(self, case: Mapping[str, Any], turn: Mapping[str, Any],
                                t: Mapping[str, Any], first: bool) -> None:
        """The session and turn records that ``tensorverse view`` and the HTML report read (the
        turn's answer is the basis)."""
        def put() -> None:
            if first:
                tags = {"case": str(case["id"]), **({"title": str(case["title"])} if case.get("title") else {})}
                self.store.put_session(Session(id=t["session_id"], tags=tags)).result()
            self.store.put_turn(Turn(id=t["id"], session_id=t["session_id"], index=turn["index"], state="ok",
                                     endpoint=t.get("endpoint"), backend=t["backend"], request=t.get("request"),
                                     prompt_token_ids=t["prompt_token_ids"], output_token_ids=t["output_token_ids"],
                                     text=t.get("text"), finish_reason=t.get("finish_reason"),
                                     sampling=t.get("sampling"), reference=self.opts.reference)).result()

        try:
            await asyncio.to_thread(put)
        except Exception as e:  # noqa: BLE001 - the view records are a convenience, never fatal
            log.warning("tensorverse replay: case %s: view records not stored: %s", case.get("id"), e)

    async def case(self, case: Mapping[str, Any]) -> dict[str, Any]:
        from tensorverse.shadow.compare import compare_turn

        opts = self.opts
        live = [b for b in opts.backends if b.name not in self.refused]
        ref_b = next((b for b in live if b.name == opts.reference), None)
        active = {b.name for b in live}  # free branches still on the recorded path
        branch: dict[str, dict[str, Any]] = {b.name: {"status": "completed", "turn": None} for b in live}
        for name, why in self.refused.items():
            branch[name] = {"status": "refused", "turn": None, "error": why}
        turns_out: list[dict[str, Any]] = []
        roles = {b.name: b.role for b in opts.backends}
        session_id = _safe(self.prefix + case["id"])
        for turn in case["turns"]:
            rec = case_turn_input(case, turn, prefix=self.prefix)
            t, ref_run, basis = await self._basis(rec, ref_b)
            if live and t["output_token_ids"]:
                pieces = await self.token_pieces(t["output_token_ids"], ref_b or live[0])
                if pieces is not None:
                    t["pieces"] = pieces
            await self._put_case_records(case, turn, t, first=turn["index"] == case["turns"][0]["index"])
            tokens = list(t["output_token_ids"])
            runs: list[Run] = [ref_run] if ref_run is not None else []
            # on the recorded path: every mode; off it (and the reference, whose free run is the
            # basis): forced only, on the recorded context
            on_path = [b for b in live if b.name in active and b is not ref_b]
            forced_only = [b for b in live if b.name not in active or b is ref_b]
            jobs = []
            if on_path:
                jobs.append(self._run(t, opts.modes, on_path))
            if forced_only and "forced" in opts.modes:
                jobs.append(self._run(t, ("forced",), forced_only))
            for got in await asyncio.gather(*jobs):
                runs += got
            comps: list[Comparison] = []
            compare_error = None
            if runs:
                try:
                    comps = await asyncio.to_thread(compare_turn, self.store, t["id"], roles=roles)
                except Exception as e:  # noqa: BLE001 - recorded per run below, never fatal
                    compare_error = f"{type(e).__name__}: {e}"
            per: dict[str, Any] = {}
            for b in live:
                per[b.name] = self._turn_result(b, runs, comps, tokens, compare_error)
            if ref_b is not None:
                self._reference_free_row(per[ref_b.name], ref_run, rec,
                                         on_path=ref_b.name in active and "free" in opts.modes)
            for name in list(active):
                free = per[name].get("free")
                if free is None or "free" not in opts.modes:
                    continue
                run = next((r for r in runs if r.backend == name and r.mode == "free"), None)
                path = _vs_recorded(run, rec).verdict if free.get("status") == "ok" and run else None
                if free.get("status") != "ok" or path != "match":
                    active.discard(name)
                    branch[name] = {"status": "diverged" if free.get("status") == "ok" else "error",
                                    "turn": turn["index"], "verdict": path,
                                    "error": free.get("error")}
                    if opts.simulator is not None and free.get("status") == "ok" \
                            and turn["index"] < len(case["turns"]) - 1:
                        b = next(x for x in live if x.name == name)
                        run = next(r for r in runs if r.backend == name and r.mode == "free")
                        sim = await self._simulate(case, turn, b, run)
                        branch[name].update(status="simulated", simulated=sim)
            turns_out.append({"index": turn["index"], "positions": len(tokens), "basis": basis,
                              "backends": per})
        return {"id": case["id"], "session": session_id, "turns": turns_out, "branches": branch}

    def _reference_free_row(self, row: dict[str, Any], run: Run | None,
                            rec: Mapping[str, Any], *, on_path: bool) -> None:
        """The reference's free row: its basis run against the recorded output (what the
        scrubbing changed), only while its branch is on the recorded path."""
        if not on_path or run is None:
            row.pop("free", None)
            return
        res: dict[str, Any] = {"status": run.status, "capture": run.capture,
                               "method": run.method, "template": None, "basis": True}
        if run.retries:
            res["retries"] = run.retries
        if run.status != "ok":
            res["error"] = run.error
        else:
            c = _vs_recorded(run, rec)
            res.update(tokens=len(run.token_ids or []), finish_reason=run.finish_reason,
                       diverged=c.diverged, first_flip=c.first_flip,
                       common_prefix=c.common_prefix, verdict=c.verdict,
                       differences=[{k: v for k, v in d.items()
                                     if self.opts.include_text or k in ("kind", "path")}
                                    for d in (c.tool_calls or {}).get("differences") or ()],
                       vs="recorded")
            if self.opts.include_text:
                res["text"] = run.text
        row["free"] = res

    def _turn_result(self, b: Backend, runs: Sequence[Run], comps: Sequence[Comparison],
                     tokens: Sequence[int], compare_error: str | None = None) -> dict[str, Any]:
        """One backend's runs of a turn, with their comparisons (``compare_error``: comparing the
        turn failed, said on each run that ran)."""
        out: dict[str, Any] = {}
        for mode in self.opts.modes:
            run = next((r for r in runs if r.backend == b.name and r.mode == mode), None)
            if run is None:
                continue
            res: dict[str, Any] = {"status": run.status, "capture": run.capture,
                                   "method": run.method,
                                   "template": (run.template or {}).get("status")}
            if run.retries:
                res["retries"] = run.retries
            if run.status != "ok":
                res["error"] = run.error
                out[mode] = res
                continue
            if mode == "forced":
                res["departures"] = _departures(run, tokens)
                c = next((c for c in comps if isinstance(c, ForcedComparison) and c.backend == b.name
                          and c.ref_backend == self.opts.reference), None)
                if c is not None and c.status == "ok":
                    m = c.metrics or {}
                    res.update(kind=c.kind, n=c.n, flips=c.flips,
                               first_flip=c.first_flip, approximate=c.approximate,
                               top1_agree=sum(1 for x in m.get("top1_agree") or () if x),
                               kl=[round(float(x), 9) for x in m.get("kl") or ()],
                               flip_tokens=c.flip_tokens if self.opts.include_text else None,
                               flip_regions=[f.get("region") for f in c.flip_tokens or ()],
                               flip_classes=c.flip_classes)
                elif c is not None:
                    res["compare_error"] = c.error
                elif compare_error is not None:
                    res["compare_error"] = compare_error
            else:
                fc = next((c for c in comps if isinstance(c, FreeComparison) and c.backend == b.name), None)
                res.update(tokens=len(run.token_ids or []), finish_reason=run.finish_reason)
                if self.opts.include_text:
                    res["text"] = run.text
                if fc is not None and fc.status == "ok":
                    tc = fc.tool_calls or {}
                    res.update(diverged=fc.diverged, first_flip=fc.first_flip,
                               common_prefix=fc.common_prefix, verdict=fc.verdict,
                               differences=[{k: v for k, v in d.items()
                                             if self.opts.include_text or k in ("kind", "path")}
                                            for d in tc.get("differences") or ()],
                               confirms_forced=fc.confirms_forced, flip_class=fc.flip_class)
                elif fc is not None:
                    res["compare_error"] = fc.error
                elif compare_error is not None:
                    res["compare_error"] = compare_error
            out[mode] = res
        return out

    async def _simulate(self, case: Mapping[str, Any], turn: Mapping[str, Any], b: Backend,
                        run: Run) -> list[dict[str, Any]]:
        """Continue a diverged branch with the tool simulator, up to the remaining turns."""
        from tensorverse.analysis.toolcalls import extract_tool_calls
        from tensorverse.shadow.client import BackendError
        from tensorverse.shadow.tokenizer import render_chat

        steps: list[dict[str, Any]] = []
        messages = list(turn.get("messages") or [])
        tools = turn.get("tools")
        text = run.text or ""
        remaining = len(case["turns"]) - 1 - turn["index"]
        for step in range(remaining):
            x = extract_tool_calls(text)
            if not x.calls:
                steps.append({"step": step, "stopped": "no_tool_call"})
                break
            calls = [{"id": f"sim-{step}-{i}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                     for i, c in enumerate(x.calls)]
            messages.append({"role": "assistant", "content": x.content or "", "tool_calls": calls})
            ctx = {"case": case["id"], "turn": turn["index"] + step, "backend": b.name, "messages": messages}
            for c, oc in zip(x.calls, calls):
                try:
                    content = await self.opts.simulator({"name": c.name, "arguments": c.arguments,
                                                         "id": oc["id"]}, ctx)
                except Exception as e:  # noqa: BLE001 - a simulator failure ends the branch
                    steps.append({"step": step, "stopped": "simulator_error", "error": f"{type(e).__name__}: {e}"})
                    return steps
                messages.append({"role": "tool", "tool_call_id": oc["id"], "content": content})
            req = {"messages": messages, **({"tools": tools} if tools else {})}
            try:
                prompt = await render_chat(self.runner._client(b), req)
            except (BackendError, ValueError) as e:
                steps.append({"step": step, "stopped": "render_error", "error": str(e)})
                break
            t = {"id": _turn_id(self.prefix, case["id"], turn["index"]) + f".sim{b.name}{step}",
                 "prompt_token_ids": prompt, "output_token_ids": [],
                 "sampling": dict(turn.get("sampling") or {}), "backend": RECORDED}
            from tensorverse.shadow.turn import TurnInput

            r: Run = await self.runner.run_free(TurnInput.from_dict(t), b)
            text = r.text or ""
            y = extract_tool_calls(text)
            steps.append({"step": step, "status": r.status, "tokens": len(r.token_ids or []),
                          "finish_reason": r.finish_reason,
                          "tool_calls": [c.name for c in y.calls], "malformed": len(y.malformed),
                          **({"text": text} if self.opts.include_text else {})})
            if r.status != "ok":
                break
        return steps


class _Progress:
    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self.total, self.done, self.t0 = total, done, time.monotonic()
        self.start_done = done
        self._p = None
        if enabled:
            try:
                from rich.console import Console
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                           TimeElapsedColumn, TimeRemainingColumn)

                self._p = Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(),
                                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                   console=Console(stderr=True), transient=False)
                self._task = self._p.add_task("cases", total=total, completed=done)
                self._p.start()
            except ImportError:
                self._p = None
        self.enabled = enabled

    def advance(self) -> None:
        self.done += 1
        if self._p is not None:
            self._p.update(self._task, completed=self.done)
        elif self.enabled:
            el = time.monotonic() - self.t0
            rate = (self.done - self.start_done) / el if el > 0 else 0
            eta = (self.total - self.done) / rate if rate else float("nan")
            print(f"replay: {self.done}/{self.total} cases, ETA {eta:.0f} s", file=sys.stderr)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


async def replay(corpus: Corpus, opts: ReplayOptions, *,
                 finalize: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the replay; return the results (also written to ``opts.out`` when set).
    ``finalize`` completes the results (the ``--fail-on`` verdicts) before they are written and
    before the HTML report (``opts.html``) is made from the working store."""
    from tensorverse.replay.report import build_results
    from tensorverse.shadow.cache import RunnerCache
    from tensorverse.shadow.runner import ShadowRunner
    from tensorverse.store import Store

    cases = [c for c in corpus.cases if not opts.cases or c["id"] in set(opts.cases)]
    tmp = None
    store_path = opts.store
    if store_path is None:
        tmp = tempfile.mkdtemp(prefix="tensorverse-replay-")
        store_path = Path(tmp)
    key = journal_key(corpus, opts)
    journal = Path(str(opts.out) + ".partial.jsonl") if opts.out else None
    done = read_journal(journal, key) if (journal and opts.resume) else {}
    results_cases: dict[str, dict[str, Any]] = {cid: c for cid, c in done.items()}
    started = time.time()
    interrupted = _on_interrupt()
    try:
        with Store.open(store_path, durable=False) as store:
            async with ShadowRunner(store, opts.backends, cache=RunnerCache(),
                                    rows_timeout_s=opts.rows_timeout_s,
                                    check_tokenizer=False, check_template=opts.check_template) as runner:
                r = _Replay(corpus, opts, store, runner)
                r.prefix = f"r{int(started)}-"
                tokenizers = await r.vet_backends()
                rig = await rig_fingerprint(opts.backends)
                todo = [c for c in cases if c["id"] not in done]
                prog = _Progress(len(cases), len(cases) - len(todo), opts.progress)
                sem = asyncio.Semaphore(max(1, opts.concurrency))
                jf = journal.open("a", encoding="utf-8") if journal else None

                async def one(c: Mapping[str, Any]) -> None:
                    async with sem:
                        if interrupted.is_set():
                            return
                        try:
                            res = await r.case(c)
                        except Exception as e:  # noqa: BLE001 - a case never aborts the run
                            res = {"id": c["id"], "error": f"{type(e).__name__}: {e}", "turns": [],
                                   "branches": {}}
                    results_cases[c["id"]] = res
                    if jf is not None:
                        jf.write(json.dumps({"key": key, "case": res}, ensure_ascii=False) + "\n")
                        jf.flush()
                    prog.advance()

                try:
                    await asyncio.gather(*(one(c) for c in todo))
                except asyncio.CancelledError:
                    if interrupted.is_set():
                        raise KeyboardInterrupt from None
                    raise
                finally:
                    prog.close()
                    if jf is not None:
                        jf.close()
            verdict = await asyncio.to_thread(_verdict, store)
        if interrupted.is_set():  # the cancellation was lost on the way (asyncio.wait_for in 3.11 can)
            raise KeyboardInterrupt
        ordered = [results_cases[c["id"]] for c in cases if c["id"] in results_cases]
        results = build_results(corpus, opts, ordered, rig=rig, tokenizers=tokenizers,
                                refused=r.refused, wall_s=time.time() - started, resumed=len(done))
        results["verdict"] = verdict
        if finalize is not None:
            finalize(results)
        if opts.out:
            tmpf = Path(str(opts.out) + ".tmp")
            tmpf.write_text(json.dumps(results, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
            os.replace(tmpf, opts.out)
            if journal is not None and journal.exists():
                journal.unlink()
        if opts.html is not None:
            from tensorverse.replay.html import write_html_report

            results["html"] = str(write_html_report(results, store_path, opts.html))
    finally:
        _off_interrupt()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return results


def _verdict(store: Any) -> dict[str, Any]:
    """Each candidate's verdict over the replayed turns (docs/verdict.md): forced runs against
    the reference's, free runs against the basis; the replay has no secondary, so there is no
    noise floor. For ``--fail-on 'NAME:verdict=regression'``."""
    from tensorverse.analysis.verdict import VerdictPolicy, verdicts, verdicts_json
    from tensorverse.exporters.comparison_rows import from_store

    policy = VerdictPolicy()
    vs = verdicts(from_store(store), policy, forced_refs=("reference", "primary"))
    return verdicts_json([v for v in vs if v.role != "reference"], policy)


async def with_retries(run: Callable[[], Awaitable[Run]], retries: int, backoff_s: float) -> Run:
    """``await run()`` again while it comes back ``failed`` or ``timeout``, at most ``retries``
    more times, waiting ``backoff_s`` and then twice as long each time; the last run (its
    ``retries`` says how many more it took)."""
    out = await run()
    delay = backoff_s
    for attempt in range(retries):
        if out.status not in ("failed", "timeout"):
            break
        await asyncio.sleep(delay)
        delay *= 2
        out = await run()
        out.retries = attempt + 1
    return out


def _on_interrupt() -> asyncio.Event:
    """Ctrl-C (SIGINT) during a replay: set the returned event and cancel the running task. The
    event also stops cases not started yet, so an interruption holds even when a cancellation
    is swallowed on the way; `replay` then raises KeyboardInterrupt and keeps the journal. In a
    thread other than the main one (no signal handlers there) the event is never set."""
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def on_sigint() -> None:
        interrupted.set()
        if task is not None:
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):
        pass
    return interrupted


def _off_interrupt() -> None:
    try:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
    except (NotImplementedError, RuntimeError, ValueError):
        pass


def run_replay(corpus_path: str, opts: ReplayOptions, *, fail_on: Sequence[str] = (),
               as_json: bool = False) -> int:
    """The CLI: load, replay, print the summary, apply ``--fail-on``. Exit status: 0 ok, 1 a
    threshold exceeded, 2 usage or corpus error, 130 interrupted (finished cases kept)."""
    from tensorverse.replay.corpus import CorpusError
    from tensorverse.replay.report import check_thresholds, parse_threshold, render_summary

    try:
        thresholds = [parse_threshold(s) for s in fail_on]
        corpus = load_corpus(corpus_path)
    except (CorpusError, ValueError, FileNotFoundError) as e:
        print(f"tensorverse replay: {e}", file=sys.stderr)
        return 2
    def finalize(results: dict[str, Any]) -> None:
        results["thresholds"] = {"rules": list(fail_on), "failed": check_thresholds(results, thresholds)}

    try:
        results = asyncio.run(replay(corpus, opts, finalize=finalize))
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C (`_on_interrupt`)
        print("tensorverse replay: interrupted; finished cases are kept in "
              f"{opts.out}.partial.jsonl — rerun the same command to resume" if opts.out else
              "tensorverse replay: interrupted (no --out: nothing kept)", file=sys.stderr)
        return 130
    failures = results["thresholds"]["failed"]
    if as_json:
        print(json.dumps(results["summary"], indent=1))
    else:
        print(render_summary(results))
    if results.get("html"):
        print(f"HTML report: {results['html']}", file=sys.stderr)
    for f in failures:
        print(f"FAIL {f['message']}", file=sys.stderr)
    return 1 if failures else 0
