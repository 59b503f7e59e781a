"""Router-side metrics split by version: every request the router relays is counted under
its pool, the model and config version the worker answered with (its ``X-Arbor-Model``
and ``X-Arbor-Config-Version`` headers: read from the workers, never typed by hand), the
tenant, the entry point and the prompt's length bucket::

    arbor_router_split_requests_total{pool,model,config_version,tenant,entry_point,context,status}
    arbor_router_split_ttft_seconds      time to the answer's first byte (a stream: first event)
    arbor_router_split_itl_seconds       a stream's mean gap between events after the first
    arbor_router_split_e2e_seconds       the whole request
    arbor_router_split_output_tokens_total, _prompt_tokens_total, _cached_tokens_total
    arbor_router_split_constraint_failures_total   outputs the worker's check found invalid

``panel()`` is the side-by-side view (``GET /rollout``): per pool p50/p99 of each latency
with the number of samples behind it, over the last ``PANEL_SAMPLES`` requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from runtime.router.gates import percentile

LABELS = ("pool", "model", "config_version", "tenant", "entry_point", "context")
CONTEXT_BUCKETS = ((512, "<512"), (2048, "512-2k"), (8192, "2k-8k"))  # (upper bound, label)
PANEL_SAMPLES = 2000  # per pool
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def context_bucket(prompt_tokens: int | None) -> str:
    if prompt_tokens is None:
        return "unknown"
    return next((label for bound, label in CONTEXT_BUCKETS if prompt_tokens < bound), ">=8k")


@dataclass(frozen=True)
class Outcome:
    """What one relayed request came to (built by the proxy when it ends)."""

    labels: tuple[str, ...]  # values of LABELS
    status: int
    ttft_s: float | None
    itl_s: float | None
    e2e_s: float
    prompt_tokens: int | None
    output_tokens: int | None
    cached_tokens: int | None
    constraint_valid: bool | None


class SplitMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("arbor_router_split_requests", "Requests relayed, by version and status",
                                [*LABELS, "status"], registry=registry)
        self.ttft = Histogram("arbor_router_split_ttft_seconds", "Time to the first byte of the answer",
                              LABELS, buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("arbor_router_split_itl_seconds", "Mean gap between a stream's events",
                             LABELS, buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("arbor_router_split_e2e_seconds", "End-to-end latency", LABELS,
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.output_tokens = Counter("arbor_router_split_output_tokens", "Output tokens", LABELS, registry=registry)
        self.prompt_tokens = Counter("arbor_router_split_prompt_tokens", "Prompt tokens", LABELS, registry=registry)
        self.cached_tokens = Counter("arbor_router_split_cached_tokens", "Prompt tokens read from the cache",
                                     LABELS, registry=registry)
        self.constraint_failures = Counter("arbor_router_split_constraint_failures",
                                           "Constrained outputs the worker's check found invalid", LABELS,
                                           registry=registry)
        self.recent: dict[str, deque[Outcome]] = {}

    def observe(self, o: Outcome) -> None:
        self.requests.labels(*o.labels, str(o.status)).inc()
        self.e2e.labels(*o.labels).observe(o.e2e_s)
        if o.ttft_s is not None:
            self.ttft.labels(*o.labels).observe(o.ttft_s)
        if o.itl_s is not None:
            self.itl.labels(*o.labels).observe(o.itl_s)
        for counter, value in ((self.output_tokens, o.output_tokens), (self.prompt_tokens, o.prompt_tokens),
                               (self.cached_tokens, o.cached_tokens)):
            if value:
                counter.labels(*o.labels).inc(value)
        if o.constraint_valid is False:
            self.constraint_failures.labels(*o.labels).inc()
        self.recent.setdefault(o.labels[0], deque(maxlen=PANEL_SAMPLES)).append(o)

    def panel(self) -> dict[str, dict[str, object]]:
        """Per pool: p50/p99 of TTFT, ITL and end-to-end latency with their sample counts,
        errors, and the versions seen."""
        return {pool: _pool_panel(list(outs)) for pool, outs in sorted(self.recent.items())}


def _pool_panel(outs: list[Outcome]) -> dict[str, object]:
    row: dict[str, object] = {"requests": len(outs), "errors": sum(o.status >= 500 for o in outs),
                              "versions": sorted({f"{o.labels[1]}@{o.labels[2]}" for o in outs})}
    for name in ("ttft_s", "itl_s", "e2e_s"):
        row[name] = _quantiles(v for o in outs if (v := getattr(o, name)) is not None)
    return row


def _quantiles(values: Iterable[float]) -> dict[str, float | int | None]:
    vals = list(values)
    if not vals:
        return {"p50": None, "p99": None, "samples": 0}
    return {"p50": percentile(vals, 50), "p99": percentile(vals, 99), "samples": len(vals)}
