"""A small fake vLLM with a tokenizer and chat templates: the fake engine's model for the shadow
runner, replay, doctor and exporter tests (no model, no vLLM import).

:class:`FakeVLLM` is a :class:`~tensorverse.testing.fake_engine.FakeEngine` (the same server, the
same batched decode loop, the plugin's opt-in parsed by :mod:`tensorverse.capture.optin`, rows
captured through the real :class:`~tensorverse.capture.tap.Tap` into a sink) with another model:

* logits: a deterministic function of the context over a small vocabulary (64 ids), plus
  ``perturb`` (seeded by ``perturb_seed``) to stand for another runtime, and ``flip_at``
  (output position -> token made the argmax, forced and free runs alike);
* a dictionary and two chat templates: ``/tokenize`` (text or chat ``messages``; ``tokenizer="b"``
  numbers the same characters one id higher, ``template="b"`` renders tools and the generation
  prompt differently) and ``/detokenize``; ``/version``;
* what vLLM's ``/v1/completions`` answers besides: ``prompt_logprobs``, ``logprob_token_ids``
  (its 400 for out-of-vocabulary ids), its 400 for ``logprobs`` above the vocabulary, text tokens
  unless ``return_tokens_as_token_ids``, ``token_ids`` only with ``return_token_ids``, a stop at
  ``eos`` unless ``ignore_eos``, the sampled token among the top logprobs.

``store``: an open :class:`~tensorverse.store.Store` the captured rows go to (through the tap and
a :class:`~tensorverse.capture.sink.StoreSink` that borrows it, as a ``dir:`` sink writes them);
``sink=False`` or no store: the plugin answers ``tv_capture`` with a 400, as the real one does
without ``TENSORVERSE_CAPTURE_SINK``. ``plugin=False``: no plugin, ``vllm_xargs`` are ignored.
``delay_s``, ``fail_status``: every request but ``/version`` waits, or is answered with that
status. Every request body is kept in ``requests`` (path, body), its Authorization header in
``auth``.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import numpy as np

from tensorverse.capture import optin
from tensorverse.testing.fake_engine import FakeEngine, _Req

__all__ = ["FakeVLLM", "SPECIALS"]

SPECIALS = {"<|im_start|>": 60, "<|im_end|>": 61, "<tool_call>": 62, "</tool_call>": 63}


class FakeVLLM(FakeEngine):
    def __init__(self, *, vocab: int = 64, store: Any = None, plugin: bool = True,
                 sink: bool = True, tokenizer: str = "a", template: str = "a",
                 perturb: float = 0.0, perturb_seed: int = 1, delay_s: float = 0.0,
                 fail_status: int | None = None, model: str = "fake-model",
                 eos: int | None = None, flip_at: dict[int, int] | None = None) -> None:
        from tensorverse.capture.sink import StoreSink

        self.store = store
        self.plugin = plugin
        self.sink = sink and store is not None
        super().__init__(sink=StoreSink(store, linger_s=0.0) if self.sink else None, vocab=vocab,
                         batch_variant=False, step_s=0.0, model=model)
        self.tokenizer = tokenizer
        self.template = template
        self.perturb = perturb
        self.perturb_seed = perturb_seed
        self.delay_s = delay_s
        self.fail_status = fail_status
        self.eos = eos
        self.flip_at = flip_at or {}
        self.requests: list[tuple[str, dict]] = []
        self.auth: list[str | None] = []  # the Authorization header of each request

    def _routes(self, app: Any) -> None:
        app.router.add_get("/v1/models", self.h_models)
        app.router.add_get("/version", self.h_version)
        app.router.add_post("/tokenize", self.h_tokenize)
        app.router.add_post("/detokenize", self.h_detokenize)
        app.router.add_post("/v1/completions", self.h_completions)

    # -- the "model" ------------------------------------------------------------------------
    def logits(self, ctx: list[int], position: int | None = None) -> np.ndarray:
        h = hashlib.sha256(np.asarray(ctx, np.int64).tobytes()).digest()
        rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
        x = rng.standard_normal(self.vocab) * 3.0
        if self.perturb:
            rng2 = np.random.default_rng(int.from_bytes(h[8:16], "little") + self.perturb_seed)
            x = x + self.perturb * rng2.standard_normal(self.vocab)
        if position is not None and position in self.flip_at:
            x[self.flip_at[position]] = x.max() + 1.0
        return x.astype(np.float32)

    def row(self, req: _Req, batch_size: int) -> np.ndarray:
        return self.logits(req.prompt + req.out, len(req.out))

    @staticmethod
    def logprobs(x: np.ndarray) -> np.ndarray:
        z = x.astype(np.float64) - x.max()
        return z - np.log(np.exp(z).sum())

    def _top(self, lp: np.ndarray, k: int, chosen: int, as_ids: bool) -> dict[str, float]:
        """vLLM's top logprobs: the best ``k`` (ties by id) and the sampled token."""
        order = np.lexsort((np.arange(lp.size), -lp))[: max(k, 0)]
        keys = {int(i) for i in order} | {int(chosen)}
        return {(f"token_id:{i}" if as_ids else self.decode_one(i)): float(lp[i]) for i in keys}

    def _take(self, r: _Req, x: np.ndarray, forced: int | None) -> None:
        lp = self.logprobs(x)
        t = int(forced) if forced is not None else int(np.argmax(x))
        r.out.append(t)
        if r.logprobs is not None and r.logprobs >= 0:
            r.tops.append(self._top(lp, r.logprobs, t, r.as_ids))
            r.lps.append(float(lp[t]))
        if self.eos is not None and t == self.eos and not r.ignore_eos:
            r.finish = "stop"

    # -- the "tokenizer" --------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        i = 0
        shift = 0 if self.tokenizer == "a" else 1
        while i < len(text):
            for s, tid in SPECIALS.items():
                if text.startswith(s, i):
                    out.append(tid if self.tokenizer == "a" else tid - 4)
                    i += len(s)
                    break
            else:
                out.append(2 + (ord(text[i]) + shift) % (self.vocab - 6))
                i += 1
        return out

    def decode_one(self, tid: int) -> str:
        for s, t in SPECIALS.items():
            if t == tid:
                return s
        if 2 <= tid < self.vocab - 4:
            return chr(tid - 2 + 32)
        return ""

    def render(self, messages: list[dict], tools: Any, add_generation_prompt: bool) -> str:
        text = ""
        if tools and self.template == "a":
            text += "<|im_start|>system\n# Tools<|im_end|>\n"
        for m in messages:
            text += f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n" + ("" if self.template == "a" else "<think>\n")
        return text

    # -- HTTP -------------------------------------------------------------------------------
    @staticmethod
    def error(status: int, message: str) -> Any:
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": "BadRequestError",
                                             "code": status}}, status=status)

    async def _gate(self, request: Any, path: str) -> tuple[dict, Any]:
        body = await request.json() if request.can_read_body else {}
        self.requests.append((path, body))
        self.auth.append(request.headers.get("Authorization"))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_status:
            return body, self.error(self.fail_status, "fake failure")
        return body, None

    async def h_models(self, request: Any) -> Any:
        from aiohttp import web

        _, err = await self._gate(request, "/v1/models")
        if err is not None:
            return err
        return web.json_response({"object": "list", "data": [{"id": self.model, "max_model_len": 512}]})

    async def h_version(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"version": "0.0.fake"})

    async def h_tokenize(self, request: Any) -> Any:
        from aiohttp import web

        body, err = await self._gate(request, "/tokenize")
        if err is not None:
            return err
        if "messages" in body:
            text = self.render(body["messages"], body.get("tools"), body.get("add_generation_prompt", True))
        else:
            text = body["prompt"]
        ids = self.encode(text)
        if body.get("add_special_tokens") and "messages" not in body and self.tokenizer == "b":
            ids = [1, *ids]
        return web.json_response({"count": len(ids), "max_model_len": 512, "tokens": ids})

    async def h_detokenize(self, request: Any) -> Any:
        from aiohttp import web

        body, err = await self._gate(request, "/detokenize")
        if err is not None:
            return err
        return web.json_response({"prompt": "".join(self.decode_one(t) for t in body["tokens"])})

    async def h_completions(self, request: Any) -> Any:
        from aiohttp import web

        body, err = await self._gate(request, "/v1/completions")
        if err is not None:
            return err
        k = body.get("logprobs")
        if body.get("logprob_token_ids") is not None:
            if k is None:
                return self.error(400, "when using `logprob_token_ids`, `logprobs` must be set.")
            bad = [t for t in body["logprob_token_ids"] if t >= self.vocab]
            if bad:
                return self.error(400, f"token_id(s) {bad} in logprob_token_ids contain out-of-vocab "
                                       f"token ids. Vocabulary size: {self.vocab}")
        if k is not None and k > self.vocab:
            return self.error(400, f"Requested sample logprobs of {k}, which is greater than max "
                                   f"allowed: {self.vocab}")
        try:  # the plugin's own parser, as vLLM's validate_params runs it
            opt = optin.parse_extra_args(body.get("vllm_xargs") or None) if self.plugin else None
        except ValueError as e:
            return self.error(400, str(e))
        if opt is not None and opt.capture_id is not None and not self.sink:
            return self.error(400, "tensorverse capture: tv_capture needs a sink on this server "
                                   "(set TENSORVERSE_CAPTURE_SINK=http://HOST:PORT/PATH or dir:/path/to/store)")
        prompt = [int(t) for t in body["prompt"]]
        if any(t >= self.vocab for t in prompt):
            return self.error(400, f"Token id {max(prompt)} is out of vocabulary")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        req = _Req(prompt=prompt, max_tokens=int(body.get("max_tokens") or 16), opt=opt,
                   logprobs=k if k is not None else -1, done=asyncio.get_running_loop().create_future(),
                   as_ids=as_ids, ignore_eos=bool(body.get("ignore_eos")))
        await self.generate(req)
        out = req.out
        choice: dict[str, Any] = {"index": 0, "text": "".join(self.decode_one(t) for t in out),
                                  "finish_reason": req.finish, "stop_reason": None, "logprobs": None,
                                  "prompt_logprobs": None}
        if k is not None:
            choice["logprobs"] = {"tokens": [f"token_id:{t}" if as_ids else self.decode_one(t) for t in out],
                                  "token_logprobs": req.lps, "top_logprobs": req.tops, "text_offset": []}
        if body.get("prompt_logprobs"):
            pk = int(body["prompt_logprobs"])
            pl: list[Any] = [None]
            for j in range(1, len(prompt)):
                lp = self.logprobs(self.logits(prompt[:j]))
                top = self._top(lp, pk, prompt[j], True)
                pl.append({key.split(":")[1]: {"logprob": v, "rank": 1, "decoded_token": key}
                           for key, v in top.items()})
            choice["prompt_logprobs"] = pl
        if body.get("return_token_ids"):
            choice["token_ids"] = out
            choice["prompt_token_ids"] = prompt
        return web.json_response({"id": "cmpl-fake", "object": "text_completion",
                                  "model": self.model, "choices": [choice]})
