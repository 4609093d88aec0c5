"""Assemble a bundle from a run's rows: the manifest's fields, the summaries (computed here from
the same rows the checker will recompute them from), the hashes (:func:`~tensorverse.bundle.io.write_bundle`).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from tensorverse.bundle.format import FORMAT, FORMAT_VERSION
from tensorverse.bundle.known import KnownCorpus

__all__ = ["SettingOutcome", "make_bundle", "rig_id"]


@dataclass(frozen=True)
class SettingOutcome:
    """One setting of the suite on this rig: what was asked and what happened."""

    name: str
    axis: str
    value: str
    status: str  # ran | refused | failed
    reason: str | None = None
    vllm_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "axis": self.axis, "value": self.value, "status": self.status,
                "reason": self.reason, "vllm_args": list(self.vllm_args), "env": dict(self.env)}


def rig_id(fingerprint: Mapping[str, Any], label: str = "") -> str:
    """16 hex digits naming a rig by its fingerprint and label (the same machine and stack under
    the same label: the same id; two profiles of one machine under two labels: two rigs)."""
    return hashlib.sha256(json.dumps([fingerprint, label], sort_keys=True, default=str).encode()).hexdigest()[:16]


def make_bundle(path: str | Path, *, suite: Mapping[str, Any], corpus: KnownCorpus, rig_label: str,
                fingerprint: Mapping[str, Any], settings: Sequence[SettingOutcome], reference: str,
                noise: str | None, positions: Sequence[Mapping[str, Any]], free: Sequence[Mapping[str, Any]],
                provenance: Mapping[str, Any], created: str | None = None) -> Path:
    from tensorverse import __version__
    from tensorverse.bundle.io import write_bundle
    from tensorverse.bundle.summary import summarize

    ran = [s.name for s in settings if s.status == "ran"]
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tensorverse_version": __version__,
        "created": created or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "suite": {"name": suite["name"], "version": int(suite["version"])},
        "corpus": corpus.identity(),
        "rig": {"id": rig_id(fingerprint, rig_label), "label": rig_label, "fingerprint": dict(fingerprint)},
        "reference_setting": reference, "noise_setting": noise,
        "settings": [s.as_dict() for s in settings],
    }
    summaries = summarize(positions, free, ran)
    return write_bundle(path, manifest, positions, free, summaries, provenance)
