"""The ``RequestMetrics`` addon: each LLM request's outcome and the latency the proxy added, fed
to the process's Prometheus metrics (`tensorverse.exporters.metrics.Metrics`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tensorverse.proxy.flow import ABORTED, OK, Addon, Flow

if TYPE_CHECKING:
    from tensorverse.exporters.metrics import Metrics

__all__ = ["RequestMetrics"]


class RequestMetrics(Addon):
    """Proxy addon: each LLM request's outcome and the latency the proxy added.

    Added latency = (upstream request about to be sent − request body read) + (client response
    finished − upstream's last byte or event). It leaves out the relay of the events in the middle
    of a stream (measured by ``benchmarks/proxy_overhead.py``). Put it last among the addons, so
    its ``request`` hook runs after every other addon's."""

    name = "metrics"

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    async def request(self, flow: Flow) -> None:
        flow.t_upstream_send = time.perf_counter()

    def response_body(self, flow: Flow) -> None:
        flow.t_upstream_last = time.perf_counter()

    def _added(self, flow: Flow) -> float | None:
        sent = flow.t_upstream_send
        if sent is None:
            return None
        added = max(0.0, sent - flow.t0)
        # a stream's last byte: the core's own time when this hook did not see it
        last = flow.t_upstream_last if flow.t_upstream_last is not None else flow.t_last_event
        if last is not None and flow.t_end is not None:
            added += max(0.0, flow.t_end - last)
        return added

    async def response_done(self, flow: Flow) -> None:
        outcome = "ok" if flow.state == OK else "upstream_error"
        self.metrics.observe_request(outcome, added_latency_s=self._added(flow) if outcome == "ok" else None,
                                     endpoint=flow.kind)

    async def error(self, flow: Flow) -> None:
        self.metrics.observe_request("aborted" if flow.state == ABORTED else "error")
