"""Checks a JSON schema against its metaschema and against what Arbor supports."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import jsonschema
from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for

from grammars.errors import ConstraintError

# Nesting of objects and arrays in a schema document (``{"properties": {"a": {...}}}`` is
# two levels per property). The metaschema validator recurses about ten Python frames per
# level, so this bound keeps it far from the interpreter's recursion limit even on a
# server's deep call stack; EngineConfig.schema_max_depth may only lower it.
MAX_SCHEMA_DEPTH = 64


def check_json_schema(schema: dict[str, Any], max_depth: int = MAX_SCHEMA_DEPTH) -> None:
    """Raise ConstraintError unless ``schema`` is a valid, supported JSON schema.

    Validity is checked against the metaschema the schema's ``$schema`` names
    (draft 2020-12 when absent). Supported means: nested at most ``max_depth`` objects and
    arrays deep, every ``$ref`` local (``#...``), and no cycle of references that never
    passes through a property or an item (such a schema has no instance at all).
    """
    depth = json_depth(schema)
    if depth > max_depth:
        raise ConstraintError(f"JSON schema too deep: it nests {depth} levels of objects and arrays; "
                              f"the limit is {max_depth} (schema_max_depth)")
    validator_cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    # NOTE: no format checker here: a "pattern" in ECMA regex syntax that Python's
    # `re` rejects is still a valid schema; the grammar backend judges the pattern.
    try:
        error = best_match(validator_cls(validator_cls.META_SCHEMA).iter_errors(schema))
    except RecursionError:  # a backstop: max_depth is meant to keep this from happening
        raise ConstraintError("JSON schema too deeply nested to validate") from None
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise ConstraintError(f"invalid JSON schema at {where}: {error.message}")
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise ConstraintError(
                f"unsupported JSON schema feature: non-local $ref {ref!r} "
                "(only refs inside the schema, starting with '#', are supported)"
            )
    cycle = ref_cycle(schema)
    if cycle is not None:
        raise ConstraintError(
            "JSON schema $ref cycle: " + " -> ".join(cycle) + " (a schema that must match itself "
            "before any property or item has no instance; recursion through properties or items is fine)")


def json_depth(node: Any) -> int:
    """Nesting depth of dicts and lists in ``node`` (a scalar: 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(node, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def ref_cycle(schema: dict[str, Any]) -> list[str] | None:
    """A cycle of schemas that each must match the next without consuming any input, as
    the pointers along it (``["#/$defs/a", "#/$defs/a"]``), or None.

    Such a step is a ``$ref``, an ``allOf`` member, or the only member of an ``anyOf`` /
    ``oneOf``; a reference that cannot be resolved here ends the walk (the grammar backend
    reports it). A depth-first search without recursion: each pointer is entered once.
    """
    done: set[str] = set()
    for start in _ref_pointers(schema):
        if start in done:
            continue
        path = [start]
        on_path = {start}
        steps = [iter(list(_unconsumed_steps(resolve_pointer(schema, start), start)))]
        while steps:
            nxt = next(steps[-1], None)
            if nxt is None:
                steps.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif nxt in on_path:
                return [*path[path.index(nxt):], nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                steps.append(iter(list(_unconsumed_steps(resolve_pointer(schema, nxt), nxt))))
    return None


def _unconsumed_steps(node: Any, pointer: str) -> Iterator[str]:
    """Pointers of the schemas ``node`` must also match at the same position of the input."""
    if not isinstance(node, dict):
        return
    if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
        yield _normal(node["$ref"])
    for key in ("allOf", "anyOf", "oneOf"):
        members = node.get(key)
        if isinstance(members, list) and (key == "allOf" or len(members) == 1):
            yield from (f"{pointer.rstrip('/')}/{key}/{i}" for i in range(len(members)))


def _ref_pointers(schema: dict[str, Any]) -> Iterator[str]:
    yield "#"
    for ref in _refs(schema):
        if ref.startswith("#"):
            yield _normal(ref)


def _normal(ref: str) -> str:
    return "#" if ref in ("#", "#/") else ref


def resolve_pointer(root: Any, pointer: str) -> Any:
    """The node a local JSON pointer (``#/$defs/a``) names, or None (anchors included)."""
    if pointer == "#":
        return root
    if not pointer.startswith("#/"):
        return None
    node = root
    for raw in pointer[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _refs(node: Any) -> Iterator[str]:
    """Every ``$ref`` string anywhere in ``node``, without recursion."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in reversed(item.items()):  # NOTE: reversed: yielded in document order
                if key == "$ref" and isinstance(value, str):
                    yield value
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(reversed(item))
