"""The production-load path end to end, small: the real proxy process with three ``FakeEngine``
shadows at Qwen3's vocabulary posting through the real capture tap, evidence at the source.
What ``benchmarks/production_load.py`` measures at saturation must first be whole: every turn
shadowed on every shadow, every captured row stored (none lost, none dropped), most rows compact,
the flips the engines' runtimes make sent in full and found by the comparisons."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import production_load as PL


def test_three_evidence_shadows_behind_the_real_proxy_store_every_row_and_compare_every_turn(tmp_path: Path):
    # the agents outrun the shadows on purpose (a burst of 3 s, drained afterwards): the tee's queue
    # holds the whole burst, so no turn is shed however slow the machine (a CI machine shed 9 of 77
    # turns with a queue of 64); shedding itself is tested in tests/proxy/test_tee.py
    a = argparse.Namespace(tokens=48, first_ms=5.0, token_ms=1.0, engine_step_ms=1.0, shadow_concurrency=4,
                           queue=1024, secondary=False)
    with PL.primary() as url:
        out = PL.run_mode("evidence", [2], 3.0, a, tmp_path, url, detached=False)
    (level,) = out["levels"]
    assert level["errors"] == 0 and level["turns"] >= 4
    assert level["shadowed_turns"] == level["turns"] and level["shed_turns"] == 0
    rows = PL.lost_silently(out["taps"], out["ingest"])
    # forced and free on three shadows: a row per output token of every run, all stored
    assert rows["captured"] == level["turns"] * 6 * 48 == rows["stored"]
    assert rows["lost_silently"] == 0 and rows["dropped_at_tap"] == 0 and rows["counted_at_proxy"] == 0
    assert level["rows_compact"] >= 0.8 * level["rows"]  # only the evidence travels in full
    full = {r: sum((t.get("rows_evidence") or {}).get(r, 0) for t in out["taps"].values())
            for r in ("flip", "requested", "close")}
    # the flips, and the positions the proxy asked for (the primary's close calls, capped, and the
    # sample); the engines' near ties are all one bf16 step apart, at the cap's cut: none close
    assert full["flip"] > 0 and full["requested"] > 0 and full["close"] == 0
    # the comparisons found the runtimes' flips: the turns' tokens are the same, so shadow-2 and
    # shadow-3 (runtimes 2 and 3) flip the same positions of every turn and shadow-1 none
    assert out["flipped_comparisons"] == {"flipped": 2 * level["turns"], "turns": level["turns"], "per_turn": 2.0}


def test_turn_length_gives_the_proxys_cpu_per_token_with_short_and_long_turns():
    # 100 turns of 48 tokens in 6 CPU-s, 0.24 of it the relays of shed turns: 1.2 ms a token; 25
    # turns of 192 tokens in 6 CPU-s: 1.25 ms a token
    short = {"concurrency": 2, "proxy_cpu_s": 6.0, "unshadowed_relay_cpu_s": 0.24, "shadowed_turns": 100,
             "shadowed_tokens": 4800}
    long = {"concurrency": 2, "proxy_cpu_s": 6.0, "shadowed_turns": 25, "shadowed_tokens": 4800}
    m = PL.turn_length(short, long)
    assert m == {"concurrency": 2, "tokens_per_turn": [48.0, 192.0], "cpu_ms_per_shadowed_token": [1.2, 1.25],
                 "long_over_short": round(1.25 / 1.2, 3)}
