"""parse_output: finished outputs checked against their constraint, values built."""

from __future__ import annotations

import pytest

from grammars import (
    OutputMismatchError,
    RegexConstraint,
    TypeConstraint,
    is_valid_output,
    load_grammar,
    parse_output,
    to_constraint,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


def test_json_output_is_parsed_and_validated() -> None:
    assert parse_output(to_constraint(PERSON), '{"name": "Ada", "age": 36}') == {
        "name": "Ada",
        "age": 36,
    }


def test_json_output_violating_the_schema_says_why() -> None:
    with pytest.raises(OutputMismatchError, match="-1 is less than the minimum of 0"):
        parse_output(to_constraint(PERSON), '{"name": "Ada", "age": -1}')


def test_json_output_that_is_not_json() -> None:
    with pytest.raises(OutputMismatchError, match="not JSON"):
        parse_output(to_constraint(PERSON), '{"name": "Ada",')


def test_regex_is_a_full_match() -> None:
    constraint = RegexConstraint(r"[0-9]{3}")
    assert parse_output(constraint, "123") == "123"
    assert not is_valid_output(constraint, "1234")
    assert not is_valid_output(constraint, "12")


def test_choice_membership() -> None:
    constraint = to_constraint(["yes", "no"])
    assert parse_output(constraint, "no") == "no"
    assert not is_valid_output(constraint, "yes ")


@pytest.mark.parametrize(
    ("python_type", "text", "value"),
    [(int, "-42", -42), (float, "2.5e3", 2500.0), (float, "7", 7.0), (bool, "False", False),
     (str, '"a \\"q\\""', 'a "q"')],
)
def test_builtin_types_build_python_values(python_type: type, text: str, value: object) -> None:
    result = parse_output(to_constraint(python_type), text)
    assert result == value
    assert type(result) is python_type


@pytest.mark.parametrize(("type_name", "text"), [("int", "01"), ("bool", "true"), ("str", "abc")])
def test_builtin_type_mismatch(type_name: str, text: str) -> None:
    assert not is_valid_output(TypeConstraint(type_name), text)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("json", '{"a": [1, 2.5, "x"], "b": null}', '{"a": }'),
        ("arithmetic", "1 + 2 * (3 - 4) / 5", "1 + * 2"),
        ("sql_select", "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
         "SELECT FROM users"),
    ],
)
def test_shipped_grammars_parse_good_and_refuse_bad(name: str, good: str, bad: str) -> None:
    grammar = load_grammar(name)
    assert parse_output(grammar, good) == good
    with pytest.raises(OutputMismatchError):
        parse_output(grammar, bad)


def test_regex_shorthands_are_ascii() -> None:
    constraint = RegexConstraint(r"\d+")
    assert is_valid_output(constraint, "123")
    assert not is_valid_output(constraint, "١٢٣")  # Arabic-Indic digits
