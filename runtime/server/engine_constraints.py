"""Engine constraints (``SamplingParams.constraint``) from what a client sent: a native
``constraint`` object (``protocol.ConstraintSpec``) or an OpenAI ``response_format`` /
forced tool-call schema. The result is a ``grammars`` constraint object, validated before
the engine sees it.

An invalid schema, regex or grammar raises ``grammars.ConstraintError`` here (HTTP 400),
so a bad constraint never takes an engine slot.
"""

from __future__ import annotations

from typing import Any

import grammars
from runtime.server.protocol import ConstraintSpec


def from_spec(spec: ConstraintSpec) -> Any:
    """The ``SamplingParams.constraint`` for a native ``constraint`` object."""
    if spec.json_schema is not None:
        return json_schema(spec.json_schema)
    if spec.regex is not None:
        return grammars.RegexConstraint(spec.regex)
    if spec.choices is not None:
        return grammars.ChoiceConstraint(tuple(spec.choices))
    if spec.grammar is not None:
        return grammars.GrammarConstraint(spec.grammar)
    assert spec.type is not None
    return grammars.TypeConstraint(spec.type)


# NOTE: a stopgap until ``grammars`` has a whitespace option of its own: llguidance reads
# this key (other backends ignore it) and then allows no free whitespace between JSON
# tokens. Without it a weak model can fill max_tokens with newlines inside the object and
# the client gets truncated JSON, which OpenAI-style structured outputs never return.
COMPACT_WHITESPACE = {"x-guidance": {"whitespace_flexible": False}}


def json_schema(schema: dict[str, Any], compact: bool = False) -> Any:
    """A JSON-schema constraint (``{"type": "object"}`` for "any object").

    Args:
        schema: the JSON schema; invalid ones raise ``grammars.ConstraintError``.
        compact: forbid free whitespace (unless the schema sets its own ``x-guidance``).
    """
    if compact and "x-guidance" not in schema:
        schema = {**schema, **COMPACT_WHITESPACE}
    return grammars.to_constraint(schema)
