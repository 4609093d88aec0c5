"""Forced and free runs of one recorded turn on shadow backends (docs/architecture.md, "Data flow").

For each shadow backend and each recorded turn, two runs, both through the backend's
``/v1/completions`` with the primary's prompt token ids (the requests and their answers:
:mod:`tensorverse.shadow.completions`; the turn: :mod:`tensorverse.shadow.turn`; the records:
:mod:`tensorverse.shadow.runs`):

``forced``
    teacher forcing through the decode path, the plugin forcing the primary's ids and capturing
    every row. The emitted ids must equal the forced ids; when they do not (no plugin), or the
    server cannot force, the run falls back to *scoring* the primary's output as a prompt
    (``prompt_logprobs``: the prefill path, top-k only) and is marked ``approximate``.
``free``
    the shadow generates on its own from the same prompt ids, capture on.

Rows travel from the plugin to the store through the server's sink (``TENSORVERSE_CAPTURE_SINK``);
the runner waits (bounded by ``rows_timeout_s``) until the expected rows are in the store.
Failures never raise to the caller: they become run records with ``status`` ``failed`` or
``timeout`` and an ``error``. A backend whose tokenizer differs from the primary's gets
``status: refused`` records and is never run. Capabilities and fingerprints are cached
(:mod:`tensorverse.shadow.cache`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Iterable, Mapping, Sequence

import aiohttp
import msgspec

from tensorverse.analysis.flips import first_difference
from tensorverse.capture.optin import KEY_CAPTURE
from tensorverse.shadow.backend import Backend
from tensorverse.shadow.cache import SHARED_CACHE, RunnerCache, _Caps
from tensorverse.shadow.client import BackendClient, BackendError
from tensorverse.shadow.completions import (forced_body, free_body, parse_completion,
                                            parse_prompt_logprobs, scoring_body)
from tensorverse.shadow.doctor import probe_capabilities
from tensorverse.shadow.evidence import SourceEvidence, close_threshold, free_requested_positions, requested_positions
from tensorverse.shadow.evidence import xargs as evidence_xargs
from tensorverse.shadow.runs import (MODES, fail_run, primary_parser_check, primary_record,
                                     primary_run_id, run_record, sent_sampling)
from tensorverse.shadow.tokenizer import check_template, fingerprint, render_chat, same_dictionary
from tensorverse.shadow.turn import TurnInput
from tensorverse.store.records import Run, Turn

# How long a run waits for its captured rows to land in the store (the tee budgets for it).
ROWS_TIMEOUT_S = 30.0

__all__ = ["ShadowRunner", "shadow_turn", "ROWS_TIMEOUT_S"]

log = logging.getLogger("tensorverse.shadow")


def _sink_refusal(e: BackendError) -> bool:
    return e.kind == "http" and e.status == 400 and ("tv_capture" in e.message or "sink" in e.message)


def _now() -> float:
    return time.monotonic()


# --------------------------------------------------------------------------- the runner


class ShadowRunner:
    """Runs recorded turns on shadow backends and stores run records (and comparisons).

    One runner per process is the intended use (the proxy keeps one): it caches each backend's
    capabilities (plugin, sink) and tokenizer fingerprint, and bounds the requests in flight per
    backend to ``backend.concurrency``. Use ``async with ShadowRunner(store, backends) as r``.
    """

    def __init__(self, store: Any, backends: Iterable[Backend], *, rows_timeout_s: float = ROWS_TIMEOUT_S,
                 rows_poll_s: float = 0.1, check_tokenizer: bool = True,
                 strict_tokenizer: bool = False, check_template: bool = True,
                 free_margin: int = 64, forced_positions: str | Sequence[int] | None = None,
                 free_positions: str | Sequence[int] | None = None,
                 primary: Backend | None = None, cache: RunnerCache | None = None,
                 session: aiohttp.ClientSession | None = None,
                 evidence: SourceEvidence | None = None) -> None:
        self.store = store
        self.backends = list(backends)
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique: {names}")
        self.rows_timeout_s = rows_timeout_s
        self.rows_poll_s = rows_poll_s
        self.check_tokenizer = check_tokenizer
        self.strict_tokenizer = strict_tokenizer
        self.check_template = check_template
        self.free_margin = free_margin
        self.forced_positions = forced_positions
        self.free_positions = free_positions
        #: evidence chosen at the source (`tensorverse.shadow.evidence`); None: every row in full
        self.evidence = evidence
        self._session = session
        self._own_session = session is None
        self._primary = primary or next((b for b in self.backends if b.role == "primary"), None)
        self.cache = cache if cache is not None else RunnerCache()
        self._sems: dict[str, asyncio.Semaphore] = {}
        self._caps_lock: dict[str, asyncio.Lock] = {}
        self._fp_lock: dict[str, asyncio.Lock] = {}
        self._registered: set[str] = set()

    # -- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> "ShadowRunner":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    def _client(self, backend: Backend) -> BackendClient:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
            self._own_session = True
        return BackendClient(backend, self._session)

    def _sem(self, backend: Backend) -> asyncio.Semaphore:
        s = self._sems.get(backend.name)
        if s is None:
            s = self._sems[backend.name] = asyncio.Semaphore(backend.concurrency)
        return s

    @property
    def primary(self) -> Backend | None:
        return self._primary

    def _primary_from_store(self, name: str | None) -> Backend | None:
        """The primary as the proxy registered it (``put_backend(name, BackendInfo(name=name, url=...))``)."""
        if not name or not hasattr(self.store, "get_backend"):
            return None
        try:
            info = self.store.get_backend(name)
        except Exception:  # noqa: BLE001 - not registered
            return None
        url = info.url
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return None
        try:
            return Backend(name=name, url=url, model=info.model, role="primary",
                           timeout_s=float(info.timeout_s or 30.0))
        except (TypeError, ValueError):
            return None

    # -- store helpers (never raise) ------------------------------------------------------
    async def _put(self, method: str, *args: Any) -> bool:
        try:
            await asyncio.wrap_future(getattr(self.store, method)(*args))
            return True
        except Exception as e:  # noqa: BLE001 - a full or closed store must not break the runner
            log.warning("tensorverse shadow: store %s failed: %s", method, e)
            return False

    async def _register(self, backend: Backend, fp: Mapping[str, Any] | None) -> None:
        if backend.name in self._registered:
            return
        info = backend.info()
        if backend.role == "primary":  # keep what the proxy stored about its primary
            try:
                stored = self.store.get_backend(backend.name)
                info = msgspec.structs.replace(stored, **{k: v for k, v in msgspec.structs.asdict(info).items()
                                                          if v is not None})
            except Exception:  # noqa: BLE001
                pass
        if fp and fp.get("available"):
            info.tokenizer = {k: fp.get(k) for k in ("fingerprint", "vocab_size", "template_fingerprint")}
        caps = self.cache.get_caps(backend)
        if caps is not None and caps.probed:
            info.capabilities = {"forcing": caps.forcing, "capture": caps.capture, "detail": caps.detail}
        if await self._put("put_backend", backend.name, info):
            self._registered.add(backend.name)

    # -- cached checks --------------------------------------------------------------------
    async def fingerprint_of(self, backend: Backend) -> dict[str, Any]:
        lock = self._fp_lock.setdefault(backend.name, asyncio.Lock())
        async with lock:
            fp = self.cache.get_fp(backend)
            if fp is None:
                fp = await fingerprint(self._client(backend))
                if fp.get("available"):  # cache only answers, so a backend that was down is retried
                    self.cache.put_fp(backend, fp)
            return fp

    async def tokenizer_verdict(self, backend: Backend, primary: Backend | None = None) -> dict[str, Any]:
        """``{"allowed", "message", "fingerprint"}`` for a backend against the primary."""
        fp = await self.fingerprint_of(backend)
        primary = primary or self.primary
        if primary is None:
            return {"allowed": True, "message": "no primary backend declared; the same-dictionary "
                    "check was skipped", "fingerprint": fp.get("fingerprint")}
        if primary.name == backend.name:
            return {"allowed": True, "message": "primary", "fingerprint": fp.get("fingerprint")}
        pfp = await self.fingerprint_of(primary)
        ok, msg = same_dictionary(pfp, fp, primary_name=primary.name, shadow_name=backend.name,
                                  strict=self.strict_tokenizer)
        return {"allowed": ok, "message": msg, "fingerprint": fp.get("fingerprint")}

    async def capabilities(self, backend: Backend) -> _Caps:
        lock = self._caps_lock.setdefault(backend.name, asyncio.Lock())
        async with lock:
            caps = self.cache.get_caps(backend)
            if caps is not None:
                return caps
            if backend.capture == "full":
                caps = _Caps(forcing=True, capture=True, probed=False, detail="configured: full")
                self.cache.caps[self.cache.key(backend)] = caps
                return caps
            probe = await probe_capabilities(self._client(backend))
            if probe.get("plugin") is None:  # the probe failed: try the runs as configured
                return _Caps(forcing=True, capture=backend.capture != "topk",
                             detail=probe.get("error", ""))
            caps = _Caps(forcing=bool(probe.get("forcing")),
                         capture=bool(probe.get("capture_sink")) and backend.capture != "topk",
                         probed=True, detail=probe.get("detail", ""))
            self.cache.caps[self.cache.key(backend)] = caps
            return caps

    # -- rows -----------------------------------------------------------------------------
    def _present(self, run_id: str, positions: Sequence[int], have: set[int], full: bool) -> None:
        """Add to ``have`` the positions whose row is in the store (stops at the first missing
        one unless ``full``: rows arrive in order, so a poll stays cheap)."""
        for p in positions:
            if p in have:
                continue
            try:
                self.store.read_row(run_id, p)
            except KeyError:
                if self.evidence is None or self.store.read_compact_row(run_id, p) is None:
                    if not full:
                        return
                    continue
            have.add(p)

    async def wait_rows(self, run_id: str, positions: Sequence[int]) -> dict[str, Any]:
        """Wait (at most ``rows_timeout_s``) until the rows of ``positions`` are in the store."""
        t0 = _now()
        have: set[int] = set()
        deadline = t0 + self.rows_timeout_s
        error = None
        # Rows this process commits (the proxy's ingest) are announced by the store: a waiter wakes
        # on its last row and never reads the store for them. Rows written by another process are
        # found by polling the store, as are any once their run is forgotten by the announcements.
        arrivals = getattr(self.store, "arrivals", None)
        while True:
            if arrivals is not None:
                need = [p for p in positions if p not in have]
                have |= await arrivals.wait(run_id, need, min(self.rows_poll_s, max(0.0, deadline - _now())),
                                            compact=self.evidence is not None)
                if len(have) >= len(positions):
                    break
                if arrivals.knows(run_id) and _now() < deadline:
                    continue
            try:
                await asyncio.to_thread(self._present, run_id, positions, have, False)
            except Exception as e:  # noqa: BLE001 - a reader hiccup: keep polling until the deadline
                error = f"{type(e).__name__}: {e}"
            if len(have) >= len(positions) or _now() >= deadline:
                break
            if arrivals is None:
                await asyncio.sleep(self.rows_poll_s)
        if arrivals is not None:
            arrivals.forget(run_id)
        if len(have) < len(positions):
            try:
                await asyncio.to_thread(self._present, run_id, positions, have, True)
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
        out: dict[str, Any] = {"expected": len(positions), "present": len(have),
               "complete": len(have) >= len(positions), "waited_s": round(_now() - t0, 4)}
        if not out["complete"]:
            missing = [p for p in positions if p not in have]
            out["missing"] = missing[:64]
            if error:
                out["error"] = error
        return out

    # -- runs -----------------------------------------------------------------------------

    async def _post(self, backend: Backend, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        async with self._sem(backend):
            t0 = _now()
            resp = await self._client(backend).completions(body)
            return resp, _now() - t0

    async def run_forced(self, t: TurnInput, backend: Backend, run_id: str | None = None) -> Run:
        from tensorverse.store.schema import new_id

        t_start = _now()
        run = run_record(t, backend, "forced", run_id or new_id())
        n = len(t.output_token_ids)
        if n == 0:
            return fail_run(run, "the primary's output is empty: nothing to force")
        caps = await self.capabilities(backend)
        resp = None
        if caps.forcing:
            body = forced_body(t, backend, run.id, capture=caps.capture,
                               positions=self.forced_positions)
            self._ask_evidence(t, body, run)
            try:
                resp, dt = await self._post(backend, body)
            except BackendError as e:
                if caps.capture and _sink_refusal(e):
                    caps.capture = False  # the server has the plugin but no sink
                    run.attempts.append({"method": "forced_decode", "error": str(e)})
                    body = forced_body(t, backend, run.id, capture=False)
                    try:
                        resp, dt = await self._post(backend, body)
                    except BackendError as e2:
                        if e2.kind in ("timeout", "connect"):
                            return fail_run(run, e2)
                        run.attempts.append({"method": "forced_decode", "error": str(e2)})
                elif e.kind in ("timeout", "connect"):
                    run.timings["total_s"] = round(_now() - t_start, 4)
                    return fail_run(run, e)
                else:
                    run.attempts.append({"method": "forced_decode", "error": str(e)})
            if resp is not None:
                try:
                    got = parse_completion(resp)
                except BackendError as e:
                    run.attempts.append({"method": "forced_decode", "error": str(e)})
                    got = None
                if got is not None:
                    j = first_difference(t.output_token_ids, got["token_ids"])
                    if j is None:
                        run.status, run.method, run.sampling = "ok", "forced_decode", sent_sampling(body)
                        run.k = body.get("logprobs", 0)
                        run.token_ids, run.text = got["token_ids"], got["text"]
                        run.finish_reason = got["finish_reason"]
                        run.top_logprobs = got["top_logprobs"]
                        run.token_logprobs = got["token_logprobs"]
                        run.timings["request_s"] = round(dt, 4)
                        if KEY_CAPTURE in (body.get("vllm_xargs") or {}):
                            rows = await self._collect_rows(run, n, self.forced_positions)
                            if not rows["present"]:
                                run.attempts.append({
                                    "method": "capture",
                                    "error": f"no captured row arrived in {self.rows_timeout_s:g} s "
                                             "(is the server's TENSORVERSE_CAPTURE_SINK pointing at "
                                             "this store or its recorder?)"})
                        run.timings["total_s"] = round(_now() - t_start, 4)
                        return run
                    emitted = got["token_ids"]
                    msg = (f"the backend did not emit the forced tokens (first difference at "
                           f"position {j}: forced {t.output_token_ids[j] if j < n else None}, emitted "
                           f"{emitted[j] if j < len(emitted) else None}): the Tensorverse plugin is "
                           "missing or switched off; falling back to prompt_logprobs scoring")
                    run.attempts.append({"method": "forced_decode", "error": msg})
                    caps.forcing = False
                    caps.capture = False
        # Fallback: score the primary's output in one prefill (top-k only, approximate).
        body = scoring_body(t, backend)
        try:
            resp, dt = await self._post(backend, body)
            got = parse_prompt_logprobs(resp, len(t.prompt_token_ids), t.output_token_ids)
        except BackendError as e:
            run.timings["total_s"] = round(_now() - t_start, 4)
            return fail_run(run, e)
        run.status, run.method, run.sampling = "ok", "prompt_logprobs", sent_sampling(body)
        run.token_ids = list(t.output_token_ids)
        run.top_logprobs, run.token_logprobs = got["top_logprobs"], got["token_logprobs"]
        run.capture, run.approximate, run.k = "topk", True, max(1, backend.logprobs)
        run.timings["request_s"] = round(dt, 4)
        run.timings["total_s"] = round(_now() - t_start, 4)
        return run

    def _ask_evidence(self, t: TurnInput, body: dict[str, Any], run: Run) -> None:
        """With evidence at the source: ask the plugin for compact rows and the positions the run
        keeps in full (`tensorverse.shadow.evidence`: a forced run the primary's, a free run the
        sample); say so on the run."""
        xargs = body.get("vllm_xargs")
        if self.evidence is None or not xargs or KEY_CAPTURE not in xargs:
            return
        if run.mode == "free":
            full = free_requested_positions(t, self.evidence, int(body.get("max_tokens") or 0))
        else:
            full = requested_positions(t, self.evidence)
        close = close_threshold(t, self.evidence)
        xargs.update(evidence_xargs(self.evidence, full, close))
        run.evidence = {"k": self.evidence.k, "close_nats": close, "requested": len(full)}

    async def run_free(self, t: TurnInput, backend: Backend, run_id: str | None = None) -> Run:
        from tensorverse.store.schema import new_id

        t_start = _now()
        run = run_record(t, backend, "free", run_id or new_id())
        caps = await self.capabilities(backend)
        body = free_body(t, backend, run.id, capture=caps.capture, margin=self.free_margin,
                         positions=self.free_positions)
        self._ask_evidence(t, body, run)
        if caps.capture and "vllm_xargs" not in body:
            run.attempts.append({"method": "capture", "error": "capture skipped: the primary's "
                                 "sampling uses penalties, which the plugin cannot capture under"})
        try:
            resp, dt = await self._post(backend, body)
        except BackendError as e:
            if not _sink_refusal(e):
                run.timings["total_s"] = round(_now() - t_start, 4)
                return fail_run(run, e)
            caps.capture = False
            run.attempts.append({"method": "generate", "error": str(e)})
            body = free_body(t, backend, run.id, capture=False, margin=self.free_margin)
            try:
                resp, dt = await self._post(backend, body)
            except BackendError as e2:
                run.timings["total_s"] = round(_now() - t_start, 4)
                return fail_run(run, e2)
        try:
            got = parse_completion(resp)
        except BackendError as e:
            return fail_run(run, e)
        run.status, run.method, run.sampling = "ok", "generate", sent_sampling(body)
        run.k = body.get("logprobs", 0)
        run.token_ids, run.text, run.finish_reason = got["token_ids"], got["text"], got["finish_reason"]
        run.top_logprobs, run.token_logprobs = got["top_logprobs"], got["token_logprobs"]
        run.timings["request_s"] = round(dt, 4)
        if "vllm_xargs" in body and got["token_ids"]:
            await self._collect_rows(run, len(got["token_ids"]), self.free_positions)
        run.timings["total_s"] = round(_now() - t_start, 4)
        return run

    async def _collect_rows(self, run: Run, n: int, position_spec: Any) -> dict[str, Any]:
        """Wait for the captured rows of a run's `n` output positions (those `position_spec`
        selects) and record what arrived; a run with its rows becomes exact (`capture: full`)."""
        positions = list(range(n))
        if position_spec is not None:
            from tensorverse.capture.optin import Positions

            ps = Positions.parse(position_spec)
            positions = [p for p in positions if p in ps]
        rows = await self.wait_rows(run.id, positions)
        run.rows = rows
        run.timings["rows_wait_s"] = rows["waited_s"]
        if rows["present"]:
            run.capture = "full"
            run.approximate = False
        return rows

    async def _pieces(self, t: TurnInput, allowed: Sequence[Backend]) -> list[str] | None:
        """Decoded text of each output token (``/detokenize`` per distinct id), for regions."""
        if t.pieces is not None:
            return t.pieces
        try:  # an earlier call for this turn (another backend) may have stored them
            prev = await asyncio.to_thread(self.store.get_run, primary_run_id(t.id))
            pieces = prev.pieces
            if pieces is not None and len(pieces) == len(t.output_token_ids):
                return pieces
        except Exception:  # noqa: BLE001 - not there yet
            pass
        for backend in allowed:
            if self.cache.lacks_detokenize(backend):
                continue
            client = self._client(backend)
            known = self.cache.pieces_of(backend)
            uniq = sorted(set(t.output_token_ids) - known.keys())
            sem = asyncio.Semaphore(8)

            async def one(tid: int) -> tuple[int, str]:
                async with sem:  # noqa: B023 - called in this iteration
                    body: dict[str, Any] = {"tokens": [tid]}
                    if backend.model:  # noqa: B023 - called in this iteration
                        body["model"] = backend.model  # noqa: B023 - called in this iteration
                    out = await client.post("/detokenize", body, root=True)  # noqa: B023 - called in this iteration
                    return tid, (out.get("prompt") if isinstance(out, dict) else "") or ""

            try:
                known.update(await asyncio.gather(*(one(x) for x in uniq)))
            except BackendError as e:
                log.info("tensorverse shadow: no pieces from %s: %s", backend.name, e)
                if e.kind == "http" and e.status in (404, 405, 501):  # it has no /detokenize: ask again after ttl_s
                    self.cache.no_detokenize[self.cache.key(backend)] = time.monotonic()
                continue
            return [known[x] for x in t.output_token_ids]
        return None

    async def _template_basis(self, t: TurnInput, primary: Backend | None) -> tuple[list[int], str]:
        """What a shadow's rendering of the chat request is compared with: the primary's own
        rendering by ``/tokenize`` when it can be had (like with like), else the recorded prompt."""
        if not self.check_template or t.chat_request is None or primary is None:
            return t.prompt_token_ids, "recorded_prompt"
        try:
            rendered = await render_chat(self._client(primary), t.chat_request)
        except (BackendError, ValueError):
            return t.prompt_token_ids, "recorded_prompt"
        if rendered != t.prompt_token_ids:
            log.info("tensorverse shadow: turn %s: the primary's /tokenize rendering differs from "
                     "the prompt it served; comparing template renderings with each other", t.id)
            return rendered, "primary_render"
        return rendered, "recorded_prompt"

    async def run_turn(self, turn: Mapping[str, Any] | Turn | TurnInput, *,
                       modes: Sequence[str] = MODES,
                       backends: Sequence[Backend] | None = None) -> list[Run]:
        """Run ``modes`` of one turn on every non-primary backend; store and return the records.

        The first record is the primary's (``mode: recorded``). Never raises for backend trouble."""
        for m in modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r} (forced, free)")
        t = TurnInput.from_dict(turn)
        targets = [b for b in (backends if backends is not None else self.backends)
                   if b.role != "primary"]
        primary = self.primary or self._primary_from_store(t.primary)
        written: set[tuple[str, str]] = set()
        try:
            return await self._run_turn(t, targets, primary, modes, written)
        except asyncio.CancelledError:
            # The caller's deadline passed (the shadow tee bounds a turn): every run not stored yet
            # is stored as a timeout, so no run of the turn goes missing.
            from tensorverse.store.schema import new_id

            for b in targets:
                for mode in modes:
                    if (b.name, mode) not in written:
                        run = run_record(t, b, mode, new_id())
                        run.status, run.error = "timeout", "cancelled: the deadline for the turn passed"
                        try:
                            self.store.put_run(run)  # the writer thread commits it; not awaited
                        except Exception as e:  # noqa: BLE001
                            log.warning("tensorverse shadow: store put_run failed: %s", e)
            raise

    async def _run_turn(self, t: TurnInput, targets: list[Backend], primary: Backend | None,
                        modes: Sequence[str], written: set[tuple[str, str]]) -> list[Run]:
        expected, basis = await self._template_basis(t, primary)

        # Same-dictionary check (cached per backend) and chat-template check (per turn).
        async def vet(b: Backend) -> tuple[Backend, dict[str, Any], dict[str, Any] | None]:
            verdict = (await self.tokenizer_verdict(b, primary)) if self.check_tokenizer else \
                {"allowed": True, "message": "not checked", "fingerprint": None}
            tmpl = None
            if verdict["allowed"] and self.check_template and t.chat_request is not None:
                tmpl = await check_template(self._client(b), t.chat_request, expected)
                tmpl["basis"] = basis
            return b, verdict, tmpl

        vetted = await asyncio.gather(*(vet(b) for b in targets))
        if self.evidence is not None and t.pieces is None:
            # the tool-call regions of the primary's answer are asked for in full: its pieces first
            try:
                pieces = await self._pieces(t, [b for b, v, _ in vetted if v["allowed"]])
            except Exception as e:  # noqa: BLE001
                log.info("tensorverse shadow: no pieces for turn %s: %s", t.id, e)
                pieces = None
            if pieces is not None:
                t = dataclasses.replace(t, pieces=list(pieces))

        async def run_one(b: Backend, verdict: dict[str, Any], tmpl: dict[str, Any] | None,
                          mode: str) -> Run:
            from tensorverse.store.schema import new_id

            if not verdict["allowed"]:
                run = run_record(t, b, mode, new_id())
                run.status, run.error = "refused", verdict["message"]
            else:
                try:
                    if mode == "forced":
                        run = await self.run_forced(t, b)
                    else:
                        run = await self.run_free(t, b)
                except Exception as e:
                    log.exception("tensorverse shadow: %s run of turn %s on %s", mode, t.id, b.name)
                    run = run_record(t, b, mode, new_id())
                    fail_run(run, f"internal error: {type(e).__name__}: {e}")
            run.tokenizer = {"same_dictionary": verdict["allowed"], "message": verdict["message"],
                             "fingerprint": verdict.get("fingerprint")}
            run.template = tmpl
            written.add((b.name, mode))
            await self._put("put_run", run)
            return run

        runs = await asyncio.gather(*(run_one(b, v, tm, m) for b, v, tm in vetted for m in modes))
        for b in targets:  # after the runs, so the record has the probed capabilities
            await self._register(b, self.cache.get_fp(b))
        if primary is not None and self.check_tokenizer:
            await self._register(primary, self.cache.get_fp(primary))
        allowed = [b for b, v, _ in vetted if v["allowed"]]
        pieces = t.pieces if self.evidence is not None else None
        if pieces is None and any(r.status == "ok" for r in runs):
            try:
                pieces = await self._pieces(t, allowed)
            except Exception as e:  # noqa: BLE001
                log.info("tensorverse shadow: no pieces for turn %s: %s", t.id, e)
        record = primary_record(t, pieces, primary)
        if pieces is not None:
            record.parser_check = primary_parser_check(t, pieces)
        await self._put("put_run", record)
        return [record, *runs]


async def shadow_turn(turn: Mapping[str, Any], backends: Sequence[Backend], store: Any, *,
                      modes: Sequence[str] = MODES, compare: bool = True,
                      **runner_kwargs: Any) -> list[Run]:
    """Run one recorded turn on the shadow backends (forced + free), store the run records and,
    with ``compare``, the comparisons. Returns the run records (the primary's first).

    For many turns keep one :class:`ShadowRunner` (capabilities and fingerprints are cached)."""
    runner_kwargs.setdefault("cache", SHARED_CACHE)
    try:
        t = TurnInput.from_dict(turn)
    except ValueError as e:
        log.warning("tensorverse shadow: turn %s not shadowed: %s",
                    turn.get("id") if isinstance(turn, Mapping) else None, e)
        return []
    async with ShadowRunner(store, backends, **runner_kwargs) as runner:
        runs = await runner.run_turn(t, modes=modes)
    if compare:
        from tensorverse.shadow.compare import compare_turn

        try:
            await asyncio.to_thread(compare_turn, store, runs[0].turn_id,
                                    backends=[b.name for b in backends if b.role != "primary"])
        except Exception:
            log.exception("tensorverse shadow: comparing turn %s failed", runs[0].turn_id)
    return runs
