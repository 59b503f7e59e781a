"""The wire shapes every API shares: the base models (``Strict``, ``Lenient``) and the parts
of the one internal request that more than one API sends or answers (Arbor's constraint
object, the retention hint, the verdict on a constrained output).

Only shapes and types are checked here (a failure is a 422); value checks that the engine
owns (temperature range, prompt length...) stay in the engine and come back as 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from runtime.server.api.common.fields import WireModel


class Strict(BaseModel):
    """Unknown fields are an error (native API: typos must not pass silently). Types are
    strict on both APIs: ``"5"`` is no integer and ``"true"`` no boolean (a 422)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Lenient(WireModel):
    """OpenAI API shapes: unknown fields are kept so the route can refuse them by name
    (``fields.py``: 400, or ignored with a header on a ``--unknown-fields warn``
    server); an explicit null means the default, as the OpenAI spec allows. Fields that
    would change the output and are not supported are declared and refused with a 400
    (``logit_bias``, ``best_of``...); the OpenAI fields that cannot change the output are
    listed, with why, in each API's ``IGNORED`` table (``api/openai/fields.py``).
    """

    # NOTE: types are strict too ("5" is no integer); extra fields are kept for fields.py
    model_config = ConfigDict(extra="allow", populate_by_name=True, strict=True)


class ConstraintSpec(Strict):
    """Exactly one of: a JSON schema, a regex, a list of choices, a Lark grammar, a type.

    For a JSON schema, ``strict`` refuses (400) a schema the grammar could only relax,
    and ``json_bounds: false`` lifts the bounds on number literals (``grammars.JsonBounds``).
    """

    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choices: list[str] | None = None
    grammar: str | None = None  # Lark grammar text
    type: Literal["int", "float", "bool", "str"] | None = None
    strict: bool = False
    json_bounds: bool = True

    @model_validator(mode="after")
    def _exactly_one(self) -> ConstraintSpec:
        given = [k for k in ("json_schema", "regex", "choices", "grammar", "type")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a constraint needs exactly one of json_schema, regex, choices, "
                             f"grammar, type; got {given or 'none'}")
        return self


class ConstraintCheckInfo(BaseModel):
    """Arbor's own field, on the final output of a constrained request
    (``runtime.ConstraintCheck``): was the output measured against the whole constraint?"""

    # NOTE: defaults, because a streamed chunk is sent with exclude_none (a None is absent).
    relaxed: str | None = None  # what the grammar did not enforce (the keywords); null: exact grammar
    valid: bool | None = None  # satisfies the whole constraint; null: cut by the length cap
    checked: bool  # parsed and checked (jsonschema...); false: valid by construction
    error: str | None = None  # why not, when valid is false


class RetentionHint(Strict):
    """Keep this request's prefix cached for the session's next request (docs/retention.md)."""

    session_id: str  # the caller's session; namespaced by tenant on the server
    ttl_s: float  # seconds to keep it after this request; the server caps it (a 400 above)
