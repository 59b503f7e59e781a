"""Regex text for the constraints that are regular: regex, choice and built-in type.

The escaping below is understood alike by llguidance (Rust ``regex`` syntax),
outlines-core (``regex-automata``) and xgrammar (ECMAScript-like): punctuation is
backslash-escaped, control characters become ``\\xHH``, everything else is literal.
"""

from __future__ import annotations

from grammars import ChoiceConstraint, Constraint, RegexConstraint, TypeConstraint

_META = set("\\.+*?()|[]{}^$-/#&~")


def escape_literal(text: str) -> str:
    """A regex that matches exactly ``text``."""
    out = []
    for char in text:
        if char in _META:
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02X}")
        else:
            out.append(char)
    return "".join(out)


def choice_regex(choices: tuple[str, ...]) -> str:
    """Alternation of the escaped choices (one group, full match by the backend)."""
    return "(" + "|".join(escape_literal(c) for c in choices) + ")"


def regex_of(constraint: Constraint) -> str | None:
    """The constraint's regex, or None when it is not a regular constraint."""
    if isinstance(constraint, RegexConstraint):
        return constraint.pattern
    if isinstance(constraint, ChoiceConstraint):
        return choice_regex(constraint.choices)
    if isinstance(constraint, TypeConstraint):
        return constraint.regex
    return None
