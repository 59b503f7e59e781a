"""Hostile bodies on the SGLang, Responses and Anthropic endpoints: each a 4xx that says
why, never a 5xx (in-band stream errors included), and the engine's pages stay sound."""

from __future__ import annotations

import json
from typing import Any

import pytest

USER: Any = [{"role": "user", "content": "x"}]
BODIES: list[tuple[str, Any]] = [
    ("/generate", {"input_ids": [[]]}),
    ("/generate", {"input_ids": [[-1]]}),
    ("/generate", {"input_ids": [10**12]}),
    ("/generate", {"text": [""]}),
    ("/generate", {"text": "a", "sampling_params": {"n": 1000}}),
    ("/generate", {"text": "a", "return_logprob": [True], "logprob_start_len": [0, 1]}),
    ("/generate", {"text": ["a", "b"], "rid": ["x"]}),
    ("/generate", {"text": "a", "sampling_params": {"ebnf": "root ::= root"}}),
    ("/generate", {"text": "a", "sampling_params": {"top_k": -2}}),
    ("/generate", {"text": "a", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}),
    ("/generate", {"text": "a", "stream": True, "sampling_params": [{"regex": "("}]}),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": "{\"type\": \"bogus\"}"}}),
    ("/v1/responses", {"input": []}),
    ("/v1/responses", {"input": [{"type": "function_call"}]}),
    ("/v1/responses", {"input": "x", "tool_choice": "required",
                       "tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]}),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema"}}}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 10**9}),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}],
                       "tool_choice": {"type": "function", "name": "g"}}),
    ("/v1/responses", {"input": "x", "stream": True,
                       "text": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}}),
    ("/v1/messages", {"messages": [], "max_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "tool_use"}]}], "max_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "assistant", "content": [{"type": "tool_use"}]}], "max_tokens": 1}),
    ("/v1/messages", {"messages": USER, "max_tokens": 10**9}),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": [
        {"type": "image"}]}]}], "max_tokens": 2}),
    ("/v1/messages", {"messages": USER, "max_tokens": 2, "tool_choice": {"type": "tool"}, "tools": [{"name": "f"}]}),
    ("/v1/messages", {"messages": USER, "max_tokens": 2, "stream": True,
                      "output_config": {"format": {"type": "json_schema", "schema": {"type": 5}}}}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "\udcff"}]}),
]


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_hostile_bodies_get_a_4xx_that_says_why(http: Any, idle_engine: Any, path: str, body: Any) -> None:
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    message = r.json()["error"]["message"]
    assert isinstance(message, str) and message
