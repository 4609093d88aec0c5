"""Doctor and the same-dictionary check on the standard rig (``@pytest.mark.vllm``, ``rig``)."""

from __future__ import annotations

import asyncio

import pytest

from tensorverse.shadow import Backend, ShadowRunner
from tensorverse.shadow.client import BackendClient
from tensorverse.shadow.doctor import doctor
from tensorverse.shadow.cache import RunnerCache
from tensorverse.shadow.tokenizer import check_template, fingerprint, same_dictionary

pytestmark = pytest.mark.vllm


def test_doctor_on_a_rig_server(rig):
    r = asyncio.run(doctor(rig.primary.url))
    assert r["reachable"] is True and r["version"]
    assert r["model"] == rig.primary.model == "tiny-a"
    assert r["plugin"] is True and r["forcing"] is True  # the installed plugin forces one step
    # the standard rig configures no capture sink: top-k only, unless it does
    expected = "full" if r["capture_sink"] else "topk"
    assert r["capture"] == expected
    assert r["vocab_size"] == 151936 and r["tokenizer"]["available"]


def test_tokenize_renders_what_the_chat_endpoint_serves(rig):
    """The template check relies on /tokenize with messages rendering the prompt the chat
    endpoint really uses (tools included)."""
    import aiohttp

    from tensorverse.shadow.tokenizer import TEMPLATE_PROBE, render_chat

    s = rig.primary

    async def main():
        async with BackendClient(Backend("p", s.url, s.model)) as c:
            rendered = await render_chat(c, TEMPLATE_PROBE)
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url + "/chat/completions", json={
                    "model": s.model, "messages": TEMPLATE_PROBE["messages"],
                    "tools": TEMPLATE_PROBE["tools"], "tool_choice": "none", "max_tokens": 1,
                    "temperature": 0, "return_token_ids": True}) as r:
                body = await r.json()
        assert "prompt_token_ids" in body, body  # (servers without a tool parser need "none")
        served = body["prompt_token_ids"]
        return rendered, served

    rendered, served = asyncio.run(main())
    assert rendered == served


def test_model_b_uses_the_primarys_dictionary(rig, tmp_path):
    async def fps():
        out = []
        for name in ("primary", "model_b"):
            s = rig[name]
            async with BackendClient(Backend(name, s.url, s.model)) as c:
                out.append(await fingerprint(c))
        return out

    fa, fb = asyncio.run(fps())
    ok, msg = same_dictionary(fa, fb, primary_name="primary", shadow_name="model_b")
    assert ok, msg
    assert fa["fingerprint"] == fb["fingerprint"] and fa["vocab_size"] == fb["vocab_size"] == 151936
    assert fa["template_fingerprint"] == fb["template_fingerprint"]

    # the runner accepts model_b: its forced run emits the primary's ids (plugin, no sink: top-k)
    from tensorverse.store import Store

    prim, b = rig["primary"], rig["model_b"]
    msgs = [{"role": "user", "content": "Show VLAN 201 on sw1."}]

    async def main():
        async with BackendClient(Backend("p", prim.url, prim.model)) as c:
            import aiohttp

            async with aiohttp.ClientSession() as s:
                async with s.post(prim.url.removesuffix("/v1") + "/tokenize",
                                  json={"model": prim.model, "messages": msgs}) as r:
                    prompt = (await r.json())["tokens"]
                async with s.post(prim.url + "/completions", json={
                        "model": prim.model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                        "return_token_ids": True}) as r:
                    ch = (await r.json())["choices"][0]
            tmpl = await check_template(c, {"messages": msgs}, prompt)
        turn = {"id": "rig-turn", "prompt_token_ids": prompt, "output_token_ids": ch["token_ids"],
                "text": ch["text"], "request": {"model": prim.model, "messages": msgs}}
        with Store.open(tmp_path / "store", durable=False) as st:
            backends = [Backend("primary", prim.url, prim.model, role="primary"),
                        Backend("model_b", b.url, b.model)]
            async with ShadowRunner(st, backends, cache=RunnerCache(), rows_timeout_s=5) as r:
                runs = await r.run_turn(turn)
        return tmpl, turn, runs

    tmpl, turn, runs = asyncio.run(main())
    assert tmpl["status"] == "ok"
    forced = next(r for r in runs if r.backend == "model_b" and r.mode == "forced")
    assert forced.status == "ok" and forced.tokenizer["same_dictionary"] is True
    assert forced.token_ids == turn["output_token_ids"] and forced.method == "forced_decode"
    assert forced.template["status"] == "ok"
