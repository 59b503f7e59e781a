"""Every constraint field of the major servers, as the one constraint the engine takes.

    regex            SGLang (OpenAI extra body, /generate sampling_params)   regex
    guided_regex     vLLM                                                   regex
    guided_choice    vLLM                                                   one of the strings
    guided_json      vLLM (schema object or JSON text)                      JSON schema
    json_schema      SGLang /generate and extra body (JSON text or object)  JSON schema
    guided_grammar   vLLM (GBNF, or Lark)                                   grammar
    ebnf             SGLang (GBNF dialect)                                  grammar
    grammar          llama.cpp server (GBNF)                                grammar
    structured_outputs  vLLM >= 0.10: {json | regex | choice | grammar | json_object}

At most one may be given (with ``response_format`` counted too); anything that cannot be
honoured exactly is a 400 (``grammars.ConstraintError`` or ``InvalidRequestError``) — a
constraint is never dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import grammars
from grammars.ebnf import grammar_constraint
from runtime.errors import InvalidRequestError
from runtime.server import engine_constraints

CONSTRAINT_FIELDS = ("regex", "guided_regex", "guided_choice", "guided_json", "json_schema",
                     "guided_grammar", "ebnf", "grammar", "structured_outputs")
_STRUCTURED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                    "grammar": "guided_grammar"}


def constraint_from_fields(given: Mapping[str, Any], json_bounds: bool = True) -> tuple[str, Any] | None:
    """``(field name, constraint)`` of the one constraint field set in ``given`` (None if none).

    Args:
        given: field name → value, nulls left out, of the fields in ``CONSTRAINT_FIELDS``.
        json_bounds: bound number literals of JSON outputs (``grammars.JsonBounds``).
    """
    names = [n for n in CONSTRAINT_FIELDS if given.get(n) is not None]
    if len(names) > 1:
        raise InvalidRequestError(f"give at most one output constraint; got {', '.join(names)}")
    if not names:
        return None
    name = names[0]
    value = given[name]
    if name == "structured_outputs":
        return name, _structured_outputs(value, json_bounds)
    return name, one_constraint(name, value, json_bounds)


def one_constraint(name: str, value: Any, json_bounds: bool = True) -> Any:
    """The constraint of one field of ``CONSTRAINT_FIELDS`` (not ``structured_outputs``)."""
    if name in ("regex", "guided_regex"):
        return grammars.RegexConstraint(_text(name, value))
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"{name} must be a non-empty list of strings")
        return grammars.ChoiceConstraint(tuple(value))
    if name in ("guided_json", "json_schema"):
        return engine_constraints.json_schema(schema_object(name, value), json_bounds=json_bounds)
    return grammar_constraint(_text(name, value), source=name)


def schema_object(name: str, value: Any) -> dict[str, Any]:
    """A JSON schema given as an object or as JSON text (SGLang sends text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name} must be a JSON schema object")
    return value


def _structured_outputs(value: Any, json_bounds: bool) -> Any:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object")
    set_keys = [k for k, v in value.items() if v is not None and v is not False]
    unknown = [k for k in set_keys if k not in _STRUCTURED_KEYS and k != "json_object"]
    if unknown:
        raise InvalidRequestError(f"structured_outputs.{unknown[0]} is not supported "
                                  "(supported: json, regex, choice, grammar, json_object)")
    if len(set_keys) != 1:
        raise InvalidRequestError("structured_outputs needs exactly one of json, regex, choice, "
                                  f"grammar, json_object; got {set_keys or 'none'}")
    key = set_keys[0]
    if key == "json_object":
        return engine_constraints.json_schema({"type": "object"}, json_bounds=json_bounds)
    return one_constraint(_STRUCTURED_KEYS[key], value[key], json_bounds)


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string")
    return value
