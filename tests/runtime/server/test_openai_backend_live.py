"""``OpenAIBackend`` against a live ``arbor serve`` through its OpenAI endpoint: the same
programs give the same result in-process, via ``RuntimeEndpoint`` and via OpenAI."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from server_helpers import API_KEY

from frontend_dsl import ProgramError, assistant, gen, program, select, system, tool, user
from frontend_dsl.openai_backend import OpenAIBackend
from frontend_dsl.runtime_endpoint import RuntimeEndpoint


class Flag(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    ok: bool


@tool
def double(x: int) -> int:
    """Double a number."""
    return 2 * x


@program
def extraction(s, topic: str):
    s += "Topic: " + topic + "\nCode:"
    s += gen("code", max_tokens=6, temperature=0, regex="[A-Z]{2}-[0-9]{3}")
    s += "\nAs JSON: "
    s += gen("flag", max_tokens=20, temperature=0, json_schema=Flag)
    s += "\nCall a tool: "
    s += gen("call", max_tokens=40, temperature=0, tools=[double])
    s += "\nNext:"
    s += gen("next", max_tokens=5, temperature=0, stop=["."])


@program
def chat(s, question: str):
    s += system("You answer briefly.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=6, temperature=0))
    s += user("And why?")
    s += assistant(gen("why", max_tokens=6, temperature=0))


@program
def chat_select(s):
    s += user("Pick one.")
    s += assistant(select("pick", ["red", "blue"]))


def _openai(server: Any, **kw: Any) -> OpenAIBackend:
    return OpenAIBackend(base_url=server.url + "/v1", model="m", api_key=API_KEY, timeout=60, **kw)


def _same(a: Any, b: Any, tokens: bool = True) -> None:
    assert a.variables() == b.variables()
    assert a.text() == b.text()
    if tokens:
        assert a.token_ids() == b.token_ids()


def test_same_program_in_process_runtime_endpoint_and_openai(server: Any, engine: Any,
                                                             programs: dict[str, Any]) -> None:
    endpoint = RuntimeEndpoint(server.url, api_key=API_KEY, timeout=30)
    try:
        local = programs["two_steps"].run(engine, topic="owls")
        _same(programs["two_steps"].run(endpoint, topic="owls"), local)
        _same(programs["two_steps"].run(_openai(server, tokenizer=engine.tokenizer), topic="owls"), local)
    finally:
        endpoint.client.close()


def test_constraints_and_tools_through_completions(server: Any, engine: Any) -> None:
    local = extraction.run(engine, topic="travel")
    remote = extraction.run(_openai(server, tokenizer=engine.tokenizer), topic="travel")
    _same(remote, local)
    assert isinstance(remote["flag"], Flag) and remote["call"].name == "double"


def test_chat_mode_runs_role_programs_over_chat_completions(server: Any, engine: Any) -> None:
    """No tokenizer: messages go to /v1/chat/completions, whose template renders them as
    the DSL's roles do in-process, so greedy answers agree."""
    local = chat.run(engine, question="What is tea?")
    remote = chat.run(_openai(server), question="What is tea?")
    assert remote.variables() == local.variables()


def test_chat_mode_refuses_what_a_chat_api_cannot_do(server: Any) -> None:
    backend = _openai(server)
    with pytest.raises(ProgramError, match="select needs log-probabilities"):
        chat_select.run(backend)
    with pytest.raises(ProgramError, match="every piece of text must be inside a role"):
        extraction.run(backend, topic="x")


def test_dialects_without_regex_raise_a_clear_error(server: Any, engine: Any) -> None:
    with pytest.raises(ProgramError, match="a regex constraint needs a server extension that dialect 'openai'"):
        extraction.run(_openai(server, tokenizer=engine.tokenizer, dialect="openai"), topic="x")


def test_server_errors_come_back_with_their_message(server: Any, engine: Any) -> None:
    backend = OpenAIBackend(base_url=server.url + "/v1", model="m", api_key="wrong", tokenizer=engine.tokenizer)
    with pytest.raises(ProgramError, match="answered 401"):
        programs_qa(backend)


def programs_qa(backend: Any) -> Any:
    @program
    def one(s):
        s += "Hi" + gen("x", max_tokens=2, temperature=0)

    return one.run(backend)


@program
def penalized(s, prompt: str):
    s += prompt
    s += gen("x", max_tokens=10, temperature=0, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5,
             repetition_penalty=1.3, min_tokens=2, stop_regex="zzz")
    s += gen("y", max_tokens=4, temperature=0, return_logprob=True, top_logprobs_num=3, logprob_start_len=2)


def test_penalties_and_logprobs_through_openai(server: Any, engine: Any) -> None:
    local = penalized.run(engine, prompt="one two three one two three one two")
    remote = penalized.run(_openai(server, tokenizer=engine.tokenizer), prompt="one two three one two three one two")
    _same(remote, local)
    ours, theirs = remote.get_meta("y"), local.get_meta("y")
    assert ours["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-4) and len(theirs["logprobs"]) == 4
    assert ours["prompt_logprobs"] == pytest.approx(theirs["prompt_logprobs"], abs=1e-4)
    assert [set(d) for d in ours["top_logprobs"]] == [set(d) for d in theirs["top_logprobs"]]
    assert all(len(d) == 3 for d in theirs["top_logprobs"])
