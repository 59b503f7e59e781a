"""SGLang's native wire shapes on ``/generate`` and its side routes, by raw HTTP
(``runtime/server/api/sglang/routes.py``; the real frontend is in test_sglang_frontend.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from runtime import SamplingParams

PROMPT = "The capital of France is"


def evictable(engine: Any) -> float:
    """Prefix-cache pages no request holds (what a flush frees)."""
    m = engine.metrics()
    return float(m["kv_pages_total"] - m["kv_pages_free"] - m["kv_pages_used"])


def greedy(engine: Any, prompt: str, max_new_tokens: int) -> Any:
    return engine.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0))[0]


def test_a_batch_answers_a_list_in_prompt_order(http: Any, engine: Any) -> None:
    prompts = ["Hello", PROMPT]
    r = http.post("/generate", json={"text": prompts, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [a["text"] for a in got] == [greedy(engine, p, 4).text for p in prompts]
    for answer in got:  # SGLang's meta_info beside Arbor's meta
        info = answer["meta_info"]
        assert info["finish_reason"] == {"type": "length", "length": 4} and info["completion_tokens"] == 4
        assert answer["finish_reason"] == "length" and answer["meta"]["completion_tokens"] == 4


def test_n_samples_come_sample_major_and_seeded(http: Any) -> None:
    body = {"text": ["Hello", "Bye"], "sampling_params": {"max_new_tokens": 5, "n": 2, "seed": 11}}
    first, again = (http.post("/generate", json=body).json() for _ in range(2))
    assert [a["text"] for a in first] == [a["text"] for a in again]  # seeded
    assert len(first) == 4
    one = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 5, "seed": 11}})
    assert first[0]["text"] == one.json()["text"]  # sample 0 of prompt 0 has the seed itself
    assert first[0]["text"] != first[2]["text"]  # sample 1 of prompt 0: seed + 1


def test_input_token_logprobs_in_sglang_shape(http: Any, engine: Any) -> None:
    ids = engine.tokenizer(PROMPT)["input_ids"]
    start = 1
    r = http.post("/generate", json={"input_ids": [ids], "return_logprob": True, "logprob_start_len": start,
                                     "return_text_in_logprobs": True,
                                     "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    [answer] = r.json()
    triples = answer["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in triples] == ids[start:]
    assert [text for _, _, text in triples] == [engine.tokenizer.decode([t]) for t in ids[start:]]
    logits = engine.score(ids)
    want = torch.log_softmax(logits.float(), dim=-1)
    assert triples[0][0] is None  # SGLang: the first position has no logprob
    for pos, (lp, token, _) in enumerate(triples[1:], start=start + 1):
        assert lp == pytest.approx(float(want[pos - 1, token]), abs=1e-3)
    assert answer["meta_info"]["output_token_logprobs"] == [] and answer["text"] == ""


def test_streaming_events_carry_the_text_so_far(http: Any, engine: Any) -> None:
    body = {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    with http.stream("POST", "/generate", json=body) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    want = greedy(engine, PROMPT, 6)
    assert all(e["text"] == "".join(x["delta_text"] for x in events[:i + 1]) for i, e in enumerate(events))
    assert events[-1]["text"] == want.text and events[-1]["output_ids"] == want.token_ids
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert events[0]["meta_info"]["finish_reason"] is None or len(events) == 1
    assert events[-1]["finish_reason"] == "length" and events[-1]["meta"]["completion_tokens"] == 6


def test_a_streamed_batch_tags_events_with_their_index(http: Any, engine: Any) -> None:
    prompts = ["Hello", PROMPT]
    body = {"text": prompts, "stream": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    with http.stream("POST", "/generate", json=body) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    finals = {e["index"]: e["text"] for e in events if e.get("finish_reason")}
    assert finals == {i: greedy(engine, p, 3).text for i, p in enumerate(prompts)}


def test_max_new_tokens_null_and_sglang_defaults(http: Any, engine: Any) -> None:
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": None, "top_k": -1, "temperature": 0, "stop": [], "stop_token_ids": [], "stop_regex": [],
        "json_schema": None, "regex": None, "spaces_between_special_tokens": True, "min_new_tokens": 0, "n": 1},
        "rid": "mine"})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["id"] == "mine"
    assert r.json()["meta_info"]["completion_tokens"] > 0


@pytest.mark.parametrize(("body", "said"), [
    ({"text": "x", "sampling_params": {"no_stop_trim": True}}, "no_stop_trim is not supported"),
    ({"text": "x", "image_data": "abc"}, "image_data is not supported"),
    ({"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "at most one output constraint"),
    ({"text": "x", "sampling_params": {"regex": "a", "constraint": {"regex": "b"}}}, "at most one output constraint"),
    ({"text": ["a", "b"], "sampling_params": [{}, {}, {}]}, "3 sampling_params for 2 prompts"),
    ({"text": [], "sampling_params": {}}, "empty"),
    ({"text": "x", "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2},
     "top logprobs of prompt tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 2, "speling": 1}}, "unknown field: sampling_params.speling"),
    ({"text": "x", "sampling_params": [{"max_new_tokens": 2, "speling": 1}]}, "sampling_params.0.speling"),
])
def test_what_cannot_be_honoured_is_a_400(http: Any, body: dict[str, Any], said: str) -> None:
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert said in r.json()["error"]["message"]


def test_model_info_server_info_and_flush_cache(http: Any, engine: Any, idle_engine: Any) -> None:
    info = http.get("/get_model_info").json()
    assert info["model_path"] == engine.config.model and info["is_generation"] is True
    assert http.get("/model_info").json() == info
    server = http.get("/server_info").json()
    assert server["context_length"] == engine.max_model_len and server == http.get("/get_server_info").json()
    http.post("/generate", json={"text": PROMPT * 8, "sampling_params": {"max_new_tokens": 1}})
    assert idle_engine.wait_idle(30)
    assert evictable(idle_engine) > 0
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert evictable(idle_engine) == 0  # pages other tests hold locked may stay
    assert http.get("/flush_cache").status_code == 200  # SGLang takes both methods
