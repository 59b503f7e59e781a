"""``Ref``: a generated value used before it exists.

``s.ref("x")`` (and, while tracing, ``s["x"]``) returns a ``Ref`` instead of waiting for
``x``. Appending it to a state (``s += "Refine: " + s.ref("x")``) adds a ``var`` node that
depends on the node defining ``x``: the value's text is appended when it is ready, and
the program body never blocks, so every node after it is submitted at once. This is how
the request graph records a read as an edge.

Any other use needs the value itself (``if ref == ...``, ``int(ref)``, ``ref.strip()``,
an f-string): it resolves the reference, which under ``run`` waits for the value and
under ``trace`` ends the graph (control flow on a generated value, see ``tracer.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pydantic

from frontend_dsl.primitives import Expr, Seq


class Ref(Expr):
    """A reference to variable ``name`` as defined by graph node ``source`` (``key``: the
    entry of a join's gathered dict, None for the node's own value)."""

    __slots__ = ("_resolve", "key", "name", "source")

    def __init__(self, source: Any, key: str | None, name: str, resolve: Callable[[], Any]) -> None:
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_resolve", resolve)

    def value(self) -> Any:
        """The value itself: waits for it under ``run``; ends the graph under ``trace``."""
        return self._resolve()

    # ---- flowing into a prompt: stays lazy ----

    def __add__(self, other: Any) -> Any:
        if isinstance(other, str | Expr):
            return Seq((self, other))
        return self.value() + other

    def __radd__(self, other: Any) -> Any:
        if isinstance(other, str | Expr):
            return Seq((other, self))
        return other + self.value()

    def __repr__(self) -> str:
        return f"Ref({self.name!r}, node={getattr(self.source, 'id', None)})"

    # ---- anything else needs the value ----

    def __str__(self) -> str:
        return value_text(self.value())

    def __format__(self, spec: str) -> str:
        return format(self.value(), spec)

    def __bool__(self) -> bool:
        return bool(self.value())

    def __eq__(self, other: object) -> bool:
        return bool(self.value() == other)

    def __ne__(self, other: object) -> bool:
        return bool(self.value() != other)

    def __lt__(self, other: Any) -> bool:
        return bool(self.value() < other)

    def __le__(self, other: Any) -> bool:
        return bool(self.value() <= other)

    def __gt__(self, other: Any) -> bool:
        return bool(self.value() > other)

    def __ge__(self, other: Any) -> bool:
        return bool(self.value() >= other)

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return len(self.value())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.value())

    def __contains__(self, item: Any) -> bool:
        return item in self.value()

    def __getitem__(self, index: Any) -> Any:
        return self.value()[index]

    def __int__(self) -> int:
        return int(self.value())

    def __float__(self) -> float:
        return float(self.value())

    def __index__(self) -> int:
        return int(self.value().__index__())

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self.value(), attr)


def value_text(value: Any) -> str:
    """The text a variable's value contributes when appended to a prompt: strings as they
    are, pydantic objects and dicts as JSON, anything else by ``str``."""
    if isinstance(value, str):
        return value
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump_json()
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)
