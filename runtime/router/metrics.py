"""The router's ``/metrics`` (Prometheus text): per-worker load and health, how requests
were routed, and the hit rate the router estimates from its prefix indexes.

    arbor_router_worker_load{worker}             requests in flight on the worker
    arbor_router_worker_healthy{worker}          1 while it answers its health probes
    arbor_router_worker_removals_total{worker}   times it was taken out
    arbor_router_requests_total{worker,reason}   routed requests (prefix, balance, ...)
    arbor_router_prefix_routed_ratio             share of keyed requests routed by prefix
    arbor_router_estimated_hit_rate              matched / total key symbols of routed requests
    arbor_router_retries_total                   requests sent again to another worker
    arbor_router_errors_total{kind}              requests the router answered with an error
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.router.policy import Route
from runtime.router.workers import WorkerPool


class RouterStats(Collector):
    """Counters kept by the router; rendered on each scrape."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.routed: Counter[tuple[str, str]] = Counter()  # (worker url, reason)
        self.keyed = 0  # routed requests that had a key
        self.by_prefix = 0
        self.key_symbols = 0
        self.matched_symbols = 0
        self.retries = 0
        self.errors: Counter[str] = Counter()
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def observe(self, route: Route) -> None:
        self.routed[(self.pool.workers[route.worker].url, route.reason)] += 1
        if route.key_len:
            self.keyed += 1
            self.by_prefix += route.reason == "prefix"
            self.key_symbols += route.key_len
            self.matched_symbols += route.matched_len

    @property
    def estimated_hit_rate(self) -> float:
        return self.matched_symbols / self.key_symbols if self.key_symbols else 0.0

    @property
    def prefix_routed_ratio(self) -> float:
        return self.by_prefix / self.keyed if self.keyed else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        workers = self.pool.workers
        load = GaugeMetricFamily("arbor_router_worker_load", "Requests in flight on the worker",
                                 labels=["worker"])
        healthy = GaugeMetricFamily("arbor_router_worker_healthy", "1 while the worker answers "
                                    "its health probes", labels=["worker"])
        removals = CounterMetricFamily("arbor_router_worker_removals", "Times the worker was taken out",
                                       labels=["worker"])
        for w in workers:
            load.add_metric([w.url], w.load)
            healthy.add_metric([w.url], float(w.healthy))
            removals.add_metric([w.url], w.num_removals)
        routed = CounterMetricFamily("arbor_router_requests", "Requests routed, by worker and reason",
                                     labels=["worker", "reason"])
        for (url, reason), n in sorted(self.routed.items()):
            routed.add_metric([url, reason], n)
        errors = CounterMetricFamily("arbor_router_errors", "Requests the router answered with an "
                                     "error, by kind", labels=["kind"])
        for kind, n in sorted(self.errors.items()):
            errors.add_metric([kind], n)
        yield from (load, healthy, removals, routed, errors)
        yield GaugeMetricFamily("arbor_router_prefix_routed_ratio", "Share of keyed requests routed "
                                "to the worker holding their prefix", value=self.prefix_routed_ratio)
        yield GaugeMetricFamily("arbor_router_estimated_hit_rate", "Matched share of the routing "
                                "keys' symbols, by the router's prefix indexes", value=self.estimated_hit_rate)
        yield CounterMetricFamily("arbor_router_retries", "Requests sent again to another worker",
                                  value=self.retries)
