"""The hypercube's merge, statistics and command (fast; no browser): synthetic bundles of three
rigs (:mod:`tensorverse.testing.rig_bundles`, the real writer and checker) merge into totals
that are the sum of the bundles' summaries; intervals hold their estimate and are wider when the
flips sit in few turns (hand-made rows); a refused bundle, two bundles of one rig or of two
corpora make the command exit 2 and write nothing."""

from __future__ import annotations

import argparse
import io
import json
import re
import tarfile
from pathlib import Path

import pytest

from tensorverse.bundle.check import CheckedBundle, check_bundle
from tensorverse.bundle.summary import summarize
from tensorverse.hypercube import cli
from tensorverse.hypercube.merge import MergeError, hardware_of, merge_bundles, totals
from tensorverse.hypercube.site import site_data
from tensorverse.hypercube.stats import marginals, paired_clusters
from tensorverse.testing.rig_bundles import make_corpus, synth_bundle

SCALES = {"bf16": 0, "bf16_noise": 0.05, "dtype_fp16": 0.15, "kv_fp8e4m3": 0.6, "quant_fp8": 0.4}
RIGS = [  # label, seed, jitter, refused
    ("rig-a", 1, 0.02, {}),
    ("rig-b", 2, 0.05, {"kv_fp8e4m3": "refused before start: no AVX-512"}),
    ("rig-c", 3, 0.10, {}),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus") / "synthetic-v1")


@pytest.fixture(scope="module")
def paths(tmp_path_factory, corpus) -> list[Path]:
    d = tmp_path_factory.mktemp("bundles")
    out = []
    for label, seed, jitter, refused in RIGS:
        scales = {k: v for k, v in SCALES.items() if k not in refused}
        out.append(synth_bundle(d / f"{label}.tvbundle", corpus, rig_label=label, scales=scales, refused=refused,
                                rig_seed=seed, rig_jitter=jitter, gpu=f"GPU {seed}"))
    return out


@pytest.fixture(scope="module")
def checked(paths, corpus) -> list[CheckedBundle]:
    return [check_bundle(str(p), {corpus.name: corpus}) for p in paths]


@pytest.fixture(scope="module")
def cube(checked):
    return merge_bundles(checked)


# ---------------------------------------------------------------------------------------------
# the merge


def test_totals_are_the_sum_of_the_bundles_summaries(cube, checked):
    assert [r.label for r in cube.rigs] == ["rig-a", "rig-b", "rig-c"]
    assert [r.hardware for r in cube.rigs] == ["GPU 1", "GPU 2", "GPU 3"]
    assert [s.name for s in cube.settings] == list(SCALES)
    t = totals(cube)
    for s in SCALES:
        ran = [b.summaries[s] for b in checked if s in b.summaries]
        assert t[s] == {"rigs": len(ran), "positions": sum(x["positions"] for x in ran),
                        "flips": sum(x["flips"] for x in ran)}, s
        # the turn clusters add up to the same totals
        tc = [x for x in cube.turn_counts if x.setting == s]
        assert sum(x.positions for x in tc) == t[s]["positions"] and sum(x.flips for x in tc) == t[s]["flips"]
        assert sum(1 for x in tc if x.flips) == sum(x["turns_with_flip"] for x in ran)
    assert t["kv_fp8e4m3"]["rigs"] == 2 and t["quant_fp8"]["flips"] > t["bf16_noise"]["flips"]


def test_cells_keep_status_reason_and_summary(cube, checked):
    for i, b in enumerate(checked):
        for s in SCALES:
            c = cube.cell(i, s)
            if s in b.summaries:
                assert c.status == "ran" and c.reason is None
                assert c.summary.flips == b.summaries[s]["flips"] and c.summary.kl_mean == b.summaries[s]["kl_mean"]
            else:
                assert c.status == "refused" and c.reason == "refused before start: no AVX-512" and c.summary is None


def test_lanes_and_turns_are_the_bundles_rows(cube, checked, corpus):
    assert {(t.case, t.turn): list(t.tokens) for t in cube.turns} == corpus.tokens
    assert len(cube.lanes) == sum(len(b.ran) for b in checked) * len(corpus.tokens)
    for ln in cube.lanes:
        rows = sorted((r for r in checked[ln.rig].positions
                       if (r["setting"], r["case"], r["turn"]) == (ln.setting, ln.case, ln.turn)),
                      key=lambda r: r["position"])
        assert list(ln.margin) == [r["margin"] for r in rows] and list(ln.kl) == [r["kl"] for r in rows]
        assert [(f.position, f.top1, f.flip_class, list(f.topk_ids)) for f in ln.flips] == \
            [(r["position"], r["top1"], r["flip_class"], r["topk_ids"]) for r in rows if r["flip"]]


def test_two_bundles_of_one_rig_or_of_two_corpora_do_not_merge(checked, tmp_path):
    with pytest.raises(MergeError) as e:
        merge_bundles([checked[0], checked[1], checked[0]])
    assert e.value.reason == "duplicate_rig" and checked[0].rig["id"] in e.value.detail
    other = make_corpus(tmp_path / "other", seed=9, name="synthetic-v2")
    p = synth_bundle(tmp_path / "o.tvbundle", other, rig_label="rig-o", scales=SCALES)
    with pytest.raises(MergeError) as e:
        merge_bundles([checked[0], check_bundle(str(p), {other.name: other})])
    assert e.value.reason == "suite_mismatch" and e.value.path == str(p)


def test_hardware_of_any_fingerprint():
    assert hardware_of({"gpus": {"count": 8, "models": ["NVIDIA H100 80GB HBM3"]}}) == "8x NVIDIA H100 80GB HBM3"
    assert hardware_of({"gpus": None, "cpu": {"model": "AMD EPYC"}}) == "AMD EPYC"
    for junk in (None, [], "x", {"gpus": "weird", "cpu": 3}, {"gpus": {"models": {"a": 1}}}):
        assert isinstance(hardware_of(junk), str)


# ---------------------------------------------------------------------------------------------
# the statistics


def test_every_interval_holds_its_estimate(cube):
    ms = {m.setting: m for m in marginals(cube)}
    for m in ms.values():
        for iv in (m.flip_rate, m.vs_reference, m.vs_noise):
            if iv is None or iv.low is None:
                continue
            assert iv.low <= iv.estimate <= iv.high
    assert ms["bf16"].vs_reference is None and ms["bf16_noise"].vs_noise is None
    q = ms["quant_fp8"]
    assert q.vs_reference.clusters == 3 * len(cube.turns)  # the unit: (rig, case, turn)
    assert q.vs_reference.low > 0  # FP8 flips more than the reference, clearly
    d, n = paired_clusters(cube, "quant_fp8", "bf16")
    assert q.vs_reference.estimate == pytest.approx(d.sum() / n.sum())
    assert ms["kv_fp8e4m3"].rigs == 2 and ms["kv_fp8e4m3"].vs_reference.clusters == 2 * len(cube.turns)
    assert marginals(cube) == marginals(cube)  # fixed seed: the same figures every time


def _hand_bundle(rig: str, flips: dict[tuple[str, int], list[int]], *, turns: int = 40, n: int = 20) -> CheckedBundle:
    """A checked bundle written by hand: ``turns`` turns of ``n`` positions (token 0 everywhere);
    the reference ``ref`` never flips, setting ``x`` flips at ``flips[(case, turn)]``."""
    rows = []
    for t in range(turns):
        case, turn = f"c{t // 2:02d}", t % 2
        for s in ("ref", "x"):
            for p in range(n):
                f = s == "x" and p in flips.get((case, turn), ())
                rows.append({"setting": s, "case": case, "turn": turn, "position": p, "token": 0,
                             "top1": 1 if f else 0, "flip": f, "flip_class": "runtime" if f else None,
                             "margin": -0.5 if f else 0.5, "kl": 0.0 if s == "ref" else 0.01,
                             "topk_ids": [1, 0] if f else None, "topk_logits": [1.0, 0.5] if f else None})
    corpus = {"name": "hand", "manifest_sha256": "0" * 64, "tokens_sha256": "0" * 64,
              "model": {"name": "m", "content_hash": "0" * 64}, "cases": turns // 2, "positions": turns * n}
    manifest = {"suite": {"name": "hand", "version": 1}, "corpus": corpus, "reference_setting": "ref",
                "noise_setting": None, "created": "2026-12-02T00:00:00Z", "tensorverse_version": None,
                "rig": {"id": rig, "label": rig, "fingerprint": {}},
                "settings": [{"name": s, "axis": "a", "value": s, "status": "ran", "reason": None, "vllm_args": [],
                              "env": {}} for s in ("ref", "x")]}
    return CheckedBundle(f"{rig}.tvbundle", manifest, rows, [], summarize(rows, [], ["ref", "x"]), {})


def test_intervals_are_wider_when_flips_cluster_in_few_turns():
    # the same 40 flips in 3,200 positions (two rigs x 40 turns x 20): in 4 turns, or one in each of 40
    few = {("c00", 0): range(10), ("c05", 1): range(10)}
    spread = {(f"c{t // 2:02d}", t % 2): [t % 20] for t in range(0, 40, 2)}
    cubes = {}
    for name, flips in (("few", few), ("spread", spread)):
        cubes[name] = merge_bundles([_hand_bundle("0" * 15 + "a", flips), _hand_bundle("0" * 15 + "b", flips)])
    ms = {k: {m.setting: m for m in marginals(c)} for k, c in cubes.items()}
    a, b = ms["few"]["x"].vs_reference, ms["spread"]["x"].vs_reference
    assert a.estimate == b.estimate == pytest.approx(40 / 1600)
    assert a.clusters == b.clusters == 80
    for iv in (a, b):
        assert iv.low <= iv.estimate <= iv.high
    assert (a.high - a.low) > 2 * (b.high - b.low), (a, b)
    # positions as independent trials would give both the same (binomial) width: turns are the unit here
    assert ms["few"]["ref"].vs_reference is None and ms["few"]["x"].flip_rate.estimate == a.estimate


def test_matrix_replay_and_hypercube_give_one_interval_for_the_same_turns(checked):
    """The same turns, read by the three reports that show a flip rate per setting: the hypercube
    site (one rig), the matrix report's marginal of a value run by one point, and the replay
    report's per-backend summary give the same turn-clustered interval; the matrix's effect
    against the reference value and the site's ``vs_reference`` give the same paired one."""
    from tensorverse.matrix.hypercube import marginals as matrix_marginals
    from tensorverse.replay.report import summarize_backend

    one = merge_bundles(checked[:1])
    site = {m.setting: m for m in marginals(one)}

    def point(setting):
        counts = [t for t in one.turn_counts if t.setting == setting]
        # the replay report reads forced runs per case and turn: the same turns as results cases
        cases = {}
        for t in counts:
            cases.setdefault(t.case, {"id": t.case, "turns": []})["turns"].append(
                {"index": t.turn, "positions": t.positions,
                 "backends": {setting: {"forced": {"status": "ok", "n": t.positions, "flips": list(range(t.flips)),
                                                   "flip_classes": ["runtime"] * t.flips}}}})
        summary = summarize_backend(setting, list(cases.values()), is_reference=False)
        return counts, {"name": setting, "status": "ok", "reference": False, "effective": {"axis": setting},
                        "summary": summary}

    ref_counts, ref_point = point(one.reference)
    assert len(ref_counts) >= 2
    for setting in ("dtype_fp16", "quant_fp8"):
        counts, p = point(setting)
        assert len(counts) >= 2 and sum(t.flips for t in counts) > 0
        summary = p["summary"]
        matrix = matrix_marginals([p], {"axis": [setting]})["axis"][0]
        rate = site[setting].flip_rate
        want = [round(rate.low, 6), round(rate.high, 6)]
        assert summary["flip_rate_ci"] == want
        assert matrix["flip_rate_ci"] == want
        assert matrix["flip_rate"] == pytest.approx(rate.estimate)
        # the matrix's effect of the setting against the reference value is the site's paired
        # vs_reference interval
        effect = matrix_marginals([ref_point, p], {"axis": [one.reference, setting]})["axis"][1]
        vs = site[setting].vs_reference
        assert effect["effect_ci"] == vs.bounds() and effect["effect"] == pytest.approx(vs.estimate)


# ---------------------------------------------------------------------------------------------
# the command


def _tamper(src: Path, dst: Path) -> Path:
    """``src`` with one byte of summaries.json changed and the manifest left as it was."""
    with tarfile.open(src, "r:") as tf:
        members = [(ti.name, tf.extractfile(ti).read()) for ti in tf]
    with tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            if name == "summaries.json":
                data = data.replace(b'"flips"', b'"flipz"', 1)
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return dst


def test_build_writes_the_site_and_prints_its_index(paths, corpus, tmp_path, capsys):
    site = tmp_path / "site"
    assert cli.main(["build", *map(str, paths), "--site", str(site), "--corpus", str(corpus.path)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(site / "index.html")
    lines = err.strip().splitlines()
    assert len(lines) == 3 and all(re.match(r"tensorverse hypercube: \[\d/3\] .*: ok \(rig rig-[abc], ", x) for x in lines)
    assert sorted(p.name for p in (site / "static").iterdir()) == ["hypercube.css", "hypercube.js"]
    page = (site / "index.html").read_text()
    raw = re.search(r'<script type="application/json" id="hc-data">(.*?)</script>', page, re.S).group(1)
    data = json.loads(raw)
    assert [r["label"] for r in data["rigs"]] == ["rig-a", "rig-b", "rig-c"]
    assert data["cells"][1][3]["status"] == "refused"
    assert "script-src 'self'" in page.replace("&#x27;", "'") and "default-src 'none'" in page.replace("&#x27;", "'")
    # the same bundles, the same site
    again = tmp_path / "again"
    assert cli.main(["hypercube", "build", *map(str, paths), "--site", str(again), "--corpus", str(corpus.path)]) == 0
    assert (again / "index.html").read_bytes() == (site / "index.html").read_bytes()


def test_hostile_strings_are_escaped_in_the_page_and_on_the_terminal(corpus, tmp_path, capsys):
    label = "<img src=x onerror=window.__pwned=1><script>window.__pwned=1</script>\x1b[31m\u2028&"
    p = synth_bundle(tmp_path / "x.tvbundle", corpus, rig_label=label, scales=SCALES,
                     refused={"fp8_kv": "</script><script>alert(1)</script>"}, gpu="<b>GPU</b>")
    site = tmp_path / "site"
    assert cli.main(["build", str(p), "--site", str(site), "--corpus", str(corpus.path)]) == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[31m" in err
    page = (site / "index.html").read_text()
    assert page.count("<script") == 2 and "<img" not in page and "</script><script>alert" not in page
    assert "\u2028" not in page and "\\u003cimg src=x" in page
    data = json.loads(re.search(r'id="hc-data">(.*?)</script>', page, re.S).group(1))
    assert data["rigs"][0]["label"] == label and data["rigs"][0]["hardware"] == "<b>GPU</b>"


def test_a_refused_bundle_exits_2_and_writes_nothing(paths, corpus, tmp_path, capsys):
    bad = _tamper(paths[1], tmp_path / "bad.tvbundle")
    site = tmp_path / "site"
    assert cli.main(["build", str(paths[0]), str(bad), "--site", str(site), "--corpus", str(corpus.path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"tensorverse hypercube: [1/2] {paths[0]}: ok")
    assert err[-1].startswith(f"tensorverse hypercube: {bad}: hash_mismatch: summaries.json")
    assert not site.exists()
    # the corpus unknown (no --corpus): refused too
    assert cli.main(["build", str(paths[0]), "--site", str(site)]) == 2
    assert f"{paths[0]}: unknown_corpus: " in capsys.readouterr().err and not site.exists()
    # one rig twice: the merge refuses
    assert cli.main(["build", str(paths[0]), str(paths[0]), "--site", str(site), "--corpus", str(corpus.path)]) == 2
    assert f"tensorverse hypercube: {paths[0]}: duplicate_rig: " in capsys.readouterr().err and not site.exists()
    # not a bundle at all
    junk = tmp_path / "junk.tvbundle"
    junk.write_bytes(b"not a tar")
    assert cli.main(["build", str(junk), "--site", str(site)]) == 2
    assert f"{junk}: unreadable: " in capsys.readouterr().err and not site.exists()


def test_register_adds_the_command_to_a_parser():
    p = argparse.ArgumentParser(prog="tensorverse")
    cli.register(p.add_subparsers(dest="command"))
    a = p.parse_args(["hypercube", "build", "a.tvbundle", "b.tvbundle", "--site", "out", "--corpus", "c1",
                      "--corpus", "c2"])
    assert a.bundles == ["a.tvbundle", "b.tvbundle"] and a.site == Path("out") and a.corpus == ["c1", "c2"]
    assert a.func is cli._build
    with pytest.raises(SystemExit):
        p.parse_args(["hypercube", "build", "a.tvbundle"])  # --site is required
    assert p.parse_args(["hypercube"]).func(None) == 2


def test_site_data_is_what_the_page_reads(cube):
    d = site_data(cube, marginals(cube))
    assert len(d["cells"]) == 3 and all(len(row) == len(SCALES) for row in d["cells"])
    assert [a["axis"] for a in d["axes"]] == ["dtype", "kv", "quant"]
    lanes = sum(len(t["lanes"]) for c in d["cases"] for t in c["turns"])
    assert lanes == len(cube.lanes)
    assert d["marginals"][0]["setting"] == "bf16" and d["marginals"][0]["vs_reference"] is None


def test_the_app_writes_no_html():
    """Every bundle string goes in as text: the app never parses HTML (the browser test checks
    the hostile strings render as text; this keeps the sinks out of the code)."""
    from tensorverse.hypercube.site import STATIC_DIR

    js = (STATIC_DIR / "hypercube.js").read_text()
    code = re.sub(r"/\*.*?\*/", "", js, flags=re.S)
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "createContextualFragment", "DOMParser", "srcdoc", "fetch(", "XMLHttpRequest", "import("):
        assert sink not in code, sink
