"""to_constraint: every accepted input kind, stable keys, and every error."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Literal

import pydantic
import pytest

from grammars import (
    DEFAULT_JSON_BOUNDS,
    ChoiceConstraint,
    ConstraintError,
    GrammarConstraint,
    JsonBounds,
    JsonSchemaConstraint,
    RegexConstraint,
    TypeConstraint,
    load_grammar,
    shipped_grammars,
    to_constraint,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


class Person(pydantic.BaseModel):
    name: str
    age: int


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


def test_dict_becomes_json_schema_with_compact_text_in_schema_order() -> None:
    constraint = to_constraint(PERSON)
    assert isinstance(constraint, JsonSchemaConstraint)
    assert constraint.schema == PERSON
    assert constraint.schema_json.startswith('{"type":"object","properties":{"name":')


def test_keys_are_stable_and_property_order_matters() -> None:
    same = {"type": "object", "properties": dict(PERSON["properties"]), "required": ["name", "age"]}
    swapped = {**PERSON, "properties": {"age": {"type": "integer", "minimum": 0},
                                        "name": {"type": "string"}}}
    assert to_constraint(PERSON).key == to_constraint(same).key
    assert to_constraint(PERSON).key != to_constraint(swapped).key  # emitted in another order
    assert to_constraint(PERSON).key != to_constraint({"type": "object"}).key
    assert to_constraint(PERSON).key.startswith("json_schema:")


def test_keys_differ_across_kinds_with_the_same_text() -> None:
    assert RegexConstraint("int").key != TypeConstraint("int").key


def test_pydantic_model_class_becomes_its_json_schema() -> None:
    constraint = to_constraint(Person)
    assert isinstance(constraint, JsonSchemaConstraint)
    assert constraint.schema["required"] == ["name", "age"]


@pytest.mark.parametrize(
    "value", [["yes", "no"], ("yes", "no"), Literal["yes", "no"]], ids=["list", "tuple", "Literal"]
)
def test_choice_inputs(value: object) -> None:
    assert to_constraint(value) == ChoiceConstraint(("yes", "no"))


def test_str_enum_becomes_choice_of_values() -> None:
    assert to_constraint(Color) == ChoiceConstraint(("red", "green"))


@pytest.mark.parametrize("python_type", [int, float, bool, str])
def test_builtin_types(python_type: type) -> None:
    constraint = to_constraint(python_type)
    assert constraint == TypeConstraint(python_type.__name__)  # type: ignore[arg-type]


def test_constraint_objects_pass_through() -> None:
    regex = RegexConstraint(r"\d+")
    assert to_constraint(regex) is regex


def test_lark_path_becomes_grammar(tmp_path: Path) -> None:
    path = tmp_path / "yesno.lark"
    path.write_text('start: "yes" | "no"\n')
    constraint = to_constraint(path)
    assert isinstance(constraint, GrammarConstraint)
    assert constraint.lark_text == 'start: "yes" | "no"\n'


def test_shipped_grammars_load_by_name() -> None:
    assert {"json", "arithmetic", "sql_select"} <= set(shipped_grammars())
    for name in ("json", "arithmetic.lark", "sql_select"):
        constraint = load_grammar(name)
        assert isinstance(constraint, GrammarConstraint)
        assert "start" in constraint.lark_text


class TestOutlinesTypes:
    """outlines' output types are accepted wherever a constraint is."""

    def test_regex(self) -> None:
        from outlines.types import Regex

        assert to_constraint(Regex(r"[0-9]{3}")) == RegexConstraint(r"[0-9]{3}")

    def test_json_schema(self) -> None:
        from outlines.types import JsonSchema

        assert to_constraint(JsonSchema(PERSON)) == to_constraint(PERSON)

    def test_choice(self) -> None:
        from outlines.types import Choice

        assert to_constraint(Choice(["a", "b"])) == ChoiceConstraint(("a", "b"))

    def test_cfg(self) -> None:
        from outlines.types import CFG

        constraint = to_constraint(CFG('start: "a"+'))
        assert constraint == GrammarConstraint('start: "a"+')

    def test_regex_terms(self) -> None:
        from outlines import types

        constraint = to_constraint(types.integer)
        assert isinstance(constraint, RegexConstraint)
        assert constraint.pattern == types.integer.pattern


# --- errors ------------------------------------------------------------------------


def test_constraint_error_is_a_value_error() -> None:
    assert issubclass(ConstraintError, ValueError)


def test_schema_failing_the_metaschema_names_the_place() -> None:
    bad = {"type": "object", "properties": {"age": {"type": "integer", "minimum": "zero"}}}
    with pytest.raises(ConstraintError, match=r"invalid JSON schema at properties/age/minimum"):
        to_constraint(bad)


def test_unknown_json_type_is_invalid() -> None:
    with pytest.raises(ConstraintError, match="invalid JSON schema"):
        to_constraint({"type": "integr"})


def test_remote_ref_is_unsupported() -> None:
    with pytest.raises(ConstraintError, match="unsupported JSON schema feature: non-local"):
        to_constraint({"$ref": "https://example.com/person.json"})


def test_schema_text_that_is_not_json() -> None:
    with pytest.raises(ConstraintError, match="not JSON"):
        JsonSchemaConstraint("{type: object}")


def test_invalid_regex_names_the_pattern() -> None:
    with pytest.raises(ConstraintError, match=r"invalid regex 'a\(b'.*missing \)"):
        RegexConstraint("a(b")


def test_grammar_syntax_error_names_line_and_column() -> None:
    text = 'start: item+\nitem: "a" | "b" ]\n'
    with pytest.raises(ConstraintError, match=r"line 2, column 17"):
        GrammarConstraint(text)


def test_grammar_with_unclosed_paren_names_line_and_column() -> None:
    with pytest.raises(ConstraintError, match=r"line 1 column 13"):
        GrammarConstraint('start: "a" (')


def test_grammar_with_undefined_rule() -> None:
    with pytest.raises(ConstraintError, match="Rule 'item' used but not defined"):
        GrammarConstraint("start: item")


def test_grammar_without_start_rule() -> None:
    with pytest.raises(ConstraintError, match="invalid grammar"):
        GrammarConstraint('value: "a"')


def test_grammar_file_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.lark"
    path.write_text('start: "a"\n  | ]\n')
    with pytest.raises(ConstraintError, match=r"bad\.lark at line 2"):
        to_constraint(path)


def test_non_lark_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConstraintError, match=r"must end in \.lark"):
        to_constraint(tmp_path / "grammar.txt")


def test_unknown_shipped_grammar_lists_the_known_ones() -> None:
    with pytest.raises(ConstraintError, match="unknown grammar 'yaml'.*arithmetic"):
        load_grammar("yaml")


def test_unknown_type_is_refused() -> None:
    with pytest.raises(ConstraintError, match="unknown constraint type object"):
        to_constraint(object())


def test_bytes_type_is_unknown() -> None:
    with pytest.raises(ConstraintError, match="unknown constraint type type"):
        to_constraint(bytes)


def test_bare_string_is_ambiguous() -> None:
    with pytest.raises(ConstraintError, match="ambiguous"):
        to_constraint(r"\d+")


def test_unknown_builtin_type_name() -> None:
    with pytest.raises(ConstraintError, match="unknown built-in type 'complex'"):
        TypeConstraint("complex")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("choices", "message"),
    [([], "empty"), (["a", 1], "must be strings"), (["a", "a"], "distinct")],
)
def test_bad_choice_lists(choices: list[object], message: str) -> None:
    with pytest.raises(ConstraintError, match=message):
        to_constraint(choices)


def test_an_incomplete_constraint_object_is_refused() -> None:
    with pytest.raises(ConstraintError, match="incomplete RegexConstraint"):
        to_constraint(RegexConstraint.__new__(RegexConstraint))


def test_constraints_are_frozen_and_hashable() -> None:
    regex = RegexConstraint("a+")
    with pytest.raises(dataclasses.FrozenInstanceError):
        regex.pattern = "b"  # type: ignore[misc]
    assert len({regex, RegexConstraint("a+"), to_constraint(PERSON)}) == 2


def test_json_schemas_are_bounded_and_not_strict_by_default() -> None:
    plain = to_constraint(PERSON)
    assert isinstance(plain, JsonSchemaConstraint)
    assert (plain.strict, plain.bounds) == (False, DEFAULT_JSON_BOUNDS)
    assert JsonBounds(max_int_digits=20, max_frac_digits=16, max_exp_digits=3) == DEFAULT_JSON_BOUNDS


def test_strict_and_bounds_options_reach_dicts_and_models_and_change_the_key() -> None:
    plain = to_constraint(PERSON)
    strict = to_constraint(PERSON, strict=True)
    unbounded = to_constraint(Person, json_bounds=None)
    assert isinstance(strict, JsonSchemaConstraint) and strict.strict
    assert isinstance(unbounded, JsonSchemaConstraint) and unbounded.bounds is None
    assert len({plain.key, strict.key, to_constraint(PERSON, json_bounds=None).key}) == 3
    assert to_constraint(strict) is strict  # an object keeps its own options
    assert to_constraint(int, strict=True) == TypeConstraint("int")


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_json_bounds_must_be_positive_integers(bad: object) -> None:
    with pytest.raises(ConstraintError, match="max_frac_digits must be an integer >= 1"):
        JsonBounds(max_frac_digits=bad)  # type: ignore[arg-type]
