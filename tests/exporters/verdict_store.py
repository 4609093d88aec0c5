"""A real store holding the comparisons of three shadows over many turns (the verdict tests)."""

from __future__ import annotations

from tensorverse.store import Store
from tensorverse.store.records import ForcedComparison, FreeComparison, Turn
from tensorverse.testing.records import trun, tsession

T0 = 1_700_000_000_000_000_000


def _forced(run_id, ref_run_id, backend, role, turn_id, n, flips, cls, *, tool_flips=0, noise_floor=False):
    by_class = {"tie": 0, "near_tie": 0, "noise": 0, "parser": 0, "runtime": 0}
    by_class[cls] = flips
    return ForcedComparison(
        run_id=run_id, ref_run_id=ref_run_id, turn_id=turn_id, kind="topk", backend=backend, ref_backend="primary",
        role=role, ref_role="primary", status="ok", noise_floor=noise_floor, n=n,
        flips=list(range(flips)), flips_by_class=by_class,
        summary={"flips_by_class": by_class,
                 "positions_by_region": {"content": n - 10, "tool_name": 4, "tool_args": 6},
                 "flips_by_region_class": {"tool_args": {cls: tool_flips},
                                           "content": {cls: flips - tool_flips}}})


def _free(run_id, ref_run_id, backend, role, turn_id, verdict, *, calls=1):
    return FreeComparison(
        run_id=run_id, ref_run_id=ref_run_id, turn_id=turn_id, kind="tokens", backend=backend,
        ref_backend="primary", role=role, ref_role="primary", status="ok", verdict=verdict,
        ref_tool_calls=calls, cand_tool_calls=calls if verdict == "match" else 0,
        diverged=verdict != "match", common_prefix=5)


def build_store(path, turns=40, prefix="", first=0):
    with Store.open(path) as st:
        fill_store(st, turns, prefix, first)


def fill_store(st, turns=40, prefix="", first=0):
    """A primary, a shadow `bad` that breaks every 4th tool call and flips on every 5th turn, a
    shadow `good` that never differs, and the secondary (never differs either): comparisons as
    `tensorverse.shadow.compare` stores them, the fields the verdict reads."""
    sid = f"{prefix}sess1"
    st.put_session(tsession(sid, created_ns=T0)).result()
    for i in range(first, first + turns):
        tid = f"{prefix}turn{i:03d}"
        st.put_turn(Turn(id=tid, session_id=sid, index=i - first, created_ns=T0 + i * 30 * 10**9)).result()
        st.put_run(trun(f"{prefix}rec{i}", tid, "primary", "recorded", role="primary")).result()
        for b, role in (("bad", "shadow"), ("good", "shadow"), ("secondary", "secondary")):
            for mode in ("forced", "free"):
                st.put_run(trun(f"{prefix}{b}-{mode}-{i}", tid, b, mode, role=role)).result()
            flips = 6 if (b == "bad" and i % 5 == 0) else 0
            cand, ref = f"{prefix}{b}-forced-{i}", f"{prefix}rec{i}"
            st.put_comparison(cand, ref,
                              _forced(cand, ref, b, role, tid, 40, flips, "noise" if role == "secondary" else "runtime",
                                      tool_flips=2 if flips else 0, noise_floor=role == "secondary")).result()
            verdict = "value_mismatch" if (b == "bad" and i % 4 == 0) else "match"
            cand = f"{prefix}{b}-free-{i}"
            st.put_comparison(cand, ref, _free(cand, ref, b, role, tid, verdict)).result()
