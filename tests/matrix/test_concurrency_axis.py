"""The matrix's ``concurrency`` axis: a setting of the run, not of the server; each forced run of
such a point runs inside a batch of that size (checked with the engine states a fake engine that
speaks the capture plugin's protocol stores with every row)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tensorverse.testing.fake_engine import FakeEngine
from tensorverse.matrix.launcher import build_command, build_env
from tensorverse.matrix.run import RunRequest, capture
from tensorverse.matrix.spec import SpecError, parse_spec, server_settings, settings_key
from tensorverse.replay.corpus import write_corpus
from tensorverse.store import Store

BASE = {"model": {"path": "/m/qwen3", "served_name": "fake-batchy"},
        "server": {"options": {"--dtype": "bfloat16"}, "env": {"OMP_NUM_THREADS": "1"}},
        "replay": {"modes": ["forced"], "rows_timeout_s": 20}}


def test_concurrency_is_an_axis_of_the_run_not_of_the_server():
    s = parse_spec({**BASE, "axes": {"concurrency": [1, 8], "--dtype": ["bfloat16"]}})
    assert [p.name for p in s.all_points()] == ["concurrency=1,dtype=bfloat16", "concurrency=8,dtype=bfloat16"]
    eff = s.effective({"concurrency": 8})
    assert eff["concurrency"] == 8 and server_settings(eff) == {"--dtype": "bfloat16", "OMP_NUM_THREADS": "1"}
    assert settings_key(s, {"concurrency": 1}, "c") != settings_key(s, {"concurrency": 8}, "c")
    srv = server_settings(eff)
    assert "concurrency" not in " ".join(build_command("py", "/m", "q", 1, srv))
    assert "concurrency" not in build_env(srv, {})
    assert s.axis_values()["concurrency"] == [1, 8]


@pytest.mark.parametrize("bad,where", [
    ({"axes": {"concurrency": [0, 4]}}, "integer >= 1"),
    ({"axes": {"concurrency": ["8"]}}, "integer >= 1"),
    ({"points": [{"name": "a", "settings": {"concurrency": True}}]}, "integer >= 1"),
    ({"axes": {"--dtype": ["x"]}, "server": {"env": {"concurrency": "4"}}}, "not the server's environment"),
])
def test_concurrency_errors_name_the_key(bad, where):
    with pytest.raises(SpecError) as e:
        parse_spec({**BASE, **bad})
    assert where in str(e.value) and e.value.reason == "invalid"  # the message naming the key is the contract


def _corpus(path: Path) -> Path:
    cases = [{"format": "tensorverse.case", "format_version": 1, "id": f"case-{i}",
              "tokenizer": {"fingerprint": None, "source": "fake"},
              "provenance": {"source": "hand-written", "reference_backend": "primary", "scrubbed": True},
              "turns": [{"index": 0, "endpoint": "completions", "sampling": {"temperature": 0, "max_tokens": 12},
                         "prompt_token_ids": [3 + i, 9, 27],
                         "reference": {"backend": "primary", "output_token_ids": [(5 * i + p) % 400 for p in range(12)],
                                       "text": "", "tool_calls": None, "finish_reason": "length"}}]}
             for i in range(3)]
    return write_corpus(path, cases, name="fake")


def test_each_forced_run_of_a_point_runs_in_a_batch_of_its_concurrency(tmp_path):
    from tensorverse.replay.corpus import load_corpus

    corpus = load_corpus(_corpus(tmp_path / "corpus"))
    spec = parse_spec({**BASE, "axes": {"concurrency": [1, 6]}})
    basis = {c["id"]: {"0": c["turns"][0]["reference"]["output_token_ids"]} for c in corpus.cases}

    async def run(c: int) -> tuple[dict, list]:
        store_dir = tmp_path / f"s{c}"
        async with FakeEngine(sink=f"dir:{store_dir}") as eng:
            with Store.open(store_dir) as store:
                req = RunRequest(spec=spec, corpus=str(corpus.path), out=tmp_path / "out",
                                 settings={"concurrency": c}, label=f"c{c}", basis=basis)
                index = await capture(req, eng.url, store, corpus.cases)
                sizes = []
                for per in index["cases"].values():
                    e = per["0"]["forced"]
                    assert e["status"] == "ok" and e["capture"] == "full", e
                    sizes += [st.batch_size for st in store.read_engine_states(e["run_id"]).values()]
        return index, sizes

    _, one = asyncio.run(run(1))
    _, six = asyncio.run(run(6))
    assert len(one) == len(six) == 36
    assert set(one) == {1}  # no batching at concurrency 1 (cases one at a time)
    assert set(six) == {6}  # every forced row of the point was computed in a batch of 6
