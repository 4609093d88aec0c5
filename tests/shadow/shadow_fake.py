"""A tiny fake vLLM for the shadow runner's unit tests (no model, no vLLM import).

``FakeVLLM`` serves the endpoints the runner, the tokenizer check and doctor use:
``/v1/models``, ``/version``, ``/tokenize`` (text or chat ``messages``), ``/detokenize`` and
``/v1/completions`` with ``logprobs``, ``prompt_logprobs``, ``return_token_ids``,
``return_tokens_as_token_ids``, ``ignore_eos``, ``logprob_token_ids`` and ``vllm_xargs``. Logits
are a deterministic function of the context (plus ``perturb`` to emulate another runtime); with
``plugin=True`` it honours ``tv_force`` and, when it has a store (``sink``), writes each captured
row into it the way the capture sink does. Every request body is kept in ``requests``.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import numpy as np
from aiohttp import web

SPECIALS = {"<|im_start|>": 60, "<|im_end|>": 61, "<tool_call>": 62, "</tool_call>": 63}


class FakeVLLM:
    def __init__(self, *, vocab: int = 64, store: Any = None, plugin: bool = True,
                 sink: bool = True, tokenizer: str = "a", template: str = "a",
                 perturb: float = 0.0, perturb_seed: int = 1, delay_s: float = 0.0,
                 fail_status: int | None = None, model: str = "fake-model",
                 eos: int | None = None, flip_at: dict[int, int] | None = None) -> None:
        self.vocab = vocab
        self.store = store
        self.plugin = plugin
        self.sink = sink and store is not None
        self.tokenizer = tokenizer
        self.template = template
        self.perturb = perturb
        self.perturb_seed = perturb_seed
        self.delay_s = delay_s
        self.fail_status = fail_status
        self.model = model
        self.eos = eos
        self.flip_at = flip_at or {}  # output position -> token made the argmax (free and forced)
        self.requests: list[tuple[str, dict]] = []
        self.auth: list[str | None] = []  # the Authorization header of each request
        self._runner: web.AppRunner | None = None
        self.port = 0

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

    @staticmethod
    def logprobs(x: np.ndarray) -> np.ndarray:
        z = x.astype(np.float64) - x.max()
        return z - np.log(np.exp(z).sum())

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

    # -- the server -------------------------------------------------------------------------
    async def start(self) -> "FakeVLLM":
        app = web.Application()
        app.router.add_get("/v1/models", self.h_models)
        app.router.add_get("/version", self.h_version)
        app.router.add_post("/tokenize", self.h_tokenize)
        app.router.add_post("/detokenize", self.h_detokenize)
        app.router.add_post("/v1/completions", self.h_completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @staticmethod
    def error(status: int, message: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": "BadRequestError",
                                             "code": status}}, status=status)

    async def _gate(self, request: web.Request, path: str) -> tuple[dict | None, web.Response | None]:
        body = await request.json() if request.can_read_body else {}
        self.requests.append((path, body))
        self.auth.append(request.headers.get("Authorization"))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_status:
            return body, self.error(self.fail_status, "fake failure")
        return body, None

    async def h_models(self, request: web.Request) -> web.Response:
        _, err = await self._gate(request, "/v1/models")
        if err is not None:
            return err
        return web.json_response({"object": "list", "data": [{"id": self.model, "max_model_len": 512}]})

    async def h_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.0.fake"})

    async def h_tokenize(self, request: web.Request) -> web.Response:
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

    async def h_detokenize(self, request: web.Request) -> web.Response:
        body, err = await self._gate(request, "/detokenize")
        if err is not None:
            return err
        return web.json_response({"prompt": "".join(self.decode_one(t) for t in body["tokens"])})

    def _top(self, lp: np.ndarray, k: int, chosen: int, as_ids: bool) -> dict[str, float]:
        order = np.lexsort((np.arange(lp.size), -lp))[: max(k, 0)]
        keys = {int(i) for i in order} | {int(chosen)}
        return {(f"token_id:{i}" if as_ids else self.decode_one(i)): float(lp[i]) for i in keys}

    async def h_completions(self, request: web.Request) -> web.Response:
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
        xargs = body.get("vllm_xargs") or {}
        if self.plugin and "tv_capture" in xargs and not self.sink:
            return self.error(400, "tensorverse capture: tv_capture needs a sink on this server "
                                   "(set TENSORVERSE_CAPTURE_SINK=http://HOST:PORT/PATH or dir:/path/to/store)")
        prompt = [int(t) for t in body["prompt"]]
        if any(t >= self.vocab for t in prompt):
            return self.error(400, f"Token id {max(prompt)} is out of vocabulary")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        force = xargs.get("tv_force") if self.plugin else None
        capture = xargs.get("tv_capture") if self.plugin else None
        from tensorverse.capture.optin import Positions

        positions = Positions.parse(xargs.get("tv_positions"))
        out: list[int] = []
        tops: list[dict] = []
        tok_lps: list[float] = []
        rows: list[tuple[int, bytes]] = []
        finish = "length"
        for i in range(int(body.get("max_tokens") or 16)):
            x = self.logits(prompt + out, i)
            lp = self.logprobs(x)
            if capture is not None and i in positions:
                from tensorverse.store.codec import encode_row

                rows.append((i, encode_row(x)))
            if force is not None and i < len(force):
                t = int(force[i])
            else:
                t = int(np.argmax(x))
            out.append(t)
            if k is not None:
                tops.append(self._top(lp, k, t, as_ids))
                tok_lps.append(float(lp[t]))
            if self.eos is not None and t == self.eos and not body.get("ignore_eos"):
                finish = "stop"
                break
        if rows and self.store is not None:
            self.store.write_rows(capture, rows)  # like the sink: lands a little later
        choice: dict[str, Any] = {"index": 0, "text": "".join(self.decode_one(t) for t in out),
                                  "finish_reason": finish, "stop_reason": None, "logprobs": None,
                                  "prompt_logprobs": None}
        if k is not None:
            choice["logprobs"] = {"tokens": [f"token_id:{t}" if as_ids else self.decode_one(t) for t in out],
                                  "token_logprobs": tok_lps, "top_logprobs": tops, "text_offset": []}
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
