"""``POST /v1/embeddings`` against a live server: the official ``openai`` SDK (which asks
for base64), every input shape, usage, batching, and bad inputs as 400s."""

from __future__ import annotations

import base64
import struct
from typing import Any

import openai
import pytest
import torch
from server_helpers import API_KEY

from runtime.server.api.embeddings.schema import MAX_INPUTS


@pytest.fixture()
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def ids_of(engine: Any, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=True)["input_ids"])


def test_the_sdk_gets_the_engine_embeddings(client: openai.OpenAI, engine: Any) -> None:
    texts = ["The cat sat on the mat.", "Paris is in France."]
    got = client.embeddings.create(model="m", input=texts)  # NOTE: the SDK asks for base64, decodes it
    want = engine.embed([ids_of(engine, t) for t in texts])
    assert [d.index for d in got.data] == [0, 1] and got.model == "m"
    torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), want)
    tokens = sum(len(ids_of(engine, t)) for t in texts)
    assert (got.usage.prompt_tokens, got.usage.total_tokens) == (tokens, tokens)


def test_every_input_shape_and_both_encodings(http: Any, engine: Any) -> None:
    hidden = engine.model.args.hidden_size
    ids = ids_of(engine, "hello world")
    want = engine.embed([ids])[0].tolist()
    for item in ("hello world", ["hello world"], ids, [ids]):
        r = http.post("/v1/embeddings", json={"input": item, "model": "m", "user": "u1", "dimensions": hidden})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        assert body["data"][0]["embedding"] == pytest.approx(want, abs=1e-6)
        assert body["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    r = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{hidden}f", raw)) == pytest.approx(want, abs=1e-6)


def test_a_batch_equals_its_items_one_by_one(http: Any) -> None:
    items = [[1, 5, 9, 20], [3, 4], [7] * 40, "a sentence"]
    batch = http.post("/v1/embeddings", json={"input": items}).json()["data"]
    for i, item in enumerate(items):
        alone = http.post("/v1/embeddings", json={"input": [item]}).json()["data"][0]["embedding"]
        assert batch[i]["index"] == i
        assert batch[i]["embedding"] == pytest.approx(alone, abs=1e-5)
        assert sum(x * x for x in alone) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("body", [
    {"input": []},
    {"input": ""},
    {"input": [[]]},
    {"input": ["ok", ""]},
    {"input": 5},
    {"input": {"text": "x"}},
    {"input": [1, "mixed"]},
    {"input": [[1, 2], [True]]},
    {"input": [1.5]},
    {"input": [-1]},
    {"input": [10**9]},
    {"input": [5] * 600},  # past max_model_len (512)
    {"input": ["x"] * (MAX_INPUTS + 1)},
    {"input": "x", "dimensions": 0},
    {"input": "x", "dimensions": 65},
    {"input": "x", "stream": True},
])
def test_bad_input_is_a_400(http: Any, body: dict[str, Any]) -> None:
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, (body, r.status_code, r.text)
    assert r.json()["error"]["message"]


def test_dimensions_cut_and_renormalize_and_pooling_is_asked_for(http: Any, engine: Any) -> None:
    ids = ids_of(engine, "hello world")
    r = http.post("/v1/embeddings", json={"input": ids, "dimensions": 8, "pooling": "mean"})
    assert r.status_code == 200, r.text
    got = r.json()["data"][0]["embedding"]
    assert got == pytest.approx(engine.embed([ids], "mean", 8)[0].tolist(), abs=1e-6)
    assert len(got) == 8 and sum(x * x for x in got) == pytest.approx(1.0, abs=1e-5)
    assert http.post("/v1/embeddings", json={"input": ids, "pooling": "max"}).status_code == 422


def test_a_wrong_encoding_format_is_a_validation_error(http: Any) -> None:
    r = http.post("/v1/embeddings", json={"input": "x", "encoding_format": "int8"})
    assert r.status_code == 422 and "encoding_format" in r.json()["error"]["message"]


def test_an_unknown_model_is_a_404(http: Any) -> None:
    assert http.post("/v1/embeddings", json={"input": "x", "model": "nope"}).status_code == 404
