"""The rollout inside the router: which pool a request goes to, what it came to, the
periodic gate check, the shadow replay, and the rollout's own Prometheus metrics.

Without a plan every request may go to any worker (the pools only label the metrics);
with one, an eligible request goes to the pool its sticky key's bucket falls in under
the current weights (``pools.choose_pool``), an ineligible one to the baseline. A request
whose pool has no healthy worker left goes to the baseline instead (no request is lost
to a dying candidate; the ``candidate_healthy`` check rolls the plan back).

The rollout metrics (beside ``split_metrics``)::

    arbor_rollout_weight{pool}                the share of eligible traffic, percent
    arbor_rollout_state{state}                1 for the current state
    arbor_rollout_step                        index of the current step
    arbor_rollout_rollbacks_total{gate}       rollbacks, by the gate that failed ("operator": by hand)
    arbor_rollout_gate_value{metric}          each gate's last value, and
    arbor_rollout_gate_samples{metric}        the samples behind it
    arbor_rollout_shadow_jobs_total{outcome}  offered, sent, compared, failed, dropped_full, dropped_load
    arbor_rollout_shadow_pairs_total          compared pairs; _greedy_pairs_total, _exact_pairs_total
    arbor_rollout_shadow_exact_match          exact share of the greedy pairs so far
    arbor_rollout_shadow_mean_kl              mean KL over pairs with logprobs on both sides
    arbor_rollout_shadow_prefix_share         mean share of tokens before the first divergence
    arbor_rollout_shadow_length_ratio         mean candidate/baseline length
    arbor_rollout_shadow_constraint_valid{side}  valid share of constrained outputs, per side
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.router.gates import RequestSample, ShadowSample
from runtime.router.pools import Pools, bucket, choose_pool, entry_point, sticky_key
from runtime.router.rollout import Rollout
from runtime.router.rollout_plan import Plan
from runtime.router.rollout_store import RolloutStore
from runtime.router.shadow import PairComparison, SendFn, ShadowRunner
from runtime.router.shadow_answers import shadowable
from runtime.router.split_metrics import Outcome, SplitMetrics
from runtime.router.workers import WorkerPool
from runtime.server.tenant_labels import TenantLabels

log = logging.getLogger("arbor.router.rollout")
STATES = ("progressing", "paused", "rolled_back", "completed")
KNOWN_ENTRY_POINTS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})


@dataclass(frozen=True)
class Assignment:
    pool: str | None  # None: any worker (no plan)
    eligible: bool  # takes part in the rollout (the plan's match)
    tenant: str  # bounded metric label
    entry_point: str


@dataclass
class ShadowTotals:
    pairs: int = 0
    greedy: int = 0
    exact: int = 0
    kl_sum: float = 0.0
    kl_pairs: int = 0
    prefix_sum: float = 0.0
    length_sum: float = 0.0
    valid: Counter[str] = field(default_factory=Counter)  # "baseline" / "candidate": valid outputs
    constrained: Counter[str] = field(default_factory=Counter)  # ... constrained outputs checked
    units: Counter[str] = field(default_factory=Counter)  # pairs compared on "ids" / "tokens" / "text"

    def add(self, p: PairComparison) -> None:
        self.pairs += 1
        self.units[p.unit] += 1
        self.prefix_sum += p.prefix_share
        self.length_sum += p.length_ratio
        if p.greedy:
            self.greedy += 1
            self.exact += p.exact
        if p.kl is not None:
            self.kl_sum += p.kl
            self.kl_pairs += 1
        for side, valid in (("baseline", p.base_valid), ("candidate", p.cand_valid)):
            if valid is not None:
                self.constrained[side] += 1
                self.valid[side] += valid


class Canary(Collector):
    def __init__(self, pools: Pools, workers: WorkerPool, split: SplitMetrics, plan: Plan | None = None,
                 store: RolloutStore | None = None, clock: Callable[[], float] = time.time) -> None:
        self.pools = pools
        self.workers = workers
        self.split = split
        self.plan = plan
        self.clock = clock
        self.rollout = Rollout(plan, store or RolloutStore(":memory:"), clock) if plan else None
        self.tenants = TenantLabels()
        # NOTE: program names and other paths are client-chosen: bounded like tenants
        self.programs = TenantLabels(max_labels=32)
        self.rollbacks: Counter[str] = Counter()
        self.shadow: ShadowRunner | None = None
        self.shadow_totals = ShadowTotals()
        self.versions: dict[str, str] = {}  # pool -> "model@config_version" last answered with
        self._task: asyncio.Task[None] | None = None

    # --- routing ------------------------------------------------------------------------

    def assign(self, path: str, headers: Mapping[str, str], body: Any) -> Assignment:
        tenant = headers.get("x-tenant") or (body.get("user") if isinstance(body, dict) else None)
        tenant = tenant if isinstance(tenant, str) else None
        entry = entry_point(path)
        label = self.tenants.label(tenant)
        entry_label = entry if entry in KNOWN_ENTRY_POINTS else self.programs.label(entry)
        if self.plan is None or self.rollout is None:
            return Assignment(None, False, label, entry_label)
        if not self.plan.match.admits(tenant, entry):
            return Assignment(self.plan.baseline, False, label, entry_label)
        key = sticky_key(self.plan.sticky, path, headers, body, tenant)
        # NOTE: a request without any key is spread by a fresh bucket each time (no session to keep)
        b = bucket(key) if key is not None else bucket(f"anon:{self.clock()}:{id(body)}")
        pool = choose_pool(b, self.rollout.weights(), self.plan.baseline, self.plan.candidate)
        return Assignment(pool, True, label, entry_label)

    def allowed(self, assignment: Assignment) -> list[set[int]]:
        """Worker index sets to try in turn: the assigned pool, then the baseline."""
        if assignment.pool is None or self.plan is None:
            return [set(range(len(self.workers.workers)))]
        sets = [set(self.pools.members[assignment.pool])]
        if assignment.pool != self.plan.baseline:
            sets.append(set(self.pools.members[self.plan.baseline]))
        return sets

    def is_candidate(self, worker: int) -> bool:
        return self.plan is not None and self.pools.pool_of(worker) == self.plan.candidate

    def pool_healthy(self, pool: str) -> bool:
        return any(self.workers.workers[i].healthy for i in self.pools.members[pool])

    # --- what requests came to ------------------------------------------------------------

    def attempt_failed(self, worker: int) -> None:
        """A worker failed a request that was then retried elsewhere: an error of its pool."""
        if self.rollout is not None:
            now = self.clock()
            self.rollout.windows.add_request(self.pools.pool_of(worker),
                                             RequestSample(now, False, None, None, 0.0, None))

    def observe(self, assignment: Assignment, worker: int | None, outcome: Outcome) -> None:
        self.split.observe(outcome)
        pool = outcome.labels[0]
        if worker is not None:
            self.versions[pool] = f"{outcome.labels[1]}@{outcome.labels[2]}"
        if self.rollout is not None and assignment.eligible:
            self.rollout.windows.add_request(pool, RequestSample(
                self.clock(), outcome.status < 500, outcome.ttft_s, outcome.itl_s, outcome.e2e_s,
                outcome.constraint_valid))

    def labels(self, assignment: Assignment, worker: int | None, model: str, config: str,
               prompt_tokens: int | None) -> tuple[str, ...]:
        from runtime.router.split_metrics import context_bucket

        pool = self.pools.pool_of(worker) if worker is not None else (assignment.pool or "none")
        return (pool, model, config, assignment.tenant, assignment.entry_point, context_bucket(prompt_tokens))

    # --- shadow -------------------------------------------------------------------------

    def start_shadow(self, send: SendFn, user_inflight: Callable[[], int]) -> None:
        if self.plan is not None and self.plan.shadow.share > 0:
            self.shadow = ShadowRunner(self.plan.shadow, send, self._on_pair, user_inflight)
            self.shadow.start()

    def shadow_wanted(self, assignment: Assignment, path: str, body: Mapping[str, Any]) -> bool:
        return (self.shadow is not None and self.plan is not None and assignment.eligible
                and assignment.pool == self.plan.baseline and shadowable(path, body)
                and self.pool_healthy(self.plan.candidate) and self.shadow.wants())

    def _on_pair(self, pair: PairComparison) -> None:
        self.shadow_totals.add(pair)
        if self.rollout is not None:
            self.rollout.windows.add_shadow(ShadowSample(self.clock(), pair.exact if pair.greedy else None, pair.kl))

    # --- the periodic check -------------------------------------------------------------------

    def start(self) -> None:
        if self.rollout is not None:
            self._task = asyncio.create_task(self._loop(), name="arbor-router-rollout")

    async def stop(self) -> None:
        for task in (self._task,):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.shadow is not None:
            await self.shadow.stop()

    def tick(self) -> None:
        assert self.rollout is not None and self.plan is not None
        before = self.rollout.state
        self.rollout.tick(candidate_healthy=self.pool_healthy(self.plan.candidate))
        if self.rollout.state == "rolled_back" and before != "rolled_back":
            event = self.rollout.store.events(1)[-1]
            self.rollbacks[str(event.detail.get("gate") or "operator")] += 1

    async def _loop(self) -> None:
        assert self.plan is not None
        while True:
            try:
                self.tick()
            except Exception:  # NOTE: a failed check must not end the checks (logged, retried)
                log.exception("rollout check failed")
            await asyncio.sleep(self.plan.interval_s)

    def status(self) -> dict[str, Any]:
        """The ``GET /rollout`` page: the state, the gates, the side-by-side panel, shadow."""
        assert self.rollout is not None
        t = self.shadow_totals
        shadow = {"jobs": dict(self.shadow.counts) if self.shadow else {}, "pairs": t.pairs,
                  "greedy_pairs": t.greedy, "exact_match": t.exact / t.greedy if t.greedy else None,
                  "mean_kl": t.kl_sum / t.kl_pairs if t.kl_pairs else None, "kl_pairs": t.kl_pairs,
                  "prefix_share": t.prefix_sum / t.pairs if t.pairs else None,
                  "length_ratio": t.length_sum / t.pairs if t.pairs else None,
                  "constraint_valid": {s: t.valid[s] / n for s, n in t.constrained.items() if n},
                  "units": dict(t.units)}
        pools = {name: {"workers": [self.workers.workers[i].url for i in idx],
                        "healthy": self.pool_healthy(name), "version": self.versions.get(name)}
                 for name, idx in self.pools.members.items()}
        return {**self.rollout.status(), "pools": pools, "panel": self.split.panel(), "shadow": shadow}

    # --- Prometheus -------------------------------------------------------------------------

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if self.rollout is None:
            return
        weight = GaugeMetricFamily("arbor_rollout_weight", "Share of eligible traffic, percent", labels=["pool"])
        for pool in self.pools.names:
            weight.add_metric([pool], self.rollout.weights().get(pool, 0))
        state = GaugeMetricFamily("arbor_rollout_state", "1 for the rollout's current state", labels=["state"])
        for name in STATES:
            state.add_metric([name], float(self.rollout.state == name))
        rollbacks = CounterMetricFamily("arbor_rollout_rollbacks", "Rollbacks by the gate that failed",
                                        labels=["gate"])
        for gate, n in sorted(self.rollbacks.items()):
            rollbacks.add_metric([gate], n)
        value = GaugeMetricFamily("arbor_rollout_gate_value", "Each gate's last value", labels=["metric"])
        samples = GaugeMetricFamily("arbor_rollout_gate_samples", "Samples behind each gate's last value",
                                    labels=["metric"])
        for check in self.rollout.last_checks:
            if check.value is not None:
                value.add_metric([check.gate.metric], check.value)
            samples.add_metric([check.gate.metric], check.num_samples)
        yield from (weight, state, rollbacks, value, samples)
        yield GaugeMetricFamily("arbor_rollout_step", "Index of the current step", value=self.rollout.st.step_idx)
        yield from self._shadow_metrics()

    def _shadow_metrics(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        t = self.shadow_totals
        jobs = CounterMetricFamily("arbor_rollout_shadow_jobs", "Shadow jobs by outcome", labels=["outcome"])
        for outcome, n in sorted((self.shadow.counts if self.shadow else Counter()).items()):
            jobs.add_metric([outcome], n)
        yield jobs
        yield CounterMetricFamily("arbor_rollout_shadow_pairs", "Shadowed pairs compared", value=t.pairs)
        yield CounterMetricFamily("arbor_rollout_shadow_greedy_pairs", "Greedy pairs compared", value=t.greedy)
        yield CounterMetricFamily("arbor_rollout_shadow_exact_pairs", "Greedy pairs with identical tokens",
                                  value=t.exact)
        for name, num, den, text in (
                ("exact_match", t.exact, t.greedy, "Exact share of the greedy pairs"),
                ("mean_kl", t.kl_sum, t.kl_pairs, "Mean KL(baseline||candidate) over pairs with logprobs"),
                ("prefix_share", t.prefix_sum, t.pairs, "Mean share of tokens before the first divergence"),
                ("length_ratio", t.length_sum, t.pairs, "Mean candidate/baseline output length")):
            if den:
                yield GaugeMetricFamily(f"arbor_rollout_shadow_{name}", text, value=num / den)
        valid = GaugeMetricFamily("arbor_rollout_shadow_constraint_valid", "Valid share of constrained "
                                  "outputs in shadowed pairs", labels=["side"])
        for side, n in sorted(t.constrained.items()):
            if n:
                valid.add_metric([side], t.valid[side] / n)
        yield valid
