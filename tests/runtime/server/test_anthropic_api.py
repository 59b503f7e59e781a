"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) with the
official ``anthropic`` SDK against a live server: messages, stop sequences, tools (tool_use
and tool_result given back), streaming events, token counting."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from server_helpers import API_KEY

from runtime import SamplingParams

WEATHER: Any = {"name": "get_weather", "description": "Weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}
MESSAGES: Any = [{"role": "user", "content": "Name a colour."}]
GREEDY: Any = {"temperature": 0}  # NOTE: the SDK no longer takes temperature: as extra body


@pytest.fixture()
def client(server: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def greedy(engine: Any, messages: list[dict[str, str]], max_new_tokens: int, **kw: Any) -> Any:
    prompt = engine.apply_chat_template(messages)
    return engine.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **kw))[0]


def test_a_message_equals_the_chat_template_greedy_output(client: anthropic.Anthropic, engine: Any) -> None:
    got = client.messages.create(model="m", max_tokens=6, extra_body=GREEDY, messages=MESSAGES,
                                 system="Be terse.")
    want = greedy(engine, [{"role": "system", "content": "Be terse."}, *MESSAGES], 6)
    assert got.content[0].type == "text" and got.content[0].text == want.text
    assert got.stop_reason == "max_tokens" and got.role == "assistant"
    assert (got.usage.input_tokens, got.usage.output_tokens) == (len(want.prompt_token_ids), 6)
    counted = client.messages.count_tokens(model="m", messages=MESSAGES, system="Be terse.")
    assert counted.input_tokens == len(want.prompt_token_ids)


def test_a_stop_sequence_is_named(client: anthropic.Anthropic, engine: Any) -> None:
    full = greedy(engine, MESSAGES, 8).text
    stop = full[len(full) // 2:][:2]
    assert stop.strip()
    got = client.messages.create(model="m", max_tokens=8, extra_body=GREEDY, messages=MESSAGES, stop_sequences=[stop])
    assert got.content[0].text == greedy(engine, MESSAGES, 8, stop=(stop,)).text
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == stop


def test_tools_forced_and_results_given_back(client: anthropic.Anthropic) -> None:
    got = client.messages.create(model="m", max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert got.stop_reason == "tool_use"
    [use] = got.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo")
    follow = client.messages.create(model="m", max_tokens=4, extra_body=GREEDY, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}])
    assert follow.content[0].type == "text"  # a random model's auto answer is text
    several = client.messages.create(model="m", max_tokens=120, tools=[WEATHER],
                                     tool_choice={"type": "any"}, messages=[{"role": "user", "content": "?"}])
    assert several.content and all(b.type == "tool_use" for b in several.content)


def test_streaming_events(client: anthropic.Anthropic, engine: Any) -> None:
    with client.messages.stream(model="m", max_tokens=6, extra_body=GREEDY, messages=MESSAGES) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == greedy(engine, MESSAGES, 6).text and final.stop_reason == "max_tokens"
    with client.messages.stream(model="m", max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        called = stream.get_final_message()
    assert called.stop_reason == "tool_use" and called.content[0].type == "tool_use"
    assert called.content[0].input["city"] in ("Paris", "Oslo")


def test_structured_output(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    got = client.messages.create(model="m", max_tokens=40, messages=MESSAGES,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert got.stop_reason == "end_turn" and isinstance(json.loads(got.content[0].text)["n"], int)


@pytest.mark.parametrize(("fields", "said"), [
    ({"output_config": {"effort": "high"}}, "unknown field: output_config.effort"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking is not supported"),
    ({"colour": 1}, "unknown field: colour"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.source"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document' is not supported"),
])
def test_what_cannot_be_honoured_is_a_4xx(http: Any, fields: dict[str, Any], said: str) -> None:
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": MESSAGES, **fields})
    assert 400 <= r.status_code < 500, r.text
    assert said in r.json()["error"]["message"]


def test_the_api_key_header_of_anthropic_clients(http: Any, server: Any) -> None:
    import httpx

    body = {"model": "m", "max_tokens": 1, "messages": MESSAGES}
    ok = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=30)
    assert ok.status_code == 200 and json.loads(ok.text)["type"] == "message"
    bad = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "nope"}, timeout=30)
    assert bad.status_code == 401
