"""Chat roles, rendered exactly through the model's chat template.

A role segment is the template's own rendering cut around a sentinel content:

    render(previous + [{"role": r, "content": SENTINEL}]) - render(previous)
        = prefix + SENTINEL + suffix

so ``prefix + content + suffix`` appended per message reproduces
``apply_chat_template(messages)`` character for character (default system prompts
included). Only the ROLES of earlier messages are needed, never their content, so the
text is known before any generation runs. Templates whose rendering of a conversation is
not a prefix of the rendering of a longer one cannot be split this way; they raise.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from frontend_dsl.backend import Backend
from frontend_dsl.errors import ProgramDefinitionError
from frontend_dsl.primitives import Expr

ROLES = ("system", "user", "assistant")
_SENTINEL = "\x1eARBOR-CONTENT\x1e"


@dataclass(frozen=True)
class Role(Expr):
    """A whole message: the role's prefix, ``content``, then its suffix."""

    role: str
    content: tuple[Expr | str, ...]


def system(*content: Expr | str) -> Role:
    """A system message; ``content`` may mix text and expressions such as ``gen``."""
    return Role("system", content)


def user(*content: Expr | str) -> Role:
    """A user message; ``content`` may mix text and expressions."""
    return Role("user", content)


def assistant(*content: Expr | str) -> Role:
    """An assistant message; typically ``assistant(gen("answer"))``."""
    return Role("assistant", content)


def role_affixes(backend: Backend, previous_roles: tuple[str, ...], role: str) -> tuple[str, str]:
    """The text before and after the content of a ``role`` message that follows messages
    with ``previous_roles``."""
    return _affixes(backend, previous_roles, role)


@lru_cache(maxsize=4096)
def _affixes(backend: Backend, previous_roles: tuple[str, ...], role: str) -> tuple[str, str]:
    previous = [{"role": r, "content": f"m{i}"} for i, r in enumerate(previous_roles)]
    base = backend.apply_chat_template(previous) if previous else ""
    full = backend.apply_chat_template(previous + [{"role": role, "content": _SENTINEL}])
    if not full.startswith(base) or full.count(_SENTINEL) != 1:
        raise ProgramDefinitionError(
            f"the chat template cannot be rendered message by message (role {role!r})"
        )
    prefix, suffix = full[len(base):].split(_SENTINEL)
    return prefix, suffix
