"""Registered programs over HTTP, and the same program on a remote backend."""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_helpers import API_KEY

from frontend_dsl.runtime_endpoint import RuntimeEndpoint
from runtime.server.client import ArborClient


def test_programs_are_listed_with_argument_schemas(http: Any) -> None:
    programs = {p["name"]: p for p in http.get("/programs").json()["programs"]}
    assert set(programs) == {"qa", "two_steps", "long_story", "fan_out"}
    schema = programs["qa"]["arguments_schema"]
    assert schema["properties"]["question"]["type"] == "string"
    assert schema["properties"]["max_tokens"] == {"default": 6, "title": "Max Tokens", "type": "integer"}
    assert schema["required"] == ["question"]
    assert programs["qa"]["description"] == "Answer a question in a few tokens."


def test_program_run_matches_an_in_process_run(http: Any, engine: Any, programs: dict[str, Any]) -> None:
    r = http.post("/programs/two_steps", json={"arguments": {"topic": "tea"}})
    assert r.status_code == 200, r.text
    local = programs["two_steps"].run(engine, topic="tea")
    assert r.json()["variables"] == local.variables()
    assert r.json()["text"] == local.text()


def test_program_stream_sends_an_event_per_gen(http: Any, programs: dict[str, Any], engine: Any) -> None:
    events = []
    with http.stream("POST", "/programs/two_steps", json={"arguments": {"topic": "tea"}, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    gens = [e for e in events if e["event"] == "gen"]
    local = programs["two_steps"].run(engine, topic="tea").variables()
    assert [g["text"] for g in gens] == [local["first"], local["second"]]
    assert events[-1]["event"] == "result" and events[-1]["variables"] == local


def test_same_program_on_a_remote_backend(server: Any, engine: Any, programs: dict[str, Any]) -> None:
    endpoint = RuntimeEndpoint(server.url, api_key=API_KEY, timeout=30)
    try:
        remote = programs["two_steps"].run(endpoint, topic="owls")
        local = programs["two_steps"].run(engine, topic="owls")
        assert remote.variables() == local.variables()
        assert remote.text() == local.text() and remote.token_ids() == local.token_ids()
    finally:
        endpoint.client.close()


@pytest.mark.parametrize(("name", "arguments", "status", "message"), [
    ("nope", {}, 404, "no program named 'nope'"),
    ("qa", {"question": ["not", "a", "string"]}, 422, "arguments.question"),
    ("qa", {}, 422, "arguments.question: Field required"),
    ("qa", {"question": "hi", "extra": 1}, 400, "unknown field: arguments.extra"),
    ("qa", {"question": "hi", "max_tokens": "many"}, 422, "arguments.max_tokens"),
])
def test_bad_program_calls_are_4xx(http: Any, name: str, arguments: dict[str, Any], status: int,
                                   message: str) -> None:
    r = http.post(f"/programs/{name}", json={"arguments": arguments})
    assert r.status_code == status
    assert message in r.json()["error"]["message"]


def test_client_lists_and_runs_programs(server: Any) -> None:
    client = ArborClient(server.url, api_key=API_KEY, timeout=30)
    try:
        assert {p.name for p in client.list_programs()} == {"qa", "two_steps", "long_story", "fan_out"}
        result = client.run_program("qa", question="Why?", max_tokens=3)
        assert set(result.variables) == {"answer"} and result.program == "qa"
    finally:
        client.close()


def test_a_run_past_its_bounds_is_a_422_naming_the_bound(http: Any, idle_engine: Any) -> None:
    ok = http.post("/programs/fan_out", json={"arguments": {"n": 4}})
    assert ok.status_code == 200, ok.text
    over = http.post("/programs/fan_out", json={"arguments": {"n": 5}})
    assert over.status_code == 422, over.text
    assert over.json()["error"]["type"] == "program_limit"
    assert "the limit is 4 (max_branches)" in over.json()["error"]["message"]
