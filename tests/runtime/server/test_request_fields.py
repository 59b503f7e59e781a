"""Unknown is an error, null means the default, and every constraint field of the major
servers is honoured or refused (``runtime/server/api/common/fields.py``, ``constraint_fields.py``)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest
from server_helpers import LiveServer

from runtime import SamplingParams
from runtime.server import ServerLimits, create_app

MESSAGES = [{"role": "user", "content": "Name a colour."}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


def chat(http: Any, **fields: Any) -> httpx.Response:
    r: httpx.Response = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, **fields})
    return r


def chat_text(http: Any, **fields: Any) -> str:
    r = chat(http, max_tokens=24, temperature=0, **fields)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


# ---- unknown fields --------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "named"), [
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "guided_jsn": {}}, "guided_jsn"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x", "colour": 1}]},
     "messages.0.colour"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES,
                              "response_format": {"type": "json_object", "shema": {}}}, "response_format.shema"),
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 2, "top_n": 3}, "top_n"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1, "temprature": 0}},
     "sampling_params.temprature"),
    ("/generate", {"text": "Hi", "colour": 1}, "colour"),
])
def test_an_unknown_field_is_a_400_naming_it(http: Any, path: str, body: dict[str, Any], named: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]


def test_a_warn_server_ignores_unknown_fields_and_names_them_in_a_header(engine: Any) -> None:
    app = create_app(engine, limits=ServerLimits(unknown_fields="warn"), model_name="m")
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 2,
                                                    "colour": 1, "shade": "red"})
        assert r.status_code == 200, r.text
        assert r.headers["X-Arbor-Ignored-Fields"] == "colour, shade"
        streamed = http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2,
                                                      "stream": True, "colour": 1})
        assert streamed.status_code == 200 and streamed.headers["X-Arbor-Ignored-Fields"] == "colour"
        plain = http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
        assert "X-Arbor-Ignored-Fields" not in plain.headers


def test_the_server_flag_sets_the_policy_and_refuses_other_values() -> None:
    import argparse

    from runtime.server.launch import add_server_flags, limits_from_args

    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    assert limits_from_args(parser.parse_args([])).unknown_fields == "error"
    assert limits_from_args(parser.parse_args(["--unknown-fields", "warn"])).unknown_fields == "warn"
    with pytest.raises(ValueError, match="unknown_fields"):
        ServerLimits(unknown_fields="ignore")


def test_known_no_op_fields_are_accepted_and_refused_ones_are_400(http: Any) -> None:
    base = chat_text(http)
    assert chat_text(http, store=True, metadata={"k": "v"}, service_tier="auto", prompt_cache_key="x",
                     modalities=["text"], functions=[], parallel_tool_calls=True) == base
    for field, value in [("functions", [{"name": "f"}]), ("modalities", ["text", "audio"]),
                         ("audio", {"voice": "x"}), ("reasoning_effort", "high"),
                         ("web_search_options", {"x": 1})]:
        r = chat(http, max_tokens=2, **{field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["message"].startswith(f"{field} is not supported")


# ---- null is the default --------------------------------------------------------------------


def test_explicit_null_means_the_default(http: Any, engine: Any) -> None:
    nulls = {k: None for k in ("top_p", "presence_penalty", "frequency_penalty", "n", "logprobs",
                               "top_logprobs", "stop", "seed", "tools", "tool_choice", "response_format",
                               "stream_options", "user", "max_completion_tokens", "logit_bias")}
    got = chat_text(http, **nulls)
    prompt = engine.apply_chat_template(MESSAGES)
    assert got == engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0))[0].text
    r = http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": None, "temperature": 0,
                                           "echo": None, "logprobs": None, "suffix": None})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16  # the spec's default max_tokens


# ---- constraint fields -----------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "check"), [
    ({"regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
    ({"guided_regex": "(ab)+c"}, lambda t: re.fullmatch("(ab)+c", t)),
    ({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"json_schema": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ({"ebnf": 'root ::= digit{2,3} "!"\ndigit ::= [0-9]'}, lambda t: re.fullmatch("[0-9]{2,3}!", t)),
    ({"grammar": 'root ::= "a" ws "b"\nws ::= [ ]*'}, lambda t: re.fullmatch("a *b", t)),
    ({"guided_grammar": 'start: "x" | "y"'}, lambda t: t in ("x", "y")),  # Lark is taken as is
    ({"structured_outputs": {"regex": "[a-c]{4}"}}, lambda t: re.fullmatch("[a-c]{4}", t)),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    # NOTE: any object: a random model's string runs to the length cap, so only its start is checked
    ({"structured_outputs": {"json_object": True}}, lambda t: re.match(r'\{\s*("|\})', t)),
])
def test_every_constraint_field_is_honoured(http: Any, fields: dict[str, Any], check: Any) -> None:
    r = chat(http, max_tokens=40, temperature=1.0, seed=3, **fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if "json_object" not in json.dumps(fields):
        assert choice["finish_reason"] == "stop", choice  # the grammar ended, not the length cap
    assert check(choice["message"]["content"]), choice["message"]["content"]
    r = http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 40, "seed": 3, **fields})
    assert r.status_code == 200 and check(r.json()["choices"][0]["text"]), r.text


@pytest.mark.parametrize(("fields", "said"), [
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one output constraint; got regex, ebnf"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "response_format, guided_json"),
    ({"ebnf": 'root ::= "a" | missing'}, "not a valid GBNF grammar"),
    ({"ebnf": "root ::= [a-z]{2,}"}, "without an upper bound"),
    ({"guided_grammar": "start: ("}, "grammar"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema must be a JSON schema object"),
    ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag is not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern is not supported"),
])
def test_a_constraint_that_cannot_be_honoured_is_a_400(http: Any, fields: dict[str, Any], said: str) -> None:
    r = chat(http, max_tokens=4, **fields)
    assert r.status_code == 400, r.text
    assert said in r.json()["error"]["message"]
