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
from runtime.model.default_model import default_model_dir  # noqa: E402

TOKENIZER_DIR = default_model_dir()


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The default model's tokenizer (real chat template, real token boundaries)."""
    if not TOKENIZER_DIR.exists():
        pytest.skip(f"default model tokenizer not found at {TOKENIZER_DIR}")
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


def _engine_class() -> Any:
    try:
        from runtime import Engine
    except Exception as exc:  # noqa: BLE001 - any import failure means "engine not ready"
        pytest.skip(f"runtime.Engine unavailable: {exc}")
    return Engine


@pytest.fixture(scope="session")
def default_engine() -> Iterator[Any]:
    """The engine on the default model (SmolLM2-135M-Instruct), shared by the session."""
    engine = _engine_class()(model="default")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir: Path) -> Iterator[Any]:
    """The engine on the project's tiny random-weight Llama (``tests/conftest.py``)."""
    engine = _engine_class()(model=str(tiny_llama_dir))
    yield engine
    engine.close()


@pytest.fixture(params=[pytest.param("default", marks=pytest.mark.slow), "tiny"])
def engine(request: pytest.FixtureRequest) -> Any:
    """Each engine-level test runs on the default model and on the tiny random model (the
    default-model runs are slow: the quick run, ``-m "not slow"``, keeps the tiny ones)."""
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture
def constrained_engine(engine: Any) -> Any:
    """``engine``, skipping the test while the engine ignores ``SamplingParams.constraint``."""
    if not _honours_constraints(engine):
        pytest.skip("the engine does not apply constraints yet")
    return engine


@pytest.fixture(scope="session")
def default_constraints_on(default_engine: Any) -> bool:
    """Whether the default engine applies constraints yet."""
    return _honours_constraints(default_engine)


def _honours_constraints(engine: Any) -> bool:
    """Whether the engine applies ``SamplingParams.constraint`` (a regex probe)."""
    from runtime import SamplingParams

    try:
        import grammars

        params = SamplingParams(max_new_tokens=3, temperature=0,
                                constraint=grammars.RegexConstraint("[0-9]{3}"))
        out = engine.generate("Write a word:", params)[0]
    except Exception:  # noqa: BLE001 - any failure means "not usable yet"
        return False
    return out.error is None and out.text.isdigit() and len(out.text) == 3
