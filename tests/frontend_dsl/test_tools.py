"""@tool: schema from the signature; calls parsed, validated, executed; errors kept in state."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pydantic
import pytest

from frontend_dsl import ProgramDefinitionError, ToolCall, gen, program, tool
from frontend_dsl.fake_backend import FakeBackend
from frontend_dsl.tools import call_schema


class Point(pydantic.BaseModel):
    x: float
    y: float


@tool
def add(a: int, b: int = 1) -> int:
    """Add two integers."""
    return a + b


@tool
def norm(p: Point) -> float:
    """Length of a point."""
    return float((p.x**2 + p.y**2) ** 0.5)


@tool(name="explode")
def failing(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(f"boom: {reason}")


def test_schema_comes_from_the_signature() -> None:
    schema = add.parameters_schema()
    assert schema["properties"] == {"a": {"title": "A", "type": "integer"},
                                    "b": {"default": 1, "title": "B", "type": "integer"}}
    assert schema["required"] == ["a"]
    assert add.description == "Add two integers."
    assert add(2, 3) == 5  # still callable as a function
    assert failing.name == "explode"


def test_untyped_parameter_is_rejected() -> None:
    with pytest.raises(ProgramDefinitionError, match="type hint"):
        tool(lambda x: x)


def test_call_schema_accepts_exactly_valid_calls() -> None:
    schema = call_schema([add, norm])
    jsonschema.validate({"name": "add", "arguments": {"a": 2}}, schema)
    jsonschema.validate({"name": "norm", "arguments": {"p": {"x": 3, "y": 4}}}, schema)
    for bad in ({"name": "add", "arguments": {"a": "two"}}, {"name": "sub", "arguments": {}},
                {"name": "norm", "arguments": {"p": {"x": 3}}},
                {"name": "add", "arguments": {"a": 1, "c": 2}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def _agent(tools: list[Any]) -> Any:
    @program
    def agent(s: Any) -> None:
        s += "Action: " + gen("call", tools=tools, max_tokens=64)
        s += "\nDone."

    return agent


def test_a_call_is_executed_and_its_result_appended(make_fake: Callable[..., FakeBackend]) -> None:
    call_text = '{"name": "norm", "arguments": {"p": {"x": 3, "y": 4}}}'
    backend = make_fake(lambda r: call_text)
    state = _agent([add, norm]).run(backend)
    call: ToolCall = state["call"]
    assert (call.name, call.arguments, call.result, call.error) == ("norm", {"p": {"x": 3, "y": 4}}, 5.0, None)
    assert state.text() == f"Action: {call_text}\nObservation: 5.0\nDone."
    sent = backend.requests[0].params.constraint
    assert sent is not None and sent.value == call_schema([add, norm])  # the model is constrained


def test_a_raising_tool_puts_the_error_in_the_state(make_fake: Callable[..., FakeBackend]) -> None:
    backend = make_fake(lambda r: '{"name": "explode", "arguments": {"reason": "x"}}')
    state = _agent([failing]).run(backend)  # no exception: the program handles it
    call = state["call"]
    assert not call.ok and call.error == "RuntimeError: boom: x"
    assert state.text().endswith("\nObservation: Error: RuntimeError: boom: x\nDone.")


@pytest.mark.parametrize("text, error", [
    ('{"name": "add", "arguments": {"a": "two"}}', "ValidationError"),
    ('{"name": "sub", "arguments": {}}', "unknown tool 'sub'"),
    ("not json", "JSONDecodeError"),
])
def test_invalid_calls_are_reported_not_raised(make_fake: Callable[..., FakeBackend], text: str, error: str) -> None:
    state = _agent([add]).run(make_fake(lambda r: text))
    assert error in state["call"].error
    assert "Observation: Error:" in state.text()


def test_async_tools_are_awaited(make_fake: Callable[..., FakeBackend]) -> None:
    @tool
    async def echo(text: str) -> dict[str, str]:
        """Echo back."""
        return {"echo": text}

    backend = make_fake(lambda r: json.dumps({"name": "echo", "arguments": {"text": "hi"}}))
    state = _agent([echo]).run(backend)
    assert state["call"].result == {"echo": "hi"}
    assert 'Observation: {"echo": "hi"}' in state.text()


def test_tools_and_other_constraints_do_not_mix() -> None:
    with pytest.raises(ProgramDefinitionError):
        gen("x", tools=[add], regex="a")
