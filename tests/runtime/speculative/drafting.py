"""Test helper: make an engine verify every lookup draft, paying or not."""

from __future__ import annotations

from runtime import Engine
from runtime.scheduler.cost_model import StepCostModel, StepShape


class FlatCost(StepCostModel):
    """Every step costs the same, so the speculation gate verifies every lookup draft:
    tests of exactness need drafts whether or not they pay on this machine."""

    def predict(self, shape: StepShape) -> float | None:
        return 1.0


def always_draft(engine: Engine) -> Engine:
    engine.outputs.gate.cost = FlatCost()
    return engine
