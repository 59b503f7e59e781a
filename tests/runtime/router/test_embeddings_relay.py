"""``arbor router`` in front of a real server: ``/v1/embeddings`` (the official ``openai``
SDK, dimensions and pooling) reaches the worker and comes back unchanged, refusals too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from server_helpers import LiveServer

from runtime import Engine
from runtime.router.app import create_router_app
from runtime.router.config import HealthConfig, PolicyConfig


@pytest.fixture(scope="module")
def routed(tiny_llama_dir: Path) -> Iterator[tuple[str, Any]]:
    from runtime.server import create_app

    engine = Engine(model=str(tiny_llama_dir), num_pages=256, max_model_len=256, num_threads=1, seed=0)
    try:
        with LiveServer(create_app(engine, model_name="m")) as worker:
            app = create_router_app([worker.url], PolicyConfig(), HealthConfig(interval_s=0.1, timeout_s=2.0))
            with LiveServer(app) as router:
                yield router.url, engine
    finally:
        engine.close()


def test_the_router_relays_embeddings(routed: tuple[str, Any]) -> None:
    url, engine = routed
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    texts = ["The cat sat on the mat.", "Paris is in France."]
    ids = [list(engine.tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts]
    got = client.embeddings.create(model="m", input=texts)
    torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), engine.embed(ids))
    cut = client.embeddings.create(model="m", input=texts, dimensions=16, extra_body={"pooling": "mean"})
    torch.testing.assert_close(torch.tensor([d.embedding for d in cut.data]), engine.embed(ids, "mean", 16))
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="m", input="x", dimensions=1000)
