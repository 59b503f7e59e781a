"""``OpenAIBackend``'s request bodies per dialect and chat mode's role markup (the live
server tests are in tests/runtime/server/test_openai_backend_live.py)."""

from __future__ import annotations

import dataclasses

import pytest

from frontend_dsl.backend import GenParams
from frontend_dsl.errors import GenerationError
from frontend_dsl.openai_backend import OpenAIBackend
from frontend_dsl.output_constraint import make_constraint


def backend(dialect: str = "vllm") -> OpenAIBackend:
    return OpenAIBackend("http://x/v1/", "m", dialect=dialect)  # type: ignore[arg-type]


def test_every_gen_setting_goes_on_the_wire() -> None:
    # NOTE: a new GenParams field fails here until _sampling sends it (or refuses it).
    # run_id is no sampling setting: it names the run for a backend that keeps its states;
    # a thinking span's marker and budget stay home (the executor splits the text and
    # refuses a constraint or budget after a span on this backend).
    assert {f.name for f in dataclasses.fields(GenParams)} - {"run_id", "reasoning_end", "reasoning_budget"} == {
        "max_tokens", "stop", "temperature", "top_p", "top_k", "min_p", "seed", "constraint",
        "return_logprob", "speculation", "stop_token_ids", "stop_regex", "ignore_eos", "min_tokens",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "top_logprobs_num", "logprob_start_len"}
    params = GenParams(max_tokens=7, stop=(".",), temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, seed=4,
                       constraint=make_constraint("[0-9]+", None, None), stop_token_ids=(9,),
                       stop_regex=("x+",), ignore_eos=True, min_tokens=2, frequency_penalty=0.5,
                       presence_penalty=-0.5, repetition_penalty=1.2)
    body = backend()._sampling(params)
    assert body == {"model": "m", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
                    "stop": ["."], "temperature": 0.5, "top_p": 0.9, "seed": 4, "top_k": 3, "min_p": 0.1,
                    "guided_regex": "[0-9]+", "stop_token_ids": [9], "stop_regex": ["x+"], "ignore_eos": True,
                    "min_tokens": 2, "frequency_penalty": 0.5, "presence_penalty": -0.5,
                    "repetition_penalty": 1.2}
    assert backend("sglang")._sampling(GenParams(constraint=make_constraint("a+", None, None)))["regex"] == "a+"


def test_json_schema_goes_as_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = backend("openai")._sampling(GenParams(constraint=make_constraint(None, schema, None, strict=True)))
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema, "strict": True}}


@pytest.mark.parametrize(("params", "message"), [
    (GenParams(top_k=3), "top_k is not an OpenAI API field"),
    (GenParams(min_tokens=3), "min_tokens is not an OpenAI API field"),
    (GenParams(constraint=make_constraint("a+", None, None)),
     "a regex constraint needs a server extension that dialect 'openai' does not have"),
    (GenParams(constraint=make_constraint(None, None, "start: \"a\"")), "a grammar constraint needs"),
])
def test_what_plain_openai_lacks_is_a_clear_error(params: GenParams, message: str) -> None:
    with pytest.raises(GenerationError, match=message):
        backend("openai")._sampling(params)


def test_bad_dialect() -> None:
    with pytest.raises(ValueError, match="dialect must be"):
        backend("tgi")


def test_chat_markup_round_trips_to_messages() -> None:
    b = backend()
    assert b.chat_mode and b.eos_token_ids == []
    text = b.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "héllo"}],
                                 add_generation_prompt=True)
    ids = b.encode(text)
    assert b.decode(ids) == text
    assert b.codec.messages_for_gen(ids) == [{"role": "system", "content": "S"},  # type: ignore[union-attr]
                                             {"role": "user", "content": "héllo"}]
    with pytest.raises(GenerationError, match="must start its assistant message"):
        b.codec.messages_for_gen(b.encode(text + "Sure,"))  # type: ignore[union-attr]
    with pytest.raises(GenerationError, match="inside an assistant message"):
        b.codec.messages_for_gen(b.encode(text[: -len("\x02assistant\x03")]))  # type: ignore[union-attr]
