"""A rollout plan: which pool is the baseline, which the candidate, the traffic share of
each step, who may go, the gates, and the shadow replay. Torch-free; frozen and checked
at construction, so a bad plan fails when the router starts, never mid-rollout.

The file is JSON (``.json``) or TOML (``.toml``); ``docs/rollouts.md`` has the format::

    {"baseline": "baseline", "candidate": "candidate",
     "steps": [{"weight": 5, "dwell_s": 60}, {"weight": 25, "dwell_s": 60}, {"weight": 100}],
     "match": {"tenants": [], "entry_points": ["/generate", "program:extract"]},
     "sticky": ["session", "tenant", "prompt"],
     "window_s": 60, "min_samples": 20, "interval_s": 1, "failure_limit": 1,
     "gates": [{"metric": "error_rate", "max": 0.02}, {"metric": "ttft_p99_ratio", "max": 1.5}],
     "shadow": {"share": 0.1, "queue_cap": 64}}

A step's ``weight`` is the candidate's percentage; ``weights`` gives every pool's
(they must add up to 100).
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.errors import InvalidRequestError

# metric name -> (its side: "max" or "min" bounds make sense, what it is)
GATE_METRICS: dict[str, tuple[str, str]] = {
    "error_rate": ("max", "candidate's share of requests that failed (5xx, connection lost)"),
    "ttft_p99_ratio": ("max", "candidate TTFT p99 / baseline TTFT p99"),
    "itl_p99_ratio": ("max", "candidate ITL p99 / baseline ITL p99"),
    "e2e_p99_ratio": ("max", "candidate end-to-end latency p99 / baseline's"),
    "constraint_failure_rate": ("max", "candidate's share of constrained outputs that are invalid"),
    "shadow_exact_match": ("min", "share of shadowed greedy pairs with identical tokens"),
    "shadow_mean_kl": ("max", "mean KL(baseline || candidate) over shadowed pairs' shared positions"),
}
STICKY_KEYS = ("session", "tenant", "program", "prompt")
SESSION_HEADER = "x-session-id"


class PlanError(InvalidRequestError):
    """The plan cannot run: unknown pools, shares that do not add up, an unknown gate
    metric, no baseline, ..."""


@dataclass(frozen=True)
class Step:
    weights: Mapping[str, int]  # pool -> percent of the eligible traffic; adds up to 100
    dwell_s: float  # least time at this step before it may advance (with every gate passing)


@dataclass(frozen=True)
class Gate:
    metric: str  # a key of GATE_METRICS
    bound: float
    side: str  # "max": fails above the bound; "min": fails below it
    min_samples: int  # fewer samples in the window: no decision (the gate waits)
    window_s: float  # the sliding window the metric is computed over

    @property
    def name(self) -> str:
        return f"{self.metric} {'<=' if self.side == 'max' else '>='} {self.bound:g}"


@dataclass(frozen=True)
class Match:
    """Which requests take part (others always go to the baseline); empty: all."""

    tenants: frozenset[str] = frozenset()
    entry_points: frozenset[str] = frozenset()  # "/generate", "/v1/chat/completions", "program:NAME"

    def admits(self, tenant: str | None, entry_point: str) -> bool:
        if self.tenants and tenant not in self.tenants:
            return False
        return not self.entry_points or entry_point in self.entry_points


@dataclass(frozen=True)
class ShadowSettings:
    share: float = 0.0  # of the baseline's eligible /generate requests, replayed on the candidate
    queue_cap: int = 64  # shadow jobs waiting; beyond, new ones are dropped (counted)
    max_user_inflight: int = 8  # user requests in flight above which shadow jobs are dropped


@dataclass(frozen=True)
class Plan:
    baseline: str
    candidate: str
    steps: tuple[Step, ...]
    gates: tuple[Gate, ...] = ()
    match: Match = field(default_factory=Match)
    sticky: tuple[str, ...] = ("session", "prompt")
    interval_s: float = 1.0  # between gate checks
    failure_limit: int = 1  # failed checks in a row that roll back
    shadow: ShadowSettings = field(default_factory=ShadowSettings)
    digest: str = ""  # of the source text: a stored state resumes only under the same plan

    def weights(self, step_idx: int) -> Mapping[str, int]:
        return self.steps[step_idx].weights


def load_plan(path: Path, pools: Sequence[str]) -> Plan:
    """Read and check a plan file against the router's ``pools``.

    Raises:
        PlanError: the file cannot be read or parsed, or the plan is not valid.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"cannot read the rollout plan {path}: {exc}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise PlanError(f"rollout plan {path} does not parse: {exc}") from None
    return plan_from_dict(data, pools, digest=hashlib.sha256(text.encode()).hexdigest()[:16])


def plan_from_dict(data: Any, pools: Sequence[str], digest: str = "") -> Plan:
    """Build a plan from parsed JSON/TOML, checked against the router's ``pools``."""
    if not isinstance(data, dict):
        raise PlanError("a rollout plan is an object with baseline, candidate and steps")
    _no_unknown(data, {"baseline", "candidate", "steps", "gates", "match", "sticky", "interval_s",
                       "failure_limit", "window_s", "min_samples", "shadow"}, "plan")
    if "baseline" not in data:
        raise PlanError("the rollout plan names no baseline pool (\"baseline\": \"<pool>\")")
    baseline, candidate = str(data["baseline"]), str(data.get("candidate", ""))
    for role, name in (("baseline", baseline), ("candidate", candidate)):
        if name not in pools:
            raise PlanError(f"the plan's {role} pool {name!r} is not one of the router's pools "
                            f"({', '.join(pools) or 'none given'}; add --pool {name or 'NAME'}=URL)")
    if baseline == candidate:
        raise PlanError("the plan's baseline and candidate are the same pool")
    steps = tuple(_step(s, i, baseline, candidate, pools) for i, s in enumerate(_list(data, "steps")))
    if not steps:
        raise PlanError("the rollout plan has no steps")
    window_s = _positive(data.get("window_s", 60.0), "window_s")
    min_samples = int(data.get("min_samples", 20))
    if min_samples < 1:
        raise PlanError(f"min_samples must be >= 1, got {min_samples}")
    gates = tuple(_gate(g, window_s, min_samples) for g in _list(data, "gates"))
    sticky = tuple(data.get("sticky", ("session", "prompt")))
    for key in sticky:
        if key not in STICKY_KEYS:
            raise PlanError(f"unknown sticky key {key!r} (one of {', '.join(STICKY_KEYS)})")
    failure_limit = int(data.get("failure_limit", 1))
    if failure_limit < 1:
        raise PlanError(f"failure_limit must be >= 1, got {failure_limit}")
    return Plan(baseline, candidate, steps, gates, _match(data.get("match", {})), sticky,
                _positive(data.get("interval_s", 1.0), "interval_s"), failure_limit,
                _shadow(data.get("shadow", {})), digest)


def _step(raw: Any, i: int, baseline: str, candidate: str, pools: Sequence[str]) -> Step:
    if not isinstance(raw, dict):
        raise PlanError(f"step {i}: a step is an object with weight (or weights) and dwell_s")
    _no_unknown(raw, {"weight", "weights", "dwell_s"}, f"step {i}")
    if ("weight" in raw) == ("weights" in raw):
        raise PlanError(f"step {i}: give either weight (the candidate's percent) or weights (every pool's)")
    if "weight" in raw:
        w = _percent(raw["weight"], f"step {i} weight")
        weights = {candidate: w, baseline: 100 - w}
    else:
        if not isinstance(raw["weights"], dict):
            raise PlanError(f"step {i}: weights is an object of pool -> percent")
        weights = {str(k): _percent(v, f"step {i} weight of {k}") for k, v in raw["weights"].items()}
        unknown = sorted(set(weights) - set(pools))
        if unknown:
            raise PlanError(f"step {i}: unknown pool(s) {', '.join(unknown)} (pools: {', '.join(pools)})")
        if sum(weights.values()) != 100:
            raise PlanError(f"step {i}: the shares add up to {sum(weights.values())}, not 100 "
                            f"({', '.join(f'{k}={v}' for k, v in weights.items())})")
    return Step(weights, float(raw.get("dwell_s", 0.0)))


def _gate(raw: Any, window_s: float, min_samples: int) -> Gate:
    if not isinstance(raw, dict) or "metric" not in raw:
        raise PlanError(f"a gate is an object with metric and max (or min), got {raw!r}")
    _no_unknown(raw, {"metric", "max", "min", "min_samples", "window_s"}, f"gate {raw.get('metric')}")
    metric = raw["metric"]
    if metric not in GATE_METRICS:
        raise PlanError(f"gate on unknown metric {metric!r} (known: {', '.join(GATE_METRICS)})")
    if ("max" in raw) == ("min" in raw):
        raise PlanError(f"gate {metric}: give exactly one of max or min")
    side = "max" if "max" in raw else "min"
    samples = int(raw.get("min_samples", min_samples))
    if samples < 1:
        raise PlanError(f"gate {metric}: min_samples must be >= 1")
    return Gate(metric, float(raw[side]), side, samples, _positive(raw.get("window_s", window_s), "window_s"))


def _match(raw: Any) -> Match:
    if not isinstance(raw, dict):
        raise PlanError("match is an object with tenants and entry_points")
    _no_unknown(raw, {"tenants", "entry_points"}, "match")
    return Match(frozenset(map(str, raw.get("tenants", []))), frozenset(map(str, raw.get("entry_points", []))))


def _shadow(raw: Any) -> ShadowSettings:
    if not isinstance(raw, dict):
        raise PlanError("shadow is an object with share and queue_cap")
    _no_unknown(raw, {"share", "queue_cap", "max_user_inflight"}, "shadow")
    s = ShadowSettings(float(raw.get("share", 0.0)), int(raw.get("queue_cap", 64)),
                       int(raw.get("max_user_inflight", 8)))
    if not 0.0 <= s.share <= 1.0 or s.queue_cap < 1 or s.max_user_inflight < 1:
        raise PlanError("shadow share must be in [0, 1], queue_cap and max_user_inflight >= 1")
    return s


def _list(data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise PlanError(f"{key} must be a list")
    return value


def _percent(value: Any, what: str) -> int:
    if not isinstance(value, int | float) or not 0 <= value <= 100 or value != int(value):
        raise PlanError(f"{what} must be a whole percent in [0, 100], got {value!r}")
    return int(value)


def _positive(value: Any, what: str) -> float:
    if not isinstance(value, int | float) or value <= 0:
        raise PlanError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def _no_unknown(raw: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
