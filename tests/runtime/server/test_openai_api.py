"""The official ``openai`` client against a live server: completions, chat, streaming,
n / stop / seed / logprobs, response_format and tools."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from server_helpers import API_KEY

from runtime import SamplingParams

PROMPT = "The capital of France is"
MESSAGES: list[Any] = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture()
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def engine_text(engine: Any, prompt: str, max_new_tokens: int, **kw: Any) -> Any:
    return engine.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **kw))[0]


def test_models_lists_the_served_model(client: openai.OpenAI, engine: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["m"]  # the conftest server's served name


def test_completion_equals_the_engine_greedy_output(client: openai.OpenAI, engine: Any) -> None:
    got = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0)
    want = engine_text(engine, PROMPT, 6)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), 6)


def test_completion_token_prompt_and_logprobs(client: openai.OpenAI, engine: Any) -> None:
    ids = engine.tokenizer(PROMPT)["input_ids"]
    got = client.completions.create(model="m", prompt=ids, max_tokens=3, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == got.choices[0].text
    assert len(lp.token_logprobs or []) == 3 and all(len(t) == 2 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in
               zip(lp.top_logprobs, lp.token_logprobs or [], strict=True))


def test_completion_stream_concatenates_to_the_full_text(client: openai.OpenAI, engine: Any) -> None:
    chunks = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == engine_text(engine, PROMPT, 6).text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client: openai.OpenAI, engine: Any) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it)."""
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, temperature=0,
                                                 stream=True, stream_options=options))
    prompt_len = len(engine.tokenizer(engine.apply_chat_template(MESSAGES))["input_ids"])
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    done = [c.usage.completion_tokens for c in with_choices if c.usage is not None]
    assert done == sorted(done) and done[0] >= 1 and done[-1] == 6
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt_len
               and c.usage.total_tokens == prompt_len + c.usage.completion_tokens for c in with_choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6  # the final usage chunk
    # two prompts, two choices each: the usage covers every prompt and every choice so far
    chunks = list(client.completions.create(model="m", prompt=[PROMPT, PROMPT + " and"], max_tokens=3,
                                            temperature=0, n=2, stream=True, stream_options=options))
    done = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    final = chunks[-1].usage
    assert final is not None and not chunks[-1].choices
    assert len(done) == len([c for c in chunks if c.choices]) and done == sorted(done)
    assert done[-1] == final.completion_tokens and final.completion_tokens > 6  # more than one choice counted
    prompts = sum(len(engine.tokenizer(p)["input_ids"]) for p in (PROMPT, PROMPT + " and"))
    assert {c.usage.prompt_tokens for c in chunks if c.usage is not None} == {prompts}


def test_continuous_usage_stats_needs_include_usage(client: openai.OpenAI) -> None:
    """As on vLLM: without ``include_usage`` no chunk carries usage."""
    options: Any = {"continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, temperature=0,
                                                 stream=True, stream_options=options))
    assert chunks and all(c.usage is None for c in chunks)


def test_chat_completion_and_n_with_seed(client: openai.OpenAI, engine: Any) -> None:
    got = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, temperature=0)
    prompt = engine.apply_chat_template(MESSAGES)
    assert got.choices[0].message.content == engine_text(engine, prompt, 5).text
    assert got.choices[0].message.role == "assistant"
    seeded = [client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=1.0,
                                             seed=7, n=2) for _ in range(2)]
    texts = [[c.message.content for c in r.choices] for r in seeded]
    assert texts[0] == texts[1]  # same seed, same choices
    assert len(texts[0]) == 2 and texts[0][0] != texts[0][1]  # choice i uses seed + i


def test_chat_stream_stop_and_logprobs(client: openai.OpenAI, engine: Any) -> None:
    prompt = engine.apply_chat_template(MESSAGES)
    full = engine_text(engine, prompt, 8).text
    stop = full[len(full) // 2:][:3]
    assert stop.strip(), "need a non-blank stop string from the reference output"
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stop=[stop], logprobs=True, top_logprobs=1))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert tokens and all(len(t.top_logprobs) == 1 for t in tokens)


def test_chat_json_schema_response_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
              "required": ["colour"], "additionalProperties": False}
    got = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert got.choices[0].finish_reason == "stop"
    value = json.loads(got.choices[0].message.content or "")
    assert set(value) == {"colour"} and isinstance(value["colour"], str) and len(value["colour"]) <= 8


def test_chat_json_object_response_format(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40, temperature=0,
                                         response_format={"type": "json_object"})
    content, finish = got.choices[0].message.content or "", got.choices[0].finish_reason
    # A free-form object may outgrow max_tokens on a random model; a finished one must parse.
    assert content.startswith("{") and "\n" not in content
    if finish == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert finish == "length"


WEATHER_TOOL: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False}}}


def test_chat_forced_tool_call(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=40,
        temperature=0, tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_chat_tools_auto_answers_text_when_the_model_does_not_call(client: openai.OpenAI) -> None:
    # The tiny random model never writes a valid call: the answer is plain content.
    got = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        tools=[WEATHER_TOOL], tool_choice="auto")
    assert got.choices[0].message.tool_calls is None
    assert got.choices[0].message.content and got.choices[0].finish_reason == "length"


def test_tool_call_parsing_and_schema() -> None:
    from runtime.server.api.common.messages import ChatTool
    from runtime.server.formats.tool_calls import parse_tool_call, tool_call_schema

    tool = ChatTool.model_validate(WEATHER_TOOL)
    call = parse_tool_call(' <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', [tool])
    assert call is not None and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert parse_tool_call('{"name": "other", "arguments": {}}', [tool]) is None
    assert parse_tool_call("sunny", [tool]) is None
    schema = tool_call_schema([tool])
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["required"] == ["name", "arguments"]


def test_penalties_and_vllm_extensions_reach_the_engine(client: openai.OpenAI, engine: Any) -> None:
    """presence/frequency_penalty (OpenAI) and the extra-body fields vLLM and SGLang
    accept: repetition_penalty, min_tokens, stop_token_ids, ignore_eos, stop_regex."""
    extra: dict[str, Any] = {"repetition_penalty": 1.3, "min_tokens": 4, "ignore_eos": True}
    got = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0,
                                    frequency_penalty=1.2, presence_penalty=0.4, extra_body=extra)
    want = engine_text(engine, PROMPT, 10, frequency_penalty=1.2, presence_penalty=0.4, **extra)
    assert got.choices[0].text == want.text
    assert want.token_ids != engine_text(engine, PROMPT, 10, ignore_eos=True).token_ids  # penalties acted
    stop_id = want.token_ids[2]
    chat = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0,
                                          presence_penalty=1.0, extra_body={"stop_token_ids": [stop_id]})
    want_chat = engine_text(engine, engine.apply_chat_template(MESSAGES), 8, presence_penalty=1.0,
                            stop_token_ids=[stop_id])
    assert chat.choices[0].message.content == want_chat.text
    cut = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={
        "stop_regex": "[A-Za-z]{3}", "ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == engine_text(engine, PROMPT, 10, stop_regex=["[A-Za-z]{3}"], ignore_eos=True).text


def test_echo_scores_the_prompt_like_the_native_api(client: openai.OpenAI, engine: Any) -> None:
    """echo + logprobs + max_tokens=0: the legacy way to score text (what OpenAIBackend's
    select uses), equal to the engine's prompt logprobs."""
    ids = engine.tokenizer(PROMPT)["input_ids"]
    got = client.completions.create(model="m", prompt=ids, max_tokens=0, echo=True, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    lp = got.choices[0].logprobs
    assert got.choices[0].text == engine.tokenizer.decode(ids)
    assert lp is not None and lp.tokens == [f"token_id:{t}" for t in ids]
    want = engine.generate(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=0, prompt_logprobs=True))[0]
    assert lp.token_logprobs == want.prompt_logprobs and lp.token_logprobs[0] is None
    more = client.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    assert more.choices[0].text == PROMPT + engine_text(engine, PROMPT, 3).text
    assert more.choices[0].logprobs is not None and len(more.choices[0].logprobs.tokens or []) == len(ids) + 3


def test_regex_and_choice_extensions(client: openai.OpenAI) -> None:
    got = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"regex": "[0-9]{3}"})
    assert got.choices[0].text.isdigit() and len(got.choices[0].text) == 3
    got = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": ["Paris", "Lyon"]})
    assert got.choices[0].text in {"Paris", "Lyon"}


def test_unsupported_options_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, logit_bias={"5": 1.0})
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_chat_stream_with_n_choices(client: openai.OpenAI, engine: Any) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0,
                                                 n=2, stream=True, stream_options={"include_usage": True}))
    texts = ["", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    want = engine_text(engine, engine.apply_chat_template(MESSAGES), 4).text
    assert texts == [want, want]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 8
    assert usage.prompt_tokens == len(engine.tokenizer(engine.apply_chat_template(MESSAGES))["input_ids"])
