"""The ``--fault-delay-ms`` test hook: generation requests wait, everything else does not."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.testclient import TestClient

from runtime.cli import build_parser
from runtime.server.fault import FaultDelayMiddleware


def test_generation_requests_are_delayed_and_other_routes_are_not() -> None:
    app = FastAPI()

    @app.post("/generate")
    def generate() -> dict[str, str]:
        return {"text": "same answer"}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    app.add_middleware(FaultDelayMiddleware, delay_s=0.3)
    client = TestClient(app)
    start = time.perf_counter()
    assert client.post("/generate").json() == {"text": "same answer"}  # NOTE: only slower, never different
    assert time.perf_counter() - start >= 0.3
    start = time.perf_counter()
    assert client.get("/health").status_code == 200
    assert time.perf_counter() - start < 0.3


def test_the_flag_is_off_by_default() -> None:
    assert build_parser().parse_args(["serve"]).fault_delay_ms == 0.0
    assert build_parser().parse_args(["serve", "--fault-delay-ms", "250"]).fault_delay_ms == 250.0
