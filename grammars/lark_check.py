"""Validates Lark grammar text with ``lark`` so errors name their line and column."""

from __future__ import annotations

import lark
from lark.exceptions import LarkError, UnexpectedInput

from grammars.errors import ConstraintError


def check_lark(text: str, source: str = "<grammar>") -> None:
    """Raise ConstraintError unless ``text`` is a Lark grammar with a ``start`` rule.

    Args:
        text: Lark grammar source.
        source: name used in the message (a file name or ``"<grammar>"``).
    """
    if not isinstance(text, str):
        raise ConstraintError(f"grammar must be text, got {type(text).__name__}")
    try:
        parser = lark.Lark(text, start="start")
    except UnexpectedInput as exc:
        raise ConstraintError(
            f"grammar syntax error in {source} at line {exc.line}, column {exc.column}: "
            f"{_first_line(str(exc))}"
        ) from None
    except LarkError as exc:
        raise ConstraintError(f"invalid grammar in {source}: {_first_line(str(exc))}") from None
    if "start" not in _productive(parser):
        # NOTE: a grammar that matches no text (start: start) compiles, then rejects every
        # token; refused here, not as a failed generation.
        raise ConstraintError(f"grammar {source} matches no text: its start rule never ends in terminals")


def _productive(parser: lark.Lark) -> set[str]:
    """Rules that derive at least one string of terminals (a fixpoint over the rules)."""
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for rule in parser.rules:
            name = rule.origin.name
            if name not in found and all(s.is_term or s.name in found for s in rule.expansion):
                found.add(name)
                changed = True
    return found


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message
