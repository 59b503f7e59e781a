"""A reasoning model behind ``/v1/chat/completions``: a tiny random Llama whose chat
template (built here, Qwen 3's shape) has a ``<think>`` span and ``<tool_call>`` blocks.

What a user would see: the thinking comes back as ``reasoning_content`` (streamed as such
deltas), ``reasoning_budget`` closes it, and a JSON schema or a forced tool call is
enforced only after it (the random model writes noise while thinking, valid JSON after).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from server_helpers import API_KEY, LiveServer, auth

from runtime import Engine

TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}]
BUDGET = 6


@pytest.fixture(scope="module")
def thinking_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_thinking")
    shutil.copytree(tiny_llama_dir, out, dirs_exist_ok=True)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def url(thinking_dir: Path) -> Iterator[str]:
    from runtime.server import ServerLimits, create_app

    engine = Engine(model=str(thinking_dir), num_pages=512, max_model_len=512, num_threads=1, seed=0)
    limits = ServerLimits(max_tokens=256, request_timeout_s=60.0)
    try:
        with LiveServer(create_app(engine, api_key=API_KEY, limits=limits, model_name="m")) as live:
            yield live.url
    finally:
        engine.close()


def chat(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers=auth(), timeout=180,
                      json={"model": "m", "messages": MESSAGES, "temperature": 0, "max_tokens": 60, **body})


def test_thinking_is_returned_apart_and_the_schema_holds_only_after_it(url: str) -> None:
    r = chat(url, response_format=JSON_FORMAT, reasoning_budget=BUDGET)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"]  # the random model's free thinking
    assert "</think>" not in message["reasoning_content"] and "</think>" not in message["content"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop" and choice["constraint_check"]["valid"] is True
    # the thinking was not held to the schema: it is not JSON at all
    with pytest.raises(json.JSONDecodeError):
        json.loads(message["reasoning_content"])


def test_thinking_off_in_the_template_means_no_span(url: str) -> None:
    r = chat(url, response_format=JSON_FORMAT, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] is None
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    refused = chat(url, reasoning_budget=4, chat_template_kwargs={"enable_thinking": False})
    assert refused.status_code == 400 and "reasoning_budget" in refused.text
    assert chat(url, chat_template_kwargs={"tokenize": True}).status_code == 400


def test_streamed_thinking_and_answer_equal_the_whole_answer(url: str) -> None:
    whole = chat(url, response_format=JSON_FORMAT, reasoning_budget=BUDGET).json()["choices"][0]["message"]
    thinking, content = "", ""
    with httpx.stream("POST", url + "/v1/chat/completions", headers=auth(), timeout=60, json={
            "model": "m", "messages": MESSAGES, "temperature": 0, "max_tokens": 60, "stream": True,
            "response_format": JSON_FORMAT, "reasoning_budget": BUDGET}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                thinking += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    assert thinking == whole["reasoning_content"] and content == whole["content"]


def test_a_forced_tool_call_after_thinking_in_the_hermes_syntax(url: str) -> None:
    r = chat(url, tools=TOOLS, tool_choice="required", reasoning_budget=BUDGET, max_tokens=80)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])


def test_a_forced_tool_call_without_thinking_follows_the_written_marker(url: str) -> None:
    r = chat(url, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
             chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add"]


def test_a_model_without_a_thinking_span_refuses_a_budget(http: Any) -> None:
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "reasoning_budget": 4})
    assert r.status_code == 400 and "no thinking span" in r.text


@pytest.mark.parametrize("extra", [
    {"reasoning_budget": -1}, {"reasoning_budget": "many"}, {"reasoning_budget": 10**30},
    {"chat_template_kwargs": ["enable_thinking"]}, {"chat_template_kwargs": {"messages": []}},
    {"chat_template_kwargs": {"enable_thinking": {"deep": [None, 1.5]}}},
    {"reasoning_budget": 0, "response_format": JSON_FORMAT, "max_tokens": 1},
])
def test_hostile_reasoning_fields_are_4xx_or_answered(url: str, extra: dict[str, Any]) -> None:
    r = chat(url, **extra)
    assert r.status_code < 500, (extra, r.status_code, r.text)
    if r.status_code == 200:  # answered: the span closes at once, the answer may be cut
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_messages_and_responses_force_calls_in_the_family_syntax(url: str, thinking_dir: Path) -> None:
    """The Anthropic and Responses APIs read the same Hermes syntax: the template renders
    the tools, a forced call is generated after the ``<tool_call>`` marker the server
    writes (the prompt's token count shows both), and comes back whole."""
    from transformers import AutoTokenizer

    params = TOOLS[0]["function"]["parameters"]
    tokenizer = AutoTokenizer.from_pretrained(thinking_dir)
    rendered = tokenizer.apply_chat_template(MESSAGES, tools=[{"type": "function", "function": {
        "name": "add", "parameters": params}}], add_generation_prompt=True, tokenize=False)
    want_prompt = tokenizer(rendered + "<tool_call>\n", add_special_tokens=False)["input_ids"]
    r = httpx.post(url + "/v1/messages", headers=auth(), timeout=180, json={
        "model": "m", "max_tokens": 60, "temperature": 0, "messages": MESSAGES,
        "tools": [{"name": "add", "input_schema": params}], "tool_choice": {"type": "any"}})
    assert r.status_code == 200, r.text
    (use,) = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert use["name"] == "add" and r.json()["stop_reason"] == "tool_use"
    assert r.json()["usage"]["input_tokens"] == len(want_prompt)
    jsonschema.validate(use["input"], params)
    r = httpx.post(url + "/v1/responses", headers=auth(), timeout=180, json={
        "model": "m", "max_output_tokens": 60, "temperature": 0, "input": "What is 2 + 2?",
        "tools": [{"type": "function", "name": "add", "parameters": params}], "tool_choice": "required"})
    assert r.status_code == 200, r.text
    (call,) = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert call["name"] == "add"
    jsonschema.validate(json.loads(call["arguments"]), params)
