"""A scripted OpenAI chat server for real agent clients (turnstone) in fast tests and the session
grouping benchmark: it streams the Chat Completions wire format as vLLM does, deterministically,
so that an agent runs a long, compacting conversation without a model. The agent, its history
handling, its compaction and its side requests are the real ones; only the answers are scripted:

* the first ``rounds`` requests with tools of a conversation (told apart by their system
  prompt, which carries a per-conversation token in turnstone): a ``read_file`` call of
  ``f<k>.txt`` (k = 0, 1, ...);
* later requests with tools: a final answer;
* a request without tools (turnstone's title generator, compaction summaries and merges): a
  short text that names the request's kind and a counter (each summary is distinct).
"""

from __future__ import annotations

import itertools
import time

import orjson
from aiohttp import web

from tensorverse.testing.serve import serve


class ScriptedChat:
    def __init__(self, rounds: int = 8) -> None:
        self.rounds = rounds
        self.requests: list[dict] = []
        self._n = itertools.count()
        self._rounds: dict[str, int] = {}

    def answer(self, body: dict) -> dict:
        msgs = body.get("messages") or []
        if body.get("tools"):
            key = str(msgs[0].get("content", "")) if msgs else ""
            since = self._rounds[key] = self._rounds.get(key, -1) + 1
            if since < self.rounds:
                return {"tool_calls": [{"index": 0, "id": f"call_{next(self._n)}", "type": "function",
                                        "function": {"name": "read_file",
                                                     "arguments": orjson.dumps({"path": f"f{since}.txt"}).decode()}}]}
            return {"content": f"FINAL: read {since} files; every uplink is up."}
        system = str(msgs[0].get("content", "")) if msgs else ""
        n = next(self._n)
        if "title generator" in system:
            return {"content": "Uplink Check"}
        return {"content": f"Summary {n}: the user asked to read f0..f{self.rounds - 1}.txt; reading goes on."}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        delta = self.answer(body)
        rid, created, model = f"chatcmpl-{len(self.requests)}", int(time.time()), body.get("model", "m")

        def chunk(d: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
            ev = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                  "choices": [] if usage else [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}
            if usage:
                ev["usage"] = usage
            return b"data: " + orjson.dumps(ev) + b"\n\n"

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk({"role": "assistant", "content": ""}))
        if "content" in delta:
            for i in range(0, len(delta["content"]), 16):
                await resp.write(chunk({"content": delta["content"][i:i + 16]}))
            await resp.write(chunk({}, "stop"))
        else:
            await resp.write(chunk({"tool_calls": delta["tool_calls"]}))
            await resp.write(chunk({}, "tool_calls"))
        if (body.get("stream_options") or {}).get("include_usage"):
            # about what a tokenizer would count (4 characters a token): agents budget their
            # context (and compact) from the usage the server reports
            prompt = len(orjson.dumps(body.get("messages"))) // 4 + len(orjson.dumps(body.get("tools") or [])) // 4
            await resp.write(chunk({}, usage={"prompt_tokens": prompt, "completion_tokens": 20,
                                              "total_tokens": prompt + 20}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 32768}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        return app


async def start(server: ScriptedChat) -> tuple[web.AppRunner, int]:
    return await serve(server.app(), access_log=None)
