"""GBNF (SGLang's ebnf, vLLM's guided_grammar, llama.cpp's grammar) as a Lark
``GrammarConstraint`` (``grammars/ebnf.py``)."""

from __future__ import annotations

import lark
import pytest

from grammars import ConstraintError
from grammars.ebnf import grammar_constraint, is_lark


def parser(text: str) -> lark.Lark:
    return lark.Lark(grammar_constraint(text).lark_text, start="start")


def test_lark_is_taken_as_is_and_gbnf_is_translated() -> None:
    assert is_lark('start: "a"') and not is_lark('root ::= "a"')
    assert grammar_constraint('start: "a" | "b"').lark_text == 'start: "a" | "b"'
    p = parser('root ::= "yes" | "no"')
    p.parse("yes")
    with pytest.raises(lark.exceptions.LarkError):
        p.parse("maybe")


def test_bounded_repetition_and_empty_rules_keep_their_meaning() -> None:
    p = parser('root ::= item ("," item){0,2}\nitem ::= [0-9]+ ws\nws ::= [ ]*')
    p.parse("1,22 ,3")  # ws may be empty: a rule, not a terminal (lark refuses empty terminals)
    with pytest.raises(lark.exceptions.LarkError):
        p.parse("1,2,3,4")  # at most two more items
    q = parser('root ::= [a-z]{2,3} "{1,2}"')  # braces inside a literal stay literal
    q.parse("ab{1,2}")
    with pytest.raises(lark.exceptions.LarkError):
        q.parse("a{1,2}")


@pytest.mark.parametrize(("text", "said"), [
    ("root ::= [a-z]{2,}", "without an upper bound"),
    ('root ::= "a" | missing', "not a valid GBNF grammar"),
    ("", "non-empty"),
    ("start: (", "grammar"),
])
def test_what_cannot_be_translated_exactly_is_refused(text: str, said: str) -> None:
    with pytest.raises(ConstraintError, match=said):
        grammar_constraint(text)


def test_a_grammar_that_matches_no_text_is_refused() -> None:
    with pytest.raises(ConstraintError, match="matches no text"):
        grammar_constraint("root ::= root")
    with pytest.raises(ConstraintError, match="matches no text"):
        grammar_constraint('start: a\na: a "y"')
    grammar_constraint('start: a | "x"\na: a "y" | "z"')  # recursion with an exit is fine
