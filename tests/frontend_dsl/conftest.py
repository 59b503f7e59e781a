"""Fixtures for DSL tests: the default model's tokenizer, fake backends, engines."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def _prefer_project_packages() -> None:
    """pytest (prepend import mode) puts ``tests/`` on ``sys.path`` for the top-level
    conftest, where ``tests/frontend_dsl`` and ``tests/runtime`` would shadow the real
    packages as namespace packages. Put the repository root first and drop such shadows."""
    root = str(Path(__file__).resolve().parents[2])
    if sys.path[:1] != [root]:
        sys.path.insert(0, root)
    for name in ("frontend_dsl", "runtime"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) is None:
            del sys.modules[name]


_prefer_project_packages()

from frontend_dsl.fake_backend import FakeBackend, Responder  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.model.default_model import default_model_dir  # noqa: E402

TOKENIZER_DIR = default_model_dir()


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The default model's tokenizer (real chat template, real token boundaries)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture
def make_fake(tokenizer: Any) -> Callable[..., FakeBackend]:
    """Build a ``FakeBackend`` with the default tokenizer."""
    def make(responder: Responder | None = None, **kwargs: Any) -> FakeBackend:
        if responder is not None:
            kwargs["responder"] = responder
        return FakeBackend(tokenizer, **kwargs)

    return make


@pytest.fixture
def fake(make_fake: Callable[..., FakeBackend]) -> FakeBackend:
    return make_fake()


@pytest.fixture(scope="session")
def default_engine() -> Iterator[Any]:
    """The engine on the default model (SmolLM2-135M-Instruct), shared by the session."""
    engine = Engine(model="default")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir: Path) -> Iterator[Any]:
    """The engine on the project's tiny random-weight Llama (``tests/conftest.py``)."""
    engine = Engine(model=str(tiny_llama_dir))
    yield engine
    engine.close()


@pytest.fixture(params=[pytest.param("default", marks=pytest.mark.slow), "tiny"])
def engine(request: pytest.FixtureRequest) -> Any:
    """Each engine-level test runs on the default model and on the tiny random model (the
    default-model runs are slow: the quick run, ``-m "not slow"``, keeps the tiny ones)."""
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(scope="session")
def endpoint(tiny_engine: Any) -> Iterator[Any]:
    """A ``RuntimeEndpoint`` on a live HTTP server (uvicorn on 127.0.0.1) over the tiny engine."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "server"))
    from server_helpers import LiveServer

    from frontend_dsl.runtime_endpoint import RuntimeEndpoint
    from runtime.server import create_app

    with LiveServer(create_app(tiny_engine)) as live:
        yield RuntimeEndpoint(live.url)
