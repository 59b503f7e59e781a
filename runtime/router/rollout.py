"""The rollout state machine: the plan's steps, the gates, and the operator's actions.
Torch-free; the clock is injected (tests drive it by hand), state is saved on every
change (``rollout_store``).

    progressing --dwell over, every gate passes--> next step (the last one done: completed)
    progressing | paused --a gate fails failure_limit checks in a row--> rolled_back
    progressing | paused --candidate pool without a healthy worker--> rolled_back
    any --rollback--> rolled_back (0% candidate; held until an operator acts)
    progressing --pause--> paused (weights stand; gates still roll back)
    paused --resume--> progressing
    any but completed --promote--> the next step now (``full``: the last);
                                   rolled_back: step 0 again, fresh windows
    any --set_weight(w)--> paused at w% candidate (an outside controller owns the weight)

Every check looks only at samples of the current step (and of each gate's window), so a
step is judged on its own traffic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from runtime.errors import InvalidRequestError
from runtime.router.gates import GateCheck, Windows, check_gate
from runtime.router.rollout_plan import Plan
from runtime.router.rollout_store import Event, RolloutState, RolloutStore

log = logging.getLogger("arbor.router.rollout")


class Rollout:
    def __init__(self, plan: Plan, store: RolloutStore, clock: Callable[[], float] = time.time) -> None:
        self.plan = plan
        self.store = store
        self.clock = clock
        horizon = max([g.window_s for g in plan.gates] + [60.0])
        self.windows = Windows(horizon)
        self.last_checks: list[GateCheck] = []
        saved = store.load(plan.digest)
        if saved is not None:
            self.st = saved
            log.info("rollout resumed: %s at step %d (%d%% candidate)", saved.state, saved.step_idx,
                     self.candidate_weight)
        else:
            self.st = RolloutState(step_started=clock())
            self._record("start", {})

    # --- what the router reads -------------------------------------------------------

    @property
    def state(self) -> str:
        return self.st.state

    @property
    def candidate_weight(self) -> int:
        return self.weights().get(self.plan.candidate, 0)

    def weights(self) -> Mapping[str, int]:
        """Percent of the eligible traffic per pool, now."""
        if self.st.state == "rolled_back":
            return {self.plan.baseline: 100}
        if self.st.weight_override is not None:
            w = self.st.weight_override
            return {self.plan.candidate: w, self.plan.baseline: 100 - w}
        return self.plan.weights(self.st.step_idx)

    # --- the periodic check ------------------------------------------------------------

    def tick(self, candidate_healthy: bool = True) -> list[GateCheck]:
        """Check the gates; roll back, advance or hold. Returns the checks made."""
        now = self.clock()
        self.windows.prune(now)
        if self.st.state in ("rolled_back", "completed") or self.candidate_weight == 0:
            self.last_checks = []
            return []
        checks = [check_gate(g, self.windows, self.plan.baseline, self.plan.candidate, now, self.st.step_started)
                  for g in self.plan.gates]
        self.last_checks = checks
        failed = [c for c in checks if c.verdict == "fail"]
        if not candidate_healthy:
            self._rollback({"gate": "candidate_healthy", "why": "no healthy worker in the candidate pool"})
        elif failed:
            self.st.failed_checks += 1
            if self.st.failed_checks >= self.plan.failure_limit:
                self._rollback(_gate_detail(failed[0]))
            else:
                self._save()
        else:
            if self.st.failed_checks:
                self.st.failed_checks = 0
                self._save()
            if self.st.state == "progressing" and now - self.st.step_started >= self._step_dwell():
                last = self.st.step_idx == len(self.plan.steps) - 1
                if all(c.verdict == "pass" for c in checks) or (last and not failed):
                    self._advance(now)
        return checks

    # --- operator and controller actions ----------------------------------------------------

    def promote(self, full: bool = False) -> None:
        if self.st.state == "completed":
            raise InvalidRequestError("the rollout is already complete")
        if self.st.state == "rolled_back":
            self._restart()
            return
        if full:
            self.st.step_idx = len(self.plan.steps) - 1
            self.st.state = "completed"
            self._new_step("promote", {"full": True})
            return
        self._advance(self.clock(), kind="promote")

    def rollback(self, reason: str = "operator") -> None:
        self._rollback({"gate": None, "why": reason})

    def pause(self, reason: str = "operator") -> None:
        if self.st.state in ("rolled_back", "completed"):
            raise InvalidRequestError(f"a {self.st.state} rollout cannot be paused")
        self.st.state, self.st.reason = "paused", reason
        self._record("pause", {"why": reason})

    def resume(self) -> None:
        if self.st.state != "paused":
            raise InvalidRequestError(f"only a paused rollout resumes (it is {self.st.state})")
        self.st.state, self.st.weight_override = "progressing", None
        self.st.step_started = self.clock()
        self.windows.clear()
        self._record("resume", {})

    def set_weight(self, weight: int) -> None:
        """An outside controller (an Argo Rollouts or Flagger step) sets the candidate's share."""
        if not isinstance(weight, int) or not 0 <= weight <= 100:
            raise InvalidRequestError(f"weight must be a whole percent in [0, 100], got {weight!r}")
        self.st.state, self.st.weight_override, self.st.failed_checks = "paused", weight, 0
        self.st.reason = "weight set through the API"
        self.st.step_started = self.clock()
        self.windows.clear()
        self._record("set_weight", {"weight": weight})

    def status(self) -> dict[str, Any]:
        st = self.st
        return {"state": st.state, "step": st.step_idx, "num_steps": len(self.plan.steps),
                "weights": dict(self.weights()), "weight_override": st.weight_override,
                "step_started": st.step_started, "dwell_s": self._step_dwell(), "reason": st.reason,
                "baseline": self.plan.baseline, "candidate": self.plan.candidate,
                "failed_checks": st.failed_checks,
                "gates": [{"gate": c.gate.name, "metric": c.gate.metric, "bound": c.gate.bound,
                           "value": c.value, "samples": c.num_samples, "min_samples": c.gate.min_samples,
                           "verdict": c.verdict} for c in self.last_checks],
                "events": [vars(e) for e in self.store.events(50)]}

    # --- internals -------------------------------------------------------------------------

    def _step_dwell(self) -> float:
        return self.plan.steps[self.st.step_idx].dwell_s

    def _advance(self, now: float, kind: str = "advance") -> None:
        if self.st.step_idx == len(self.plan.steps) - 1:
            self.st.state = "completed"
            self._record("complete", {})
            return
        self.st.step_idx += 1
        self.st.weight_override = None
        if kind == "promote" and self.st.state == "paused":
            self.st.state = "progressing"
        self._new_step(kind, {})

    def _new_step(self, kind: str, detail: dict[str, Any]) -> None:
        self.st.step_started, self.st.failed_checks = self.clock(), 0
        self.windows.clear()
        self._record(kind, detail)

    def _restart(self) -> None:
        self.st = RolloutState(step_started=self.clock())
        self.windows.clear()
        self._record("promote", {"restart": True})

    def _rollback(self, detail: dict[str, Any]) -> None:
        self.st.state, self.st.weight_override = "rolled_back", None
        self.st.reason = detail.get("why") or f"gate {detail.get('gate')} failed"
        log.warning("rollout rolled back at step %d: %s", self.st.step_idx, detail)
        self._record("rollback", detail)

    def _record(self, kind: str, detail: dict[str, Any]) -> None:
        self.store.add_event(Event(self.clock(), kind, self.st.step_idx, self.candidate_weight, detail))
        self._save()

    def _save(self) -> None:
        self.store.save(self.plan.digest, self.st)


def _gate_detail(check: GateCheck) -> dict[str, Any]:
    return {"gate": check.gate.metric, "value": check.value, "bound": check.gate.bound,
            "side": check.gate.side, "samples": check.num_samples, "why": f"gate {check.describe()}"}
