"""A fake vLLM server whose logits rows depend on the batch, speaking the capture plugin's protocol.

vLLM-CPU with one OpenMP thread computes bit-identical rows whatever else is in the batch
(docs/matrix.md), so it cannot show that ``tensorverse noise`` finds batch noise where there is
some, as on GPUs. This server can: a toy engine that steps every ``step_s`` seconds, gives every
request in the batch one token per step, and computes each request's logits row as a function of
its prompt and output so far (near ties at every third position, a clear winner elsewhere) **plus, with
``batch_variant``, a perturbation that depends on the number of requests in the step**. With
``batch_variant=False`` rows never depend on the batch.

What it shares with vLLM and the real plugin, so the probe is tested end to end:

* ``POST /v1/completions`` with token-id prompts, ``max_tokens``, ``ignore_eos``, ``logprobs``,
  ``return_token_ids`` and the plugin's ``vllm_xargs`` (``tv_force``, ``tv_capture``,
  ``tv_positions``, ``tv_compact``, ``tv_close``, ``tv_full``, parsed by
  :mod:`tensorverse.capture.optin`); answers in vLLM's shape
  (``token_ids``, ``logprobs.top_logprobs`` with ``token_id:N`` keys); ``/health``, ``/v1/models``.
* captured rows go through the real :class:`~tensorverse.capture.tap.Tap` with each step's
  engine state, into the sink named like the plugin's ``TENSORVERSE_CAPTURE_SINK``
  (``dir:STORE`` or the recorder's ``http://.../ingest``), as binary frames.
* a client that disconnects has its request aborted (vLLM does the same).

Tensorverse's tests measure it against it (``tests/replay/test_batch_noise.py``,
``tests/matrix/test_concurrency_axis.py``); it is no model.

**``agree_base``: a shadow of a fake primary, at a real vocabulary.** With ``agree_base=B`` the
rows stand in for another runtime of the model behind
:class:`~tensorverse.testing.fake_upstream.FakeUpstream` (``token_base=B``), whose output token at
position ``i`` is ``B + i`` whatever the prompt. That token is the row's argmax, a clear winner
except at a seeded ``2 * flip_rate`` share of positions where a runner-up is one bfloat16 step
below it (0.0625 at Qwen3's width). An engine with ``runtime != 0`` puts the runner-up one step
ahead at half of those (seeded by ``runtime``): its forced runs flip there and its free runs say
the runner-up, at about ``flip_rate`` of positions; ``runtime=0`` is the primary's own runtime and
never flips. Rows are bfloat16 values, captured as a bf16 tensor as a bf16 model's plugin captures
them: a seeded base row (``vocab`` normals, drawn once) rotated by a hash of the context, with the
two tokens set, cheap enough (tens of microseconds) that a load benchmark at Qwen3's 151,936 ids
measures the capture path and the proxy, not the fake's arithmetic. The log-sum-exp and top
logprobs are computed from the base's, exactly (float64). ``prompt_ids``: what ``/tokenize``
renders any chat request to (the fake primary serves that prompt); ``/detokenize`` gives
FakeUpstream's text of its ids.
"""

from __future__ import annotations

import asyncio
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorverse.capture import optin
from tensorverse.capture.sink import Sink, sink_from_env
from tensorverse.capture.tap import Tap
from tensorverse.store.engine_state import RUNNER_V1

__all__ = ["FakeEngine"]


@dataclass(eq=False)
class _Req:
    prompt: list[int]
    max_tokens: int
    opt: optin.OptIn | None
    logprobs: int
    done: asyncio.Future
    out: list[int] = field(default_factory=list)
    tops: list[dict[str, float]] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    as_ids: bool = True  # top-logprob keys as ``token_id:N`` (else the token's text)
    ignore_eos: bool = True
    finish: str = "length"


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return r.view(np.float32)


class FakeEngine:
    """See the module docstring. ``async with FakeEngine(sink="dir:/tmp/store") as e: e.url``."""

    def __init__(self, *, sink: str | Sink | None = None, vocab: int = 512, batch_variant: bool = True,
                 noise: float = 0.05, tie_margin: float = 0.01, step_s: float = 0.002,
                 model: str = "fake-batchy", seed: int = 0, agree_base: int | None = None,
                 flip_rate: float = 0.02, runtime: int = 0, max_rows: int = 512,
                 prompt_ids: list[int] | None = None) -> None:
        from aiohttp import web

        self.agree_base = agree_base
        self.prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        self.flip_rate = flip_rate
        self.runtime = runtime
        if agree_base is not None:
            if not 0 <= agree_base < vocab:
                raise ValueError(f"agree_base {agree_base} is outside the vocabulary of {vocab}")
            base = (np.random.default_rng([seed, 11]).standard_normal(vocab) * 2.0).astype(np.float32)
            self._base = _bf16(base)  # a bfloat16 model's logits, as a GPU shadow's plugin captures them
            b64 = self._base.astype(np.float64)
            self._base_max = float(b64.max())
            self._order = np.argsort(-b64, kind="stable")[:64]  # the base's best ids, best first
            self._exp_sum = float(np.exp(b64 - self._base_max).sum())  # of the base, relative to its max
            self._win = _bf16(np.array([self._base_max + 1.0], dtype=np.float32))[0]  # the argmax's logit
            self._step = np.float32(np.spacing(self._win) * 65536)  # one bfloat16 step at that logit
            self._second = _bf16(np.array([self._base_max + 0.5], dtype=np.float32))[0]  # a clear second
        self.vocab = vocab
        self.batch_variant = batch_variant
        self.noise = noise
        self.tie_margin = tie_margin
        self.step_s = step_s
        self.model = model
        self.seed = seed
        # the sink as the plugin reads it: its token from TENSORVERSE_CAPTURE_TOKEN
        if isinstance(sink, str):
            sink = sink_from_env({**os.environ, "TENSORVERSE_CAPTURE_SINK": sink})
        self.tap = Tap(sink, max_rows=max_rows, name="fake-engine-capture")
        self.step = 0
        self.batch_sizes: list[int] = []  # every step's batch size, for tests
        self._active: list[_Req] = []
        self._joining: list[_Req] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._app = web.Application()
        self._routes(self._app)

    def _routes(self, app: Any) -> None:
        """The HTTP endpoints (a model that speaks more of vLLM's API adds its own)."""
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/v1/models", self.h_models)
        app.router.add_post("/v1/completions", self.h_completions)
        if self.agree_base is not None:
            app.router.add_post("/tokenize", self.h_tokenize)
            app.router.add_post("/detokenize", self.h_detokenize)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self, port: int = 0) -> "FakeEngine":
        from tensorverse.testing.serve import serve

        self._runner, self.port = await serve(self._app, port, handler_cancellation=True)
        self._task = asyncio.create_task(self._engine())
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self._runner is not None:
            await self._runner.cleanup()
        await asyncio.to_thread(self.tap.close)

    async def __aenter__(self) -> "FakeEngine":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every captured row has reached the sink."""
        return self.tap.flush(timeout)

    # -- the model -------------------------------------------------------------------------
    def _agree(self, req: _Req) -> tuple[np.ndarray, int, int, int]:
        """An ``agree_base`` row: (row, winner, runner-up, rotation of the base)."""
        pos = len(req.out)
        V = self.vocab
        shift = zlib.crc32(np.asarray(req.prompt + req.out, dtype=np.int64).tobytes()) % V
        x = np.empty(V, dtype=np.float32)  # x[j] = base[(j + shift) % V]
        x[: V - shift] = self._base[shift:]
        x[V - shift:] = self._base[:shift]
        w = (self.agree_base + pos) % V  # type: ignore[operator]
        h = zlib.crc32(np.asarray([self.seed, pos], dtype=np.int64).tobytes())
        r = (w + 1 + h % (V - 1)) % V
        near = (h >> 8) % 1_000_000 < 2 * self.flip_rate * 1_000_000
        x[w] = self._win
        if not near:
            x[r] = self._second
        elif self.runtime and zlib.crc32(np.asarray([self.seed, pos, self.runtime], dtype=np.int64).tobytes()) % 2:
            x[r] = self._win + self._step  # this runtime's rounding puts the runner-up ahead: a flip
        else:
            x[r] = self._win - self._step  # a near tie: one bfloat16 step apart
        return x, w, r, shift

    def _agree_logprobs(self, x: np.ndarray, w: int, r: int, shift: int,
                        k: int) -> tuple[float, list[tuple[int, float]]]:
        """The exact float64 log-sum-exp of an ``agree_base`` row (the base's sum with the two set
        entries replaced), and its top ``k`` as (id, logprob), best first."""
        V = self.vocab
        m = self._base_max + 1.0
        bw, br = float(self._base[(w + shift) % V]), float(self._base[(r + shift) % V])
        s = (self._exp_sum * np.exp(self._base_max - m) - np.exp(bw - m) - np.exp(br - m)
             + np.exp(float(x[w]) - m) + np.exp(float(x[r]) - m))
        lse = m + float(np.log(s))
        seen = {w, r}
        tops = [(w, float(x[w]) - lse), (r, float(x[r]) - lse)]
        for i in self._order:  # the rest of the row is the base's: its best ids, rotated
            if len(tops) >= k:
                break
            t = (int(i) - shift) % V
            if t not in seen:
                seen.add(t)
                tops.append((t, float(x[t]) - lse))
        tops.sort(key=lambda e: (-e[1], e[0]))
        return lse, tops[:k]

    def top_logprobs(self, prompt: list[int], out: list[int], k: int) -> list[tuple[int, float]]:
        """``agree_base``: the top ``k`` (id, logprob) of the row after ``prompt + out`` (what a fake
        primary of the same model records as its top logprobs)."""
        x, w, r, shift = self._agree(_Req(prompt=list(prompt), max_tokens=0, opt=None, logprobs=0,
                                          done=None, out=list(out)))  # type: ignore[arg-type]
        return self._agree_logprobs(x, w, r, shift, k)[1]

    def row(self, req: _Req, batch_size: int) -> np.ndarray:
        """The logits row of ``req``'s next position in a batch of ``batch_size`` requests."""
        pos = len(req.out)
        key = zlib.crc32(np.asarray(req.prompt + req.out, dtype=np.int64).tobytes())
        rng = np.random.default_rng([self.seed, key, pos])
        x = rng.standard_normal(self.vocab).astype(np.float32) * 2.0
        two = np.argpartition(x, -2)[-2:]
        a, b = (two[1], two[0]) if x[two[1]] >= x[two[0]] else (two[0], two[1])
        if pos % 3 == 0:  # a near tie between the two best tokens
            x[b] = x[a] - self.tie_margin
        else:  # a clear winner: no batch perturbation flips it
            x[a] = x[b] + 1.0
        if self.batch_variant and batch_size > 1:
            nrng = np.random.default_rng([self.seed, key, pos, batch_size, 7])
            x = x + (nrng.standard_normal(self.vocab) * self.noise).astype(np.float32)
        return x

    async def _engine(self) -> None:
        while True:
            if not self._active and not self._joining:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.step_s)
            joined = len(self._joining)
            self._active.extend(self._joining)
            self._joining.clear()
            batch = [r for r in self._active if not r.done.done()]
            self._active = batch
            if not batch:
                continue
            self.step += 1
            n = len(batch)
            self.batch_sizes.append(n)
            agreed = [self._agree(r) for r in batch] if self.agree_base is not None else None
            logits = np.stack([a[0] for a in agreed] if agreed is not None else [self.row(r, n) for r in batch])
            items = []
            for i, r in enumerate(batch):
                pos = len(r.out)
                if r.opt is not None and r.opt.capture_id is not None and r.opt.captures(pos):
                    items.append((i, r.opt.capture_id, pos, (RUNNER_V1, self.step, n, i, joined, -1, -1),
                                  r.opt.evidence(pos)))
            if items:
                import torch

                t = torch.from_numpy(logits)
                # agree_base rows are bfloat16 values: captured as a bf16 model's plugin captures them
                self.tap.capture(t.to(torch.bfloat16) if agreed is not None else t, items)
            for i, r in enumerate(batch):
                forced = r.opt.forced_token(len(r.out)) if r.opt is not None else None
                if agreed is not None:
                    x32, w, ru, shift = agreed[i]
                    lse, top_pairs = self._agree_logprobs(x32, w, ru, shift, max(2, r.logprobs))
                    tok = int(forced) if forced is not None else top_pairs[0][0]
                    r.out.append(tok)
                    r.lps.append(float(x32[tok]) - lse)
                    if r.logprobs:
                        r.tops.append({f"token_id:{t}": lp for t, lp in top_pairs[: r.logprobs]})
                else:
                    self._take(r, logits[i], forced)
                if len(r.out) >= r.max_tokens or r.finish != "length":
                    r.done.set_result(None)
            self._active = [r for r in self._active if not r.done.done()]

    def _take(self, r: _Req, x: np.ndarray, forced: int | None) -> None:
        """Append ``r``'s next token (the forced one, else the row's argmax), its logprob and,
        when asked for, the row's top logprobs."""
        x = x.astype(np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        tok = int(forced) if forced is not None else int(np.argmax(x))
        r.out.append(tok)
        r.lps.append(float(lp[tok]))
        if r.logprobs:
            k = min(r.logprobs, lp.size)
            part = np.argpartition(lp, -k)[-k:]
            top = part[np.argsort(lp[part])[::-1]]
            r.tops.append({f"token_id:{int(t)}": float(lp[t]) for t in top})

    async def generate(self, req: _Req) -> None:
        """Decode ``req`` in the engine's batches until it is done (a client that goes away
        aborts it, as vLLM does)."""
        self._joining.append(req)
        self._wake.set()
        try:
            await req.done
        finally:
            if not req.done.done():
                req.done.cancel()

    # -- HTTP ------------------------------------------------------------------------------
    # -- the primary's dictionary (agree_base) ------------------------------------------------
    def piece(self, token_id: int) -> str:
        """The text of a token: FakeUpstream's ``"t<i> "`` for its output ids, ``"<id>"`` otherwise."""
        i = token_id - self.agree_base  # type: ignore[operator]
        return f"t{i} " if 0 <= i < 1_000_000 else f"<{token_id}>"

    async def h_tokenize(self, request: Any) -> Any:
        """vLLM's ``/tokenize``: a chat request renders to ``prompt_ids`` (the fake primary serves
        every chat request that prompt); text to one id per byte."""
        from aiohttp import web

        body = await request.json()
        if "messages" in body:
            if self.prompt_ids is None:
                return web.json_response({"error": {"message": "no chat template"}}, status=400)
            ids = list(self.prompt_ids)
        else:
            ids = list(str(body.get("prompt", "")).encode())
        return web.json_response({"count": len(ids), "max_model_len": 32768, "tokens": ids})

    async def h_detokenize(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        return web.json_response({"prompt": "".join(self.piece(int(t)) for t in body.get("tokens") or [])})

    async def h_health(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(text="")

    async def h_models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def h_completions(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return web.json_response({"error": {"message": "prompt must be token ids"}}, status=400)
        extra = body.get("vllm_xargs") or None
        try:
            opt = optin.parse_extra_args(extra) if extra else None
        except Exception as e:  # noqa: BLE001
            return web.json_response({"error": {"message": str(e)}}, status=400)
        req = _Req(prompt=list(prompt), max_tokens=int(body.get("max_tokens") or 16), opt=opt,
                   logprobs=int(body.get("logprobs") or 0), done=asyncio.get_running_loop().create_future())
        await self.generate(req)
        choice: dict[str, Any] = {
            "index": 0, "text": "".join(f"<{t}>" for t in req.out), "token_ids": req.out,
            "finish_reason": "length", "stop_reason": None,
            "logprobs": ({"tokens": [f"token_id:{t}" for t in req.out], "token_logprobs": req.lps,
                          "top_logprobs": req.tops, "text_offset": None} if req.logprobs else None)}
        return web.json_response({
            "id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": self.model, "choices": [choice],
            "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.out),
                      "total_tokens": len(req.prompt) + len(req.out)}})
