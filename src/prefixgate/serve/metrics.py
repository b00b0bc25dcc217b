"""Prometheus metrics of ``prefixgate serve``, all named ``prefixgate_*``, with bounded labels.

Two kinds: counters and gauges read from :meth:`Gateway.statistics` at each scrape (a collector:
nothing is counted twice, and the gateway's own counters stay the one source of truth), and
what only the HTTP front sees (time to first token, queue wait per request, per-tenant in-flight,
disconnects, HTTP refusals), kept here. Label sets are bounded: outcomes, reasons and rules are
enums; replicas are the gateway's; tenants beyond ``max_tenants`` share the label ``"_other"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

if TYPE_CHECKING:
    from ..gateway import Gateway

__all__ = ["METRICS", "ServeMetrics"]

METRICS: dict[str, str] = {
    "prefixgate_requests_total": "Accepted requests that ended, by outcome (completed, cancelled, ...).",
    "prefixgate_admitted_total": "Requests accepted at ingress and queued.",
    "prefixgate_refused_total": "Requests refused before they were queued, by outcome.",
    "prefixgate_refusals_by_reason_total": "Load refusals (429s), by reason (queue_full, kv_reserved, ...).",
    "prefixgate_http_refused_total": "HTTP requests answered with an error before streaming, by outcome.",
    "prefixgate_client_disconnects_total": "Clients that left, by phase (before_admission, queued, "
                                           "running, streaming); each cancelled its request.",
    "prefixgate_canonicalized_requests_total": "Accepted requests that a canonicalization rule changed, "
                                               "by rule.",
    "prefixgate_canonicalized_chars_total": "Characters canonicalization replaced or removed, by rule.",
    "prefixgate_prompt_tokens_total": "Prompt tokens of completed requests.",
    "prefixgate_predicted_hit_tokens_total": "Cache-hit tokens the gateway predicted for completed requests.",
    "prefixgate_engine_cached_tokens_total": "Cache-hit tokens the engine reported for completed requests.",
    "prefixgate_queue_depth": "Requests waiting for dispatch now.",
    "prefixgate_running": "Requests the engines are serving now.",
    "prefixgate_reserved_kv_blocks": "KV blocks reserved by running requests now.",
    "prefixgate_aged_dispatches_total": "Dispatches forced by the aging bound.",
    "prefixgate_replaced_total": "Requests placed again: their replica died before their first output.",
    "prefixgate_moved_total": "Requests placed again while waiting: another replica stored their prefix.",
    "prefixgate_queue_wait_seconds": "Seconds from arrival to dispatch, per served request.",
    "prefixgate_time_to_first_token_seconds": "Seconds from an HTTP request to its first output.",
    "prefixgate_tenant_in_flight": "HTTP requests in flight per tenant (beyond max_tenants: '_other').",
    "prefixgate_replica_in_flight": "Requests running on each replica.",
    "prefixgate_replica_queued": "Requests queued for each replica.",
    "prefixgate_replica_alive": "1 while a replica takes requests, else 0.",
    "prefixgate_placements_total": "Placement decisions: requests placed on each replica.",
    "prefixgate_kv_usage": "Share of each replica's KV blocks held by running requests (vLLM's).",
}
"""Every metric ``/metrics`` exposes (a histogram's ``_bucket``/``_sum``/``_count`` series under its
name), with its help text: the reference ``docs/serve.md`` lists."""

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _GatewayCollector:
    """Reads one gateway's statistics at scrape time."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def describe(self) -> list[Metric]:
        return []  # collected lazily; names are checked in tests instead

    def collect(self) -> Iterator[Metric]:
        s = self._gateway.statistics()
        name = "prefixgate_requests"
        fam = CounterMetricFamily(name, METRICS[name + "_total"], labels=["outcome"])
        for outcome, n in sorted(s.outcomes.items()):
            fam.add_metric([outcome], n)
        yield fam
        yield CounterMetricFamily("prefixgate_admitted", METRICS["prefixgate_admitted_total"],
                                  value=s.requests)
        fam = CounterMetricFamily("prefixgate_refused", METRICS["prefixgate_refused_total"],
                                  labels=["outcome"])
        for outcome, n in sorted(s.refused.items()):
            fam.add_metric([outcome], n)
        yield fam
        fam = CounterMetricFamily("prefixgate_refusals_by_reason",
                                  METRICS["prefixgate_refusals_by_reason_total"], labels=["reason"])
        for reason, n in sorted(s.rejected_reasons.items()):
            fam.add_metric([reason], n)
        yield fam
        reqs = CounterMetricFamily("prefixgate_canonicalized_requests",
                                   METRICS["prefixgate_canonicalized_requests_total"], labels=["rule"])
        chars = CounterMetricFamily("prefixgate_canonicalized_chars",
                                    METRICS["prefixgate_canonicalized_chars_total"], labels=["rule"])
        for rule, stats in sorted(s.canonicalize_rules.items()):
            reqs.add_metric([rule], stats.requests)
            chars.add_metric([rule], stats.chars_changed)
        yield reqs
        yield chars
        for short, value in (("prompt_tokens", s.prompt_tokens),
                             ("predicted_hit_tokens", s.predicted_hit_tokens),
                             ("engine_cached_tokens", s.engine_cached_tokens),
                             ("aged_dispatches", s.aged_dispatches), ("replaced", s.replaced),
                             ("moved", s.moved)):
            name = f"prefixgate_{short}"
            yield CounterMetricFamily(name, METRICS[name + "_total"], value=value)
        for short, value in (("queue_depth", s.queued), ("running", s.running),
                             ("reserved_kv_blocks", s.reserved_blocks)):
            name = f"prefixgate_{short}"
            yield GaugeMetricFamily(name, METRICS[name], value=value)
        gauges = {n: GaugeMetricFamily(n, METRICS[n], labels=["replica"]) for n in (
            "prefixgate_replica_in_flight", "prefixgate_replica_queued", "prefixgate_replica_alive",
            "prefixgate_kv_usage")}
        placed = CounterMetricFamily("prefixgate_placements", METRICS["prefixgate_placements_total"],
                                     labels=["replica"])
        if s.replicas:
            for r in s.replicas:
                gauges["prefixgate_replica_in_flight"].add_metric([r.name], r.running)
                gauges["prefixgate_replica_queued"].add_metric([r.name], r.queued)
                gauges["prefixgate_replica_alive"].add_metric([r.name], 1.0 if r.alive else 0.0)
                if r.kv is not None:
                    gauges["prefixgate_kv_usage"].add_metric([r.name], r.kv.usage)
                placed.add_metric([r.name], r.placed)
        else:  # one engine: it is the only replica, and every request was placed on it
            name = getattr(self._gateway.engine, "replica_name", None) or "replica-0"
            gauges["prefixgate_replica_in_flight"].add_metric([name], s.running)
            gauges["prefixgate_replica_queued"].add_metric([name], s.queued)
            gauges["prefixgate_replica_alive"].add_metric([name], 1.0)
            if s.kv is not None:
                gauges["prefixgate_kv_usage"].add_metric([name], s.kv.usage)
            placed.add_metric([name], s.requests)
        yield from gauges.values()
        yield placed


class ServeMetrics:
    """The ``prefixgate_*`` metrics of one served gateway, in a registry of their own.

    Args:
        gateway: Read at every scrape.
        registry: Where to register; a new :class:`~prometheus_client.CollectorRegistry` when
            ``None`` (so two apps in one process never collide).
        max_tenants: Tenants with a label of their own; later ones count as ``"_other"``.
    """

    def __init__(self, gateway: Gateway, *, registry: CollectorRegistry | None = None,
                 max_tenants: int = 100) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.max_tenants = max_tenants
        self._tenants: set[str] = set()
        self.registry.register(_GatewayCollector(gateway))
        r = self.registry
        self._http_refused = Counter("prefixgate_http_refused", METRICS["prefixgate_http_refused_total"],
                                     ["outcome"], registry=r)
        self._disconnects = Counter("prefixgate_client_disconnects",
                                    METRICS["prefixgate_client_disconnects_total"], ["phase"], registry=r)
        self._wait = Histogram("prefixgate_queue_wait_seconds", METRICS["prefixgate_queue_wait_seconds"],
                               buckets=_WAIT_BUCKETS, registry=r)
        self._ttft = Histogram("prefixgate_time_to_first_token_seconds",
                               METRICS["prefixgate_time_to_first_token_seconds"], ["endpoint"],
                               buckets=_TTFT_BUCKETS, registry=r)
        self._tenant = Gauge("prefixgate_tenant_in_flight", METRICS["prefixgate_tenant_in_flight"],
                             ["tenant"], registry=r)
        for endpoint in ("completions", "chat"):
            self._ttft.labels(endpoint)  # present from the start, at zero

    def http_refused(self, outcome: str) -> None:
        """Counts an HTTP request answered with an error before any output."""
        self._http_refused.labels(outcome).inc()

    def disconnected(self, phase: str) -> None:
        """Counts a client that left (``before_admission``, ``queued``, ``running``, ``streaming``)."""
        self._disconnects.labels(phase).inc()

    def first_token(self, endpoint: str, seconds: float, queue_wait: float | None = None) -> None:
        """Records a request's time to first output and, when known, its queue wait."""
        self._ttft.labels(endpoint).observe(seconds)
        if queue_wait is not None:
            self._wait.observe(max(0.0, queue_wait))

    def _tenant_label(self, tenant: str | None) -> str:
        label = tenant or "_none"
        if label in self._tenants:
            return label
        if len(self._tenants) < self.max_tenants:
            self._tenants.add(label)
            return label
        return "_other"

    @contextlib.contextmanager
    def in_flight(self, tenant: str | None) -> Iterator[None]:
        """Counts an HTTP request of ``tenant`` in flight while the block runs."""
        gauge = self._tenant.labels(self._tenant_label(tenant))
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()

    def render(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def __repr__(self) -> str:
        return f"ServeMetrics(tenants={len(self._tenants)}, max_tenants={self.max_tenants})"
