"""Scrub -> corpus -> replay on the real vLLM-CPU rig (``@pytest.mark.vllm``).

Record-like turns are made by calling the primary (bf16) with token-id prompts rendered from chat
messages full of router data; they are stored as the recorder stores turns, scrubbed with the
primary's tokenizer, and replayed on ``primary`` (the reference), ``primary2`` (the same server
under a second name: the primary against itself) and ``fp32``. The bf16/fp32 flips are found and
reported; the primary against itself has none; the corpus fingerprint matches the servers'."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tensorverse.cli import main as cli_main

pytestmark = pytest.mark.vllm

ASKS = [
    "Show the MAC table of core-sw1 (10.44.0.1) for VLAN 201; last seen 0050.56a1.b2c3.",
    "Set the description of GigabitEthernet0/0/1.201 on edge-rtr2.acme.com to 'uplink ops@acme.com'.",
    "Why does neighbor 172.16.9.2 flap on dist-rtr4? password 7 0822455D0A16 is configured.",
    "List interfaces of core-sw1 with ip address 10.44.3.1 255.255.255.0 and mac 00:1a:2b:3c:4d:5e.",
    "snmp-server community Pr1v8Comm RO is on core-sw1; rotate it and show running-config interface Vlan201.",
    "Ping 192.168.77.5 from edge-rtr2 via TenGigabitEthernet1/1/4 and report the RTT.",
]
N_TOKENS = 24


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def record(rig, path: Path) -> None:
    from tensorverse.store import Store
    from tensorverse.store.records import BackendInfo, Session, Turn

    p = rig.primary
    root = p.url.removesuffix("/v1")
    with Store.open(path, durable=False) as st:
        st.put_backend("primary", BackendInfo(name="primary", url=p.url, model=p.model)).result()
        for i, ask in enumerate(ASKS):
            msgs = [{"role": "system", "content": "You are a network automation agent. Devices: core-sw1, edge-rtr2."},
                    {"role": "user", "content": ask}]
            prompt = _post(root + "/tokenize", {"model": p.model, "messages": msgs})["tokens"]
            ch = _post(p.url + "/completions", {"model": p.model, "prompt": prompt, "max_tokens": N_TOKENS,
                                                "temperature": 0, "return_token_ids": True})["choices"][0]
            sid = f"sess-{i}"
            st.put_session(Session(id=sid)).result()
            st.put_turn(Turn(id=f"turn-{i}", session_id=sid, index=0, state="ok",
                             endpoint="chat.completions", backend="primary", model=p.model,
                             request={"model": p.model, "messages": msgs, "temperature": 0,
                                      "max_tokens": N_TOKENS},
                             prompt_token_ids=prompt, output_token_ids=ch["token_ids"],
                             text=ch["text"], tool_calls=[], finish_reason=ch["finish_reason"])).result()


def test_scrub_and_replay_on_the_rig(rig, tmp_path, capsys):
    record(rig, tmp_path / "store")
    corpus = tmp_path / "corpus"
    assert cli_main(["scrub", "--store", str(tmp_path / "store"), "--out", str(corpus),
                     "--tokenizer", str(rig.primary.model_dir)]) == 0
    capsys.readouterr()
    raw = "".join(f.read_text() for f in corpus.rglob("*.json"))
    for original in ("core-sw1", "edge-rtr2", "acme", "10.44.0.1", "0050.56a1.b2c3", "Pr1v8Comm",
                     "172.16.9.2", "192.168.77.5", "00:1a:2b:3c:4d:5e"):
        assert original not in raw, original

    p, f32 = rig.primary, rig.fp32
    out = tmp_path / "results.json"
    args = ["replay", str(corpus), "--backend", f"primary={p.url}", "--backend", f"primary2={p.url}",
            "--backend", f"fp32={f32.url}", "--reference", "primary", "--out", str(out),
            "--no-progress", "--concurrency", "2"]
    code = cli_main(args + ["--fail-on", "primary2:flip_rate>0", "--fail-on", "fp32:flip_rate>0"])
    printed = capsys.readouterr()
    res = json.loads(out.read_text())
    s = res["summary"]
    # the corpus's tokenizer fingerprint (computed locally) is the servers' (computed by API)
    assert not res["refused"], res["refused"]
    assert all(t["same_dictionary"] for t in res["tokenizers"].values()), res["tokenizers"]
    assert s["primary2"]["positions"] == s["fp32"]["positions"] == len(ASKS) * N_TOKENS
    assert s["primary2"]["flips"] == 0 and s["primary2"]["errors"] == 0  # itself: no flip
    assert s["primary2"]["departures"] == s["primary"]["departures"]
    assert s["fp32"]["flips"] > 0, s["fp32"]  # bf16 vs float32: flips found ...
    assert "FAIL fp32: flip_rate" in printed.err and code == 1  # ... and gate the run
    assert "primary2: flip_rate" not in printed.err
    assert "fp32" in printed.out and "same_top_p" in printed.out
    for c in res["cases"]:
        t = c["turns"][0]["backends"]
        assert t["primary2"]["forced"]["template"] == "ok"  # the scrubbed prompt is what the template renders
        # primary2's free run is compared with the basis (the primary's own run on the scrubbed
        # prompt): the same server, so the same tokens; the primary's free row is compared with
        # the recorded (pre-scrub) output instead
        assert t["primary2"]["free"]["diverged"] is False and t["primary2"]["free"]["verdict"] == "match"
        assert t["primary"]["free"]["vs"] == "recorded"
    assert s["primary"]["departures"] == 0  # forced through its own output: no departure

    # deterministic: a second run gives the same per-case results
    out2 = tmp_path / "results2.json"
    cli_main([a if a != str(out) else str(out2) for a in args])
    res2 = json.loads(out2.read_text())
    assert res2["summary"]["fp32"]["flips"] == s["fp32"]["flips"]
    # the same flips, departures, divergences and verdicts (KL values may differ in the last bits
    # when vLLM batches the concurrent requests differently; they are not compared exactly)
    assert _diff(_discrete(res2["cases"]), _discrete(res["cases"])) == []
    for a, b in zip(res2["cases"], res["cases"]):
        for ta, tb in zip(a["turns"], b["turns"]):
            for name in ta["backends"]:
                ka = ta["backends"][name]["forced"].get("kl") or []
                kb = tb["backends"][name]["forced"].get("kl") or []
                assert ka == pytest.approx(kb, rel=1e-3, abs=1e-6)


def _discrete(cases):
    out = json.loads(json.dumps(cases))
    for c in out:
        c.pop("session", None)  # the run's own session id in its working store
        for t in c["turns"]:
            for r in t["backends"].values():
                r.get("forced", {}).pop("kl", None)
    return out


def _diff(a, b, path="$"):
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]
