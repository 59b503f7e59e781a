"""OpenAI's Responses API (``/v1/responses``) with the official ``openai`` SDK against a
live server: plain, instructions and previous_response_id, tools (function calls and
their outputs given back), structured output, streaming events."""

from __future__ import annotations

import json
from typing import Any

import openai
import pydantic
import pytest
from server_helpers import API_KEY

from runtime import SamplingParams

WEATHER: Any = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture()
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def greedy(engine: Any, messages: list[dict[str, str]], max_new_tokens: int) -> Any:
    prompt = engine.apply_chat_template(messages)
    return engine.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0))[0]


def test_plain_input_equals_the_chat_template_greedy_output(client: openai.OpenAI, engine: Any) -> None:
    got = client.responses.create(model="m", input="Name a colour.", max_output_tokens=6, temperature=0)
    want = greedy(engine, [{"role": "user", "content": "Name a colour."}], 6)
    assert got.output_text == want.text
    assert got.status == "incomplete" and got.incomplete_details is not None
    assert got.incomplete_details.reason == "max_output_tokens"
    assert got.usage is not None and got.usage.output_tokens == 6
    assert got.usage.input_tokens == len(want.prompt_token_ids)


def test_instructions_and_previous_response_id(client: openai.OpenAI, engine: Any) -> None:
    first = client.responses.create(model="m", input="Hi", instructions="Be terse.", max_output_tokens=4,
                                    temperature=0)
    assert first.output_text == greedy(engine, [{"role": "system", "content": "Be terse."},
                                                {"role": "user", "content": "Hi"}], 4).text
    second = client.responses.create(model="m", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    # NOTE: instructions are not carried over (the spec): the template's default system prompt applies
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    assert second.output_text == greedy(engine, history, 4).text
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="m", input="x", previous_response_id="resp-nope", max_output_tokens=2)
    unstored = client.responses.create(model="m", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not"):
        client.responses.create(model="m", input="y", previous_response_id=unstored.id, max_output_tokens=2)


def test_forced_tool_calls_and_their_outputs(client: openai.OpenAI, engine: Any) -> None:
    got = client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER],
                                  tool_choice={"type": "function", "name": "get_weather"},
                                  max_output_tokens=60, temperature=0)
    [call] = [item for item in got.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert got.status == "completed"
    follow = client.responses.create(
        model="m", previous_response_id=got.id, tools=[WEATHER], max_output_tokens=4, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.output[0].type == "message"  # the auto answer of a random model is text
    required = client.responses.create(model="m", input="Weather?", tools=[WEATHER], tool_choice="required",
                                       max_output_tokens=120, temperature=1.0)
    assert all(item.type == "function_call" for item in required.output) and required.output


def test_structured_output_with_parse(client: openai.OpenAI) -> None:
    class Point(pydantic.BaseModel):
        x: int
        y: int

    # NOTE: greedy and room for two bounded integers, so the object always completes (a
    # sampled answer cut at a small max_output_tokens depended on the engine's seed draw)
    got = client.responses.parse(model="m", input="A point:", text_format=Point, max_output_tokens=120,
                                 temperature=0)
    assert isinstance(got.output_parsed, Point)
    loose = client.responses.create(model="m", input="JSON:", max_output_tokens=40, temperature=1.0,
                                    text={"format": {"type": "json_object"}})
    assert loose.output_text.lstrip().startswith("{")


def test_streaming_events_in_the_spec_order(client: openai.OpenAI, engine: Any) -> None:
    events = list(client.responses.create(model="m", input="Name a colour.", max_output_tokens=6,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == greedy(engine, [{"role": "user", "content": "Name a colour."}], 6).text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the SDK's stream helper (it needs a completed response: a constrained answer ends)
    colour = {"format": {"type": "json_schema", "name": "c", "schema": {"enum": ["red", "blue"]}}}
    with client.responses.stream(model="m", input="Name a colour.", max_output_tokens=20, text=colour) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text in ('"red"', '"blue"')
    assert "".join(deltas) == final.output_text


def test_streamed_function_calls(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="m", input="Weather?", tools=[WEATHER], stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=60, temperature=0))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"] in ("Paris", "Oslo")
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].type == "function_call"


@pytest.mark.parametrize(("fields", "said"), [
    ({"reasoning": {"effort": "high"}}, "reasoning is not supported"),
    ({"background": True}, "background is not supported"),
    ({"colour": 1}, "unknown field: colour"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "'input_audio' is not supported"),
])
def test_what_cannot_be_honoured_is_a_4xx(http: Any, fields: dict[str, Any], said: str) -> None:
    r = http.post("/v1/responses", json={"model": "m", "input": "x", "max_output_tokens": 2, **fields})
    assert 400 <= r.status_code < 500, r.text
    assert said in r.json()["error"]["message"]
