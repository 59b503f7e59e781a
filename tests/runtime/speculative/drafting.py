"""Test helper: make an engine verify every lookup draft, paying or not."""

from __future__ import annotations

from runtime import Engine
from runtime.scheduler.cost_model import StepCostModel, StepShape


class FreeVerify(StepCostModel):
    """A step with verify rows looks far cheaper than a decode-only one, so the
    speculation gate verifies every lookup draft at full length: tests of exactness need
    drafts whether or not they pay on this machine."""

    def predict(self, shape: StepShape) -> float | None:
        return 1.0 if shape.regime == "decode" else 1e-3


def always_draft(engine: Engine) -> Engine:
    engine.outputs.gate.cost = FreeVerify()
    return engine
