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


def test_the_cost_model_splits_the_cpu_into_parts_per_second_per_turn_and_per_token():
    # levels made from 0.1 CPU-s a second, 4 ms a turn, 0.5 ms a token (less the shed turns' relays)
    def level(wall, turns, tokens, shed_relays=0.0, noise=0.0):
        return {"wall_s": wall, "shadowed_turns": turns, "shadowed_tokens": tokens,
                "proxy_cpu_s": 0.1 * wall + 0.004 * turns + 0.0005 * tokens + shed_relays + noise,
                "unshadowed_relay_cpu_s": shed_relays}

    rows = [level(15, 47, 47 * 48), level(28, 92, 92 * 48), level(35, 114, 114 * 48, 0.3),
            level(38, 111, 111 * 48, 1.1), level(36, 26, 26 * 192)]
    m = PL.cost_model(rows)
    assert m["levels"] == 5 and m["tokens_per_turn"] == 48
    assert (m["cpu_ms_per_wall_s"], m["cpu_ms_per_shadowed_turn"], m["cpu_ms_per_shadowed_token"]) == (100.0, 4.0, 0.5)
    assert m["max_abs_residual_cpu_s"] == 0.0
    # a busy core: 0.9 s of each second for 4/48 + 0.5 ms a token
    assert m["busy_core_tokens_per_s"] == round(0.9 / (0.004 / 48 + 0.0005), 1)
    rows[0] = level(15, 47, 47 * 48, noise=0.2)
    assert PL.cost_model(rows)["max_abs_residual_cpu_s"] > 0.05
    assert PL.cost_model(rows[:3]) is None  # three parts need more than three levels
