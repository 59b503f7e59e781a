"""Prometheus metrics of one server, in a registry of its own (never the global one).

Latencies are observed by the server per request (TTFT, ITL per token, end-to-end);
engine state (running/waiting, KV usage, cache hit rate, speculative acceptance) is read
from ``engine.metrics()`` at scrape time by a custom collector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.server.versions import LabelledView

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """The metrics of one app. ``render()`` is the ``/metrics`` body."""

    def __init__(self, engine_metrics: Callable[[], dict[str, float]],
                 gate_state: Callable[[], dict[str, int]],
                 version_labels: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.version_labels = version_labels or {}  # on every sample (versions.py)
        r = self.registry
        self.ttft = Histogram("arbor_time_to_first_token_seconds", "Time to first token",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("arbor_inter_token_latency_seconds", "Time between output tokens",
                             ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("arbor_e2e_request_latency_seconds", "Request latency, end to end",
                             ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("arbor_requests", "Requests answered", ["endpoint", "status"],
                                registry=r)
        self.errors = Counter("arbor_errors", "Failed requests by kind", ["kind"], registry=r)
        self.prompt_tokens = Counter("arbor_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("arbor_generation_tokens", "Tokens generated", registry=r)
        r.register(_EngineCollector(engine_metrics, gate_state))

    def render(self) -> bytes:
        return generate_latest(LabelledView(self.registry, self.version_labels))  # type: ignore[arg-type]


class _EngineCollector(Collector):
    """Gauges read from the engine and the admission gate at scrape time."""

    def __init__(self, engine_metrics: Callable[[], dict[str, float]],
                 gate_state: Callable[[], dict[str, int]]) -> None:
        self.engine_metrics = engine_metrics
        self.gate_state = gate_state

    def describe(self) -> list[Any]:
        return []  # collected lazily; nothing to describe at registration

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        m = _read(self.engine_metrics)
        total = m.get("kv_pages_total", 0.0)
        drafted = m.get("spec_draft_tokens", 0.0)
        gauges = {
            "arbor_num_requests_running": ("Requests in the engine's running batch", m.get("num_running")),
            "arbor_num_requests_waiting": ("Requests in the engine's waiting queue", m.get("num_waiting")),
            "arbor_kv_pages_used": ("KV pages held by requests", m.get("kv_pages_used")),
            "arbor_kv_pages_total": ("KV pages in the pool", total),
            "arbor_kv_cache_usage_ratio": ("Share of KV pages held by requests",
                                           m.get("kv_pages_used", 0.0) / total if total else 0.0),
            "arbor_prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache",
                                            m.get("cache_hit_rate")),
            "arbor_spec_acceptance_rate": ("Accepted share of speculative draft tokens",
                                           m.get("spec_acceptance_rate",
                                                 m.get("spec_accepted_tokens", 0.0) / drafted if drafted else 0.0)),
            "arbor_spec_draft_tokens": ("Speculative draft tokens proposed (total)", m.get("spec_draft_tokens")),
            "arbor_spec_accepted_tokens": ("Speculative draft tokens accepted (total)",
                                           m.get("spec_accepted_tokens")),
            "arbor_spec_forced_tokens": ("Grammar-forced tokens (total)", m.get("spec_forced_tokens")),
            "arbor_num_retractions": ("Requests retracted for lack of KV pages (total)",
                                      m.get("num_retractions")),
        }
        gauges.update({f"arbor_server_{k}": (f"Server {k.replace('_', ' ')}", v)
                       for k, v in self.gate_state().items()})
        for name, (doc, value) in gauges.items():
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))
        yield from _constraint_counters(m)


def _constraint_counters(m: dict[str, float]) -> Iterator[CounterMetricFamily]:
    """Relaxed grammars and checked outputs (``runtime.ConstraintCheck``), as counters
    (exposed with the ``_total`` suffix)."""
    counters = {
        "arbor_constraint_relaxed_compilations": (
            "JSON schemas compiled to a relaxed grammar (keywords the grammar cannot enforce)",
            m.get("constraint_relaxed_compilations")),
        "arbor_constraint_outputs_checked": (
            "Finished constrained outputs parsed and checked against their whole constraint",
            m.get("constraint_outputs_checked")),
        "arbor_constraint_outputs_invalid": (
            "Finished constrained outputs that failed their whole constraint",
            m.get("constraint_outputs_invalid")),
    }
    for name, (doc, value) in counters.items():
        if value is not None:
            yield CounterMetricFamily(name, doc, value=float(value))


def _read(engine_metrics: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The engine's metrics (plain counters, safe to read while a step runs)."""
    return dict(engine_metrics())
