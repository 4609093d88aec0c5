"""``tensorverse doctor`` against the fake vLLM: plugin present / absent / without sink, the
text and JSON reports, and the exit status."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from tensorverse.testing.fake_vllm import FakeVLLM

from tensorverse.cli import main as cli_main
from tensorverse.shadow.doctor import doctor, format_report


def check(primary=None, **kw):
    async def main():
        fake = await FakeVLLM(**kw).start()
        try:
            return await doctor(fake.url, primary=primary), fake.requests
        finally:
            await fake.close()

    return asyncio.run(main())


def test_plugin_with_sink(store):
    r, sent = check(store=store)
    assert r["reachable"] and r["version"] == "0.0.fake" and r["model"] == "fake-model"
    assert r["models"] == [{"id": "fake-model", "max_model_len": 512}]
    assert r["max_logprobs"] == 64 and r["vocab_size"] == 64
    assert r["plugin"] is True and r["forcing"] is True and r["capture_sink"] is True
    assert r["capture"] == "full" and r["tokenizer"]["available"]
    assert not r["problems"]
    # the forcing probe forces a non-greedy token and captures nothing
    probe = [b for p, b in sent if p == "/v1/completions" and "vllm_xargs" in b][0]
    assert probe["max_tokens"] == 1 and probe["vllm_xargs"]["tv_positions"] == str(2**31 - 1)
    assert store.read_rows(probe["vllm_xargs"]["tv_capture"]) == []
    text = format_report(r)
    assert "plugin         present, forcing works" in text and "capture        full" in text
    assert "max logprobs   64 (whole vocabulary)" in text


def test_plugin_without_sink_and_without_plugin():
    r, _ = check(store=None)
    assert r["plugin"] is True and r["forcing"] is True and r["capture_sink"] is False
    assert r["capture"] == "topk" and "no capture sink" in r["plugin_detail"]
    r, _ = check(plugin=False)
    assert r["plugin"] is False and r["forcing"] is False and r["capture"] == "topk"
    assert "not installed" in r["plugin_detail"]
    assert "plugin         no" in format_report(r)


def test_same_dictionary_against_a_primary():
    async def main():
        prim = await FakeVLLM(tokenizer="a").start()
        other = await FakeVLLM(tokenizer="b").start()
        try:
            return (await doctor(other.url, primary=prim.url.removesuffix("/v1")),
                    await doctor(prim.url, primary=prim.url))
        finally:
            await prim.close()
            await other.close()

    differs, same = asyncio.run(main())
    assert differs["same_dictionary"] is False and "refused" in differs["same_dictionary_detail"]
    assert same["same_dictionary"] is True and same["same_template"] is True


class _ServeInThread:
    """Runs a fake in a background loop so the synchronous CLI can reach it."""

    def __init__(self, **kw):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fake = asyncio.run_coroutine_threadsafe(FakeVLLM(**kw).start(), self.loop).result(10)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.fake.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_cli_json_and_exit_status(capsys):
    srv = _ServeInThread()
    try:
        rc = cli_main(["doctor", "--backend", srv.fake.url, "--json"])
    finally:
        srv.close()
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(out) == 1
    report = json.loads(out[0])
    assert report["reachable"] is True and report["plugin"] is True and report["model"] == "fake-model"

    rc = cli_main(["doctor", "--backend", "http://127.0.0.1:9", "--timeout", "2"])
    captured = capsys.readouterr()
    assert rc == 2
    assert "reachable      no" in captured.out and "not reachable" in captured.err


def test_cli_help_lists_doctor(capsys):
    with pytest.raises(SystemExit):
        cli_main(["doctor", "--help"])
    assert "--backend" in capsys.readouterr().out
