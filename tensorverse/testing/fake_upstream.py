"""A tiny fake upstream that speaks vLLM 0.32's OpenAI and Anthropic wire format.

For the proxy's fast tests and its overhead benchmark (it measures the proxy, not a model).
Output is deterministic: token i is id ``1000 + i`` with text ``"t<i> "``. Field presence follows
vLLM (fields not asked for are ``null``, ``token_ids``/``prompt_token_ids`` only with
``return_token_ids``, logprobs only when asked for). Per-request behaviour via headers:

``X-Fake-Events``  output tokens (default 8)        ``X-Fake-Delay``   seconds between events
``X-Fake-Status``  answer this status with an error body
``X-Fake-Body``    answer this raw body (status from X-Fake-Status or 200, JSON content type)
``X-Fake-Tools``   answer with N tool calls (argument fragments in the stream)
``X-Fake-Hang``    sleep this many seconds before answering
``X-Fake-Cut``     close the connection after N events (a stream cut mid-way)
``X-Fake-Reasoning`` emit reasoning deltas before the content
``X-Fake-Reset``   reset the connection (TCP RST) after N events
``X-Fake-Malformed`` insert malformed SSE events (broken JSON, invalid UTF-8...) after N events
``X-Fake-Linger``   seconds between the last event and the end of the response
``X-Fake-First-Delay`` seconds before the first event (a model's time to first token)
``X-Fake-Error-Event`` after N events send vLLM's mid-stream error event and ``[DONE]``

Every request is logged in ``fake.requests`` (method, path, headers, body); the time a streaming
request noticed that its client went away is in ``fake.disconnects``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

from tensorverse.testing.serve import serve

PROMPT_IDS = [151644, 872, 198, 6023, 151645]


def _tok(i: int) -> tuple[int, str]:
    return 1000 + i, f"t{i} "


#: what ``X-Fake-Malformed`` inserts: broken JSON, a non-UTF-8 line, a field without a colon,
#: a wrong-typed chunk and a comment
MALFORMED_EVENTS = [b'data: {"id": "broken", "choices": [\n\n', b"data: \xff\xfe\x00garbage\n\n",
                    b"nonsense-without-colon\n\n", b'data: {"choices": 7, "usage": "x"}\n\n', b": comment\n\n"]


def _reset(request: web.Request) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), as a crashed or killed peer does."""
    import socket
    import struct

    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


@web.middleware
async def _validation_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A request of the wrong shape gets vLLM's 400 (its pydantic validation), not a crash."""
    try:
        return await handler(request)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        return web.json_response({"error": {"message": f"invalid request: {type(e).__name__}", "type": "BadRequestError",
                                            "param": None, "code": 400}}, status=400)


class FakeUpstream:
    """``token_base``/``prompt_ids``: the token ids it answers with (token i is ``token_base + i``;
    defaults as vLLM's Qwen3 would); ``tokenizer``: an object whose ``h_tokenize``/``h_detokenize``
    aiohttp handlers serve ``/tokenize`` and ``/detokenize`` (a ``FakeEngine`` or ``FakeVLLM``),
    so the shadow runner can fingerprint this upstream as a primary."""

    def __init__(self, *, token_base: int = 1000, prompt_ids: list[int] | None = None,
                 tokenizer: Any = None) -> None:
        self.token_base = token_base
        self.prompt_ids = list(PROMPT_IDS if prompt_ids is None else prompt_ids)
        self.tokenizer = tokenizer
        self.requests: list[dict[str, Any]] = []
        self.disconnects: list[float] = []
        self.last_event_sent: float | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self._rendered: dict[tuple, list[bytes]] = {}  # chat streams already rendered (`chat`)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _tok(self, i: int) -> tuple[int, str]:
        return self.token_base + i, f"t{i} "

    def _chat_lp(self, i: int, top: int | None, as_ids: bool) -> dict:
        tid, text = self._tok(i)
        name = f"token_id:{tid}" if as_ids else text
        tops = [{"token": f"token_id:{tid + r}" if as_ids else (text if r == 0 else f"alt{r}"),
                 "logprob": -0.1 * (r + 1), "bytes": [116]} for r in range(top or 0)]
        return {"token": name, "logprob": -0.1, "bytes": [116], "top_logprobs": tops}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[_validation_errors])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/echo{tail:.*}", self.echo)
        if self.tokenizer is not None:
            app.router.add_post("/tokenize", self.tokenizer.h_tokenize)
            app.router.add_post("/detokenize", self.tokenizer.h_detokenize)
        return app

    async def start(self, port: int = 0) -> "FakeUpstream":
        self._runner, self.port = await serve(self.app(), port, backlog=1024, handler_cancellation=True,
                                              access_log=None)
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- helpers ---------------------------------------------------------------------------------
    async def _common(self, request: web.Request) -> tuple[Any, web.Response | None]:
        raw = await request.read()
        self.requests.append({"method": request.method, "path": request.path_qs,
                              "headers": dict(request.headers), "body": raw})
        h = request.headers
        if "X-Fake-Hang" in h:
            await asyncio.sleep(float(h["X-Fake-Hang"]))
        if "X-Fake-Body" in h:
            return None, web.Response(status=int(h.get("X-Fake-Status", "200")), body=h["X-Fake-Body"].encode(),
                                      content_type="application/json")
        if "X-Fake-Status" in h:
            status = int(h["X-Fake-Status"])
            return None, web.json_response(
                {"error": {"message": f"fake error {status}", "type": "BadRequestError", "param": None, "code": status}},
                status=status)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None, web.json_response(
                {"error": {"message": "JSON decode error", "type": "Bad Request", "param": None, "code": 400}},
                status=400)
        if not isinstance(body, dict):
            raise TypeError("the request body must be a JSON object")
        return body, None

    async def _stream(self, request: web.Request, events: list[bytes], delay: float, cut: int | None,
                      headers: dict[str, str] | None = None) -> web.StreamResponse:
        h = request.headers
        reset = int(h["X-Fake-Reset"]) if "X-Fake-Reset" in h else None
        first_delay = float(h.get("X-Fake-First-Delay", "0"))  # a model's time to first token
        if "X-Fake-Malformed" in h:  # garbage events at that index (the stream then goes on)
            k = int(h["X-Fake-Malformed"])
            events = events[:k] + MALFORMED_EVENTS + events[k:]
        if "X-Fake-Error-Event" in h:  # vLLM's mid-stream error event, then [DONE]
            k = int(h["X-Fake-Error-Event"])
            err = {"error": {"message": "fake engine failure mid-stream", "type": "InternalServerError",
                             "param": None, "code": 500}}
            events = events[:k] + [b"data: " + orjson.dumps(err) + b"\n\n", b"data: [DONE]\n\n"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", **(headers or {})})
        await resp.prepare(request)
        try:
            for i, ev in enumerate(events):
                if cut is not None and i == cut:
                    request.transport.close()  # type: ignore[union-attr]
                    return resp
                if reset is not None and i == reset:
                    _reset(request)
                    return resp
                if delay and i:
                    await asyncio.sleep(delay)
                elif first_delay and not i:
                    await asyncio.sleep(first_delay)
                await resp.write(ev)
                self.last_event_sent = time.monotonic()
            if "X-Fake-Linger" in h:  # the end of the stream comes late (a slow network, a busy server)
                await asyncio.sleep(float(h["X-Fake-Linger"]))
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects.append(time.monotonic())
            raise
        return resp

    # -- endpoints -------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "vllm"}]})

    async def echo(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.requests.append({"method": request.method, "path": request.path_qs,
                              "headers": dict(request.headers), "body": raw})
        return web.json_response(
            {"method": request.method, "path": request.path_qs, "headers": dict(request.headers),
             "body": raw.decode("utf-8", "replace")},
            headers={"X-Upstream": "1", "Connection": "keep-alive, X-Hop", "X-Hop": "secret",
                     "Keep-Alive": "timeout=5"})

    def _chat_events(self, rid: str, model: Any, created: int, n: int, calls: list[dict], reasoning: bool,
                     tids: bool, lp: bool, top: Any, as_ids: bool, finish: str, include_usage: bool) -> list[bytes]:
        """A chat stream's events, as vLLM writes them."""
        n_tools = len(calls)

        def chunk(choice: dict, **extra: Any) -> bytes:
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [choice] if choice else [], **extra}
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        events = [chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}, prompt_token_ids=self.prompt_ids if tids else None, prompt_text=None)]
        pos = 0
        if reasoning:
            events.append(chunk({"index": 0, "delta": {"reasoning": "thinking..."}, "logprobs": None,
                                 "finish_reason": None, "token_ids": [999] if tids else None}))
        for k, c in enumerate(calls):
            args = c["function"]["arguments"]
            half = len(args) // 2
            events.append(chunk({"index": 0, "delta": {"tool_calls": [
                {"id": c["id"], "type": "function", "index": k, "function": {"name": c["function"]["name"], "arguments": ""}}]},
                "logprobs": None, "finish_reason": None, "token_ids": [] if tids else None}))
            for frag in (args[:half], args[half:]):
                events.append(chunk({"index": 0, "delta": {"tool_calls": [{"index": k, "function": {"arguments": frag}}]},
                                     "logprobs": {"content": [self._chat_lp(pos, top, as_ids)]} if lp else None,
                                     "finish_reason": None, "token_ids": [self._tok(pos)[0]] if tids else None}))
                pos += 1
        if not n_tools:
            for i in range(n):
                last = i == n - 1
                ch = {"index": 0, "delta": {"content": self._tok(i)[1]},
                      "logprobs": {"content": [self._chat_lp(i, top, as_ids)]} if lp else None,
                      "finish_reason": finish if last else None}
                if last:
                    ch["stop_reason"] = None
                ch["token_ids"] = [self._tok(i)[0]] if tids else None
                events.append(chunk(ch, **({"system_fingerprint": "fake"} if last else {})))
        else:
            events.append(chunk({"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": finish,
                                 "stop_reason": None, "token_ids": [] if tids else None}))
        if include_usage:
            events.append(chunk({}, usage={"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n}))
        events.append(b"data: [DONE]\n\n")
        return events

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body, early = await self._common(request)
        if early is not None:
            return early
        h = request.headers
        n = int(h.get("X-Fake-Events", "8"))
        delay = float(h.get("X-Fake-Delay", "0"))
        n_tools = int(h.get("X-Fake-Tools", "0"))
        reasoning = "X-Fake-Reasoning" in h
        cut = int(h["X-Fake-Cut"]) if "X-Fake-Cut" in h else None
        tids = bool(body.get("return_token_ids"))
        lp = bool(body.get("logprobs"))
        top = body.get("top_logprobs")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        rid = f"chatcmpl-fake{len(self.requests)}"
        model = body.get("model", "fake")
        created = 1796000000
        finish = "tool_calls" if n_tools else ("length" if body.get("max_tokens") == n else "stop")
        calls = [{"id": f"chatcmpl-tool-{k}", "type": "function",
                  "function": {"name": f"get_interface_{k}", "arguments": orjson.dumps({"name": f"Gi0/0/{k}"}).decode()}}
                 for k in range(n_tools)]
        if not body.get("stream"):
            content = "".join(self._tok(i)[1] for i in range(n))
            msg = {"role": "assistant", "content": None if n_tools else content, "refusal": None, "annotations": None,
                   "audio": None, "function_call": None, "tool_calls": calls,
                   "reasoning": "thinking..." if reasoning else None}
            resp = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": msg,
                                 "logprobs": {"content": [self._chat_lp(i, top, as_ids) for i in range(n)]} if lp else None,
                                 "finish_reason": finish, "stop_reason": None,
                                 "token_ids": [self._tok(i)[0] for i in range(n)] if tids else None,
                                 "routed_experts": None}],
                    "service_tier": None, "system_fingerprint": "fake",
                    "usage": {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n,
                              "prompt_tokens_details": None},
                    "prompt_logprobs": None, "prompt_token_ids": self.prompt_ids if tids else None,
                    "prompt_text": None, "kv_transfer_params": None}
            return web.Response(body=orjson.dumps(resp), content_type="application/json")

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        key = (rid, model, n, n_tools, reasoning, tids, lp, top, as_ids, finish, include_usage)
        cached = True
        try:  # the same request renders the same events: rendered once (the benchmark's upstream
            events = self._rendered.get(key)  # must cost the machine little, whatever is injected)
        except TypeError:  # e.g. a model that is a JSON object
            cached, events = False, None
        if events is None:
            events = self._chat_events(rid, model, created, n, calls, reasoning, tids, lp, top, as_ids, finish,
                                       include_usage)
            if cached:
                if len(self._rendered) >= 64:
                    self._rendered.clear()
                self._rendered[key] = events
        return await self._stream(request, events, delay, cut)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, early = await self._common(request)
        if early is not None:
            return early
        h = request.headers
        n = int(h.get("X-Fake-Events", "8"))
        delay = float(h.get("X-Fake-Delay", "0"))
        tids = bool(body.get("return_token_ids"))
        k = body.get("logprobs")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        rid = f"cmpl-fake{len(self.requests)}"

        def lps(i: int, k: int) -> dict:
            tid, text = self._tok(i)
            name = f"token_id:{tid}" if as_ids else text
            top = {name: -0.1}  # the sampled token is also rank 1 (vLLM merges the two entries)
            for r in range(k - 1):
                top.setdefault(f"token_id:{tid + 1 + r}" if as_ids else f"alt{r}", -0.2 - 0.1 * r)
            return {"text_offset": [3 * i], "token_logprobs": [-0.1], "tokens": [name], "top_logprobs": [top]}

        if not body.get("stream"):
            resp = {"id": rid, "object": "text_completion", "created": 1796000000, "model": body.get("model"),
                    "choices": [{"index": 0, "text": "".join(self._tok(i)[1] for i in range(n)),
                                 "logprobs": None if k is None else {
                                     "text_offset": [3 * i for i in range(n)], "token_logprobs": [-0.1] * n,
                                     "tokens": [lps(i, k)["tokens"][0] for i in range(n)],
                                     "top_logprobs": [lps(i, k)["top_logprobs"][0] for i in range(n)]},
                                 "finish_reason": "length", "stop_reason": None,
                                 "token_ids": [self._tok(i)[0] for i in range(n)] if tids else None,
                                 "prompt_logprobs": None, "prompt_token_ids": self.prompt_ids if tids else None,
                                 "routed_experts": None}],
                    "service_tier": None, "system_fingerprint": "fake",
                    "usage": {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n}}
            return web.Response(body=orjson.dumps(resp), content_type="application/json")
        events = []
        for i in range(n):
            ch = {"index": 0, "text": self._tok(i)[1], "logprobs": None if k is None else lps(i, k), "finish_reason": "length" if i == n - 1 else None,
                  "stop_reason": None, "prompt_token_ids": self.prompt_ids if tids and i == 0 else None,
                  "token_ids": [self._tok(i)[0]] if tids else None}
            events.append(b"data: " + orjson.dumps({"id": rid, "object": "text_completion", "created": 1796000000,
                                                     "model": body.get("model"), "choices": [ch]}) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return await self._stream(request, events, delay, None)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body, early = await self._common(request)
        if early is not None:
            return early
        h = request.headers
        n = int(h.get("X-Fake-Events", "4"))
        n_tools = int(h.get("X-Fake-Tools", "0"))
        text = "".join(self._tok(i)[1] for i in range(n))
        if not body.get("stream"):
            content: list[dict] = [{"type": "text", "text": text}]
            content += [{"type": "tool_use", "id": f"toolu_{k}", "name": f"get_interface_{k}",
                         "input": {"name": f"Gi0/0/{k}"}} for k in range(n_tools)]
            return web.json_response({"id": "msg_fake", "type": "message", "role": "assistant", "content": content,
                                      "model": body.get("model"), "stop_reason": "tool_use" if n_tools else "end_turn",
                                      "usage": {"input_tokens": 5, "output_tokens": n}})

        def ev(name: str, obj: dict) -> bytes:
            return f"event: {name}\n".encode() + b"data: " + orjson.dumps(obj) + b"\n\n"

        events = [ev("message_start", {"type": "message_start", "message": {
            "id": "msg_fake", "type": "message", "role": "assistant", "content": [], "model": body.get("model"),
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 0}}}),
            ev("content_block_start", {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0})]
        for i in range(n):
            events.append(ev("content_block_delta", {"type": "content_block_delta",
                                                     "delta": {"type": "text_delta", "text": self._tok(i)[1]}, "index": 0}))
        events.append(ev("content_block_stop", {"type": "content_block_stop", "index": 0}))
        for k in range(n_tools):
            idx = k + 1
            events.append(ev("content_block_start", {"type": "content_block_start", "index": idx, "content_block": {
                "type": "tool_use", "id": f"toolu_{k}", "name": f"get_interface_{k}", "input": {}}}))
            js = orjson.dumps({"name": f"Gi0/0/{k}"}).decode()
            for frag in (js[:5], js[5:]):
                events.append(ev("content_block_delta", {"type": "content_block_delta", "index": idx,
                                                         "delta": {"type": "input_json_delta", "partial_json": frag}}))
            events.append(ev("content_block_stop", {"type": "content_block_stop", "index": idx}))
        events.append(ev("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": "tool_use" if n_tools else "end_turn", "stop_sequence": None},
            "usage": {"input_tokens": 5, "output_tokens": n}}))
        events.append(ev("message_stop", {"type": "message_stop"}))
        return await self._stream(request, events, float(h.get("X-Fake-Delay", "0")), None)
