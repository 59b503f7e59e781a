"""The rollout's torch-free core, on a fake clock: plan checks, sticky pool shares, gates
with minimum sample counts, the state machine, and its state surviving a restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runtime.router.gates import RequestSample, ShadowSample, Windows, check_gate
from runtime.router.pools import Pools, bucket, choose_pool, sticky_key
from runtime.router.rollout import Rollout
from runtime.router.rollout_plan import PlanError, load_plan, plan_from_dict
from runtime.router.rollout_store import RolloutStore

POOLS = ["baseline", "candidate"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def plan_dict(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "baseline": "baseline", "candidate": "candidate",
        "steps": [{"weight": 5, "dwell_s": 10}, {"weight": 25, "dwell_s": 10}, {"weight": 100}],
        "gates": [{"metric": "error_rate", "max": 0.1}, {"metric": "ttft_p99_ratio", "max": 2.0}],
        "min_samples": 5, "window_s": 30,
    }
    return {**base, **over}


# --- the plan ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "message"), [
    ({"candidate": "canary"}, "candidate pool 'canary' is not one of the router's pools"),
    ({"steps": [{"weights": {"baseline": 90, "canary": 10}}]}, "unknown pool(s) canary"),
    ({"steps": [{"weights": {"baseline": 90, "candidate": 20}}]}, "add up to 110, not 100"),
    ({"gates": [{"metric": "tokens_per_joule", "max": 1}]}, "gate on unknown metric 'tokens_per_joule'"),
    ({"gates": [{"metric": "error_rate"}]}, "exactly one of max or min"),
    ({"steps": []}, "has no steps"),
    ({"steps": [{"weight": 120}]}, "whole percent in [0, 100]"),
    ({"sticky": ["cookie"]}, "unknown sticky key 'cookie'"),
    ({"baseline": "candidate"}, "the same pool"),
    ({"dwell": 3}, "unknown field(s) dwell"),
])
def test_a_bad_plan_fails_with_a_clear_message(change: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=None) as err:
        plan_from_dict(plan_dict(**change), POOLS)
    assert message in str(err.value)


def test_a_plan_without_a_baseline_is_refused() -> None:
    data = plan_dict()
    del data["baseline"]
    with pytest.raises(PlanError, match="names no baseline pool"):
        plan_from_dict(data, POOLS)


def test_plan_files_in_json_and_toml_read_the_same(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text(json.dumps(plan_dict()))
    (tmp_path / "p.toml").write_text(
        'baseline = "baseline"\ncandidate = "candidate"\nmin_samples = 5\nwindow_s = 30\n'
        "steps = [{weight = 5, dwell_s = 10}, {weight = 25, dwell_s = 10}, {weight = 100}]\n"
        'gates = [{metric = "error_rate", max = 0.1}, {metric = "ttft_p99_ratio", max = 2.0}]\n')
    a, b = load_plan(tmp_path / "p.json", POOLS), load_plan(tmp_path / "p.toml", POOLS)
    assert a.steps == b.steps and a.gates == b.gates
    assert [dict(s.weights) for s in a.steps] == [{"candidate": 5, "baseline": 95}, {"candidate": 25, "baseline": 75},
                                                  {"candidate": 100, "baseline": 0}]
    assert a.digest != b.digest  # NOTE: a digest of the text: state is kept per plan file
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanError, match="does not parse"):
        load_plan(tmp_path / "bad.json", POOLS)


# --- pools: shares and stickiness --------------------------------------------------------------

@pytest.mark.parametrize("weight", [5, 25, 50, 100])
def test_shares_over_1000_keys_are_within_3_points_of_the_plan(weight: int) -> None:
    weights = {"candidate": weight, "baseline": 100 - weight}
    picks = [choose_pool(bucket(f"session:user-{i}"), weights, "baseline", "candidate") for i in range(1000)]
    assert abs(picks.count("candidate") / 10 - weight) <= 3


def test_a_key_keeps_its_pool_and_raising_the_weight_only_moves_baseline_keys() -> None:
    keys = [f"session:{i}" for i in range(2000)]
    at5 = {k: choose_pool(bucket(k), {"candidate": 5, "baseline": 95}, "baseline", "candidate") for k in keys}
    again = {k: choose_pool(bucket(k), {"candidate": 5, "baseline": 95}, "baseline", "candidate") for k in keys}
    at25 = {k: choose_pool(bucket(k), {"candidate": 25, "baseline": 75}, "baseline", "candidate") for k in keys}
    assert at5 == again
    assert all(at25[k] == "candidate" for k in keys if at5[k] == "candidate")


def test_sticky_keys_follow_the_plans_order() -> None:
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "user": "acme"}
    later = {"messages": [*body["messages"], {"role": "assistant", "content": "yo"},
                          {"role": "user", "content": "more"}], "user": "acme"}
    path = "/v1/chat/completions"
    assert sticky_key(["session", "prompt"], path, {"x-session-id": "s1"}, body, None) == "session:s1"
    # NOTE: a conversation's later turn keeps its first turn's key
    assert sticky_key(["session", "prompt"], path, {}, body, None) == sticky_key(["session", "prompt"], path, {},
                                                                                    later, None)
    assert sticky_key(["tenant", "prompt"], path, {}, body, "acme") == "tenant:acme"
    assert sticky_key(["program"], "/programs/extract", {}, {"arguments": {}}, None) == "program:program:extract"
    assert sticky_key(["session"], "/generate", {}, {"text": "x"}, None) is None


def test_pools_parse_names_and_urls() -> None:
    pools, urls = Pools.parse(["baseline=http://a:1,http://b:2", "candidate=http://c:3"])
    assert urls == ["http://a:1", "http://b:2", "http://c:3"]
    assert dict(pools.members) == {"baseline": (0, 1), "candidate": (2,)} and pools.pool_of(2) == "candidate"
    for bad, message in ((["x"], "NAME=URL"), (["a=ftp://x"], "http://"), (["a=http://x", "a=http://y"], "twice")):
        with pytest.raises(ValueError, match=message):
            Pools.parse(bad)


# --- gates ------------------------------------------------------------------------------------

def sample(t: float, ok: bool = True, ttft: float = 0.1) -> RequestSample:
    return RequestSample(t, ok, ttft, None, ttft, None)


def test_a_gate_waits_for_its_minimum_samples_then_decides() -> None:
    plan = plan_from_dict(plan_dict(), POOLS)
    ratio = plan.gates[1]
    w = Windows(60)
    for i in range(4):  # NOTE: 4 on each side, 5 needed: no decision, however bad
        w.add_request("baseline", sample(i, ttft=0.1))
        w.add_request("candidate", sample(i, ttft=9.0))
    check = check_gate(ratio, w, "baseline", "candidate", now=10, since=0)
    assert check.verdict == "wait" and check.num_samples == 4
    w.add_request("baseline", sample(5, ttft=0.1))
    w.add_request("candidate", sample(5, ttft=9.0))
    check = check_gate(ratio, w, "baseline", "candidate", now=10, since=0)
    assert check.verdict == "fail" and check.value == pytest.approx(90.0) and check.num_samples == 5
    # samples before the step began (since) or outside the window do not count
    assert check_gate(ratio, w, "baseline", "candidate", now=10, since=5.5).verdict == "wait"
    assert check_gate(ratio, w, "baseline", "candidate", now=100, since=0).verdict == "wait"


def test_error_rate_and_shadow_gates() -> None:
    plan = plan_from_dict(plan_dict(gates=[{"metric": "error_rate", "max": 0.1, "min_samples": 10},
                                           {"metric": "shadow_exact_match", "min": 0.9, "min_samples": 4},
                                           {"metric": "shadow_mean_kl", "max": 0.05, "min_samples": 2}]), POOLS)
    w = Windows(60)
    for i in range(10):
        w.add_request("candidate", sample(i, ok=i != 0))
    err, exact, kl = (check_gate(g, w, "baseline", "candidate", now=10, since=0) for g in plan.gates)
    assert (err.verdict, err.value) == ("pass", 0.1)
    for i, same in enumerate([True, True, True, False]):
        w.add_shadow(ShadowSample(i, same, 0.01 * i))
    w.add_shadow(ShadowSample(5, None, None))  # not greedy, no logprobs: counts for neither
    exact = check_gate(plan.gates[1], w, "baseline", "candidate", now=10, since=0)
    kl = check_gate(plan.gates[2], w, "baseline", "candidate", now=10, since=0)
    assert (exact.verdict, exact.value, exact.num_samples) == ("fail", 0.75, 4)
    assert (kl.verdict, kl.num_samples) == ("pass", 4) and kl.value == pytest.approx(0.015)


# --- the state machine ------------------------------------------------------------------------

def feed(r: Rollout, clock: FakeClock, n: int, base_ttft: float = 0.1, cand_ttft: float = 0.1,
         cand_ok: bool = True) -> None:
    for _ in range(n):
        r.windows.add_request("baseline", sample(clock.now, ttft=base_ttft))
        r.windows.add_request("candidate", sample(clock.now, ok=cand_ok, ttft=cand_ttft))


def test_steps_advance_after_their_dwell_only_with_every_gate_passing(tmp_path: Path) -> None:
    clock = FakeClock()
    r = Rollout(plan_from_dict(plan_dict(), POOLS), RolloutStore(":memory:"), clock)
    assert (r.state, r.candidate_weight) == ("progressing", 5)
    clock.now += 11
    r.tick()
    assert r.candidate_weight == 5  # dwell over but no samples: the gates wait, the step holds
    feed(r, clock, 5)
    clock.now += 1
    assert [c.verdict for c in r.tick()] == ["pass", "pass"] and r.candidate_weight == 25
    feed(r, clock, 5)  # NOTE: a new step is judged on its own samples: dwell first
    clock.now += 5
    r.tick()
    assert r.candidate_weight == 25
    clock.now += 6
    r.tick()
    assert r.candidate_weight == 100 and r.st.step_idx == 2
    r.tick()
    assert r.state == "completed" and r.candidate_weight == 100
    assert [e.kind for e in r.store.events()] == ["start", "advance", "advance", "complete"]


def test_a_failed_gate_rolls_back_at_once_records_why_and_holds() -> None:
    clock = FakeClock()
    r = Rollout(plan_from_dict(plan_dict(), POOLS), RolloutStore(":memory:"), clock)
    feed(r, clock, 5, cand_ttft=0.5)
    clock.now += 2
    r.tick()
    assert r.state == "rolled_back" and dict(r.weights()) == {"baseline": 100} and r.candidate_weight == 0
    event = r.store.events()[-1]
    assert event.kind == "rollback" and event.weight == 0 and event.t == clock.now
    assert event.detail["gate"] == "ttft_p99_ratio" and event.detail["value"] == pytest.approx(5.0)
    assert event.detail["samples"] == 5 and event.detail["bound"] == 2.0
    assert "ttft_p99_ratio <= 2" in (r.st.reason or "")
    clock.now += 100
    feed(r, clock, 20)
    r.tick()
    assert r.state == "rolled_back"  # held until an operator acts
    r.promote()  # from a rollback: step 0 again
    assert (r.state, r.candidate_weight) == ("progressing", 5)


def test_failure_limit_needs_failures_in_a_row_and_a_dead_candidate_is_a_failed_gate() -> None:
    clock = FakeClock()
    r = Rollout(plan_from_dict(plan_dict(failure_limit=2), POOLS), RolloutStore(":memory:"), clock)
    feed(r, clock, 5, cand_ok=False)
    r.tick()
    assert r.state == "progressing" and r.st.failed_checks == 1
    r.tick()
    assert r.state == "rolled_back" and r.store.events()[-1].detail["gate"] == "error_rate"
    r2 = Rollout(plan_from_dict(plan_dict(), POOLS), RolloutStore(":memory:"), clock)
    r2.tick(candidate_healthy=False)
    assert r2.state == "rolled_back" and r2.store.events()[-1].detail["gate"] == "candidate_healthy"


def test_operator_actions() -> None:
    clock = FakeClock()
    r = Rollout(plan_from_dict(plan_dict(), POOLS), RolloutStore(":memory:"), clock)
    r.pause()
    clock.now += 100
    feed(r, clock, 5)
    r.tick()
    assert (r.state, r.candidate_weight) == ("paused", 5)  # paused: no advance
    r.promote()
    assert (r.state, r.candidate_weight) == ("progressing", 25)
    r.set_weight(40)
    assert (r.state, dict(r.weights())) == ("paused", {"candidate": 40, "baseline": 60})
    r.resume()
    assert r.candidate_weight == 25
    r.promote(full=True)
    assert (r.state, r.candidate_weight) == ("completed", 100)
    with pytest.raises(ValueError, match="already complete"):
        r.promote()
    r.rollback("bad answers")
    assert r.state == "rolled_back" and r.st.reason == "bad answers"
    with pytest.raises(ValueError, match="whole percent"):
        r.set_weight(101)


def test_state_survives_a_restart_through_sqlite(tmp_path: Path) -> None:
    clock = FakeClock()
    db = str(tmp_path / "rollout.sqlite")
    plan = plan_from_dict(plan_dict(), POOLS, digest="plan-a")
    r = Rollout(plan, RolloutStore(db), clock)
    r.promote()
    feed(r, clock, 5, cand_ok=False)
    r.tick()
    r.store.close()
    again = Rollout(plan, RolloutStore(db), clock)  # the router restarted
    assert (again.state, again.st.step_idx, again.candidate_weight) == ("rolled_back", 1, 0)
    assert [e.kind for e in again.store.events()] == ["start", "promote", "rollback"]
    other = Rollout(plan_from_dict(plan_dict(), POOLS, digest="plan-b"), RolloutStore(db), clock)
    assert (other.state, other.candidate_weight) == ("progressing", 5)  # a new plan starts afresh


def test_requests_outside_the_match_go_to_the_baseline_and_labels_stay_bounded() -> None:
    from prometheus_client import CollectorRegistry

    from runtime.router.canary import Assignment, Canary
    from runtime.router.config import HealthConfig
    from runtime.router.split_metrics import SplitMetrics
    from runtime.router.workers import WorkerPool

    pools, urls = Pools.parse(["baseline=http://a:1", "candidate=http://b:2"])
    plan = plan_from_dict(plan_dict(steps=[{"weight": 100}],
                                    match={"tenants": ["acme"], "entry_points": ["/generate", "program:extract"]}),
                          POOLS)
    canary = Canary(pools, WorkerPool(urls, HealthConfig(), on_down=lambda i: None),
                    SplitMetrics(CollectorRegistry()), plan)
    acme = {"x-tenant": "acme"}
    assert canary.assign("/generate", acme, {"text": "hi"}) == Assignment("candidate", True, "acme", "/generate")
    assert canary.assign("/generate", {}, {"text": "hi", "user": "acme"}).pool == "candidate"  # OpenAI's user field
    assert canary.assign("/generate", {"x-tenant": "zed"}, {"text": "hi"}) == Assignment("baseline", False, "zed",
                                                                                       "/generate")
    chat = canary.assign("/v1/chat/completions", acme, {"messages": [{"role": "user", "content": "hi"}]})
    assert (chat.pool, chat.eligible) == ("baseline", False)
    program = canary.assign("/programs/extract", acme, {"arguments": {}})
    assert (program.pool, program.entry_point) == ("candidate", "program:extract")
    assert canary.assign("/some/other/path", acme, None).entry_point == "other"  # NOTE: not a label per path
    assert canary.allowed(program) == [{1}, {0}]  # the candidate's workers, then the baseline's
