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
                           queue=1024)
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


def test_the_cost_model_splits_the_cpu_per_turn_into_a_part_per_turn_and_a_part_per_token():
    # 100 turns of 48 tokens in 8 CPU-s, 0.5 of it the relays of shed turns: 75 ms a turn; 50 turns
    # of 192 tokens in 11 CPU-s: 220 ms a turn. The line through them: 145 ms per 144 tokens
    short = {"concurrency": 2, "proxy_cpu_s": 8.0, "unshadowed_relay_cpu_s": 0.5, "shadowed_turns": 100,
             "shadowed_tokens": 4800}
    long = {"concurrency": 2, "proxy_cpu_s": 11.0, "unshadowed_relay_cpu_s": 0.0, "shadowed_turns": 50,
            "shadowed_tokens": 9600}
    m = PL.cost_model(short, long, 5.0)
    assert m["tokens_per_turn"] == [48, 192] and m["cpu_ms_per_turn"] == [75.0, 220.0]
    assert m["cpu_ms_per_shadowed_token"] == round(145 / 144, 3)
    assert m["fixed_cpu_ms_per_turn"] == round(75 - 145 / 144 * 48, 2)
    assert m["long_turn_limit_tokens_per_s_per_core"] == round(1000 / (145 / 144), 1)
