"""Merge checked results bundles of many rigs into one typed model: a pure function (no I/O).

Every bundle has been accepted by :func:`tensorverse.bundle.check.check_bundle`, so its rows
are those of its corpus, once each, and its summaries follow from its tables. What the merge
adds is what holds *across* bundles:

* they are about the same thing: the same suite (name and version), the same corpus identity
  (hashes, model), the same reference setting, the same noise setting where they have one, and
  a setting means the same axis in every bundle (else :class:`MergeError` ``suite_mismatch``);
* a rig appears once (its id is the hash of its fingerprint and label: two bundles of one rig
  would count its turns twice; :class:`MergeError` ``duplicate_rig``);
* every bundle's position and free rows go into one table each with a ``rig`` column (pyarrow
  tables registered in an in-memory DuckDB); the per-(rig, setting) counts, the per-turn
  clusters the statistics use (:mod:`tensorverse.hypercube.stats`), the lanes (per rig,
  setting, case and turn: the margin and KL of every position, the flips with their top-k) and
  the recorded tokens are queries over them. The per-(rig, setting) counts are cross-checked
  against the bundle's own (checked) summaries.

A setting that one rig ran and another did not list at all is ``absent`` on the latter (a rig
may run a subset of a suite: ``tensorverse rig run --settings``); ``refused`` and ``failed``
keep the bundle's reason (untrusted text, kept as text).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from tensorverse.bundle.check import CheckedBundle

__all__ = ["MergeError", "SettingInfo", "RigInfo", "CellSummary", "Cell", "TurnCount", "FlipAt", "Lane", "Turn",
           "Hypercube", "merge_bundles", "hardware_of", "totals"]

ABSENT = "absent"  # a setting this rig's bundle does not list


class MergeError(ValueError):
    """Bundles that cannot be merged: ``reason`` is ``suite_mismatch`` or ``duplicate_rig``;
    ``path`` is the bundle that does not fit the ones before it."""

    def __init__(self, path: str, reason: str, detail: str) -> None:
        super().__init__(f"{path}: {reason}: {detail}")
        self.path = path
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class SettingInfo:
    name: str
    axis: str
    value: str


@dataclass(frozen=True)
class RigInfo:
    index: int
    id: str  # 16 hex digits (schema-checked)
    label: str  # free-form, untrusted
    hardware: str  # GPU models (or the CPU model) from the fingerprint, untrusted
    fingerprint: Mapping[str, Any]  # free-form, untrusted
    bundle: str  # the bundle's path as given
    created: str
    tensorverse_version: str | None


@dataclass(frozen=True)
class CellSummary:
    """A (rig, setting) that ran: the bundle's summary (:func:`tensorverse.bundle.summary.summarize_setting`)."""

    positions: int
    flips: int
    flip_rate: float | None
    turns: int
    turns_with_flip: int
    kl_mean: float | None
    kl_max: float | None
    flips_by_class: Mapping[str, int]
    free_turns: int
    free_diverged: int
    tool_call_breaks: int
    free_errors: int

    @classmethod
    def of(cls, s: Mapping[str, Any]) -> "CellSummary":
        return cls(positions=int(s["positions"]), flips=int(s["flips"]), flip_rate=s["flip_rate"],
                   turns=int(s["turns"]), turns_with_flip=int(s["turns_with_flip"]), kl_mean=s["kl_mean"],
                   kl_max=s["kl_max"], flips_by_class=dict(s["flips_by_class"]), free_turns=int(s["free_turns"]),
                   free_diverged=int(s["free_diverged"]), tool_call_breaks=int(s["tool_call_breaks"]),
                   free_errors=int(s["free_errors"]))


@dataclass(frozen=True)
class Cell:
    """One rig x setting: ``status`` ran / refused / failed / absent; ``summary`` when it ran."""

    rig: int
    setting: str
    status: str
    reason: str | None
    summary: CellSummary | None
    vllm_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class TurnCount:
    """One cluster of the statistics: a (rig, setting, case, turn)'s positions and flips."""

    rig: int
    setting: str
    case: str
    turn: int
    positions: int
    flips: int


@dataclass(frozen=True)
class FlipAt:
    position: int
    top1: int
    flip_class: str
    topk_ids: tuple[int, ...]
    topk_logits: tuple[float, ...]


@dataclass(frozen=True)
class Lane:
    """One rig + setting's forced run of one turn: per position (in order) the margin and the
    KL from the rig's reference setting; the flips with their top-k."""

    rig: int
    setting: str
    case: str
    turn: int
    margin: tuple[float, ...]
    kl: tuple[float, ...]
    flips: tuple[FlipAt, ...]


@dataclass(frozen=True)
class Turn:
    case: str
    turn: int
    tokens: tuple[int, ...]  # the corpus's recorded tokens (the same on every rig)


@dataclass(frozen=True)
class Hypercube:
    suite: Mapping[str, Any]
    corpus: Mapping[str, Any]
    reference: str
    noise: str | None
    settings: tuple[SettingInfo, ...]
    rigs: tuple[RigInfo, ...]
    cells: tuple[Cell, ...]
    turn_counts: tuple[TurnCount, ...]
    turns: tuple[Turn, ...]
    lanes: tuple[Lane, ...]
    _cell_index: dict[tuple[int, str], Cell] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._cell_index.update({(c.rig, c.setting): c for c in self.cells})

    def cell(self, rig: int, setting: str) -> Cell:
        return self._cell_index[(rig, setting)]

    def setting(self, name: str) -> SettingInfo:
        return next(s for s in self.settings if s.name == name)

    @property
    def cases(self) -> list[str]:
        return sorted({t.case for t in self.turns})

    @property
    def axes(self) -> dict[str, list[SettingInfo]]:
        """Settings grouped by axis, in the order the axes first appear."""
        out: dict[str, list[SettingInfo]] = {}
        for s in self.settings:
            out.setdefault(s.axis, []).append(s)
        return out

    def pooled(self, setting: str) -> tuple[int, int, int]:
        """(rigs that ran it, positions, flips) of ``setting`` over every rig."""
        ran = [c.summary for c in self.cells if c.setting == setting and c.summary is not None]
        return len(ran), sum(s.positions for s in ran), sum(s.flips for s in ran)


def hardware_of(fp: Any) -> str:
    """A short "what it ran on" from a free-form fingerprint: the GPUs (count x models) or the
    CPU model; "" when it says neither. Any shape is accepted (untrusted)."""
    if not isinstance(fp, Mapping):
        return ""
    g = fp.get("gpus")
    if isinstance(g, Mapping):
        models = g.get("models")
        names = [str(m) for m in models] if isinstance(models, list) else ([str(models)] if models else [])
        if names:
            n = g.get("count")
            head = f"{n}x " if isinstance(n, int) and not isinstance(n, bool) and n > 1 else ""
            return (head + ", ".join(names))[:200]
    cpu = fp.get("cpu")
    if isinstance(cpu, Mapping) and cpu.get("model"):
        return str(cpu["model"])[:200]
    return ""


def _arrow_rows(bundles: Sequence[CheckedBundle]):
    import pyarrow as pa

    from tensorverse.bundle.format import free_schema, positions_schema

    pos: list[Any] = []
    free: list[Any] = []
    for i, b in enumerate(bundles):
        for rows, schema, out in ((b.positions, positions_schema(), pos), (b.free, free_schema(), free)):
            t = pa.Table.from_pylist(rows, schema=schema)
            out.append(t.append_column("rig", pa.array([i] * t.num_rows, pa.int32())))
    return pa.concat_tables(pos), pa.concat_tables(free)


def _identity(b: CheckedBundle) -> dict[str, Any]:
    m = b.manifest
    return {"suite": m["suite"], "corpus": m["corpus"], "reference_setting": m["reference_setting"]}


def _check_compatible(bundles: Sequence[CheckedBundle]) -> tuple[str | None, list[SettingInfo]]:
    first = _identity(bundles[0])
    noise: str | None = None
    axes: dict[str, SettingInfo] = {}
    seen: dict[str, str] = {}
    for b in bundles:
        me = _identity(b)
        for k in ("suite", "corpus", "reference_setting"):
            if me[k] != first[k]:
                raise MergeError(b.path, "suite_mismatch", f"its {k} {me[k]!r} is not {bundles[0].path}'s {first[k]!r}")
        rid = b.rig["id"]
        if rid in seen:
            raise MergeError(b.path, "duplicate_rig", f"rig {rid} is already in {seen[rid]} (one bundle per rig)")
        seen[rid] = b.path
        n = b.manifest["noise_setting"]
        if n is not None:
            if noise is not None and n != noise:
                raise MergeError(b.path, "suite_mismatch", f"its noise setting {n!r} is not {noise!r}")
            noise = n
        for s in b.manifest["settings"]:
            have = axes.get(s["name"])
            if have is None:
                axes[s["name"]] = SettingInfo(s["name"], str(s["axis"]), str(s["value"]))
            elif have.axis != s["axis"]:
                raise MergeError(b.path, "suite_mismatch", f"setting {s['name']!r} is on axis {s['axis']!r}, "
                                                           f"not {have.axis!r} as before")
    return noise, list(axes.values())


def merge_bundles(bundles: Sequence[CheckedBundle]) -> Hypercube:
    """The merged model of checked bundles (at least one), in the given order of rigs."""
    import duckdb

    if not bundles:
        raise ValueError("no bundles to merge")
    noise, settings = _check_compatible(bundles)
    ref = bundles[0].manifest["reference_setting"]
    rigs = tuple(RigInfo(i, b.rig["id"], str(b.rig["label"]), hardware_of(b.rig["fingerprint"]),
                         b.rig["fingerprint"], b.path, str(b.manifest["created"]), b.manifest["tensorverse_version"])
                 for i, b in enumerate(bundles))
    positions, free = _arrow_rows(bundles)
    con = duckdb.connect(":memory:")
    try:
        con.register("positions", positions)
        con.register("free", free)
        counts = {(r, s): (n, k, t, tf) for r, s, n, k, t, tf in con.execute(
            'SELECT rig, setting, count(*), sum(flip::INTEGER), count(DISTINCT ("case", turn)), '
            'count(DISTINCT ("case", turn)) FILTER (WHERE flip) FROM positions GROUP BY rig, setting').fetchall()}
        free_counts = {(r, s): (n, d) for r, s, n, d in con.execute(
            "SELECT rig, setting, count(*), count(*) FILTER (WHERE status = 'ok' AND diverged) "
            "FROM free GROUP BY rig, setting").fetchall()}
        turn_counts = tuple(TurnCount(r, s, c, t, n, k) for r, s, c, t, n, k in con.execute(
            'SELECT rig, setting, "case", turn, count(*), sum(flip::INTEGER) FROM positions '
            'GROUP BY rig, setting, "case", turn ORDER BY rig, setting, "case", turn').fetchall())
        turns = tuple(Turn(c, t, tuple(toks)) for c, t, toks in con.execute(
            'SELECT "case", turn, list(token ORDER BY position) FROM positions WHERE rig = 0 AND setting = ? '
            'GROUP BY "case", turn ORDER BY "case", turn', [ref]).fetchall())
        flips: dict[tuple[int, str, str, int], list[FlipAt]] = {}
        for r, s, c, t, p, top1, cls, ids, logits in con.execute(
                'SELECT rig, setting, "case", turn, position, top1, flip_class, topk_ids, topk_logits '
                'FROM positions WHERE flip ORDER BY rig, setting, "case", turn, position').fetchall():
            flips.setdefault((r, s, c, t), []).append(FlipAt(p, top1, cls, tuple(ids), tuple(logits)))
        lanes = tuple(Lane(r, s, c, t, tuple(m), tuple(k), tuple(flips.get((r, s, c, t), ())))
                      for r, s, c, t, m, k in con.execute(
                          'SELECT rig, setting, "case", turn, list(margin ORDER BY position), '
                          'list(kl ORDER BY position) FROM positions GROUP BY rig, setting, "case", turn '
                          'ORDER BY rig, setting, "case", turn').fetchall())
    finally:
        con.close()
    cells = []
    for i, b in enumerate(bundles):
        listed = {s["name"]: s for s in b.manifest["settings"]}
        for st in settings:
            s = listed.get(st.name)
            if s is None:
                cells.append(Cell(i, st.name, ABSENT, "not in this rig's bundle", None))
                continue
            summary = None
            if s["status"] == "ran":
                summary = CellSummary.of(b.summaries[st.name])
                got = counts.get((i, st.name), (0, 0, 0, 0))
                fgot = free_counts.get((i, st.name), (0, 0))
                want = (summary.positions, summary.flips, summary.turns, summary.turns_with_flip)
                if got != want or fgot != (summary.free_turns, summary.free_diverged):
                    raise AssertionError(f"{b.path}: {st.name}: tables give {got}, {fgot}; summary {want}")
            cells.append(Cell(i, st.name, str(s["status"]), s["reason"], summary, tuple(map(str, s["vllm_args"]))))
    m = bundles[0].manifest
    return Hypercube(suite=dict(m["suite"]), corpus=dict(m["corpus"]), reference=ref, noise=noise,
                     settings=tuple(settings), rigs=rigs, cells=tuple(cells), turn_counts=turn_counts,
                     turns=turns, lanes=lanes)


def totals(cube: Hypercube) -> dict[str, dict[str, int]]:
    """Per setting, positions and flips pooled over the rigs (what the site's axes show)."""
    out: dict[str, dict[str, int]] = {}
    for s in cube.settings:
        rigs, n, k = cube.pooled(s.name)
        out[s.name] = {"rigs": rigs, "positions": n, "flips": k}
    return out

