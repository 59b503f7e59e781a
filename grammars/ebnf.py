"""Other servers' grammar texts as a ``GrammarConstraint``.

SGLang's ``ebnf`` and vLLM's ``guided_grammar`` take the GBNF dialect of llama.cpp
(``root ::= ...``; xgrammar reads the same), vLLM's other backends Lark. llguidance ships
the GBNF → Lark translation (``llguidance.gbnf_to_lark``); its output is llguidance's
Lark, which differs from the ``lark`` package's in two spellings, translated here:

    %llguidance {}     a header line            → dropped
    item{m,n} / {m}    bounded repetition       → item ~ m..n / item ~ m

A repetition without an upper bound (``{m,}``) has no ``lark`` spelling and is refused,
as is anything else the ``lark`` package cannot read: the grammar is refused (a
``ConstraintError``), never replaced by a looser one.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from grammars.constraints import GrammarConstraint
from grammars.errors import ConstraintError

_LARK_HEADER = re.compile(r"(?m)^\s*%llguidance\s*\{\s*\}\s*$")
_BOUNDED = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d+)\s*)?\}")
_OPEN_BOUNDED = re.compile(r"\{\s*\d+\s*,\s*\}")


def is_lark(text: str) -> bool:
    """Lark text (a ``start:`` rule or an ``%llguidance`` header), not GBNF."""
    return re.search(r"(?m)^\s*(%llguidance\b|\??start\s*:)", text) is not None


def grammar_constraint(text: str, source: str = "<grammar>") -> GrammarConstraint:
    """The constraint of a grammar given as Lark or GBNF text.

    Raises:
        ConstraintError: not text, not valid GBNF, or a translation ``lark`` cannot read.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConstraintError(f"{source}: a grammar must be non-empty text")
    lark_text = text if is_lark(text) else _terminals_as_rules(_gbnf_to_lark(text, source))
    lark_text = _LARK_HEADER.sub("", lark_text)
    if _OPEN_BOUNDED.search(_outside_literals(lark_text)):
        raise ConstraintError(f"{source}: a repetition without an upper bound ({{m,}}) is not supported")
    return GrammarConstraint(_translate_bounds(lark_text), name=source)


def _gbnf_to_lark(text: str, source: str) -> str:
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except Exception as exc:  # the translator raises bare Exceptions for unknown rules
        raise ConstraintError(f"{source}: not a valid GBNF grammar: {exc}") from None


def _terminals_as_rules(lark_text: str) -> str:
    """The translator's terminals (upper-case names) as rules.

    NOTE: GBNF has no lexer: every rule is a grammar rule, so rules keep its meaning
    (and ``lark`` refuses terminals that match the empty string, as ``ws ::= [ ]*`` does).
    """
    names = set(re.findall(r"(?m)^([A-Z_][A-Z0-9_]*)\s*:", lark_text))
    if not names:
        return lark_text
    word = re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b")
    return _outside(lark_text, lambda part: word.sub(lambda m: "t_" + m.group(1).lower(), part))


def _translate_bounds(lark_text: str) -> str:
    """``x{m,n}`` → ``x ~ m..n`` outside string and regex literals."""
    return _outside(lark_text, lambda part: _BOUNDED.sub(_tilde, part))


def _outside(text: str, edit: Callable[[str], str]) -> str:
    """``text`` with ``edit`` applied to the parts outside string and regex literals."""
    out, pos = [], 0
    for start, end in _literal_spans(text):
        out.append(edit(text[pos:start]))
        out.append(text[start:end])
        pos = end
    out.append(edit(text[pos:]))
    return "".join(out)


def _tilde(m: re.Match[str]) -> str:
    low, high = m.group(1), m.group(2)
    return f" ~ {low}" if high is None else f" ~ {low}..{high}"


_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*')


def _literal_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _LITERAL.finditer(text)]


def _outside_literals(text: str) -> str:
    return _LITERAL.sub('""', text)
