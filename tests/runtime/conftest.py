"""Runtime fixtures: the default-model engine, shared by the tests that need it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime import Engine


@pytest.fixture(scope="session")
def default_engine() -> Iterator[Engine]:
    engine = Engine(model="default", weights="fp32", page_size=16, num_pages=4096)
    yield engine
    engine.close()
