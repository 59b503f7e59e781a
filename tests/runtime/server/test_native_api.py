"""Native ``/generate`` (text, ids, streaming, logprobs, constraints), the tokenizer
endpoints, and the typed client against a live server."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from server_helpers import API_KEY

from runtime import SamplingParams
from runtime.server.api.sglang.schema import NativeSamplingParams
from runtime.server.client import ArborClient, ServerError

PROMPT = "Once upon a time"


@pytest.fixture()
def client(server: Any) -> Any:
    c = ArborClient(server.url, api_key=API_KEY, timeout=30)
    yield c
    c.close()


def greedy(engine: Any, n: int, **kw: Any) -> Any:
    return engine.generate(PROMPT, SamplingParams(max_new_tokens=n, temperature=0, **kw))[0]


def test_generate_text_matches_the_engine(http: Any, engine: Any) -> None:
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert r.status_code == 200
    body, want = r.json(), greedy(engine, 6)
    assert (body["text"], body["output_ids"], body["finish_reason"]) == (want.text, want.token_ids, "length")
    assert body["meta"]["prompt_tokens"] == len(want.prompt_token_ids)


def test_generate_stream_deltas_add_up(http: Any, engine: Any) -> None:
    want = greedy(engine, 6)
    events = []
    with http.stream("POST", "/generate", json={"input_ids": want.prompt_token_ids, "stream": True,
                                                "sampling_params": {"max_new_tokens": 6, "temperature": 0}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert "".join(e["delta_text"] for e in events) == want.text
    assert [t for e in events for t in e["delta_token_ids"]] == want.token_ids
    assert events[-1]["finish_reason"] == "length" and events[-1]["output_ids"] == want.token_ids


def test_client_tokenizer_endpoints(client: ArborClient, engine: Any) -> None:
    info = client.tokenizer_info()
    assert info.eos_token_ids == engine.eos_token_ids and info.max_model_len == engine.max_model_len
    text = "<|im_start|>user\nHi there<|im_end|>"
    ids = client.encode(text)
    assert ids == engine.tokenizer.encode(text, add_special_tokens=False) and ids[0] == 1
    assert client.decode(ids) == text
    messages = [{"role": "user", "content": "Hi"}]
    assert client.apply_chat_template(messages) == engine.apply_chat_template(messages)


def test_client_generate_stream_and_score(client: ArborClient, engine: Any) -> None:
    want = greedy(engine, 5, logprobs=True)
    ids = want.prompt_token_ids
    params = NativeSamplingParams(max_new_tokens=5, temperature=0, logprobs=True)

    async def run() -> tuple[Any, list[Any], list[float]]:
        whole = await client.generate(ids, params)
        chunks = [c async for c in client.generate_stream(ids, params)]
        scores = await client.score(ids + want.token_ids, start=len(ids))
        return whole, chunks, scores

    whole, chunks, scores = asyncio.run(run())
    assert whole.output_ids == want.token_ids and chunks[-1].output_ids == want.token_ids
    assert whole.meta.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    # the prompt logprobs of the greedy continuation are the sampled tokens' logprobs
    assert scores == pytest.approx(want.logprobs, abs=1e-3)


def test_client_raises_typed_errors(client: ArborClient) -> None:
    with pytest.raises(ServerError) as err:
        asyncio.run(client.generate([1, 2], NativeSamplingParams(max_new_tokens=100_000)))
    assert err.value.status == 400


def test_native_constraint_choice(http: Any) -> None:
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "constraint": {"choices": ["red", "green", "blue"]}}})
    assert r.status_code == 200 and r.json()["text"] in ("red", "green", "blue")


def test_native_constraint_json_schema(http: Any) -> None:
    schema = {"enum": ["north", "south", 7]}  # a top-level enum leaves no room for whitespace
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 30, "temperature": 0, "constraint": {"json_schema": schema}}})
    assert r.status_code == 200 and r.json()["finish_reason"] == "stop"
    assert json.loads(r.json()["text"]) in ("north", "south", 7)


def test_native_constraint_regex_and_type(http: Any) -> None:
    for constraint, check in (({"regex": "[a-c]{3}-[0-9]{2}"}, r"[a-c]{3}-[0-9]{2}"),
                              ({"type": "int"}, r"-?(0|[1-9][0-9]*)")):
        r = http.post("/generate", json={"text": PROMPT, "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, "constraint": constraint}})
        assert r.status_code == 200, r.text
        assert re.fullmatch(check, r.json()["text"]), r.json()["text"]


def test_logprob_start_len_reaches_the_engine(client: ArborClient, engine: Any) -> None:
    """Positions before ``logprob_start_len`` are not scored (so the cache may serve them)."""
    ids = greedy(engine, 1).prompt_token_ids
    params = NativeSamplingParams(max_new_tokens=0, prompt_logprobs=True, logprob_start_len=3)
    out = asyncio.run(client.generate(ids, params))
    lps = out.meta.prompt_logprobs
    assert lps is not None and all(lp is None for lp in lps[:3])
    assert all(lp is not None for lp in lps[3:])


def test_native_penalties_min_tokens_and_stop_regex(http: Any, engine: Any) -> None:
    sp = {"max_new_tokens": 8, "temperature": 0, "frequency_penalty": 1.0, "repetition_penalty": 1.2,
          "min_tokens": 3, "stop_regex": ["[0-9]"]}
    r = http.post("/generate", json={"text": "Count: 1 2 3", "sampling_params": sp})
    assert r.status_code == 200, r.text
    want = engine.generate("Count: 1 2 3", SamplingParams(**sp))[0]
    assert (r.json()["text"], r.json()["output_ids"]) == (want.text, want.token_ids)
    bad = http.post("/generate", json={"text": "x", "sampling_params": {"presence_penalty": 3}})
    assert bad.status_code == 400 and "presence_penalty must be in [-2, 2]" in bad.text
