"""The OpenAI wire models: every declared field does something or is refused with a 400
naming it; fields that cannot change the answer are ignored, as OpenAI clients expect."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.server.api.common.chat import render_chat
from runtime.server.api.common.messages import ChatMessageIn

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(("body", "message"), [
    ({**CHAT, "logit_bias": {"42": 5.0}}, "logit_bias is not supported"),
    ({**CHAT, "presence_penalty": 2.5}, "invalid sampling parameter: presence_penalty must be in [-2, 2], got 2.5"),
    ({**COMPLETION, "repetition_penalty": 0}, "invalid sampling parameter: repetition_penalty must be > 0 (1 = off), got 0.0"),
    ({**COMPLETION, "min_tokens": 5}, "invalid sampling parameter: min_tokens (5) must not exceed max_new_tokens (2)"),
    ({**COMPLETION, "stop_regex": "("}, "invalid sampling parameter: stop_regex '(' is not a valid regular expression: "
                                        "missing ), unterminated subpattern at position 0"),
    ({**COMPLETION, "regex": "a+", "guided_choice": ["a"]}, "give at most one output constraint; got regex, guided_choice"),
    ({**CHAT, "guided_regex": "a+", "response_format": {"type": "json_object"}},
     "give at most one output constraint; got response_format, guided_regex"),
    ({**COMPLETION, "logit_bias": {"42": 5.0}}, "logit_bias is not supported"),
    ({**COMPLETION, "echo": True, "stream": True}, "echo is not supported with stream"),
    ({**COMPLETION, "best_of": 2}, "best_of and suffix are not supported"),
    ({**COMPLETION, "suffix": "end"}, "best_of and suffix are not supported"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs=true"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "only text content parts are supported"),
])
def test_unsupported_fields_are_a_400_not_ignored(http: Any, body: dict[str, Any], message: str) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == message


def test_fields_that_cannot_change_the_answer_are_ignored(http: Any) -> None:
    plain = http.post("/v1/chat/completions", json={**CHAT, "temperature": 0}).json()
    tagged = http.post("/v1/chat/completions", json={
        **CHAT, "temperature": 0, "user": "u-1", "parallel_tool_calls": False, "store": False}).json()
    assert tagged["choices"] == plain["choices"]


class RecordingTemplate:
    """Stands in for the engine: records the messages the chat template gets."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        self.messages = messages
        return "prompt"


def test_message_name_and_tool_call_id_reach_the_chat_template() -> None:
    engine = RecordingTemplate()
    messages = [ChatMessageIn(role="user", content="hi", name="ada"),
                ChatMessageIn(role="tool", content="18 C", tool_call_id="call_1"),
                ChatMessageIn(role="developer", content="be brief")]
    render_chat(engine, messages, [], add_generation_prompt=True)
    assert engine.messages == [{"role": "user", "content": "hi", "name": "ada"},
                               {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
                               {"role": "system", "content": "be brief"}]
