"""schemathesis against the server's own OpenAPI schema (native, OpenAI, ``/programs``):
whatever a client sends, no 5xx, every 4xx says why in ``{"error": {"message"}}``, every
stream ends without an in-band 5xx, and the engine's page accounting holds afterwards.

Bounded: ``EXAMPLES`` cases per operation in each mode (positive: bodies the schema
allows; negative: bodies it forbids), on a server with small limits so every accepted
request is cheap. ``ARBOR_FUZZ_EXAMPLES`` raises the count for a longer hunt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import LiveServer

from runtime.server import ServerLimits, create_app

EXAMPLES = int(os.environ.get("ARBOR_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def fuzz_server(engine: Any, programs: dict[str, Any]) -> Iterator[LiveServer]:
    limits = ServerLimits(max_inflight=16, max_tokens=8, default_max_tokens=8, max_n=2,
                          max_body_bytes=64 * 1024, request_timeout_s=20.0, program_timeout_s=20.0)
    app = create_app(engine, programs=programs, limits=limits, model_name="m")
    with LiveServer(app) as live:
        yield live


@pytest.fixture(scope="module")
def api_schema(fuzz_server: LiveServer) -> Any:
    import schemathesis

    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


POSTS = ["/generate", "/tokenize", "/detokenize", "/apply_chat_template", "/v1/completions",
         "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
         "/programs/{name}"]
GETS = ["/tokenizer_info", "/engine_metrics", "/v1/models", "/programs", "/health", "/get_model_info",
        "/model_info", "/server_info", "/get_server_info", "/flush_cache"]
# NOTE: a GET has no body to break: only the positive mode applies.
OPERATIONS = ([("POST", p, m) for p in POSTS for m in ("positive", "negative")]
              + [("GET", p, "positive") for p in GETS])


def check_answer(case: Any, response: Any) -> None:
    """What every answer must satisfy, whatever was sent."""
    where = f"{case.method} {case.path} body={json.dumps(case.body, default=str)[:500]}"
    # NOTE: a 504 is the answer to the client's own deadline (a "timeout" field: the
    # fuzzer asks for a few ms), never otherwise: the server's own limits are 20 s.
    asked_deadline = isinstance(case.body, dict) and case.body.get("timeout") is not None
    if not (response.status_code == 504 and asked_deadline):
        assert response.status_code < 500, f"{response.status_code} for {where}: {response.text[:500]}"
    if response.status_code >= 400:
        message = response.json()["error"]["message"]
        assert isinstance(message, str) and message, f"no message for {where}"
    if "text/event-stream" in str(response.headers.get("content-type")):
        for line in response.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                error = json.loads(line[6:]).get("error")
                if not isinstance(error, dict):  # e.g. a Responses snapshot's "error": null
                    continue
                assert error["code"] < 500 or error["type"] == "timeout", f"in-band {error} for {where}"


@pytest.mark.parametrize(("method", "path", "mode"), OPERATIONS)
def test_fuzzed_requests_never_get_a_5xx(api_schema: Any, fuzz_server: LiveServer, engine: Any,
                                         method: str, path: str, mode: str) -> None:
    from schemathesis.generation import GenerationMode

    operation = api_schema[path][method]
    extra = {"path_parameters": {"name": "qa"}} if "{name}" in path else {}
    strategy = operation.as_strategy(GenerationMode(mode), **extra)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data: Any) -> None:
        case = data.draw(strategy)
        check_answer(case, case.call(base_url=fuzz_server.url, timeout=60))

    run()
    assert engine.wait_idle(30)
    engine.check_integrity()
