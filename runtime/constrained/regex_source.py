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


# Arbor regexes use ASCII shorthand classes (Python's re.ASCII, JSON Schema's ECMA-262):
# llguidance and outlines-core would read \d as every Unicode digit, of a newer Unicode
# version than Python's, so outputs like "٣" would pass the mask and fail validation.
_IN_CLASS = {"d": "0-9", "w": "0-9A-Za-z_", "s": r" \t\n\r\x0B\x0C"}
_OUTSIDE = {
    **{k: f"[{v}]" for k, v in _IN_CLASS.items()},
    **{k.upper(): f"[^{v}]" for k, v in _IN_CLASS.items()},
}


def ascii_shorthands(pattern: str) -> str:
    r"""``pattern`` with ``\d \w \s`` (and ``\D \W \S`` outside classes) spelled out
    as ASCII character classes, so every backend reads them as Python's re.ASCII does."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            table = _IN_CLASS if in_class else _OUTSIDE
            out.append(table.get(nxt, char + nxt))
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
            end = i + 1 + (pattern[i + 1 : i + 2] == "^")
            if pattern[end : end + 1] == "]":  # NOTE: "[]...]" and "[^]...]": "]" is literal
                end += 1
            out.append(pattern[i:end])
            i = end
            continue
        if char == "]" and in_class:
            in_class = False
        out.append(char)
        i += 1
    return "".join(out)


def regex_of(constraint: Constraint) -> str | None:
    """The constraint's regex, or None when it is not a regular constraint."""
    if isinstance(constraint, RegexConstraint):
        return ascii_shorthands(constraint.pattern)
    if isinstance(constraint, ChoiceConstraint):
        return choice_regex(constraint.choices)
    if isinstance(constraint, TypeConstraint):
        return constraint.regex
    return None
