"""Store -> ``tensorverse scrub`` -> corpus, with the real Qwen3 tokenizer: the corpus validates
against its JSON Schema, loads with plain ``json``, holds no original, and its token ids are the
scrubbed text (the chat template's rendering of the scrubbed messages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tensorverse.cli import main as cli_main
from tensorverse.replay.corpus import CorpusError, load_corpus, schema, write_corpus
from tensorverse.store import Store

from tensorverse.rig.models import tokenizer_dir
from tensorverse.store.records import Turn
from tensorverse.testing.records import tsession

TOOLS = [{"type": "function", "function": {
    "name": "run_cli", "description": "Run a show command on a device.",
    "parameters": {"type": "object", "properties": {"device": {"type": "string"},
                                                    "command": {"type": "string"}},
                   "required": ["device", "command"]}}}]
SHOW_MAC = ("edge-rtr7#show mac address-table interface Gi0/0/3\n"
            " 310    3c08.f61a.9b01    DYNAMIC     Gi0/0/3\n"
            " 310    3c08.f61a.9b02    DYNAMIC     Gi0/0/3\n")
RUNCFG = ("interface GigabitEthernet0/0/3.310\n description cust-7731 uplink, noc: ops@globex.net\n"
          " encapsulation dot1Q 310\n ip address 10.77.31.1 255.255.255.252\n"
          " standby 1 authentication md5 key-string 7 0822455D0A16\n")
ORIGINALS = ["edge-rtr7", "3c08.f61a.9b01", "3c08.f61a.9b02", "globex", "10.77.31.1", "0822455D0A16",
             "ops@"]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


def _call(name, args, cid):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def record_store(path: Path, tok) -> str:
    """A two-turn agent session as the recorder stores it (tool call, tool result, answer)."""
    sys_msg = {"role": "system", "content": "You operate routers. Hostname of the edge: edge-rtr7."}
    user = {"role": "user", "content": "Which MACs are on Gi0/0/3 of edge-rtr7 (mgmt 10.77.31.1)?"}
    call1 = _call("run_cli", {"device": "edge-rtr7", "command": "show mac address-table interface Gi0/0/3"}, "c1")
    m1 = [sys_msg, user]
    out1 = ('<tool_call>\n{"name": "run_cli", "arguments": {"device": "edge-rtr7", "command": '
            '"show mac address-table interface Gi0/0/3"}}\n</tool_call><|im_end|>')
    m2 = [*m1, {"role": "assistant", "content": "", "tool_calls": [call1]},
          {"role": "tool", "tool_call_id": "c1", "content": SHOW_MAC + RUNCFG}]
    out2 = "Two MACs: 3c08.f61a.9b01 and 3c08.f61a.9b02 on VLAN 310 (GigabitEthernet0/0/3.310).<|im_end|>"
    with Store.open(path, durable=False) as st:
        st.put_session(tsession("sess-1", created_ns=1_700_000_000_000_000_000)).result()
        for i, (msgs, out, calls) in enumerate(((m1, out1, [call1]), (m2, out2, []))):
            prompt = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True)
            if hasattr(prompt, "keys"):  # transformers 5 returns a BatchEncoding
                prompt = prompt["input_ids"]
            st.put_turn(Turn(id=f"turn-{i}", session_id="sess-1", index=i, state="ok",
                             endpoint="chat.completions", backend="primary", model="tiny-a",
                             request={"model": "tiny-a", "messages": msgs, "tools": TOOLS,
                                      "temperature": 0, "max_tokens": 64},
                             prompt_token_ids=list(prompt),
                             output_token_ids=tok.encode(out, add_special_tokens=False),
                             text=out.replace("<|im_end|>", ""), tool_calls=calls,
                             finish_reason="tool_calls" if calls else "stop")).result()
        st.put_session(tsession("empty", created_ns=1_700_000_000_000_000_001)).result()
    return "sess-1"


def test_scrub_cli_writes_a_valid_corpus_without_originals(tmp_path, tok, capsys):
    record_store(tmp_path / "store", tok)
    out = tmp_path / "corpus"
    code = cli_main(["scrub", "--store", str(tmp_path / "store"), "--out", str(out),
                     "--tokenizer", str(tokenizer_dir()), "--name", "test"])
    captured = capsys.readouterr()
    printed = captured.out
    assert code == 0, captured.err
    assert "mac" in printed and "replaced" in printed
    for o in ORIGINALS:
        assert o not in printed
    # every file, read as bytes: no original anywhere
    for f in out.rglob("*.json"):
        raw = f.read_text()
        for o in ORIGINALS:
            assert o not in raw, (f, o)
    # plain json + jsonschema, no Tensorverse needed
    import jsonschema

    manifest = json.loads((out / "corpus.json").read_text())
    jsonschema.validate(manifest, json.loads((out / "schema" / "corpus.schema.json").read_text()))
    case = json.loads((out / manifest["cases"][0]["file"]).read_text())
    jsonschema.validate(case, json.loads((out / "schema" / "case.schema.json").read_text()))
    assert manifest["tokenizer"]["fingerprint"] == case["tokenizer"]["fingerprint"]
    assert manifest["scrub"]["replaced"]["mac"] >= 4 and manifest["scrub"]["hostnames_learnt"] >= 1
    assert case["provenance"]["session"] != "sess-1" and case["provenance"]["reference_backend"] == "primary"
    t0, t1 = case["turns"]
    # the ids are the scrubbed text: the chat template's rendering of the scrubbed messages
    rendered = tok.apply_chat_template(t0["messages"], tools=t0["tools"], add_generation_prompt=True, tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert list(rendered) == t0["prompt_token_ids"]
    ref_text = tok.decode(t0["reference"]["output_token_ids"])
    assert '"device": "host1"' in ref_text and "edge-rtr7" not in ref_text
    assert t0["reference"]["tool_calls"][0]["function"]["arguments"] == json.dumps(
        {"device": "host1", "command": "show mac address-table interface Gi0/0/3"})
    # recorded tool results of the multi-turn session, scrubbed consistently with turn 1's prompt
    assert t0["tool_results"][0]["role"] == "tool" and "host1#show mac" in t0["tool_results"][0]["content"]
    assert "GigabitEthernet0/0/3.310" in t0["tool_results"][0]["content"]
    assert t0["tool_results"][0]["content"] in tok.decode(t1["prompt_token_ids"])
    assert t1["reference"]["text"].startswith("Two MACs: 0000.5e00.53")
    assert load_corpus(out).cases[0]["id"] == case["id"]


def test_loader_rejects_edits_and_newer_formats(tmp_path, tok):
    record_store(tmp_path / "store", tok)
    out = tmp_path / "corpus"
    assert cli_main(["scrub", "--store", str(tmp_path / "store"), "--out", str(out),
                     "--tokenizer", str(tokenizer_dir())]) == 0
    f = next((out / "cases").glob("*.json"))
    case = json.loads(f.read_text())
    f.write_text(json.dumps({**case, "title": "edited"}))
    with pytest.raises(CorpusError) as e:
        load_corpus(out)
    assert e.value.reason == "checksum"
    assert load_corpus(out, verify=False).cases[0]["title"] == "edited"
    with pytest.raises(CorpusError) as e:
        write_corpus(tmp_path / "c2", [{**case, "format_version": 2}])
    assert e.value.reason == "version"
    bad = {**case, "turns": [{**case["turns"][0], "prompt_token_ids": [-1]}]}
    with pytest.raises(CorpusError) as e:
        write_corpus(tmp_path / "c3", [bad])
    assert e.value.reason == "schema" and "prompt_token_ids" in str(e.value)  # the message names the field


def _case(i: int = 0, **over) -> dict:
    case = {"format": "tensorverse.case", "format_version": 1, "id": f"case-{i}",
            "tokenizer": {"fingerprint": None, "source": "fake"},
            "provenance": {"source": "hand-written", "reference_backend": "primary", "scrubbed": True},
            "turns": [{"index": 0, "endpoint": "completions", "sampling": {"temperature": 0, "max_tokens": 4},
                       "prompt_token_ids": [3 + i, 9, 27],
                       "reference": {"backend": "primary", "output_token_ids": [5, 6, 7, 8], "text": "",
                                     "tool_calls": None, "finish_reason": "length"}}]}
    return {**case, **over}


def _link_outside(corpus: Path) -> None:
    """A case file that is a link to a file outside the corpus (its name passes the schema)."""
    f = next((corpus / "cases").glob("*.json"))
    outside = corpus.parent / "outside.json"
    outside.write_bytes(f.read_bytes())
    f.unlink()
    f.symlink_to(outside)


def _edit_manifest(corpus: Path, edit) -> None:
    m = json.loads((corpus / "corpus.json").read_text())
    edit(m)
    (corpus / "corpus.json").write_text(json.dumps(m))


@pytest.mark.parametrize("breakage, reason", [
    (lambda c: (c / "corpus.json").unlink(), "missing"),
    (lambda c: next((c / "cases").glob("*.json")).unlink(), "missing"),
    (lambda c: (c / "corpus.json").write_text("{not json"), "syntax"),
    (lambda c: _edit_manifest(c, lambda m: m.update(format="something.else")), "format"),
    (lambda c: _edit_manifest(c, lambda m: m.update(format_version=99)), "version"),
    (lambda c: _link_outside(c), "outside"),
    (lambda c: _edit_manifest(c, lambda m: m["cases"][0].update(id="case-9")), "case_id"),
], ids=["no-manifest", "no-case-file", "manifest-not-json", "not-a-manifest", "newer-manifest", "outside",
        "case-id"])
def test_each_broken_corpus_is_refused_with_its_reason(tmp_path, breakage, reason):
    corpus = write_corpus(tmp_path / "c", [_case(0), _case(1)], name="two")
    assert len(load_corpus(corpus).cases) == 2
    breakage(corpus)
    with pytest.raises(CorpusError) as e:
        load_corpus(corpus)
    assert e.value.reason == reason, e.value


@pytest.mark.parametrize("case, reason", [
    ([1, 2], "format"),
    (_case(format="tensorverse.other"), "format"),
    (_case(turns=[{**_case()["turns"][0], "prompt_token_ids": []}]), "schema"),
    (_case(provenance=7), "schema"),
], ids=["not-an-object", "not-a-case", "empty-prompt-by-schema", "bad-provenance"])
def test_each_broken_case_is_refused_with_its_reason(tmp_path, case, reason):
    with pytest.raises(CorpusError) as e:
        write_corpus(tmp_path / "c", [case])
    assert e.value.reason == reason, e.value


def test_a_case_file_that_is_not_json_is_refused_as_syntax(tmp_path):
    corpus = write_corpus(tmp_path / "c", [_case(0)])
    f = next((corpus / "cases").glob("*.json"))
    f.write_text("{oops")
    with pytest.raises(CorpusError) as e:
        load_corpus(corpus, verify=False)
    assert e.value.reason == "syntax"
    with pytest.raises(CorpusError) as e:
        load_corpus(f)  # a single case file
    assert e.value.reason == "syntax"


def test_scrub_needs_a_tokenizer(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["scrub", "--store", str(tmp_path), "--out", str(tmp_path / "c")])
    assert "--tokenizer" in capsys.readouterr().err
    assert cli_main(["scrub", "--store", str(tmp_path / "none"), "--out", str(tmp_path / "c"),
                     "--tokenizer", str(tmp_path)]) == 2


def test_schemas_are_valid_json_schema():
    import jsonschema

    for name in ("case", "corpus"):
        jsonschema.Draft202012Validator.check_schema(schema(name))


def test_a_rig_suite_corpus_that_names_no_model_is_refused_as_no_model(tmp_path):
    from tensorverse.bundle.known import known_corpus

    corpus = write_corpus(tmp_path / "c", [_case(0)], name="unnamed")
    with pytest.raises(CorpusError) as e:
        known_corpus(corpus)
    assert e.value.reason == "no_model"
    named = write_corpus(tmp_path / "m", [_case(0)], name="named", model={"name": "m", "content_hash": "ab" * 32})
    assert known_corpus(named).model["name"] == "m"
