"""Every constrained output is checked, on every path: native ``/generate``, OpenAI chat
``response_format`` and forced tool calls; strict schemas the grammar could only relax
are a 400 naming the keywords; ``/metrics`` counts relaxed grammars and failed outputs.

The relaxed schemas force their output whatever the (random) model: the grammar ignores
``not`` and admits only the one value the full schema then refuses (or accepts).
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from server_helpers import API_KEY, samples

RELAXED_INVALID = {"type": "string", "enum": ["a"], "not": {"const": "a"}}
RELAXED_VALID = {"const": "b", "not": {"const": "a"}}
NOT_ENFORCED = "keywords not enforced: not"
MESSAGES: list[Any] = [{"role": "user", "content": "Answer."}]


@pytest.fixture()
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def generate(http: Any, constraint: dict[str, Any], **params: Any) -> Any:
    return http.post("/generate", json={"text": "Output:", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "constraint": constraint, **params}})


def test_native_generate_flags_a_relaxed_output_that_fails_the_schema(http: Any) -> None:
    r = generate(http, {"json_schema": RELAXED_INVALID})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["text"], body["finish_reason"]) == ('"a"', "stop")
    check = body["meta"]["constraint_check"]
    assert (check["relaxed"], check["valid"], check["checked"]) == (NOT_ENFORCED, False, True)
    assert "should not be valid" in check["error"]
    ok = generate(http, {"json_schema": RELAXED_VALID}).json()["meta"]["constraint_check"]
    assert ok == {"relaxed": NOT_ENFORCED, "valid": True, "checked": True, "error": None}
    exact = generate(http, {"choices": ["x", "y"]}).json()["meta"]["constraint_check"]
    assert exact == {"relaxed": None, "valid": True, "checked": False, "error": None}


def test_native_stream_carries_the_check_on_its_last_event(http: Any) -> None:
    body = {"text": "Output:", "stream": True, "sampling_params": {
        "max_new_tokens": 8, "constraint": {"json_schema": RELAXED_INVALID}}}
    with http.stream("POST", "/generate", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["meta"]["constraint_check"]["valid"] is False


def test_native_strict_schema_that_would_be_relaxed_is_a_400_naming_the_keywords(http: Any) -> None:
    schema = {"type": "array", "uniqueItems": True, "items": {"type": "integer", "not": {"const": 0}}}
    r = generate(http, {"json_schema": schema, "strict": True})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_constraint"
    assert "strict JSON schema refused" in error["message"] and "not, uniqueItems" in error["message"]


def test_chat_response_format_flags_relaxed_outputs(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": RELAXED_INVALID}})
    choice = got.choices[0]
    assert (choice.message.content, choice.finish_reason) == ('"a"', "stop")
    check = (choice.model_extra or {})["constraint_check"]
    assert (check["relaxed"], check["valid"], check["checked"]) == (NOT_ENFORCED, False, True)


def test_chat_stream_flags_relaxed_outputs_on_the_final_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=8, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": RELAXED_VALID}}))
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert (finals[-1].model_extra or {})["constraint_check"]["valid"] is True


def test_chat_strict_response_format_is_a_400_naming_the_keywords(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"strict JSON schema refused.*not"):
        client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "a", "schema": RELAXED_VALID, "strict": True}})


def _tool(strict: bool | None = None) -> Any:
    parameters = {"type": "object", "properties": {"unit": RELAXED_INVALID}, "required": ["unit"],
                  "additionalProperties": False}
    function: dict[str, Any] = {"name": "convert", "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def test_forced_tool_call_flags_relaxed_arguments(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=40, tools=[_tool()], tool_choice="required")
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"unit": "a"}
    check = (choice.model_extra or {})["constraint_check"]
    assert (check["relaxed"], check["valid"]) == (NOT_ENFORCED, False)


def test_forced_strict_tool_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="strict JSON schema refused"):
        client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=40, tools=[_tool(strict=True)],
            tool_choice={"type": "function", "function": {"name": "convert"}})


def test_prometheus_counts_relaxed_compilations_and_failed_outputs(http: Any) -> None:
    before = samples(http.get("/metrics").text)
    schema = {"type": "string", "enum": ["z"], "not": {"const": "z"}}  # compiled here first
    assert generate(http, {"json_schema": schema}).status_code == 200
    assert generate(http, {"json_schema": schema}).status_code == 200
    after = samples(http.get("/metrics").text)

    def delta(name: str) -> float:
        return after[(name, ())] - before[(name, ())]

    assert delta("arbor_constraint_relaxed_compilations_total") == 1
    assert delta("arbor_constraint_outputs_checked_total") == 2
    assert delta("arbor_constraint_outputs_invalid_total") == 2
