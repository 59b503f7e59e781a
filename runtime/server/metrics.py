"""Prometheus metrics of one server, in a registry of its own (never the global one).

Latencies are observed by the server per request (TTFT, ITL per token, end-to-end), as
histograms labelled by endpoint, prompt-length bucket (``prompt_bucket``) and tenant
(``tenant.TenantLabels``: bounded), and kept for the last minutes in a ``LatencyWindow``
(the percentiles ``/ui`` shows). Engine state (running/waiting, KV usage, cache hit rate,
speculative acceptance) is read from ``engine.metrics()`` at scrape time by a custom
collector.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.server.run_log import RunLog
from runtime.server.tenant_labels import TenantLabels
from runtime.server.versions import LabelledView

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)
# Prompt-length buckets (tokens), upper bounds inclusive; bench_serving groups by the same.
PROMPT_BUCKET_BOUNDS = (128, 512, 2048, 8192)
LATENCY_LABELS = ["endpoint", "prompt_bucket", "tenant"]
NO_PROMPT = "none"  # prompt_bucket of a request without one prompt (a program run)


def prompt_bucket(prompt_len: int) -> str:
    """The bucket label of a prompt of ``prompt_len`` tokens: "0-128", "129-512", ...,
    ">8192"."""
    i = bisect.bisect_left(PROMPT_BUCKET_BOUNDS, prompt_len)
    if i == len(PROMPT_BUCKET_BOUNDS):
        return f">{PROMPT_BUCKET_BOUNDS[-1]}"
    low = 0 if i == 0 else PROMPT_BUCKET_BOUNDS[i - 1] + 1
    return f"{low}-{PROMPT_BUCKET_BOUNDS[i]}"


class LatencyWindow:
    """Observations of the last ``window_s`` seconds (at most ``max_samples``), for
    percentiles over a recent window. Thread-safe."""

    def __init__(self, window_s: float = 300.0, max_samples: int = 100_000) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (time, seconds)
        self._lock = threading.Lock()

    def observe(self, seconds: float, count: int = 1) -> None:
        now = time.monotonic()
        with self._lock:
            self._samples.extend([(now, seconds)] * count)

    def percentiles(self, window_s: float | None = None) -> dict[str, float | int | None]:
        """``{"count", "p50", "p95", "p99"}`` in seconds over the last ``window_s``."""
        since = time.monotonic() - (window_s or self.window_s)
        with self._lock:
            while self._samples and self._samples[0][0] < since - self.window_s:
                self._samples.popleft()  # older than any window anyone may ask for
            values = sorted(v for t, v in self._samples if t >= since)
        if not values:
            return {"count": 0, "p50": None, "p95": None, "p99": None}
        pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731 - nearest rank
        return {"count": len(values), "p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}


class ServerMetrics:
    """The metrics of one app. ``render()`` is the ``/metrics`` body."""

    def __init__(self, engine_metrics: Callable[[], dict[str, float]],
                 gate_state: Callable[[], dict[str, float | None]],
                 version_labels: dict[str, str] | None = None, max_tenant_labels: int = 16) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.version_labels = version_labels or {}  # on every sample (versions.py)
        r = self.registry
        self.engine_metrics = engine_metrics
        self.gate_state = gate_state
        self.tenants = TenantLabels(max_tenant_labels)
        self.ttft = Histogram("arbor_time_to_first_token_seconds", "Time to first token",
                              LATENCY_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("arbor_inter_token_latency_seconds", "Time between output tokens",
                             LATENCY_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("arbor_e2e_request_latency_seconds", "Request latency, end to end",
                             LATENCY_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.recent_ttft = LatencyWindow()
        self.recent_itl = LatencyWindow()
        self.runs = RunLog()  # recent program runs with their traces (for /ui)
        self.requests = Counter("arbor_requests", "Requests answered", ["endpoint", "status"],
                                registry=r)
        self.errors = Counter("arbor_errors", "Failed requests by kind", ["kind"], registry=r)
        self.prompt_tokens = Counter("arbor_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("arbor_generation_tokens", "Tokens generated", registry=r)
        r.register(_EngineCollector(engine_metrics, gate_state))

    def render(self) -> bytes:
        return generate_latest(LabelledView(self.registry, self.version_labels))  # type: ignore[arg-type]

    def labels(self, endpoint: str, prompt_len: int | None, tenant: str | None) -> tuple[str, str, str]:
        """The label values of one request's latency samples (``LATENCY_LABELS``)."""
        bucket = NO_PROMPT if prompt_len is None else prompt_bucket(prompt_len)
        return endpoint, bucket, self.tenants.label(tenant)

    def observe_ttft(self, labels: tuple[str, str, str], seconds: float) -> None:
        self.ttft.labels(*labels).observe(seconds)
        self.recent_ttft.observe(seconds)

    def observe_itl(self, labels: tuple[str, str, str], seconds: float, count: int = 1) -> None:
        """``count`` tokens that arrived together, ``seconds`` apart each."""
        child = self.itl.labels(*labels)
        for _ in range(count):
            child.observe(seconds)
        self.recent_itl.observe(seconds, count)


class TokenTimer:
    """Times one request's output tokens as they arrive: TTFT, ITL per token (k tokens
    arriving together are k gaps of gap/k) and end to end, from its construction."""

    def __init__(self, metrics: ServerMetrics, labels: tuple[str, str, str]) -> None:
        self.metrics = metrics
        self.labels = labels
        self.started = time.monotonic()
        self.last_token_at: float | None = None

    def observe(self, num_new: int, finished: bool) -> None:
        """``num_new`` tokens just arrived; ``finished``: the request's last output."""
        now = time.monotonic()
        m = self.metrics
        if num_new:
            m.generation_tokens.inc(num_new)
            if self.last_token_at is None:
                m.observe_ttft(self.labels, now - self.started)
                num_new -= 1  # the first token is TTFT, not ITL
                self.last_token_at = now
            if num_new:
                m.observe_itl(self.labels, (now - self.last_token_at) / num_new, num_new)
            self.last_token_at = now
        if finished:
            m.e2e.labels(*self.labels).observe(now - self.started)


class _EngineCollector(Collector):
    """Gauges read from the engine and the admission gate at scrape time."""

    def __init__(self, engine_metrics: Callable[[], dict[str, float]],
                 gate_state: Callable[[], dict[str, float | None]]) -> None:
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
            "arbor_kv_pages_retained": ("KV pages pinned for live program runs and sessions",
                                        m.get("kv_pages_retained")),
            "arbor_kv_pages_touched": ("KV pages that ever held a token: on the CPU, the pool's resident pages",
                                       m.get("kv_pages_touched")),
            "arbor_retention_pins_refused": ("Retention pins refused for an owner's page budget (total)",
                                             m.get("retention_pins_refused")),
            "arbor_kv_tier_pages": ("KV pages held in the second tier (--kv-tier-dir)", m.get("kv_tier_pages")),
            "arbor_tier_cached_prompt_tokens": ("Prompt tokens reloaded from the second tier (total)",
                                                m.get("tier_cached_prompt_tokens")),
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
