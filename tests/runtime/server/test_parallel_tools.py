"""Parallel tool calls with the official ``openai`` client: several calls in one answer
when ``parallel_tool_calls`` allows it (a constrained list of calls, each against its
tool's schema), streamed as one delta per call index."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from server_helpers import API_KEY

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris and the time in UTC?"}]


@pytest.fixture()
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def ask(client: openai.OpenAI, seed: int, **kw: Any) -> Any:
    return client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                          max_tokens=120, temperature=1.0, seed=seed, **kw)


def calls_of(answer: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in answer.choices[0].message.tool_calls or []]


@pytest.fixture()
def several(client: openai.OpenAI) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    """A seed whose (seeded, hence reproducible) answer holds several calls."""
    for seed in range(24):
        calls = calls_of(ask(client, seed))
        if len(calls) >= 2:
            return seed, calls
    raise AssertionError("no seed in 0..23 gave several calls")


def test_required_with_parallel_calls_gives_several_valid_calls(
        client: openai.OpenAI, several: tuple[int, list[tuple[str, dict[str, Any]]]]) -> None:
    seed, calls = several
    answer = ask(client, seed)
    assert answer.choices[0].finish_reason == "tool_calls"
    assert calls_of(answer) == calls
    ids = [c.id for c in answer.choices[0].message.tool_calls or []]
    assert len(set(ids)) == len(ids)  # each call its own id
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])


def test_streamed_calls_come_as_one_delta_per_index(
        client: openai.OpenAI, several: tuple[int, list[tuple[str, dict[str, Any]]]]) -> None:
    seed, calls = several
    by_index: dict[int, tuple[str, str]] = {}
    finish = None
    for chunk in ask(client, seed, stream=True):
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            assert delta.index not in by_index  # one delta per call
            by_index[delta.index] = (delta.function.name or "", delta.function.arguments or "")
        finish = choice.finish_reason or finish
    assert sorted(by_index) == list(range(len(calls)))
    assert [(n, json.loads(a)) for n, a in (by_index[i] for i in sorted(by_index))] == calls
    assert finish == "tool_calls"


def test_without_parallel_calls_an_answer_is_one_call(
        client: openai.OpenAI, several: tuple[int, list[tuple[str, dict[str, Any]]]]) -> None:
    seed, _ = several
    single = calls_of(ask(client, seed, parallel_tool_calls=False))
    assert len(single) == 1 and single[0][0] in SCHEMAS
    named = client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=1.0, seed=seed,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [n for n, _ in calls_of(named)] == ["get_time"]  # a named choice is one call of it


def test_auto_answers_parse_lists_and_blocks_of_calls() -> None:
    from runtime.server.api.common.messages import ChatTool
    from runtime.server.formats.tool_calls import parse_tool_calls

    tools = [ChatTool.model_validate(t) for t in TOOLS]
    listed = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    assert [c.function.name for c in parse_tool_calls(listed, tools)] == ["get_weather", "get_time"]
    blocks = ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    assert [json.loads(c.function.arguments) for c in parse_tool_calls(blocks, tools)] == [
        {"zone": "UTC"}, {"city": "Paris"}]
    assert parse_tool_calls(listed, tools, parallel=False) == []  # several calls: not one call
    assert parse_tool_calls('[{"name": "nope", "arguments": {}}]', tools) == []
    assert parse_tool_calls("[]", tools) == [] and parse_tool_calls("the weather", tools) == []
