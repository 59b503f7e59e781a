"""Server tests: a tiny random Llama engine behind a live uvicorn server on 127.0.0.1.

The model is the shared session fixture ``tiny_llama_dir`` (tests/conftest.py): a 2-layer
random Llama with the SmolLM2 tokenizer, so every request is fast on two CPU cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import API_KEY, LiveServer, auth

from runtime import Engine

PROGRAMS_FILE = Path(__file__).parent / "programs_fixture.py"


@pytest.fixture(scope="session")
def engine(tiny_llama_dir: Path) -> Iterator[Any]:
    eng = Engine(model=str(tiny_llama_dir), num_pages=2048, max_model_len=512,
                 max_running_requests=32, num_threads=1, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def programs() -> dict[str, Any]:
    from runtime.server.hosting import load_programs

    return load_programs(PROGRAMS_FILE)


@pytest.fixture(scope="session")
def server(engine: Any, programs: dict[str, Any]) -> Iterator[LiveServer]:
    """One live server for the session: API key on, modest limits."""
    from runtime.server import ServerLimits, create_app

    limits = ServerLimits(max_inflight=64, max_body_bytes=256 * 1024, max_tokens=256,
                          request_timeout_s=30.0)
    app = create_app(engine, programs=programs, api_key=API_KEY, limits=limits, model_name="m")
    with LiveServer(app) as live:
        yield live


@pytest.fixture()
def idle_engine(engine: Any) -> Any:
    """The engine, idle and with sound page accounting before and after the test."""
    assert engine.wait_idle(30)
    engine.check_integrity()
    yield engine
    assert engine.wait_idle(30)
    engine.check_integrity()


@pytest.fixture()
def http(server: LiveServer) -> Iterator[Any]:
    import httpx

    with httpx.Client(base_url=server.url, headers=auth(), timeout=30) as client:
        yield client
