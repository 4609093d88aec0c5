"""Tensorverse's Prometheus metrics: definitions, updates, and the collector behind ``/metrics``.

Two kinds of series (``docs/metrics.md`` lists every one, with its labels):

* **Divergence and shadow metrics**, held by :class:`Metrics` and updated when something happens:
  each comparison the shadow tee stores (:meth:`Metrics.observe_comparisons`: compared tokens,
  flips by region, tool-call verdicts, KL and first-flip histograms, noise-floor verdicts), each
  shadow run (:meth:`Metrics.observe_runs`) and each agent request through the proxy
  (:class:`RequestMetrics`, an addon: outcome and the latency the proxy added). Histograms are
  bulk-updated with numpy (one ``searchsorted`` per comparison, not one call per token), so a
  compared token costs well under a microsecond (``benchmarks/metrics.py``).
* **Plain counters of the proxy** (its core, recorder, sessions, tee queue, capture ingest) and
  **store gauges** (size, filesystem free space), read at scrape time: nothing to update per
  request.

Names follow Prometheus practice: prefix ``tensorverse_``, base units (seconds, bytes; KL in
nats), ``_total`` for counters, and bounded labels only: ``backend`` (configured names), ``role``
(``primary``/``shadow``/``secondary``/``reference``), ``mode`` (``forced``/``free``),
``ref_role`` (the role the comparison's reference had), ``region``, ``verdict``, ``reason``,
``outcome``, ``endpoint``. Never a session id, turn id or prompt.

Every label combination that the configuration implies is created at 0 when :class:`Metrics` is
built (:meth:`Metrics.from_config`), so ``rate()`` and alerts see a series from the first scrape,
not from the first event. A :class:`Metrics` is per process (no global registry): a proxy
builds its own and the admin listener serves it.
"""

from __future__ import annotations

import bisect
import math
import shutil
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from tensorverse.analysis.regions import UNKNOWN, region_at
from tensorverse.store.records import Comparison, ForcedComparison, FreeComparison, Run

__all__ = [
    "Metrics",
    "MetricsCollector",
    "METRICS",
    "MetricSpec",
    "exported_names",
    "REGIONS",
    "VERDICTS",
    "MODES",
    "REF_ROLES",
    "KL_BUCKETS",
    "FIRST_FLIP_BUCKETS",
    "LATENCY_BUCKETS",
    "RUN_DURATION_BUCKETS",
]

# --------------------------------------------------------------------------- label values

MODES: tuple[str, ...] = ("forced", "free")
REF_ROLES: tuple[str, ...] = ("primary", "secondary", "reference")


def _regions() -> tuple[str, ...]:
    from tensorverse.analysis.regions import REGIONS

    return (*REGIONS, UNKNOWN)


def _verdicts() -> tuple[str, ...]:
    from tensorverse.analysis.toolcalls import SEVERITY

    # "none": neither branch made a tool call (kept apart so the mismatch rate is over tool calls)
    return (*SEVERITY, "none")


def _classes() -> tuple[str, ...]:
    from tensorverse.analysis.attribution import FLIP_CLASSES

    # "unclassified": a comparison stored before flips had classes (issue 19)
    return (*FLIP_CLASSES, UNCLASSIFIED)


UNCLASSIFIED = "unclassified"
REGIONS: tuple[str, ...] = _regions()
VERDICTS: tuple[str, ...] = _verdicts()
FLIP_CLASSES: tuple[str, ...] = _classes()
PARSER_OUTCOMES: tuple[str, ...] = ("match", "mismatch")
REQUEST_OUTCOMES: tuple[str, ...] = ("ok", "upstream_error", "error", "aborted")
RUN_OUTCOMES: tuple[str, ...] = ("ok", "failed", "timeout", "refused")
TEE_OUTCOMES: tuple[str, ...] = ("ok", "failed", "timed_out", "gpu_budget", "maintenance")
COMPARISON_OUTCOMES: tuple[str, ...] = ("ok", "error")
NOISE_VERDICTS: tuple[str, ...] = ("regression", "within_noise")
SKIP_REASONS: tuple[str, ...] = ("disabled", "not_ok", "endpoint", "no_tools", "no_token_ids",
                                 "sampled_out", "over_budget")
CAPTURE_BATCH_OUTCOMES: tuple[str, ...] = ("ok", "rejected", "unauthorized", "store_full", "store_error")
ROWS_DROPPED_REASONS: tuple[str, ...] = ("store_full", "store_error")
PLUGIN_DROP_REASONS: tuple[str, ...] = ("no_buffer", "sink", "encode")
ENDPOINTS: tuple[str, ...] = ("chat.completions", "completions", "messages")

# --------------------------------------------------------------------------- buckets

#: KL(P||Q) per position, nats: 1e-6 .. 10, two steps per decade.
KL_BUCKETS: tuple[float, ...] = (1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1,
                                 0.3, 1.0, 3.0, 10.0)
#: first flip position (0-based output token index): powers of two.
FIRST_FLIP_BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: latency the proxy adds to an agent request, seconds: 50 µs .. 1 s.
LATENCY_BUCKETS: tuple[float, ...] = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
                                      0.1, 0.25, 0.5, 1.0)
#: one shadow run (request + waiting for its rows), seconds.
RUN_DURATION_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


# --------------------------------------------------------------------------- the definitions


class MetricSpec:
    """One metric family: its name (counters without ``_total``), type, help and label names."""

    __slots__ = ("name", "type", "help", "labels", "buckets")

    def __init__(self, name: str, type: str, help: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] | None = None) -> None:
        self.name = name
        self.type = type
        self.help = help
        self.labels = tuple(labels)
        self.buckets = tuple(buckets) if buckets is not None else None

    def sample_names(self) -> tuple[str, ...]:
        """The names of the samples this family exposes."""
        if self.type == "counter":
            return (self.name + "_total",)
        if self.type == "histogram":
            return (self.name + "_bucket", self.name + "_sum", self.name + "_count")
        return (self.name,)

    def __repr__(self) -> str:
        return f"MetricSpec({self.name!r}, {self.type!r}, labels={self.labels})"


_B, _R, _M, _RR = "backend", "role", "mode", "ref_role"

#: Every family Tensorverse exports (the admin listener's ``/metrics``).
METRICS: tuple[MetricSpec, ...] = (
    # -- the agent's requests (RequestMetrics) ---------------------------------------------------
    MetricSpec("tensorverse_requests", "counter",
               "LLM requests relayed to the primary, by outcome (ok, upstream_error = 4xx/5xx "
               "relayed, error = upstream unreachable or cut, aborted = client went away)",
               (_B, _R, "outcome")),
    MetricSpec("tensorverse_proxy_added_latency_seconds", "histogram",
               "time the proxy spent on a request outside waiting for the primary (before "
               "sending it upstream, and after the upstream's last byte)", ("endpoint",), LATENCY_BUCKETS),
    # -- comparisons (observe_comparisons) -------------------------------------------------------
    MetricSpec("tensorverse_comparisons", "counter",
               "comparisons stored (candidate run vs reference run), by outcome", (_B, _R, _M, _RR, "outcome")),
    MetricSpec("tensorverse_compared_tokens", "counter",
               "output positions compared: forced = aligned positions, free = positions generated "
               "in lockstep up to and including the first divergence", (_B, _R, _M, _RR)),
    MetricSpec("tensorverse_flips", "counter",
               "token flips: forced = positions whose argmax differs; free = first divergences, or "
               "differing tool calls on identical tokens (at most one per comparison); class = why "
               "it flipped (tie, near_tie, noise, parser, runtime; docs/attribution.md)",
               (_B, _R, _M, _RR, "region", "class")),
    # the moments of a turn-clustered interval (analysis/intervals.ClusterMoments): with the
    # comparisons (turns) and the sums above, what the recording rules need for the flip-rate
    # alerts' intervals with the turn as the unit (docs/metrics.md, "The flip-rate intervals")
    MetricSpec("tensorverse_compared_tokens_squared", "counter",
               "sum over ok comparisons of (compared positions)^2", (_B, _R, _M, _RR)),
    MetricSpec("tensorverse_flips_squared", "counter",
               "sum over ok comparisons of (flips of the class)^2", (_B, _R, _M, _RR, "class")),
    MetricSpec("tensorverse_flips_times_tokens", "counter",
               "sum over ok comparisons of flips of the class times compared positions",
               (_B, _R, _M, _RR, "class")),
    MetricSpec("tensorverse_parser_checks", "counter",
               "primary turns whose output ids were re-parsed for tool calls and compared with the "
               "tool calls the primary emitted, by outcome (match, mismatch)", (_B, "outcome")),
    MetricSpec("tensorverse_parser_mismatch", "counter",
               "primary turns whose emitted tool calls differ from what their own output ids parse to "
               "(a tool-parser bug, not a numeric flip)", (_B,)),
    MetricSpec("tensorverse_tool_call_verdicts", "counter",
               "tool-call verdicts of free runs against the primary's answer (none = neither "
               "branch called a tool)", (_B, _R, "verdict")),
    MetricSpec("tensorverse_kl_divergence_nats", "histogram",
               "KL(P||Q) per compared position, nats (forced mode; top-k comparisons give a lower bound)",
               (_B, _R, _RR), KL_BUCKETS),
    MetricSpec("tensorverse_first_flip_position", "histogram",
               "output position (0-based) of the first flip of comparisons that flipped",
               (_B, _R, _M, _RR), FIRST_FLIP_BUCKETS),
    MetricSpec("tensorverse_noise_verdicts", "counter",
               "candidate flip rate against the secondary's (noise floor) per turn: regression or "
               "within_noise", (_B, _R, "verdict")),
    MetricSpec("tensorverse_template_mismatches", "counter",
               "comparisons whose runs saw a chat-template mismatch (never counted as flips)", (_B, _R)),
    # -- shadow runs -----------------------------------------------------------------------------
    MetricSpec("tensorverse_shadow_runs", "counter",
               "shadow runs (requests to a shadow backend) by mode and outcome", (_B, _R, _M, "outcome")),
    MetricSpec("tensorverse_shadow_run_duration_seconds", "histogram",
               "duration of a shadow run, request and waiting for its captured rows", (_B, _M),
               RUN_DURATION_BUCKETS),
    MetricSpec("tensorverse_shadow_turns", "counter",
               "turns processed per shadow backend by outcome (timed_out = the backend's "
               "timeout_s cut it; gpu_budget, maintenance: not started)", (_B, _R, "outcome")),
    MetricSpec("tensorverse_shadow_gpu_seconds", "counter",
               "GPU-seconds charged to a shadow: its runs' request time times its gpus", (_B,)),
    MetricSpec("tensorverse_shadow_gpu_budget_left_seconds", "gauge",
               "what is left of a shadow's gpu_seconds_per_day in the last 24 hours", (_B,)),
    MetricSpec("tensorverse_shadow_queued", "counter", "turns put on the shadow queue"),
    MetricSpec("tensorverse_shadow_dropped", "counter",
               "turns dropped because the shadow queue was full"),
    MetricSpec("tensorverse_shadow_skipped", "counter",
               "turns not shadowed, by the capture policy's reason", ("reason",)),
    MetricSpec("tensorverse_shadow_queue_depth", "gauge", "turns waiting on the shadow queue"),
    MetricSpec("tensorverse_shadow_queue_capacity", "gauge", "size of the shadow queue"),
    MetricSpec("tensorverse_shadow_busy_seconds", "counter",
               "worker-seconds the shadow tee spent on turns (its rate over tensorverse_shadow_workers "
               "is the pipeline's load; one minus it, its headroom)"),
    MetricSpec("tensorverse_shadow_workers", "gauge", "shadow tee workers (turns processed at once)"),
    # -- capture ---------------------------------------------------------------------------------
    MetricSpec("tensorverse_capture_rows", "counter", "logits rows received on /ingest and stored"),
    MetricSpec("tensorverse_capture_compact_rows", "counter",
               "of those, rows that arrived as their compact form (evidence chosen at the source)"),
    MetricSpec("tensorverse_capture_bytes", "counter", "bytes of frames received on /ingest"),
    MetricSpec("tensorverse_capture_duplicate_rows", "counter",
               "rows received again (a retried batch) and skipped"),
    MetricSpec("tensorverse_capture_batches", "counter", "ingest batches by outcome", ("outcome",)),
    MetricSpec("tensorverse_capture_rows_dropped", "counter",
               "rows received but not stored, by reason", ("reason",)),
    MetricSpec("tensorverse_capture_ingest_in_process", "counter",
               "ingest batches stored in a thread of the proxy because the ingest worker died holding them (none lost)"),
    MetricSpec("tensorverse_capture_ingest_worker_restarts", "counter",
               "times the ingest worker was started again after one died"),
    MetricSpec("tensorverse_capture_plugin_rows_captured", "counter",
               "rows the capture plugins copied (as last reported by each capturing process)"),
    MetricSpec("tensorverse_capture_plugin_rows_dropped", "counter",
               "rows the capture plugins dropped before sending (no free buffer, sink failure, "
               "encoding error), as last reported by each capturing process", ("reason",)),
    MetricSpec("tensorverse_capture_plugin_rows_on_device", "counter",
               "rows the capture plugins reduced on the engine's device (TENSORVERSE_CAPTURE_REDUCE=device), "
               "as last reported by each capturing process"),
    MetricSpec("tensorverse_capture_plugin_device_overflow", "counter",
               "rows the capture plugins sent by the host path because their device row budget was full "
               "(none lost), as last reported by each capturing process"),
    MetricSpec("tensorverse_capture_rows_missing", "counter",
               "rows a shadow run expected but that were not in the store when it was compared",
               (_B, _M)),
    # -- store -----------------------------------------------------------------------------------
    MetricSpec("tensorverse_store_size_bytes", "gauge", "bytes used in the store's LMDB map"),
    MetricSpec("tensorverse_store_map_size_bytes", "gauge", "current LMDB map size"),
    MetricSpec("tensorverse_store_max_size_bytes", "gauge", "the store's size cap (0 = none)"),
    MetricSpec("tensorverse_store_free_bytes", "gauge",
               "bytes the store can still grow by: the lesser of filesystem free space and the cap's headroom"),
    MetricSpec("tensorverse_store_filesystem_free_bytes", "gauge",
               "free bytes on the store's filesystem"),
    MetricSpec("tensorverse_store_full", "gauge", "1 when the store refuses writes (cap or disk full)"),
    MetricSpec("tensorverse_store_writes_refused", "counter", "writes refused because the store was full"),
    MetricSpec("tensorverse_store_records", "gauge", "records per store table", ("table",)),
    MetricSpec("tensorverse_store_pruned_sessions", "counter", "sessions deleted by [retention] (age or bytes)"),
    MetricSpec("tensorverse_store_pruned_bytes", "counter", "live bytes freed by [retention]"),
    MetricSpec("tensorverse_store_prune_errors", "counter", "[retention] runs that failed"),
    MetricSpec("tensorverse_store_compacted_turns", "counter",
               "turns whose non-evidence rows [retention] compaction replaced by their compact form"),
    MetricSpec("tensorverse_store_compacted_rows", "counter", "full rows replaced by their compact form"),
    MetricSpec("tensorverse_store_compacted_bytes", "counter", "row bytes freed by compaction"),
    MetricSpec("tensorverse_store_over_budget", "gauge",
               "1 when [retention] cannot bring the store under max_bytes (the rest is pinned)"),
    MetricSpec("tensorverse_store_days_left", "gauge",
               "days until the budget (max_bytes, else the cap, else the disk) is full at the growth "
               "since the last [retention] run (NaN: unknown, or retention off)"),
    MetricSpec("tensorverse_analysis_jobs", "counter",
               "comparisons and compaction plans done for the proxy by its analysis workers", ("job",)),
    MetricSpec("tensorverse_analysis_in_thread", "counter",
               "analysis jobs done in a thread of the proxy because their worker died"),
    MetricSpec("tensorverse_analysis_worker_restarts", "counter",
               "times the analysis workers were started again after one died"),
    # -- the verdict (issue 25; docs/verdict.md), from the store every [verdict].refresh_s -------
    MetricSpec("tensorverse_verdict", "gauge",
               "1 for the shadow's current decision (regression, equivalent, undecided), 0 for the others",
               (_B, _R, "decision")),
    MetricSpec("tensorverse_verdict_tool_call_break_excess", "gauge",
               "excess broken tool calls per tool-calling turn over the noise floor: the estimate and "
               "its anytime-valid bounds (bound = estimate, low, high)", (_B, _R, "bound")),
    MetricSpec("tensorverse_verdict_flip_excess", "gauge",
               "excess runtime flip rate per turn over the noise floor: estimate and anytime-valid bounds",
               (_B, _R, "bound")),
    MetricSpec("tensorverse_verdict_tool_call_turns", "gauge", "tool-calling turns the verdict rests on", (_B, _R)),
    MetricSpec("tensorverse_verdict_turns_needed", "gauge",
               "about how many more tool-calling turns until a decision (0: decided; NaN: not at this rate)",
               (_B, _R)),
    MetricSpec("tensorverse_verdict_age_seconds", "gauge",
               "seconds since the verdict was last computed (NaN: not yet)"),
    MetricSpec("tensorverse_verdict_errors", "gauge", "1 when the last verdict computation failed"),
    # -- sessions --------------------------------------------------------------------------------
    MetricSpec("tensorverse_sessions_created", "counter", "sessions created"),
    MetricSpec("tensorverse_sessions_tracked", "gauge", "sessions held in memory for prefix matching"),
)

#: The proxy core's and recorder's plain counters, exported as ``tensorverse_proxy_<key>_total``
#: and ``tensorverse_recorder_<key>_total`` (any further key they gain is exported the same way).
PROXY_COUNTERS: tuple[str, ...] = ("requests", "turns", "streams", "aborted", "upstream_unreachable",
                                   "upstream_cut", "upstream_status_4xx", "upstream_status_5xx",
                                   "body_too_large", "retried_without_injection", "addon_errors",
                                   "requests_refused", "connections_evicted")
RECORDER_COUNTERS: tuple[str, ...] = ("recorded", "store_full", "store_errors", "unparsed_requests",
                                      "unparsed_events")


def exported_names() -> set[str]:
    """Every sample name ``/metrics`` can expose (families and their ``_total``/``_bucket``...)."""
    out: set[str] = set()
    for spec in METRICS:
        out.update(spec.sample_names())
    out.update(f"tensorverse_proxy_{k}_total" for k in PROXY_COUNTERS)
    out.update(f"tensorverse_recorder_{k}_total" for k in RECORDER_COUNTERS)
    return out


# --------------------------------------------------------------------------- storage


class _Counter:
    __slots__ = ("spec", "values")

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.values: dict[tuple[str, ...], float] = {}

    def init(self, key: tuple[str, ...]) -> None:
        self.values.setdefault(key, 0.0)

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        v = self.values
        v[key] = v.get(key, 0.0) + amount

    def family(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        f = CounterMetricFamily(self.spec.name, self.spec.help, labels=self.spec.labels)
        for key, value in self.values.items():
            f.add_metric(key, value)
        return f


class _Histogram:
    __slots__ = ("spec", "bounds", "_bounds_list", "counts", "sums", "_le")

    def __init__(self, spec: MetricSpec) -> None:
        assert spec.buckets is not None
        self.spec = spec
        self.bounds = np.asarray(spec.buckets, dtype=np.float64)
        self._bounds_list = list(spec.buckets)
        self.counts: dict[tuple[str, ...], np.ndarray] = {}
        self.sums: dict[tuple[str, ...], float] = {}
        self._le = [_le(b) for b in spec.buckets] + ["+Inf"]

    def _slot(self, key: tuple[str, ...]) -> np.ndarray:
        c = self.counts.get(key)
        if c is None:
            c = self.counts[key] = np.zeros(len(self.bounds) + 1, dtype=np.int64)
            self.sums[key] = 0.0
        return c

    def init(self, key: tuple[str, ...]) -> None:
        self._slot(key)

    def observe(self, key: tuple[str, ...], value: float) -> None:
        if not math.isfinite(value):
            return
        c = self._slot(key)
        c[bisect.bisect_left(self._bounds_list, value)] += 1  # le: value <= bound
        self.sums[key] += value

    def observe_many(self, key: tuple[str, ...], values: np.ndarray) -> None:
        """Observe an array of values at once (non-finite values are left out)."""
        if values.size == 0:
            return
        finite = np.isfinite(values)
        if not finite.all():
            values = values[finite]
            if values.size == 0:
                return
        c = self._slot(key)
        idx = np.searchsorted(self.bounds, values, side="left")
        c += np.bincount(idx, minlength=c.size)
        self.sums[key] += float(values.sum())

    def family(self) -> Any:
        from prometheus_client.core import HistogramMetricFamily

        f = HistogramMetricFamily(self.spec.name, self.spec.help, labels=self.spec.labels)
        les = self._le
        for key, counts in self.counts.items():
            cum = np.cumsum(counts).tolist()
            f.add_metric(list(key), list(zip(les, cum)), sum_value=self.sums[key])
        return f


def _le(b: float) -> str:
    from prometheus_client.utils import floatToGoString

    return floatToGoString(b)


# --------------------------------------------------------------------------- Metrics


class Metrics:
    """The process's event-driven metrics (see the module docstring).

    ``backends``: shadow backend name -> role; ``modes``: backend name -> its modes;
    ``refs``: backend name -> the reference roles its forced runs will be compared against
    (used only to create the series at 0). :meth:`from_config` fills all three from the config.
    Updates and scrapes may come from different threads: one lock guards the storage.
    """

    def __init__(self, *, primary: str = "primary", backends: Mapping[str, str] | None = None,
                 modes: Mapping[str, Sequence[str]] | None = None,
                 refs: Mapping[str, Sequence[str]] | None = None) -> None:
        self.primary = primary
        self.backends = dict(backends or {})
        self._lock = threading.Lock()
        self._counters: dict[str, _Counter] = {}
        self._histograms: dict[str, _Histogram] = {}
        for spec in METRICS:
            if spec.type == "counter" and spec.name in _EVENT_FAMILIES:
                self._counters[spec.name] = _Counter(spec)
            elif spec.type == "histogram":
                self._histograms[spec.name] = _Histogram(spec)
        c, h = self._counters, self._histograms
        self.requests = c["tensorverse_requests"]
        self.comparisons = c["tensorverse_comparisons"]
        self.compared_tokens = c["tensorverse_compared_tokens"]
        self.flips = c["tensorverse_flips"]
        self.tokens_sq = c["tensorverse_compared_tokens_squared"]
        self.flips_sq = c["tensorverse_flips_squared"]
        self.flips_n = c["tensorverse_flips_times_tokens"]
        self.parser_checks = c["tensorverse_parser_checks"]
        self.parser_mismatch = c["tensorverse_parser_mismatch"]
        self.verdicts = c["tensorverse_tool_call_verdicts"]
        self.noise = c["tensorverse_noise_verdicts"]
        self.template = c["tensorverse_template_mismatches"]
        self.runs = c["tensorverse_shadow_runs"]
        self.rows_missing = c["tensorverse_capture_rows_missing"]
        self.latency = h["tensorverse_proxy_added_latency_seconds"]
        self.kl = h["tensorverse_kl_divergence_nats"]
        self.first_flip = h["tensorverse_first_flip_position"]
        self.run_duration = h["tensorverse_shadow_run_duration_seconds"]
        self._preinit(modes or {}, refs or {})

    @classmethod
    def from_config(cls, cfg: Any) -> "Metrics":
        """Metrics whose series are those the configuration will produce, all at 0."""
        selected = cfg.selected_backends() if cfg.capture.enabled else []
        backends = {b.name: b.role for b in selected}
        modes = {b.name: list(b.modes or cfg.capture.modes) for b in selected}
        roles = set(backends.values())
        pivot = "secondary" if "secondary" in roles else ("reference" if "reference" in roles else None)
        refs: dict[str, list[str]] = {}
        for b in selected:
            r = []
            if cfg.recording.top_logprobs > 0:
                r.append("primary")
            if pivot is not None and b.role != pivot:
                r.append(pivot)
            refs[b.name] = r
        return cls(primary=cfg.primary.name, backends=backends, modes=modes, refs=refs)

    def _preinit(self, modes: Mapping[str, Sequence[str]], refs: Mapping[str, Sequence[str]]) -> None:
        for outcome in REQUEST_OUTCOMES:
            self.requests.init((self.primary, "primary", outcome))
        if self.backends:
            for outcome in PARSER_OUTCOMES:
                self.parser_checks.init((self.primary, outcome))
            self.parser_mismatch.init((self.primary,))
        for ep in ENDPOINTS:
            self.latency.init((ep,))
        for b, role in self.backends.items():
            bmodes = tuple(modes.get(b) or MODES)
            for m in bmodes:
                for outcome in RUN_OUTCOMES:
                    self.runs.init((b, role, m, outcome))
                self.run_duration.init((b, m))
                self.rows_missing.init((b, m))
                mrefs = ("primary",) if m == "free" else tuple(refs.get(b, ("primary",)))
                for rr in mrefs:
                    for outcome in COMPARISON_OUTCOMES:
                        self.comparisons.init((b, role, m, rr, outcome))
                    self.compared_tokens.init((b, role, m, rr))
                    self.tokens_sq.init((b, role, m, rr))
                    for cls in FLIP_CLASSES[:-1]:
                        self.flips_sq.init((b, role, m, rr, cls))
                        self.flips_n.init((b, role, m, rr, cls))
                        for reg in REGIONS:
                            self.flips.init((b, role, m, rr, reg, cls))
                    self.first_flip.init((b, role, m, rr))
                    if m == "forced":
                        self.kl.init((b, role, rr))
            if "free" in bmodes:
                for v in VERDICTS:
                    self.verdicts.init((b, role, v))
            if "forced" in bmodes and role != "secondary" and "primary" in refs.get(b, ()):
                for v in NOISE_VERDICTS:
                    self.noise.init((b, role, v))
            self.template.init((b, role))

    def _role(self, backend: str, given: Any) -> str:
        return self.backends.get(backend) or (given if isinstance(given, str) and given else "shadow")

    # -- updates ----------------------------------------------------------------------------------
    def observe_request(self, outcome: str, *, added_latency_s: float | None = None,
                        endpoint: str | None = None) -> None:
        """One agent request relayed to the primary (RequestMetrics calls this)."""
        with self._lock:
            self.requests.inc((self.primary, "primary", outcome))
            if added_latency_s is not None and endpoint:
                self.latency.observe((endpoint,), added_latency_s)

    def observe_runs(self, runs: Iterable[Run]) -> None:
        """Shadow run records as the runner stored them (the primary's ``recorded`` one is skipped)."""
        with self._lock:
            for r in runs:
                mode = r.mode
                if mode not in MODES:
                    continue
                b = r.backend
                role = self._role(b, r.role)
                status = r.status
                self.runs.inc((b, role, mode, status if status in RUN_OUTCOMES else "failed"))
                total = r.timings.get("total_s")
                if isinstance(total, (int, float)):
                    self.run_duration.observe((b, mode), float(total))

    def observe_parser_check(self, primary_run: Run) -> None:
        """The parser check of one turn (the primary's ``recorded`` run, once per turn)."""
        pc = primary_run.parser_check
        if pc is None:
            return
        b = primary_run.backend or self.primary
        bad = bool(pc.get("mismatch"))
        with self._lock:
            self.parser_checks.inc((b, "mismatch" if bad else "match"))
            if bad:
                self.parser_mismatch.inc((b,))

    def observe_comparisons(self, results: Iterable[Comparison], *,
                            pieces: Sequence[str] | None = None) -> None:
        """Comparisons as `tensorverse.shadow.compare.compare_turn` returned (and stored) them.

        ``pieces``: the primary's decoded output pieces, for the region of free-mode flips
        that have none of their own (stored before free comparisons held it)."""
        with self._lock:
            for r in results:
                self._observe(r, pieces)

    def observe_comparison(self, result: Comparison, *, pieces: Sequence[str] | None = None) -> None:
        with self._lock:
            self._observe(result, pieces)

    def _observe(self, r: Comparison, pieces: Sequence[str] | None) -> None:
        b = r.backend
        mode = r.mode
        if not isinstance(b, str) or mode not in MODES:
            return
        role = self._role(b, r.role)
        rr = r.ref_role
        if rr not in REF_ROLES:
            rr = "primary" if (mode == "free" or r.ref_backend == self.primary) else \
                (self.backends.get(r.ref_backend or "", "reference"))
        if r.status != "ok":
            self.comparisons.inc((b, role, mode, rr, "error"))
            return
        self.comparisons.inc((b, role, mode, rr, "ok"))
        if r.template_mismatch:
            self.template.inc((b, role))
        key = (b, role, mode, rr)
        if isinstance(r, ForcedComparison):
            self._observe_forced(r, key)
        else:
            self._observe_free(r, key, pieces)

    def _observe_forced(self, r: ForcedComparison, key: tuple[str, str, str, str]) -> None:
        b, role, mode, rr = key
        summary = r.summary or {}
        n = int(r.n or summary.get("n") or 0)
        n_flips = int(summary.get("flips", len(r.flips or ())))
        counted = 0
        by_class: dict[str, int] = {}
        for reg, cls, k in _flip_cells(r, summary):
            if k:
                self.flips.inc((*key, reg, cls), k)
                counted += k
                by_class[cls] = by_class.get(cls, 0) + k
        if n_flips > counted:
            self.flips.inc((*key, UNKNOWN, UNCLASSIFIED), n_flips - counted)
            by_class[UNCLASSIFIED] = by_class.get(UNCLASSIFIED, 0) + n_flips - counted
        self._count_turn(key, n, by_class)
        ff = r.first_flip
        if isinstance(ff, int):
            self.first_flip.observe(key, float(ff))
        kl = (r.metrics or {}).get("kl")
        if kl:
            self.kl.observe_many((b, role, rr), np.asarray(kl, dtype=np.float64))
        noise = r.noise
        if isinstance(noise, Mapping) and noise.get("verdict"):
            v = str(noise["verdict"]).replace(" ", "_")
            if v in NOISE_VERDICTS:
                self.noise.inc((b, role, v))

    def _observe_free(self, r: FreeComparison, key: tuple[str, str, str, str],
                      pieces: Sequence[str] | None) -> None:
        b, role, mode, rr = key
        d = r.divergence or {}
        diverged = bool(r.diverged if r.diverged is not None else d.get("position") is not None)
        prefix = r.common_prefix if r.common_prefix is not None else d.get("common_prefix")
        prefix = int(prefix) if isinstance(prefix, int) else 0
        cls = r.flip_class
        cls = cls if cls in FLIP_CLASSES else UNCLASSIFIED
        flipped = False
        if diverged:
            pos = r.first_flip if r.first_flip is not None else d.get("position")
            reg = r.region
            if reg not in REGIONS:
                reg = region_at(pieces, pos if isinstance(pos, int) else None)
            self.flips.inc((*key, reg, cls))
            flipped = True
            if isinstance(pos, int):
                self.first_flip.observe(key, float(pos))
        elif cls == "parser":  # identical tokens, different tool calls
            self.flips.inc((*key, UNKNOWN, cls))
            flipped = True
        self._count_turn(key, prefix + (1 if diverged else 0), {cls: 1} if flipped else {})
        verdict = r.verdict
        if verdict is not None:
            if verdict == "match" and not r.ref_tool_calls and not r.cand_tool_calls:
                verdict = "none"
            self.verdicts.inc((b, role, verdict if verdict in VERDICTS else "malformed"))

    def _count_turn(self, key: tuple[str, str, str, str], n: int, by_class: Mapping[str, int]) -> None:
        """One ok comparison (a turn) with ``n`` compared positions and its flips by class: the
        positions, and the moments the turn-clustered intervals of the rules need."""
        self.compared_tokens.inc(key, n)
        self.tokens_sq.inc(key, float(n) * n)
        for cls, k in by_class.items():
            self.flips_sq.inc((*key, cls), float(k) * k)
            self.flips_n.inc((*key, cls), float(k) * n)

    def observe_missing_rows(self, runs: Iterable[Run]) -> None:
        """Rows expected by full-capture runs that never reached the store."""
        with self._lock:
            for r in runs:
                rows = r.rows
                if r.mode not in MODES or rows is None:
                    continue
                exp, have = rows.get("expected"), rows.get("present")
                if isinstance(exp, int) and isinstance(have, int) and exp > have:
                    self.rows_missing.inc((r.backend, r.mode), exp - have)

    # -- exposition -------------------------------------------------------------------------------
    def families(self) -> list[Any]:
        """The event-driven families, copied under the lock."""
        with self._lock:
            return [c.family() for c in self._counters.values()] + \
                [h.family() for h in self._histograms.values()]

    def collector(self, stats: Callable[[], Mapping[str, Any]] | None = None, store: Any = None,
                  verdict: Any = None) -> "MetricsCollector":
        return MetricsCollector(self, stats, store, verdict)

    def registry(self, stats: Callable[[], Mapping[str, Any]] | None = None, store: Any = None,
                 verdict: Any = None) -> Any:
        """A prometheus_client registry serving these metrics (plus ``stats``, the store and the
        last verdict of ``verdict``, a `tensorverse.exporters.verdict_watch.VerdictWatch`)."""
        from prometheus_client import CollectorRegistry

        reg = CollectorRegistry(auto_describe=False)
        reg.register(self.collector(stats, store, verdict))
        return reg


def _flip_cells(r: ForcedComparison, summary: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """(region, class, flips) of a forced comparison: from ``flips_by_region_class`` when it
    has one, else by class (region unknown), else by region (class ``unclassified``: stored
    before issue 19)."""
    by_rc = summary.get("flips_by_region_class")
    out: list[tuple[str, str, int]] = []
    if isinstance(by_rc, Mapping) and by_rc:
        for reg, classes in by_rc.items():
            if isinstance(classes, Mapping):
                for cls, k in classes.items():
                    out.append((reg if reg in REGIONS else UNKNOWN,
                                cls if cls in FLIP_CLASSES else UNCLASSIFIED, int(k)))
        return out
    by_class = r.flips_by_class or summary.get("flips_by_class")  # in the summary: stored before 2026-12-05
    if isinstance(by_class, Mapping) and by_class:
        return [(UNKNOWN, c if c in FLIP_CLASSES else UNCLASSIFIED, int(k)) for c, k in by_class.items()]
    by_region = summary.get("flips_by_region")
    if isinstance(by_region, Mapping):
        return [(reg if reg in REGIONS else UNKNOWN, UNCLASSIFIED, int(k)) for reg, k in by_region.items()]
    return out


#: Families held (and updated) by `Metrics`; the others are read at scrape time.
_EVENT_FAMILIES = frozenset({
    "tensorverse_requests", "tensorverse_comparisons", "tensorverse_compared_tokens", "tensorverse_flips",
    "tensorverse_compared_tokens_squared", "tensorverse_flips_squared", "tensorverse_flips_times_tokens",
    "tensorverse_tool_call_verdicts", "tensorverse_noise_verdicts", "tensorverse_template_mismatches",
    "tensorverse_shadow_runs", "tensorverse_capture_rows_missing", "tensorverse_parser_checks",
    "tensorverse_parser_mismatch",
})


# --------------------------------------------------------------------------- scrape-time families


class MetricsCollector:
    """prometheus_client collector: the `Metrics` families, then the proxy's own counters (from
    ``stats()``, the proxy's `/stats` object) and the store's gauges, read at scrape time."""

    def __init__(self, metrics: Metrics | None, stats: Callable[[], Mapping[str, Any]] | None = None,
                 store: Any = None, verdict: Any = None) -> None:
        self.metrics = metrics
        self.stats = stats
        self.store = store
        self.verdict = verdict

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.metrics is not None:
            yield from self.metrics.families()
        s: Mapping[str, Any] = self.stats() if self.stats is not None else {}
        spec = {m.name: m for m in METRICS}

        def counter(name: str, value: float = 0.0, labels: Sequence[str] = ()) -> Any:
            sp = spec.get(name)
            help_ = sp.help if sp else name
            return CounterMetricFamily(name, help_, value=None if labels else value,
                                       labels=labels or None)

        def gauge(name: str, value: float = 0.0, labels: Sequence[str] = ()) -> Any:
            return GaugeMetricFamily(name, spec[name].help, value=None if labels else value,
                                     labels=labels or None)

        proxy = s.get("proxy") or {}
        for key in dict.fromkeys([*PROXY_COUNTERS, *proxy]):
            v = proxy.get(key, 0)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                yield CounterMetricFamily(f"tensorverse_proxy_{key}", f"proxy: {key.replace('_', ' ')}", value=v)
        rec = s.get("recorder")
        if rec is not None:
            for key in dict.fromkeys([*RECORDER_COUNTERS, *rec]):
                v = rec.get(key, 0)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    yield CounterMetricFamily(f"tensorverse_recorder_{key}", f"recorder: {key.replace('_', ' ')}",
                                              value=v)

        # shadow tee
        sh = s.get("shadow") or {}
        yield counter("tensorverse_shadow_queued", sh.get("queued", 0))
        yield counter("tensorverse_shadow_dropped", sh.get("dropped_queue_full", 0))
        yield gauge("tensorverse_shadow_queue_depth", sh.get("queue_depth", 0))
        yield gauge("tensorverse_shadow_queue_capacity", sh.get("queue_size", 0))
        yield counter("tensorverse_shadow_busy_seconds", sh.get("busy_s", 0.0))
        yield gauge("tensorverse_shadow_workers", sh.get("workers", 0))
        skipped = counter("tensorverse_shadow_skipped", labels=("reason",))
        got = sh.get("skipped") or {}
        for reason in dict.fromkeys([*SKIP_REASONS, *got]):
            skipped.add_metric([reason], got.get(reason, 0))
        yield skipped
        turns = counter("tensorverse_shadow_turns", labels=("backend", "role", "outcome"))
        roles = self.metrics.backends if self.metrics is not None else {}
        per_backend = sh.get("backend") or {}
        for b in dict.fromkeys([*roles, *per_backend]):
            outcomes = per_backend.get(b) or {}
            for outcome in dict.fromkeys([*TEE_OUTCOMES, *outcomes]):
                turns.add_metric([b, roles.get(b, "shadow"), outcome], outcomes.get(outcome, 0))
        yield turns
        gpu = sh.get("gpu") or {}
        spent = counter("tensorverse_shadow_gpu_seconds", labels=("backend",))
        left = gauge("tensorverse_shadow_gpu_budget_left_seconds", labels=("backend",))
        for b, g in gpu.items():
            spent.add_metric([b], g.get("gpu_seconds_total", 0.0))
            left.add_metric([b], g["budget_left"] if g.get("budget_left") is not None else math.inf)
        yield spent
        yield left

        # capture ingest
        ing = s.get("ingest") or {}
        yield counter("tensorverse_capture_rows", ing.get("rows", 0))
        yield counter("tensorverse_capture_compact_rows", ing.get("rows_compact", 0))
        yield counter("tensorverse_capture_bytes", ing.get("bytes", 0))
        yield counter("tensorverse_capture_duplicate_rows", ing.get("duplicates", 0))
        batches = counter("tensorverse_capture_batches", labels=("outcome",))
        batches.add_metric(["ok"], ing.get("batches", 0))
        batches.add_metric(["rejected"], ing.get("rejected", 0))
        batches.add_metric(["unauthorized"], ing.get("unauthorized", 0))
        batches.add_metric(["store_full"], ing.get("store_full", 0))
        batches.add_metric(["store_error"], ing.get("store_errors", 0))
        yield batches
        dropped = counter("tensorverse_capture_rows_dropped", labels=("reason",))
        dropped.add_metric(["store_full"], ing.get("rows_dropped_store_full", 0))
        dropped.add_metric(["store_error"], ing.get("rows_dropped_store_error", 0))
        yield dropped
        yield counter("tensorverse_capture_ingest_in_process", ing.get("in_process", 0))
        yield counter("tensorverse_capture_ingest_worker_restarts", ing.get("worker_restarts", 0))
        plugin = ing.get("plugins") or {}
        yield counter("tensorverse_capture_plugin_rows_captured", plugin.get("rows_captured", 0))
        pd = counter("tensorverse_capture_plugin_rows_dropped", labels=("reason",))
        for reason in PLUGIN_DROP_REASONS:
            pd.add_metric([reason], plugin.get(f"dropped_{reason}", 0))
        yield pd
        yield counter("tensorverse_capture_plugin_rows_on_device", plugin.get("rows_on_device", 0))
        yield counter("tensorverse_capture_plugin_device_overflow", plugin.get("device_overflow", 0))

        # sessions
        ses = s.get("sessions") or {}
        yield counter("tensorverse_sessions_created", ses.get("created", 0))
        yield gauge("tensorverse_sessions_tracked", ses.get("tracked_sessions", 0))

        # store
        yield from self._store_families()
        ret = s.get("retention") or {}
        yield counter("tensorverse_store_pruned_sessions", ret.get("sessions_pruned", 0))
        yield counter("tensorverse_store_pruned_bytes", ret.get("bytes_pruned", 0))
        yield counter("tensorverse_store_prune_errors", ret.get("errors", 0))
        yield counter("tensorverse_store_compacted_turns", ret.get("turns_compacted", 0))
        yield counter("tensorverse_store_compacted_rows", ret.get("rows_compacted", 0))
        yield counter("tensorverse_store_compacted_bytes", ret.get("bytes_compacted", 0))
        yield gauge("tensorverse_store_over_budget", 1.0 if ret.get("over_budget") else 0.0)
        days = ret.get("days_left")
        yield gauge("tensorverse_store_days_left", float("nan") if days is None else float(days))
        ana = s.get("analysis") or {}
        jobs = counter("tensorverse_analysis_jobs", labels=("job",))
        jobs.add_metric(["compare"], ana.get("compared", 0))
        jobs.add_metric(["plan"], ana.get("planned", 0))
        yield jobs
        yield counter("tensorverse_analysis_in_thread", ana.get("in_thread", 0))
        yield counter("tensorverse_analysis_worker_restarts", ana.get("worker_restarts", 0))
        if self.verdict is not None:
            yield from self._verdict_families()

    def _verdict_families(self) -> Iterator[Any]:
        """The last verdict snapshot (never computed here: `VerdictWatch` does, off the loop)."""
        from prometheus_client.core import GaugeMetricFamily

        from tensorverse.analysis.verdict import DECISIONS

        spec = {m.name: m for m in METRICS}
        snap = self.verdict.snapshot()

        def fam(name: str, labels: Sequence[str] = ()) -> Any:
            return GaugeMetricFamily(name, spec[name].help, labels=list(labels) or None)

        decision = fam("tensorverse_verdict", (_B, _R, "decision"))
        brk = fam("tensorverse_verdict_tool_call_break_excess", (_B, _R, "bound"))
        flp = fam("tensorverse_verdict_flip_excess", (_B, _R, "bound"))
        tct = fam("tensorverse_verdict_tool_call_turns", (_B, _R))
        need = fam("tensorverse_verdict_turns_needed", (_B, _R))
        nan = float("nan")
        for v in snap.verdicts:
            for d in DECISIONS:
                decision.add_metric([v.backend, v.role, d], 1.0 if v.decision == d else 0.0)
            for f, iv in ((brk, v.tool_call_break_excess), (flp, v.flip_excess)):
                f.add_metric([v.backend, v.role, "estimate"], nan if iv.estimate is None else iv.estimate)
                f.add_metric([v.backend, v.role, "low"], iv.low)
                f.add_metric([v.backend, v.role, "high"], iv.high)
            tct.add_metric([v.backend, v.role], float(v.tool_call_turns))
            need.add_metric([v.backend, v.role], nan if v.turns_needed is None else float(v.turns_needed))
        if snap.computed_ns is None:  # not computed yet: the configured shadows, no decision
            for b, role in getattr(self.verdict, "backends", {}).items():
                for d in DECISIONS:
                    decision.add_metric([b, role, d], 0.0)
                for f in (brk, flp):
                    for bound in ("estimate", "low", "high"):
                        f.add_metric([b, role, bound], nan)
                tct.add_metric([b, role], nan)
                need.add_metric([b, role], nan)
        yield from (decision, brk, flp, tct, need)
        age = nan if snap.computed_ns is None else max(0.0, (time.time_ns() - snap.computed_ns) / 1e9)
        yield GaugeMetricFamily("tensorverse_verdict_age_seconds", spec["tensorverse_verdict_age_seconds"].help,
                                value=age)
        yield GaugeMetricFamily("tensorverse_verdict_errors", spec["tensorverse_verdict_errors"].help,
                                value=1.0 if snap.error else 0.0)

    def _store_families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        spec = {m.name: m for m in METRICS}
        st: Mapping[str, Any] = {}
        fs_free: float = 0.0
        if self.store is not None:
            try:
                st = self.store.stats()
            except Exception:  # noqa: BLE001 - a closed store: zeros
                st = {}
            try:
                fs_free = float(shutil.disk_usage(str(self.store.path)).free)
            except (OSError, AttributeError):
                fs_free = 0.0
        used = float(st.get("used_bytes") or 0)
        cap = st.get("max_size")
        free = fs_free if not cap else min(fs_free, max(0.0, float(cap) - used))

        def g(name: str, value: float) -> Any:
            return GaugeMetricFamily(name, spec[name].help, value=value)

        yield g("tensorverse_store_size_bytes", used)
        yield g("tensorverse_store_map_size_bytes", float(st.get("map_size") or 0))
        yield g("tensorverse_store_max_size_bytes", float(cap or 0))
        yield g("tensorverse_store_free_bytes", free)
        yield g("tensorverse_store_filesystem_free_bytes", fs_free)
        yield g("tensorverse_store_full", 1.0 if st.get("full") else 0.0)
        yield CounterMetricFamily("tensorverse_store_writes_refused", spec["tensorverse_store_writes_refused"].help,
                                  value=float(st.get("writes_refused") or 0))
        rec = GaugeMetricFamily("tensorverse_store_records", spec["tensorverse_store_records"].help,
                                labels=["table"])
        for table in ("sessions", "turns", "runs", "rows", "comparisons"):
            rec.add_metric([table], float((st.get("entries") or {}).get(table, 0)))
        yield rec
