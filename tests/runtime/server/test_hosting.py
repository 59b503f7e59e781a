"""The hosting protocol (``runtime.server.hosting``): the server with a host of its own
(no DSL behind it), loading hosts from a file, and the DSL's implementation (``Program``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import LiveServer, engine_metric

from frontend_dsl import gen, program
from runtime.errors import InvalidRequestError
from runtime.server.hosting import (
    ArgumentProblem,
    GenerationDone,
    HostedProgram,
    InvalidArgumentsError,
    ProgramOutcome,
    ProgramRunFailedError,
    RunEvent,
    load_programs,
)

ROOT = Path(__file__).resolve().parents[3]


class EchoHost:
    """A hosted program without the DSL: one event per word, then the words.

    Arguments: ``words`` (str), ``delay`` (seconds before each word). The words "fail"
    make the run fail at the end. ``closed_early`` is set when the server closes the
    stream before its outcome.
    """

    name = "echo"
    description = "Echo the words back."

    def __init__(self) -> None:
        self.closed_early = threading.Event()

    def arguments_schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": {"words": {"type": "string"},
                                                 "delay": {"type": "number"}}}

    def validate_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(arguments.get("words"), str):
            raise InvalidArgumentsError([ArgumentProblem(("words",), "a string is needed", "string_type")])
        return {"words": arguments["words"], "delay": float(arguments.get("delay", 0.0))}

    async def run_hosted(self, engine: Any, arguments: dict[str, Any]) -> AsyncGenerator[RunEvent, None]:
        words = arguments["words"].split()
        ended = False
        try:
            for word in words:
                await asyncio.sleep(arguments["delay"])
                yield GenerationDone(word, "stop", 1)
            ended = True
            if words == ["fail"]:
                raise ProgramRunFailedError("echo was asked to fail")
            yield ProgramOutcome({"words": words}, " ".join(words))
        finally:
            if not ended:
                self.closed_early.set()


# ---- the server, hosting a program that is not a @program --------------------------------


@pytest.fixture(scope="module")
def echo() -> EchoHost:
    return EchoHost()


@pytest.fixture(scope="module")
def echo_http(engine: Any, echo: EchoHost) -> Iterator[httpx.Client]:
    from runtime.server import create_app

    with LiveServer(create_app(engine, programs={"echo": echo})) as live, \
            httpx.Client(base_url=live.url, timeout=30) as client:
        yield client


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def test_a_host_satisfies_the_protocol(echo: EchoHost) -> None:
    assert isinstance(echo, HostedProgram)
    assert not isinstance(object(), HostedProgram)


def test_server_lists_and_runs_a_host(echo_http: httpx.Client) -> None:
    listed = echo_http.get("/programs").json()["programs"]
    assert listed == [{"name": "echo", "description": "Echo the words back.",
                       "arguments_schema": EchoHost().arguments_schema()}]
    r = echo_http.post("/programs/echo", json={"arguments": {"words": "a b c"}})
    assert r.status_code == 200, r.text
    assert (r.json()["program"], r.json()["variables"], r.json()["text"]) == ("echo", {"words": ["a", "b", "c"]}, "a b c")


def test_server_streams_a_host_event_per_generation(echo_http: httpx.Client) -> None:
    with echo_http.stream("POST", "/programs/echo", json={"arguments": {"words": "a b"}, "stream": True}) as r:
        events = list(sse_events(r))
    assert events[:2] == [
        {"event": "gen", "index": 0, "text": "a", "finish_reason": "stop", "completion_tokens": 1},
        {"event": "gen", "index": 1, "text": "b", "finish_reason": "stop", "completion_tokens": 1}]
    assert events[2]["event"] == "result" and events[2]["variables"] == {"words": ["a", "b"]}


def test_server_reports_a_host_refusal_as_422(echo_http: httpx.Client) -> None:
    r = echo_http.post("/programs/echo", json={"arguments": {"words": 3}})
    assert r.status_code == 422
    assert r.json()["error"]["message"] == "arguments.words: a string is needed"


def test_server_reports_a_failed_run_as_500(echo_http: httpx.Client) -> None:
    r = echo_http.post("/programs/echo", json={"arguments": {"words": "fail"}})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "echo was asked to fail", "type": "program_failed", "code": 500}


def test_timeout_closes_the_hosts_stream(echo_http: httpx.Client, echo: EchoHost) -> None:
    echo.closed_early.clear()
    r = echo_http.post("/programs/echo", json={"arguments": {"words": "a b c", "delay": 2}, "timeout": 0.2})
    assert r.status_code == 504
    assert echo.closed_early.wait(1.0)


def test_a_client_leaving_a_stream_closes_the_hosts_stream(echo_http: httpx.Client, echo: EchoHost) -> None:
    echo.closed_early.clear()
    body = {"arguments": {"words": "a b c d", "delay": 0.3}, "stream": True}
    with echo_http.stream("POST", "/programs/echo", json=body) as r:
        assert next(sse_events(r))["text"] == "a"
    assert echo.closed_early.wait(2.0)


# ---- loading hosts from a file ------------------------------------------------------------


def write_programs(tmp_path: Path, body: str) -> Path:
    """A programs file with a ``@program`` (``hello``), a host class and ``body``."""
    path = tmp_path / "hosts.py"
    path.write_text(textwrap.dedent("""\
        from frontend_dsl import gen, program
        from runtime.server.hosting import HostedProgram

        @program
        def hello(s):
            s += gen("x", max_tokens=1)

        class Host:
            name = "host"
            description = ""
            def arguments_schema(self): return {}
            def validate_arguments(self, arguments): return arguments
            def run_hosted(self, engine, arguments): raise NotImplementedError
        """) + textwrap.dedent(body))
    return path


def test_load_programs_collects_every_host_at_top_level(tmp_path: Path) -> None:
    programs = load_programs(write_programs(tmp_path, "host = Host()\n"))
    assert sorted(programs) == ["hello", "host"]  # not the classes Host, HostedProgram


def test_load_programs_takes_programs_when_given(tmp_path: Path) -> None:
    assert list(load_programs(write_programs(tmp_path, "PROGRAMS = [Host()]\n"))) == ["host"]
    assert list(load_programs(write_programs(tmp_path, "PROGRAMS = {'h': hello}\n"))) == ["hello"]
    with pytest.raises(InvalidRequestError, match="PROGRAMS must hold only @program objects"):
        load_programs(write_programs(tmp_path, "PROGRAMS = [hello, len]\n"))


# ---- the DSL's implementation: Program ----------------------------------------------------


def collect(events: AsyncGenerator[RunEvent, None]) -> list[RunEvent]:
    async def drain() -> list[RunEvent]:
        return [event async for event in events]

    return asyncio.run(drain())


def test_a_program_satisfies_the_protocol(programs: dict[str, Any]) -> None:
    qa = programs["qa"]
    assert isinstance(qa, HostedProgram)
    assert qa.description == "Answer a question in a few tokens."
    assert qa.arguments_schema()["required"] == ["question"]
    assert qa.validate_arguments({"question": "hi"}) == {"question": "hi", "max_tokens": 6}
    with pytest.raises(InvalidArgumentsError) as info:
        qa.validate_arguments({"max_tokens": "many", "extra": 1})
    assert [(p.loc, p.type) for p in info.value.problems] == [
        (("question",), "missing"), (("max_tokens",), "int_parsing"), (("extra",), "extra_forbidden")]


def test_a_program_run_hosted_matches_a_local_run(idle_engine: Any, programs: dict[str, Any]) -> None:
    two_steps = programs["two_steps"]
    events = collect(two_steps.run_hosted(idle_engine, {"topic": "tea"}))
    local = two_steps.run(idle_engine, topic="tea")
    gens = [e for e in events if isinstance(e, GenerationDone)]
    assert [g.text for g in gens] == [local["first"], local["second"]]  # the select is no gen
    assert all(g.finish_reason in ("stop", "length") and 0 < g.num_completion_tokens <= 4 for g in gens)
    outcome = events[2]
    assert len(events) == 3 and isinstance(outcome, ProgramOutcome)
    assert (outcome.variables, outcome.text) == (local.variables(), local.text())
    assert outcome.trace is not None and [n["name"] for n in outcome.trace["nodes"] if n["kind"] == "gen"] == [
        "first", "second"]


def test_a_failing_program_raises_the_hosts_error(idle_engine: Any) -> None:
    @program
    def broken(s: Any) -> None:
        s += gen("x", max_tokens=1, temperature=0)
        raise RuntimeError("boom")

    with pytest.raises(ProgramRunFailedError, match="program broken raised RuntimeError: boom"):
        collect(broken.run_hosted(idle_engine, {}))


@pytest.fixture()
def slow_forward(idle_engine: Any) -> Iterator[None]:
    """10 ms per forward pass, so a 250-token generation is still running when we look."""
    remove = idle_engine.add_step_hook(lambda batch: time.sleep(0.01))
    yield
    remove()


def test_closing_a_programs_stream_aborts_its_requests(
        idle_engine: Any, programs: dict[str, Any], slow_forward: None) -> None:
    idle = engine_metric(idle_engine, "kv_pages_used")

    async def start_then_leave() -> None:
        events = programs["long_story"].run_hosted(idle_engine, {"seed_text": "Once upon a time"})
        first = asyncio.ensure_future(anext(events))
        deadline = time.monotonic() + 10
        while engine_metric(idle_engine, "num_running") == 0:
            assert time.monotonic() < deadline, "the run never reached the engine"
            await asyncio.sleep(0.01)
        first.cancel()  # as the server does when the client leaves
        with pytest.raises(asyncio.CancelledError):
            await first
        await events.aclose()

    asyncio.run(start_then_leave())
    start = time.monotonic()
    while engine_metric(idle_engine, "num_running") or engine_metric(idle_engine, "kv_pages_used") != idle:
        assert time.monotonic() - start < 1.0, "the run's request was not aborted"
        time.sleep(0.01)


def test_the_client_side_imports_without_the_app() -> None:
    code = ("import sys, frontend_dsl.runtime_endpoint, frontend_dsl.program_host, runtime.server.hosting; "
            "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
