"""A backend: one OpenAI-compatible (vLLM) endpoint the shadow runner talks to.

Roles (README.md's vocabulary; the noise floor is `tensorverse.analysis.noise`):

``primary``    the production endpoint the agent talks to; never run by the shadow runner, only
               fingerprinted (its recorded turns are the reference tokens).
``shadow``     a candidate: another kernel, dtype, quantization, GPU, model with the same tokenizer.
``secondary``  the primary's exact config on another server: its divergence is the noise floor,
               and it is the reference for candidates' full-logits comparisons.
``reference``  a designated reference for full-logits comparisons when there is no secondary.

``capture``: ``full`` (the server runs the Tensorverse plugin with a sink: full rows land in the
store), ``topk`` (never ask for capture: top-k logprobs from the API only, metrics approximate),
``auto`` (probe the server once, see :func:`tensorverse.shadow.doctor.probe_capabilities`).

``api_key`` is the backend's own credential, configured for the shadow; the client's
``Authorization`` is never forwarded. It is never stored (:meth:`Backend.info`) nor printed
(``repr`` hides it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from tensorverse.store.records import BackendInfo

__all__ = ["Backend", "ROLES", "CAPTURE_MODES"]

ROLES = ("primary", "shadow", "secondary", "reference")
CAPTURE_MODES = ("full", "topk", "auto")


@dataclass
class Backend:
    name: str
    url: str
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    role: str = "shadow"
    timeout_s: float = 120.0
    capture: str = "auto"
    concurrency: int = 4
    #: top-k logprobs asked of the API on a run whose rows are not captured (approximate metrics).
    logprobs: int = 20
    #: top-k logprobs asked of the API on a run whose rows the capture plugin sends: its rows
    #: carry its distribution; the answer's top-k serves the comparison with a reference that has
    #: top-k only (the primary's recorded answer, whose k bounds that comparison anyway). The
    #: proxy asks for ``[recording] top_logprobs`` (its CPU is what the relay shares); replay and
    #: the matrix, offline, for as many as ``logprobs``.
    captured_logprobs: int = 20
    #: extra HTTP headers sent to this backend (its own, never the client's).
    headers: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "\x00" in self.name:
            raise ValueError(f"backend name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend {self.name!r}: url must start with http:// or https://, "
                             f"got {self.url!r}")
        if self.role not in ROLES:
            raise ValueError(f"backend {self.name!r}: role must be one of {ROLES}, got {self.role!r}")
        if self.capture not in CAPTURE_MODES:
            raise ValueError(f"backend {self.name!r}: capture must be one of {CAPTURE_MODES}, "
                             f"got {self.capture!r}")
        if not self.timeout_s or self.timeout_s <= 0:
            raise ValueError(f"backend {self.name!r}: timeout_s must be > 0")
        if int(self.concurrency) < 1:
            raise ValueError(f"backend {self.name!r}: concurrency must be >= 1")
        self.concurrency = int(self.concurrency)
        self.logprobs = max(0, int(self.logprobs))
        self.captured_logprobs = max(0, int(self.captured_logprobs))

    # -- addresses ------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """The server root (``http://host:port``): vLLM's ``/tokenize``, ``/version`` live here."""
        u = self.url.rstrip("/")
        return u[: -len("/v1")] if u.endswith("/v1") else u

    @property
    def api_url(self) -> str:
        """The OpenAI base (``http://host:port/v1``)."""
        return self.base_url + "/v1"

    def http_headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", **self.headers}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    # -- records --------------------------------------------------------------------------
    def info(self) -> BackendInfo:
        """What the store keeps about this backend: never the key, never the headers' values."""
        return BackendInfo(name=self.name, url=self.url, model=self.model, role=self.role,
                           timeout_s=self.timeout_s, capture=self.capture, concurrency=self.concurrency,
                           logprobs=self.logprobs, captured_logprobs=self.captured_logprobs,
                           has_api_key=bool(self.api_key))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Backend":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"backend {d.get('name')!r}: unknown keys {sorted(unknown)}")
        return cls(**dict(d))
