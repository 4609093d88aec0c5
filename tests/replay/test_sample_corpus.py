"""The committed sample corpus (``corpus/netops-sample/``): it is exactly what its generator makes,
it validates with plain ``json`` + ``jsonschema``, an independent secret scan finds nothing, its
token ids are the real Qwen3 tokenizer's rendering of its scrubbed text, and it has what the issue
asks for (Cisco IOS tool calls, multi-turn sessions with recorded tool results)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tests.replay.test_scrub import leaks  # type: ignore[import-not-found]

from tensorverse.replay.corpus import load_corpus
from tensorverse.replay.sample import DEFAULT_OUT, SENSITIVE, differences, generate, tokenizer_dir

SAMPLE = Path(__file__).resolve().parents[2] / "corpus" / "netops-sample"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


def _cases() -> list[dict]:
    manifest = json.loads((SAMPLE / "corpus.json").read_text())
    return [json.loads((SAMPLE / e["file"]).read_text()) for e in manifest["cases"]]


def test_committed_files_equal_a_regeneration(tmp_path):
    assert DEFAULT_OUT == SAMPLE
    fresh = generate(tmp_path / "netops-sample")
    assert differences(fresh, SAMPLE) == []


def test_valid_against_its_schema_without_tensorverse():
    manifest = json.loads((SAMPLE / "corpus.json").read_text())
    jsonschema.Draft202012Validator.check_schema(json.loads((SAMPLE / "schema/case.schema.json").read_text()))
    jsonschema.validate(manifest, json.loads((SAMPLE / "schema/corpus.schema.json").read_text()))
    case_schema = json.loads((SAMPLE / "schema/case.schema.json").read_text())
    for c in _cases():
        jsonschema.validate(c, case_schema)
    assert len(load_corpus(SAMPLE).cases) == len(manifest["cases"]) == 5  # sha256s hold


def test_independent_secret_scan_finds_nothing():
    for f in sorted(SAMPLE.rglob("*")):
        if not f.is_file():
            continue
        text = f.read_text()
        # JSON strings escape newlines; scan the decoded strings too
        texts = [text]
        if f.suffix == ".json":
            texts += [s for s in _strings(json.loads(text))]
        for t in texts:
            assert leaks(t) == [], (f.name, leaks(t))
            for original in SENSITIVE:
                assert original not in t, (f.name, original)


def _strings(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from _strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x)


def test_token_ids_are_the_qwen3_rendering_of_the_scrubbed_text(tok):
    from tensorverse.replay.tokenizers import HFTokenizer, local_fingerprint

    manifest = json.loads((SAMPLE / "corpus.json").read_text())
    assert manifest["tokenizer"]["fingerprint"] == local_fingerprint(HFTokenizer(tokenizer_dir()))["fingerprint"]
    for c in _cases():
        assert c["tokenizer"] == manifest["tokenizer"]
        for t in c["turns"]:
            ids = tok.apply_chat_template(t["messages"], tools=t["tools"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert list(ids) == t["prompt_token_ids"], (c["id"], t["index"])
            out = t["reference"]["output_token_ids"]
            assert tok.decode(out, skip_special_tokens=True) == t["reference"]["text"]
            assert out[-1] == tok.convert_tokens_to_ids("<|im_end|>")
            assert len(out) <= t["sampling"]["max_tokens"]


def test_cisco_tool_calls_and_multi_turn_tool_results():
    cases = _cases()
    commands, names = [], set()
    for c in cases:
        assert c["title"] and c["provenance"]["scrubbed"] and c["provenance"]["reference_backend"] == "authored"
        for i, t in enumerate(c["turns"]):
            for call in t["reference"]["tool_calls"] or ():
                names.add(call["function"]["name"])
                args = json.loads(call["function"]["arguments"])
                commands.append(args.get("command") or args.get("description"))
                assert args["device"].startswith("host")  # the device name is scrubbed ...
                assert f'"device": "{args["device"]}"' in t["reference"]["text"]  # ... the same in text
            if i + 1 < len(c["turns"]):  # the recorded tool results are in the next prompt
                assert t["tool_results"] and all(m["role"] == "tool" for m in t["tool_results"])
                nxt = c["turns"][i + 1]["messages"]
                assert nxt[-len(t["tool_results"]):] == t["tool_results"]
    assert sum(len(c["turns"]) >= 3 for c in cases) >= 3
    assert names == {"run_show", "set_interface_description"}
    joined = "\n".join(commands)
    for cmd in ("show mac address-table address", "show mac address-table vlan 310",
                "show running-config interface GigabitEthernet1/0/12",
                "show running-config interface GigabitEthernet0/0/1.201", "show interfaces description",
                "uplink to host3 Te1/0/1"):
        assert cmd in joined, cmd
    results = "\n".join(m["content"] for c in cases for t in c["turns"] for m in t["tool_results"])
    # structure kept: interface names, VLANs, commands; secrets replaced by valid placeholders
    for kept in ("interface GigabitEthernet0/0/1.201", "encapsulation dot1Q 201", "TenGigabitEthernet1/0/1",
                 "standby 1 authentication md5 key-string 7 ", "switchport access vlan 201", "Gi1/0/3",
                 "snmp-server community community1 RO 10"):
        assert kept in results, kept
