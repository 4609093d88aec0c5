"""The matrix spec (``matrix.toml``): a model, base vLLM options and environment, and the settings
to vary, as a full grid (``[axes]``) and/or named points (``[[points]]``).

A *setting* is either a server option (a key starting with ``--``: ``--dtype``,
``--enable-prefix-caching``, ...) or an environment variable (any other key: ``VLLM_BATCH_INVARIANT``,
``NCCL_ALGO``, ...). Option values: a string or number is passed as ``--key value``; ``true`` as
``--key``; ``false`` as ``--no-key`` (vLLM's boolean options all accept the ``--no-`` form); a list
as ``--key a b``. Environment values are strings (numbers and booleans are converted; ``""``
removes the variable).

One setting is Tensorverse's own, not the server's: ``concurrency`` (an axis or a point setting,
an integer >= 1) runs each of the point's forced runs inside a batch of that many requests
(the forced request plus ``concurrency - 1`` free-running fillers of the same prompt, cases one
at a time), so batch composition is an axis like any vLLM setting. It never reaches the server
(:func:`server_settings`); it is part of the point's effective settings and cache key.

Validated in full on load; every error names its key (``axes.--dtype: ...``) and unknown keys are
errors, like :mod:`tensorverse.config`. The effective settings of a point are the base settings
overridden by the point's own; two points with the same effective settings are one server
configuration (one cached run), whatever their names.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import tomllib
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tensorverse.config import format_validation_errors
from tensorverse.refusal import Refusal
from tensorverse.matrix.launcher import PP, TP, parallel_ranks

__all__ = ["MatrixSpec", "Point", "SpecError", "load_spec", "parse_spec", "settings_key",
           "point_label", "is_option", "render_value", "is_run_setting", "server_settings",
           "CONCURRENCY"]

Value = str | int | float | bool | list[str | int | float]
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OPTION = re.compile(r"^--[a-z0-9][a-z0-9-]*$")
_POINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=,+-]{0,127}$")
# Set by the launcher itself: a spec that sets them would break capture or readiness.
_RESERVED = ("--model", "--host", "--port", "--served-model-name", "TENSORVERSE_CAPTURE_SINK")


#: Tensorverse's own settings (how a point is run, not how its server is started)
CONCURRENCY = "concurrency"
RUN_SETTINGS = (CONCURRENCY,)


class SpecError(Refusal):
    """The spec is missing, unreadable or invalid; the message names each bad key. ``reason``:
    ``unreadable`` (the file cannot be read), ``syntax`` (not TOML), ``invalid`` (keys unknown,
    missing or of the wrong value: the message lists each), ``unknown_point`` (a point asked for
    by a name the spec does not define)."""

    REASONS = ("unreadable", "syntax", "invalid", "unknown_point")


def is_option(key: str) -> bool:
    """Server option (``--x``) or environment variable."""
    return key.startswith("--")


def is_run_setting(key: str) -> bool:
    """A setting of Tensorverse's run (``concurrency``), never passed to the server."""
    return key in RUN_SETTINGS


def server_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that start the server: ``settings`` without Tensorverse's own."""
    return {k: v for k, v in settings.items() if not is_run_setting(k)}


def _check_run_value(key: str, v: Any) -> None:
    if key == CONCURRENCY and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{key}: the batch size each forced run is run in, an integer >= 1, got {v!r}")
    if key in (TP, PP):
        parallel_ranks({key: v})  # a whole number of ranks, or ValueError naming the option


def _check_setting_key(key: str) -> str:
    if is_run_setting(key):
        return key
    if key in _RESERVED:
        raise ValueError(f"{key!r} is set by tensorverse matrix itself")
    if is_option(key):
        if not _OPTION.match(key):
            raise ValueError(f"{key!r} is not a vLLM option name (--lower-case-with-dashes)")
    elif not _ENV_NAME.match(key):
        raise ValueError(f"{key!r} is neither an option (--name) nor an environment variable name")
    return key


def _check_settings(d: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        _check_setting_key(k)
        _check_run_value(k, v)
        if not is_option(k) and isinstance(v, list):
            raise ValueError(f"{k}: an environment variable takes one value, not a list")
        out[k] = v
    return out


def render_value(v: Any) -> str:
    """A setting value as it appears in a point's label (``None``: not set, vLLM's default)."""
    if v is None:
        return "(default)"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "+".join(str(x) for x in v)
    return str(v)


def point_label(settings: Mapping[str, Any]) -> str:
    """A grid point's name from its axis values: ``dtype=float32,VLLM_BATCH_INVARIANT=1``."""
    if not settings:
        return "base"
    return ",".join(f"{k.lstrip('-')}={render_value(v)}" for k, v in settings.items())


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    path: str = Field(description="--model: a local directory or a model id the server can load")
    served_name: str | None = None


class ServerSection(_Section):
    options: dict[str, Value] = Field(default_factory=dict)
    env: dict[str, str | int | float | bool] = Field(default_factory=dict)
    python: str | None = None
    ready_timeout_s: float = Field(default=900.0, gt=0)
    stop_grace_s: float = Field(default=10.0, ge=0)

    @field_validator("options")
    @classmethod
    def _options(cls, v: dict[str, Any]) -> dict[str, Any]:
        for k in v:
            if not is_option(k):
                raise ValueError(f"{k!r}: server options start with -- (environment goes in server.env)")
            _check_setting_key(k)
        return _check_settings(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, Any]) -> dict[str, Any]:
        for k in v:
            if is_option(k):
                raise ValueError(f"{k!r}: options go in server.options")
            if is_run_setting(k):
                raise ValueError(f"{k!r} is how a point is run, not the server's environment: "
                                 "put it in [axes] or a point's settings")
        return _check_settings(v)


class ReplaySection(_Section):
    modes: list[str] = Field(default_factory=lambda: ["forced", "free"])
    concurrency: int = Field(default=4, ge=1)
    timeout_s: float = Field(default=300.0, gt=0)
    retries: int = Field(default=2, ge=0)
    rows_timeout_s: float = Field(default=60.0, gt=0)
    cases: list[str] | None = None

    @field_validator("modes")
    @classmethod
    def _modes(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in ("forced", "free")]
        if bad or not v:
            raise ValueError(f"modes must be a non-empty subset of ['forced', 'free'], got {v}")
        if "forced" not in v:
            raise ValueError("the matrix compares forced runs: modes must include 'forced'")
        return v


class MatrixSection(_Section):
    reference: str | None = Field(default=None, description="the reference point's name (default: the first)")
    parallel: int = Field(default=1, ge=1, description="servers at once (1: one GPU holds one model)")


class PointSection(_Section):
    name: str
    settings: dict[str, Value] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _POINT_NAME.match(v):
            raise ValueError(f"{v!r}: point names are letters, digits and . _ = , + - (up to 128)")
        return v

    @field_validator("settings")
    @classmethod
    def _settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_settings(v)


class Point(BaseModel):
    """One server configuration: its name and the settings that differ from the base."""

    model_config = ConfigDict(frozen=True)
    name: str
    settings: dict[str, Any]


class MatrixSpec(_Section):
    model: ModelSection
    server: ServerSection = Field(default_factory=ServerSection)
    replay: ReplaySection = Field(default_factory=ReplaySection)
    matrix: MatrixSection = Field(default_factory=MatrixSection)
    axes: dict[str, list[Value]] = Field(default_factory=dict)
    points: list[PointSection] = Field(default_factory=list)

    @field_validator("axes")
    @classmethod
    def _axes(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for k, values in v.items():
            _check_setting_key(k)
            if not values:
                raise ValueError(f"{k}: an axis needs at least one value")
            if len({json.dumps(x) for x in values}) != len(values):
                raise ValueError(f"{k}: repeated values {values}")
            if not is_option(k) and any(isinstance(x, list) for x in values):
                raise ValueError(f"{k}: an environment variable takes one value, not a list")
            for x in values:
                _check_run_value(k, x)
        return v

    @model_validator(mode="after")
    def _cross(self) -> "MatrixSpec":
        if not self.axes and not self.points:
            raise ValueError("axes: give [axes] (a full grid) or [[points]] (named points), or both")
        names = [p.name for p in self.all_points()]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"points: names repeat: {dup}")
        if self.matrix.reference is not None and self.matrix.reference not in names:
            raise ValueError(f"matrix.reference: {self.matrix.reference!r} is not a point ({names})")
        return self

    # -- points ----------------------------------------------------------------------------
    def grid_points(self) -> list[Point]:
        """The full grid over ``[axes]`` (first axis slowest), named by their values."""
        if not self.axes:
            return []
        keys = list(self.axes)
        out = []
        for combo in itertools.product(*(self.axes[k] for k in keys)):
            s = dict(zip(keys, combo))
            out.append(Point(name=point_label(s), settings=s))
        return out

    def all_points(self) -> list[Point]:
        return self.grid_points() + [Point(name=p.name, settings=dict(p.settings)) for p in self.points]

    def point(self, name: str) -> Point:
        for p in self.all_points():
            if p.name == name:
                return p
        raise SpecError(f"no point named {name!r} (points: {[p.name for p in self.all_points()]})", "unknown_point")

    @property
    def reference(self) -> str:
        return self.matrix.reference or self.all_points()[0].name

    @property
    def served_name(self) -> str:
        return self.model.served_name or Path(self.model.path).name

    def effective(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """Base options and environment overridden by ``settings`` (options first, sorted)."""
        merged: dict[str, Any] = {**self.server.options, **self.server.env}
        for k, v in settings.items():  # None (internal, bisection): the setting is absent
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
        return dict(sorted(merged.items(), key=lambda kv: (not is_option(kv[0]), kv[0])))

    def axis_values(self) -> dict[str, list[Any]]:
        """Every setting that varies across the points, with its values (base value first)."""
        pts = self.all_points()
        keys: list[str] = []
        for p in pts:
            keys += [k for k in p.settings if k not in keys]
        out = {}
        for k in keys:
            vals: list[Any] = []
            for p in pts:
                v = self.effective(p.settings).get(k)
                if json.dumps(v) not in [json.dumps(x) for x in vals]:
                    vals.append(v)
            out[k] = vals
        return out


def settings_key(spec: MatrixSpec, settings: Mapping[str, Any], corpus_sha: str | None) -> str:
    """The cache key of one server configuration replaying one corpus: the same key means the
    same captured run, so a resumed matrix and a bisection reuse it."""
    body = {"model": spec.model.path, "served": spec.served_name,
            "settings": spec.effective(settings), "corpus": corpus_sha,
            "modes": list(spec.replay.modes), "python": spec.server.python}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def parse_spec(data: Mapping[str, Any], source: str = "") -> MatrixSpec:
    """Validate an already-parsed mapping; raises :class:`SpecError` naming every bad key."""
    try:
        return MatrixSpec.model_validate(dict(data))
    except ValidationError as e:
        raise SpecError(format_validation_errors(e, source, "matrix spec"), "invalid") from None


def load_spec(path: str | Path) -> MatrixSpec:
    """Read and validate a TOML matrix spec."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise SpecError(f"cannot read matrix spec {p}: {e.strerror or e}", "unreadable") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{p}: not valid TOML: {e}", "syntax") from None
    return parse_spec(data, str(p))
