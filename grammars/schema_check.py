"""Checks a JSON schema against its metaschema and against what Arbor supports."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for

from grammars.errors import ConstraintError


def check_json_schema(schema: dict[str, Any]) -> None:
    """Raise ConstraintError unless ``schema`` is a valid, supported JSON schema.

    Validity is checked against the metaschema the schema's ``$schema`` names
    (draft 2020-12 when absent). Supported means: every ``$ref`` is local (``#...``).
    """
    validator_cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    # NOTE: no format checker here: a "pattern" in ECMA regex syntax that Python's
    # `re` rejects is still a valid schema; the grammar backend judges the pattern.
    error = best_match(validator_cls(validator_cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise ConstraintError(f"invalid JSON schema at {where}: {error.message}")
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise ConstraintError(
                f"unsupported JSON schema feature: non-local $ref {ref!r} "
                "(only refs inside the schema, starting with '#', are supported)"
            )


def _refs(node: Any) -> Iterator[str]:
    """Every ``$ref`` string anywhere in ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)
