"""Engine constraints (``SamplingParams.constraint``) from what a client sent: a native
``constraint`` object (``api/common/wire.py`` ``ConstraintSpec``) or an OpenAI ``response_format`` /
forced tool-call schema. The result is a ``grammars`` constraint object, validated before
the engine sees it; ``check_info`` carries the engine's verdict on the output back.

An invalid schema, regex or grammar raises ``grammars.ConstraintError`` here (HTTP 400),
so a bad constraint never takes an engine slot; so does a compilation the engine refuses
(a strict schema the grammar could only relax), awaited before admission (``serving``).
"""

from __future__ import annotations

from typing import Any

import grammars
from runtime.output.request_output import ConstraintCheck
from runtime.server.api.common.wire import ConstraintCheckInfo, ConstraintSpec


def from_spec(spec: ConstraintSpec) -> Any:
    """The ``SamplingParams.constraint`` for a native ``constraint`` object."""
    if spec.json_schema is not None:
        return json_schema(spec.json_schema, strict=spec.strict, json_bounds=spec.json_bounds)
    if spec.regex is not None:
        return grammars.RegexConstraint(spec.regex)
    if spec.choices is not None:
        return grammars.ChoiceConstraint(tuple(spec.choices))
    if spec.grammar is not None:
        return grammars.GrammarConstraint(spec.grammar)
    assert spec.type is not None
    return grammars.TypeConstraint(spec.type)


def json_schema(schema: dict[str, Any], strict: bool = False, json_bounds: bool = True) -> Any:
    """A JSON-schema constraint (``{"type": "object"}`` for "any object").

    Args:
        schema: the JSON schema; invalid ones raise ``grammars.ConstraintError``.
        strict: refuse a schema the grammar could only relax (at compilation).
        json_bounds: bound number literals (``grammars.JsonBounds``); False lifts them.
    """
    bounds = grammars.DEFAULT_JSON_BOUNDS if json_bounds else None
    return grammars.to_constraint(schema, strict=strict, json_bounds=bounds)


def check_info(check: ConstraintCheck | None) -> ConstraintCheckInfo | None:
    """The wire form of ``RequestOutput.constraint_check``."""
    if check is None:
        return None
    return ConstraintCheckInfo(relaxed=check.relaxed, valid=check.valid, checked=check.checked,
                               error=check.error)
