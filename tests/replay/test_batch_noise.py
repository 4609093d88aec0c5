"""``tensorverse noise`` against a fake engine that speaks the capture plugin's protocol (its
rows go through the real tap, frames and store sink, with engine states): where the engine's
rows depend on the batch the probe reports flips, where they do not it reports none."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from tensorverse.testing.fake_engine import FakeEngine
from tensorverse.replay.batch_noise import NoiseOptions, ProbeTurn, parse_levels, probe_noise
from tensorverse.shadow.backend import Backend
from tensorverse.store import Store
from tensorverse.store.records import Turn
from tensorverse.testing.records import tsession

TURNS = [ProbeTurn(f"t{i}", [5 + i, 17, 33, 2], [(11 * i + 7 * p) % 500 for p in range(30)])
         for i in range(3)]


async def _probe(tmp_path, *, batch_variant: bool, levels=(1, 4, 8)):
    rows = tmp_path / "rows"
    async with FakeEngine(sink=f"dir:{rows}", batch_variant=batch_variant) as eng:
        with Store.open(rows) as store:
            res = await probe_noise(store, TURNS, NoiseOptions(
                backend=Backend(name="fake", url=eng.url, model="fake-batchy"), levels=list(levels),
                settle_s=0.05, rows_timeout_s=20))
        return res, list(eng.batch_sizes)


def test_batch_variant_engine_flips_and_the_batches_are_the_levels(tmp_path):
    res, sizes = asyncio.run(_probe(tmp_path, batch_variant=True))
    assert res["errors"] == [] and res["positions_per_level"] == 90
    assert set(res["summary"]) == {"c=4", "c=8"} and res["reference"] == "c=1"
    for label, c in (("c=4", 4), ("c=8", 8)):
        s = res["summary"][label]
        assert s["positions"] == 90 and s["errors"] == 0
        assert s["flips"] > 0 and 0 < s["flip_rate"] <= s["flip_rate_ci"][1]
        assert s["kl"]["max"] > 0
        # the engine states stored with the rows say which batch each row was computed in
        assert res["batch"][label]["median"] == c and res["batch"][label]["max"] == c
    assert res["batch"]["c=1"] == {"min": 1, "median": 1, "max": 1, "rows": 90}
    assert max(sizes) == 8  # the fake saw the batches the probe made
    # flips only where the fake puts near ties (every third position)
    for case in res["cases"]["c=8"]:
        forced = case["turns"][0]["backends"]["c=8"]["forced"]
        assert all(p % 3 == 0 for p in forced["flips"])


def test_batch_invariant_engine_has_no_flips(tmp_path):
    res, _ = asyncio.run(_probe(tmp_path, batch_variant=False, levels=(1, 6)))
    s = res["summary"]["c=6"]
    assert res["errors"] == [] and s["positions"] == 90
    assert s["flips"] == 0 and s["kl"]["max"] == 0.0 and s["flip_rate_ci"][0] == 0.0
    assert res["batch"]["c=6"]["median"] == 6


def test_levels_parse():
    assert parse_levels("1,8,32") == [1, 8, 32]
    for bad in ("8", "1,1", "0,4", "a,b"):
        with pytest.raises(ValueError):
            parse_levels(bad)


def test_cli_from_a_store(tmp_path, capsys):
    """``tensorverse noise --store``: the store's recorded turns, the table and the JSON file."""
    from tensorverse.cli import main

    rows = tmp_path / "store"
    with Store.open(rows) as store:
        store.put_session(tsession("s", created_ns=1)).result()
        for t in TURNS[:2]:
            store.put_turn(Turn(id=t.id, session_id="s", index=int(t.id[1:]),
                                prompt_token_ids=t.prompt_token_ids, output_token_ids=t.tokens)).result()
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    eng = asyncio.run_coroutine_threadsafe(FakeEngine(sink=f"dir:{rows}").start(), loop).result(10)
    try:
        rc = main(["noise", "--backend", f"fake={eng.url}#fake-batchy", "--store", str(rows),
                   "--concurrency", "1,3", "--max-positions", "12", "--out", str(tmp_path / "n.json")])
    finally:
        asyncio.run_coroutine_threadsafe(eng.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads((tmp_path / "n.json").read_text())
    assert res["turns"] == 2 and res["positions_per_level"] == 24 and res["summary"]["c=3"]["flips"] > 0
    assert "batch-noise probe of fake" in out and "c=3" in out and "flip_rate" in out
    assert f"{res['summary']['c=3']['flips']}" in out or "[" in out
