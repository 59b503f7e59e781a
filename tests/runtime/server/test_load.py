"""200 concurrent mixed requests on loopback: each attempt completes or gets a clear
429/503 (clients retry refused ones), nothing is lost, and the page pool is intact after.

The client is a process of its own (``load_client.py``: why, in its docstring); the
server and the engine run here, so the test can read the engine's state afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import LiveServer, engine_metric

from runtime.server import ServerLimits, create_app

CLIENT = Path(__file__).parent / "load_client.py"
NUM_REQUESTS = 200
DEADLINE_S = 240.0  # the burst took 11-12 s on a 2-core Zen 5; refused attempts retry until then


@pytest.mark.slow
def test_200_concurrent_mixed_requests(engine: Any, programs: dict[str, Any]) -> None:
    assert engine.wait_idle(30)
    idle_pages = engine_metric(engine, "kv_pages_used")
    app = create_app(engine, programs=programs, limits=ServerLimits(max_inflight=48, max_tokens=64),
                     model_name="m")
    with LiveServer(app) as live:
        client = subprocess.run([sys.executable, str(CLIENT), live.url, str(NUM_REQUESTS), str(DEADLINE_S)],
                                capture_output=True, text=True, timeout=DEADLINE_S + 60)
        assert client.returncode == 0, client.stderr[-4000:]
        results = json.loads(client.stdout)
        assert httpx.get(live.url + "/health").json()["requests_inflight"] == 0
    attempts = [a for request in results for a in request]
    assert len(results) == NUM_REQUESTS
    assert {status for status, _, _ in attempts} <= {200, 429, 503}, [a for a in attempts if a[0] not in (200, 429, 503)]
    refused = [outcome for status, outcome, _ in attempts if status != 200]
    assert refused and all("retry later" in outcome for outcome in refused)  # the bound held
    # nothing lost: every request was finally served, completely
    assert all(request[-1][:2] == [200, "ok"] for request in results), [r[-1] for r in results]
    gate = app.state.ctx.gate
    assert (gate.num_inflight, gate.num_waiting) == (0, 0)
    assert engine.wait_idle(30)
    engine.check_integrity()
    assert engine_metric(engine, "kv_pages_used") == idle_pages
