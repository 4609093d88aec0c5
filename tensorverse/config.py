"""The Tensorverse configuration file (TOML, or YAML when PyYAML is installed).

One file configures the proxy, its admin listener, the store, recording, sessions, the capture
policy and the shadow backends. It is validated in full at start-up; every error names the key
it is about (``shadows[1].timeout_s: ...``), and unknown keys are errors (a typo never silently
turns a feature off). See ``docs/proxy.md`` for every option and ``examples/tensorverse.toml``.

    from tensorverse.config import load_config
    cfg = load_config("tensorverse.toml")
    cfg.primary.url, cfg.shadows[0].name, ...
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tensorverse.refusal import Refusal

__all__ = [
    "Config",
    "ConfigError",
    "ProxySection",
    "PrimarySection",
    "AdminSection",
    "StoreSection",
    "RecordingSection",
    "SessionsSection",
    "CaptureSection",
    "ShadowSection",
    "ShadowBackend",
    "VerdictSection",
    "RetentionSection",
    "load_config",
    "parse_config",
    "parse_listen",
]


# Headers that never reach the store, whatever the configuration says.
ALWAYS_REDACTED_HEADERS = (
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
    "x-api-key",
    "api-key",
)


class ConfigError(Refusal):
    """The configuration file is missing, unreadable or invalid; the message names each bad key.
    ``reason``: ``unreadable`` (the file cannot be read), ``syntax`` (not TOML or YAML),
    ``dependency`` (YAML without PyYAML), ``shape`` (its top level is not a table), ``invalid``
    (keys unknown, missing or of the wrong value: the message lists each)."""

    REASONS = ("unreadable", "syntax", "dependency", "shape", "invalid")


def parse_listen(value: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[::1]:8080"`` for IPv6, ``":8080"`` for all interfaces) -> (host, port)."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host, _, port_s = value.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"port of {value!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} out of range 0..65535")
    return host, port


def _check_url(value: str, *, strip_v1: bool) -> str:
    u = urlsplit(value)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"expected an http(s)://host[:port] URL, got {value!r}")
    if u.query or u.fragment:
        raise ValueError(f"URL must not have a query or fragment: {value!r}")
    path = u.path.rstrip("/")
    if strip_v1 and path.endswith("/v1"):
        path = path[: -len("/v1")]  # accept an OpenAI base URL; requests carry /v1 themselves
    return f"{u.scheme}://{u.netloc}{path}"


#: what a turn is shadowed in, and on which endpoints, unless configured
_MODES: tuple[Literal["forced", "free"], ...] = ("forced", "free")
_ENDPOINTS: tuple[Literal["chat.completions", "completions", "messages"], ...] = ("chat.completions", "completions")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class _Listener(_Section):
    listen: str

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        parse_listen(v)
        return v

    @property
    def host(self) -> str:
        return parse_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return parse_listen(self.listen)[1]


class ProxySection(_Listener):
    """The listener agents talk to, and how requests are relayed."""

    listen: str = "127.0.0.1:8080"
    max_body_bytes: int = Field(32 << 20, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0)
    # Longest silence between two chunks of an upstream response; 0 = no limit (long generations
    # and slow streams are never cut by the proxy).
    read_timeout_s: float = Field(0.0, ge=0)
    # Also relay ``/upstream/<path>`` to ``<path>`` (reach an upstream path explicitly).
    upstream_prefix: str = "/upstream"
    max_connections: int = Field(0, ge=0)  # to the primary; 0 = unlimited
    # Slow or too many clients (tensorverse.proxy.http): a request head must arrive whole within
    # head_timeout_s of its first byte, a request body may stall at most body_timeout_s (408, then
    # the connection closes; 0 = no deadline); past max_client_connections the longest-idle
    # connection is closed, or, all busy, the request gets 503 with x-should-retry (0 = no cap).
    head_timeout_s: float = Field(30.0, ge=0)
    body_timeout_s: float = Field(60.0, ge=0)
    max_client_connections: int = Field(10_000, ge=0)
    strip_tensorverse_headers: bool = True  # drop X-Tensorverse-* before forwarding

    @field_validator("upstream_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if v and (not v.startswith("/") or v.endswith("/") or v.startswith("/v1")):
            raise ValueError("must start with '/', not end with '/', and not shadow /v1 (or be empty)")
        return v


class PrimarySection(_Section):
    """The production vLLM server the agent really talks to."""

    url: str
    name: str = "primary"
    # The proxy's own credential for its probes of the primary (tokenizer fingerprint); agents'
    # requests carry their own Authorization, which is relayed and never stored.
    api_key: str | None = None
    api_key_env: str | None = None
    # Free-form settings stored with the backend record (dtype, attention backend, GPU...).
    settings: dict[str, Any] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_url(v, strip_v1=True)


    def resolved_api_key(self) -> str | None:
        return self.api_key or (os.environ.get(self.api_key_env) if self.api_key_env else None) or None


class AdminSection(_Listener):
    """Metrics, stats and the capture ingest endpoint: their own address, loopback by default."""

    listen: str = "127.0.0.1:9464"
    enabled: bool = True
    # Bearer token for POST /ingest. Prefer token_env (the name of an environment variable).
    token: str | None = None
    token_env: str | None = None
    max_ingest_bytes: int = Field(256 << 20, gt=0)
    # store the ingested frames in a worker process (tensorverse.proxy.ingest), off the relay's
    # GIL; false: in threads of the proxy
    ingest_process: bool = True

    def resolved_token(self) -> str | None:
        if self.token:
            return self.token
        if self.token_env:
            return os.environ.get(self.token_env) or None
        return None


class StoreSection(_Section):
    path: str = "./tensorverse-data"
    max_size_bytes: int | None = Field(None, gt=0)
    durable: bool = True


class RecordingSection(_Section):
    """What is recorded for each turn, and what the proxy adds to the primary request for it."""

    enabled: bool = True
    # Add ``return_token_ids: true`` to chat/completions requests (removed from the response
    # unless the client asked for it). Needed for exact prompt/output token ids.
    return_token_ids: bool = True
    # Top-k logprobs to request from the primary for each output token (0 = none). Must not exceed
    # the primary's --max-logprobs (vLLM default 20). Removed from the response (or trimmed to
    # what the client asked for).
    top_logprobs: int = Field(5, ge=0, le=20)
    # Headers stored with the request, lowercase names; Authorization/cookies are never stored.
    redact_headers: list[str] = Field(default_factory=list)
    # Longest request/response body text kept for an unparsed (non-JSON) body.
    max_unparsed_bytes: int = Field(64 << 10, ge=0)

    @field_validator("redact_headers")
    @classmethod
    def _lower(cls, v: list[str]) -> list[str]:
        return [h.lower() for h in v]

    def redacted(self) -> frozenset[str]:
        return frozenset(ALWAYS_REDACTED_HEADERS) | frozenset(self.redact_headers)


class SessionsSection(_Section):
    header: str = "X-Tensorverse-Session"
    tags_header: str = "X-Tensorverse-Tags"  # "k=v,k=v" merged over the configured tags
    tags: dict[str, str] = Field(default_factory=dict)
    idle_timeout_s: float = Field(3600.0, gt=0)  # forget prefix state of idle sessions
    max_tracked: int = Field(10_000, gt=0)  # prefix entries kept in memory (LRU)
    # request headers that carry a conversation id some clients send; the first present wins
    client_id_headers: list[str] = Field(default_factory=lambda: ["x-session-id", "session_id", "conversation_id"])


class CaptureSection(_Section):
    """Which turns are shadowed, on which backends, how."""

    enabled: bool = True
    only_with_tools: bool = False  # only requests that offer `tools`
    sample: float = Field(1.0, ge=0.0, le=1.0)  # fraction of eligible turns
    per_minute: int = Field(0, ge=0)  # budget of shadowed turns per minute; 0 = unlimited
    # once a shadow's verdict is decided, at most this many of its turns a minute; 0 = no change
    maintenance_per_minute: int = Field(0, ge=0)
    modes: list[Literal["forced", "free"]] = Field(default_factory=lambda: list(_MODES))
    # full: each backend as configured (every captured row in full where it has the capture plugin);
    # evidence: the plugin reduces rows where they are captured and sends in full only the evidence
    #   (flips, close calls, tool-call regions, the sample; [retention]'s topk, close_nats, sample,
    #   seed): ~1/1000 of the bytes per compact row (tensorverse.shadow.evidence);
    # topk: never ask for full rows (API top-k logprobs only, metrics approximate).
    logits: Literal["full", "evidence", "topk"] = "full"
    # Output positions that get full rows, for very long outputs: "all", "0-511" (ranges,
    # "64-" open-ended, "0-15,20"), "every:4", "every:4+1".
    positions: str = "all"
    backends: list[str] | None = None  # names; None = every shadow
    endpoints: list[Literal["chat.completions", "completions", "messages"]] = Field(
        default_factory=lambda: list(_ENDPOINTS)
    )

    @field_validator("positions")
    @classmethod
    def _positions(cls, v: str) -> str:
        from tensorverse.capture.optin import OptInError, Positions

        try:
            Positions.parse(v)
        except OptInError as e:
            raise ValueError(str(e).replace("tv_positions: ", "")) from None
        return v

    @field_validator("modes")
    @classmethod
    def _modes(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one of 'forced', 'free'")
        return list(dict.fromkeys(v))


class RetentionSection(_Section):
    """The store's budget (tensorverse.store.retention): sessions past ``max_age``, then the
    oldest until the live bytes fit ``max_bytes``, are deleted; pinned sessions never are."""

    max_age: str | None = None  # a duration: "30d", "12h"
    max_bytes: str | int | None = None  # a size: "80G", "512MiB", or bytes
    interval_s: float = Field(300.0, gt=0.0)  # the proxy compacts and prunes this often (off the relay's path)
    # Compaction (tensorverse.store.compaction): once a turn's comparisons are stored, rows that
    # are not evidence keep only their compact form (top `topk` logits, the log-sum-exp).
    compact: bool = True
    compact_after_s: float = Field(120.0, ge=0.0)  # a turn is compacted this long after it was recorded
    topk: int = Field(20, ge=1, le=4096)  # logits a compacted row keeps
    close_nats: float = Field(0.1, ge=0.0)  # rows whose top-2 logits are closer than this stay full...
    close_share: float = Field(0.02, ge=0.0, le=1.0)  # ...the closest first, at most this share of a run's positions
    top_kl: int = Field(1, ge=0)  # highest-KL positions of each forced comparison that stay full
    sample: float = Field(0.005, ge=0.0, le=1.0)  # share of positions kept full for re-analysis
    seed: int = 0  # of that sample
    delta: bool = True  # kept rows stored as deltas against their reference's row where smaller

    @field_validator("max_age")
    @classmethod
    def _age(cls, v: str | None) -> str | None:
        if v is not None:
            from tensorverse.store.retention import parse_duration

            parse_duration(v)
        return v

    @field_validator("max_bytes")
    @classmethod
    def _bytes(cls, v: str | int | None) -> str | int | None:
        if v is not None:
            from tensorverse.store.retention import parse_bytes

            if parse_bytes(v) <= 0:
                raise ValueError("must be positive")
        return v

    @property
    def enabled(self) -> bool:
        """A budget is set (pruning); compaction runs whenever ``compact`` is on."""
        return self.max_age is not None or self.max_bytes is not None

    def evidence_policy(self, *, even_if_off: bool = False):  # -> compaction.EvidencePolicy | None
        """The compaction policy; None when ``compact`` is off (unless ``even_if_off``: the
        ``store compact`` command, asked by hand, uses the section's other values)."""
        if not self.compact and not even_if_off:
            return None
        from tensorverse.store.compaction import EvidencePolicy

        return EvidencePolicy(topk=self.topk, close_nats=self.close_nats, close_share=self.close_share,
                              top_kl=self.top_kl, sample=self.sample,
                              seed=self.seed, delta=self.delta, after_s=self.compact_after_s)

    def max_age_seconds(self) -> float | None:
        from tensorverse.store.retention import parse_duration

        return parse_duration(self.max_age) if self.max_age is not None else None

    def max_bytes_value(self) -> int | None:
        from tensorverse.store.retention import parse_bytes

        return parse_bytes(self.max_bytes) if self.max_bytes is not None else None


class VerdictSection(_Section):
    """How a shadow's verdict is decided (docs/verdict.md): the confidence of every bound and the
    margins below which its excess over the noise floor counts as equivalent."""

    confidence: float = Field(0.95, ge=0.5, lt=1.0)
    tool_call_break_margin: float = Field(0.005, gt=0.0, lt=1.0)  # per tool-calling turn
    flip_margin: float = Field(0.001, gt=0.0, lt=1.0)  # per position: shown, not deciding
    refresh_s: float = Field(60.0, gt=0.0)  # the admin listener recomputes /verdict at most this often
    gpu_price_per_hour: float | None = Field(None, ge=0.0)  # the shadows' spend in money too

    def policy(self):  # -> tensorverse.analysis.verdict.VerdictPolicy
        from tensorverse.analysis.verdict import VerdictPolicy

        return VerdictPolicy(confidence=self.confidence, tool_call_break_margin=self.tool_call_break_margin,
                             flip_margin=self.flip_margin)


class ShadowSection(_Section):
    queue_size: int = Field(256, gt=0)  # turns waiting for shadows; full = dropped and counted
    workers: int = Field(4, gt=0)  # turns processed at once (each runs on its backends)
    # processes that compare shadowed turns and plan their compaction, off the relay's GIL
    # (tensorverse.shadow.analysis_workers); 0: in threads of the proxy
    analysis_workers: int = Field(1, ge=0)


class ShadowBackend(_Section):
    """One shadow vLLM server (another kernel, KV dtype, quantization, GPU, model...)."""

    name: str
    url: str
    model: str | None = None  # served model name; default: the request's model
    api_key: str | None = None  # the shadow's own credential (never the client's)
    api_key_env: str | None = None  # or: the environment variable that holds it
    headers: dict[str, str] = Field(default_factory=dict)  # extra headers for this backend
    # shadow: a candidate. secondary: the primary's exact config elsewhere (noise floor; at most
    # one). reference: the reference for full-logits comparisons when there is no secondary.
    role: Literal["shadow", "secondary", "reference"] = "shadow"
    # full: the server runs the capture plugin (full logits rows); topk: API logprobs only
    # (approximate metrics); auto: probe the server once.
    capture: Literal["full", "topk", "auto"] = "auto"
    logprobs: int = Field(20, ge=0)  # top-k logprobs asked of the API on a shadow run without capture
    # top-k logprobs asked of the API on a run whose rows the plugin captures: its rows carry its
    # distribution; the answer's top-k meets the primary's recorded top-k, whose k bounds that
    # comparison anyway. Default: [recording] top_logprobs (at least 1)
    captured_logprobs: int | None = Field(None, ge=0)
    concurrency: int = Field(2, gt=0)  # shadow requests in flight to this backend
    timeout_s: float = Field(120.0, gt=0)  # per turn on this backend (all its modes)
    gpus: int = Field(1, ge=1)  # GPUs its server occupies (TP x PP): its requests' time is charged times this
    gpu_seconds_per_day: float | None = Field(None, gt=0)  # at most this much GPU time in any 24 h
    modes: list[Literal["forced", "free"]] | None = None  # override capture.modes
    settings: dict[str, Any] = Field(default_factory=dict)  # free-form, stored with the backend

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or len(v) > 64 or not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError("1-64 characters of letters, digits, '-', '_', '.'")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_url(v, strip_v1=True)

    def resolved_api_key(self) -> str | None:
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            return os.environ.get(self.api_key_env) or None
        return None


class Config(_Section):
    proxy: ProxySection = Field(default_factory=ProxySection)
    primary: PrimarySection
    admin: AdminSection = Field(default_factory=AdminSection)
    store: StoreSection = Field(default_factory=StoreSection)
    recording: RecordingSection = Field(default_factory=RecordingSection)
    sessions: SessionsSection = Field(default_factory=SessionsSection)
    capture: CaptureSection = Field(default_factory=CaptureSection)
    shadow: ShadowSection = Field(default_factory=ShadowSection)
    verdict: VerdictSection = Field(default_factory=VerdictSection)
    retention: RetentionSection = Field(default_factory=RetentionSection)
    shadows: list[ShadowBackend] = Field(default_factory=list)

    @model_validator(mode="after")
    def _cross(self) -> "Config":
        names = [b.name for b in self.shadows]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"shadows: duplicate backend name(s) {dup}")
        if self.primary.name in names:
            raise ValueError(f"shadows: name {self.primary.name!r} is the primary's name")
        if self.capture.backends is not None:
            unknown = [n for n in self.capture.backends if n not in names]
            if unknown:
                raise ValueError(f"capture.backends: unknown backend(s) {unknown}; shadows are {names}")
        if sum(b.role == "secondary" for b in self.shadows) > 1:
            raise ValueError("shadows: at most one backend may be the secondary")
        if self.admin.enabled and self.admin.listen == self.proxy.listen and self.proxy.port != 0:
            raise ValueError("admin.listen: must differ from proxy.listen")
        return self

    def selected_backends(self) -> list[ShadowBackend]:
        if self.capture.backends is None:
            return list(self.shadows)
        return [b for b in self.shadows if b.name in self.capture.backends]


def format_validation_errors(err: ValidationError, source: str, what: str = "configuration") -> str:
    """One line per bad key (``shadows[1].url: required key is missing``), for every file format
    validated with pydantic (the proxy's configuration, the matrix spec)."""
    lines = []
    for e in err.errors():
        loc = ""
        for part in e["loc"]:
            loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if e["type"] not in ("extra_forbidden", "missing", "value_error") and "input" in e and not isinstance(e["input"], (dict, list)):
            msg += f" (got {e['input']!r})"
        lines.append(f"  {loc or '(top level)'}: {msg}")
    return f"invalid {what}{' ' + source if source else ''}:\n" + "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "") -> Config:
    """Validate an already-parsed mapping; raises ConfigError naming every bad key."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_errors(e, source), "invalid") from None


def load_config(path: str | os.PathLike) -> Config:
    """Read and validate a TOML (``.toml``) or YAML (``.yaml``/``.yml``) config file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read configuration {p}: {e.strerror or e}", "unreadable") from None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{p}: YAML configuration needs PyYAML (pip install pyyaml), or use TOML",
                              "dependency") from None
        try:
            data = yaml.safe_load(raw) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}", "syntax") from None
    else:
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid TOML: {e}", "syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a table/mapping", "shape")
    return parse_config(data, f"({p})")
