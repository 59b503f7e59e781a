"""What a request's fields mean before any API reads them.

- **Unknown is an error.** A field no API declares is refused with a 400 that names it
  (dotted path, e.g. ``messages.0.foo``): a field the server does not understand may be
  a constraint or a setting the client counts on, and silently dropping it returns a
  wrong answer with a 200. A server started with ``--unknown-fields warn``
  (``ServerLimits.unknown_fields``) ignores them instead and names them in the
  ``X-Arbor-Ignored-Fields`` answer header.
- **Known but ignored** fields are listed per API with the reason (``IgnoredFields``);
  they never change what the server returns.
- **Known but refused** fields (a feature this server does not have) are a 400 when
  set to anything but null or their no-op value (``RefusedFields``).
- **Explicit null means the default**, as the OpenAI spec allows for its optional
  fields: a ``null`` value is dropped before validation (``WireModel``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from runtime.errors import InvalidRequestError

IGNORED_HEADER = "X-Arbor-Ignored-Fields"
UNKNOWN_POLICIES = ("error", "warn")

# dotted name (``*`` for a list index) → why it is ignored (the answer is the same
# whatever its value)
IgnoredFields = Mapping[str, str]
# name → (why it is refused, its accepted no-op value test)
RefusedFields = Mapping[str, tuple[str, Callable[[Any], bool]]]


class UnknownFieldError(InvalidRequestError):
    """A request carried fields the server does not understand (HTTP 400)."""


class WireModel(BaseModel):
    """A client-facing request shape: unknown fields are kept (``model_extra``) so the
    route can name them (``check_fields``); an explicit null is the field's default."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    keep_null: ClassVar[frozenset[str]] = frozenset()  # fields where null has a meaning of its own

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.keep_null}
        return data


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted paths of the fields of ``model`` (and its nested models) that no shape declares."""
    found = [prefix + str(k) for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        found += _nested(getattr(model, name), f"{prefix}{name}.")
    return found


def _nested(value: Any, prefix: str) -> list[str]:
    if isinstance(value, BaseModel):
        return unknown_fields(value, prefix)
    if isinstance(value, list):
        return [path for i, item in enumerate(value) for path in _nested(item, f"{prefix}{i}.")]
    return []


def check_fields(body: BaseModel, policy: str, ignored: IgnoredFields = {},  # noqa: B006 (read only)
                 refused: RefusedFields = {}) -> dict[str, str]:  # noqa: B006
    """Apply the field rules to a parsed request.

    Args:
        body: the parsed request (a ``WireModel``).
        policy: ``"error"`` (unknown fields are a 400) or ``"warn"`` (ignored, named in
            the returned header).
        ignored: fields this API accepts and ignores (dotted, ``*`` for any list index).
        refused: top-level fields this API knows and refuses unless at their no-op value.

    Returns:
        The headers to add to the answer (empty unless fields were ignored under ``warn``).

    Raises:
        InvalidRequestError: a refused field was set.
        UnknownFieldError: unknown fields under ``error``.
    """
    extra = body.model_extra or {}
    for name, (why, is_noop) in refused.items():
        if name in extra and not is_noop(extra[name]):
            raise InvalidRequestError(f"{name} is not supported: {why}")
    unknown = [p for p in unknown_fields(body)
               if p not in refused and not any(fnmatchcase(p, pattern) for pattern in ignored)]
    if not unknown:
        return {}
    if policy == "warn":
        return {IGNORED_HEADER: ", ".join(unknown)}
    raise UnknownFieldError(unknown_message(unknown))


def unknown_message(paths: list[str]) -> str:
    return (f"unknown field{'s' if len(paths) > 1 else ''}: {', '.join(paths)} (this server "
            "refuses fields it does not understand rather than ignore them; see docs/http-api.md)")


def is_false(value: Any) -> bool:
    return value is False


def is_empty(value: Any) -> bool:
    return value in ({}, [], "", False, 0)
