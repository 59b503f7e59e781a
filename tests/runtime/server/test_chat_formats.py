"""Tool-call syntaxes and thinking spans per model family, the parsers alone on recorded
answers (as Qwen, Llama 3 and Mistral models write them), and their streaming splitters
fed in awkward pieces."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime.server.api.common.messages import ChatTool
from runtime.server.formats.reasoning import THINK, ReasoningStream, reasoning_format
from runtime.server.formats.tool_calls import (
    HERMES,
    JSON,
    LLAMA3_JSON,
    MISTRAL,
    ToolCallStream,
    renders_tools,
    tool_format,
)

TOOLS = [ChatTool.model_validate({"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}) for n in ("get_weather", "get_time")]


def calls(parsed: tuple[str | None, list[Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in parsed[1]]


def test_hermes_blocks_after_text_become_calls_and_content() -> None:
    # as Qwen 2.5 writes it (recorded): some words, then one block per call
    text = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>')
    parsed = HERMES.parse(text, TOOLS)
    assert parsed[0] == "Let me check both."
    assert calls(parsed) == [("get_weather", {"city": "Oslo"}), ("get_time", {"city": "Oslo"})]
    assert HERMES.parse(text, TOOLS, parallel=False) == (text, [])  # two calls, one allowed: content
    # a forced call (the prompt wrote the marker): the grammar ends with the JSON, unclosed
    forced = HERMES.forced_prefix + '{"name": "get_time", "arguments": {}}'
    assert calls(HERMES.parse(forced, TOOLS)) == [("get_time", {})]
    assert HERMES.parse("<tool_call>{not json}</tool_call>", TOOLS)[1] == []
    assert HERMES.parse("no calls at all", TOOLS) == ("no calls at all", [])


def test_llama3_json_with_python_tag_and_several_calls() -> None:
    one = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls(LLAMA3_JSON.parse(one, TOOLS)) == [("get_weather", {"city": "Paris"})]
    assert LLAMA3_JSON.parse(one, TOOLS)[0] is None
    two = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    assert [n for n, _ in calls(LLAMA3_JSON.parse(two, TOOLS))] == ["get_weather", "get_time"]
    assert LLAMA3_JSON.parse("It is sunny.", TOOLS) == ("It is sunny.", [])
    assert LLAMA3_JSON.call_schema(TOOLS[:1])["required"] == ["name", "parameters"]


def test_mistral_tool_calls_list() -> None:
    text = 'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"city": "Rome"}}, {"name": "get_weather", "arguments": {}}]'
    parsed = MISTRAL.parse(text, TOOLS)
    assert parsed[0] == "Sure."
    assert calls(parsed) == [("get_time", {"city": "Rome"}), ("get_weather", {})]
    assert MISTRAL.parse('[TOOL_CALLS] [{"name": "unknown", "arguments": {}}]', TOOLS)[1] == []


def test_arbor_json_answers_stay_as_they_were() -> None:
    assert calls(JSON.parse('[{"name": "get_time", "arguments": {}}]', TOOLS)) == [("get_time", {})]
    assert JSON.parse('Here: {"name": "get_time", "arguments": {}}', TOOLS)[1] == []


@pytest.mark.parametrize(("family", "template", "want"), [
    ("qwen3", None, HERMES), ("mistral", None, MISTRAL),
    ("llama", "{{ '<|python_tag|>' }}{% if tools %}{% endif %}", LLAMA3_JSON),
    ("llama", "{% for t in tools %}<tool_call>{% endfor %}", HERMES),
    ("llama", "[TOOL_CALLS]", MISTRAL), ("llama", "<|im_start|>{{ m }}", JSON), (None, None, JSON),
])
def test_the_format_comes_from_the_family_else_the_template(family: str | None, template: str | None,
                                                            want: Any) -> None:
    assert tool_format(family, template) is want


def test_reasoning_format_from_family_or_template() -> None:
    assert reasoning_format("qwen3", None) is THINK
    assert reasoning_format("llama", "{{ '<think>' }}...{{ '</think>' }}") is THINK
    assert reasoning_format("llama", "<|im_start|>") is None
    assert renders_tools("{% if tools %}x{% endif %}") and not renders_tools("<|im_start|>")


def test_where_the_prompt_leaves_the_span() -> None:
    assert THINK.prompt_state("<|im_start|>assistant\n<think>\n") == "open"
    assert THINK.prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"
    assert THINK.prompt_state("<|im_start|>assistant\n") == "none"
    assert THINK.split("I should add.\n</think>\n\n4") == ("I should add.", "4")
    assert THINK.split("<think>hm</think>ok") == ("hm", "ok")
    assert THINK.split("still thinking") == ("still thinking", "")


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7])
def test_streamed_thinking_splits_the_same_in_any_pieces(cut: int) -> None:
    text = "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4."
    stream = ReasoningStream(THINK)
    thinking, answer = "", ""
    for i in range(0, len(text), cut):
        t, a = stream.feed(text[i:i + cut])
        thinking, answer = thinking + t, answer + a
    thinking += stream.flush()
    assert (thinking, answer) == ("Let me see: 2+2.", "It is 4.")


@pytest.mark.parametrize("cut", [1, 3, 4])
def test_streamed_content_stops_at_the_calls_marker(cut: int) -> None:
    text = 'Checking <tool the weather.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    stream = ToolCallStream(HERMES)
    sent = "".join(stream.feed(text[i:i + cut]) for i in range(0, len(text), cut))
    assert sent == "Checking <tool the weather.\n"
    assert stream.rest().startswith("<tool_call>")
    held = ToolCallStream(JSON)  # a whole-answer format: everything waits for the end
    assert held.feed("hello") == "" and held.rest() == "hello"
