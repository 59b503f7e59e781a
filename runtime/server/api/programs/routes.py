"""Compiled-program endpoints: run the programs registered at server start.

    GET  /programs          the registered programs with their argument JSON schemas
    POST /programs/{name}   {"arguments": {...}, "stream": false, "timeout": null}
                            → {"program", "variables", "text", "latency"}
                            stream=true: an SSE event per completed gen, then the result

Only programs loaded from the ``--programs`` file at start can run
(``hosting.load_programs``); a client sends arguments, checked by the program, never code.
The server knows a program only through the hosting protocol (``hosting.HostedProgram``):
it consumes the run's event stream, and closes it early when the run is cancelled (client
gone, timeout), which makes the program abort its engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError

from runtime.engine import Engine
from runtime.output.request_output import RequestOutput
from runtime.sampling.params import SamplingParams
from runtime.server.api.common.wire import Strict
from runtime.server.api.programs.schema import ProgramInfo, ProgramResult, ProgramsResponse
from runtime.server.errors import ProgramNotFoundError, stream_error_event
from runtime.server.hosting import (
    GenerationDone,
    HostedProgram,
    InvalidArgumentsError,
    ProgramOutcome,
    ProgramRunFailedError,
)
from runtime.server.metrics import NO_PROMPT, ServerMetrics, TokenTimer, prompt_bucket
from runtime.server.serving import Admission, RequestTimeoutError, ServerContext, until_disconnect
from runtime.server.sse import SSE_DONE, EventStreamResponse, sse
from runtime.server.tenants import Caller, caller_of

GenerationListener = Callable[[GenerationDone], None]


class ProgramRunRequest(Strict):
    arguments: dict[str, Any] = pydantic.Field(default_factory=dict)
    stream: bool = False
    timeout: float | None = pydantic.Field(default=None, gt=0)
    trace: bool = False  # include the run's trace in the result
    cache_salt: Any = None  # every generation of the run in this cache namespace (tenants.caller_of)


def build_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    listing = ProgramsResponse(programs=[
        ProgramInfo(name=name, description=p.description, arguments_schema=p.arguments_schema())
        for name, p in sorted(ctx.programs.items())])

    @router.get("/programs")
    async def list_programs() -> ProgramsResponse:
        return listing

    @router.post("/programs/{name}", response_model=None)
    async def run_program(name: str, body: ProgramRunRequest,
                          request: Request) -> ProgramResult | EventStreamResponse:
        program = ctx.programs.get(name)
        if program is None:
            raise ProgramNotFoundError(f"no program named {name!r} is registered "
                                       f"(registered: {sorted(ctx.programs) or 'none'})")
        args = _validate(program, body.arguments)
        timeout = ctx.limits.program_timeout_s if body.timeout is None else min(
            body.timeout, ctx.limits.program_timeout_s or body.timeout)
        admission = Admission(ctx, caller_of(request.headers, cache_salt=body.cache_salt), timeout)
        run = _Run(ctx, program, args, timeout, admission, body.trace)
        if body.stream:
            return await _stream_run(run)
        async with admission:
            return await until_disconnect(request, run.result())

    return router


def _validate(program: HostedProgram, arguments: dict[str, Any]) -> dict[str, Any]:
    """The program's own check, its refusals reported like a body's (422, ``arguments.*``)."""
    try:
        return program.validate_arguments(arguments)
    except InvalidArgumentsError as exc:
        errors = [{"loc": ("arguments", *p.loc), "msg": p.msg, "type": p.type} for p in exc.problems]
        raise RequestValidationError(errors) from None


class _Run:
    """One run of a hosted program. Leaving ``result`` early (its task cancelled: client
    gone, deadline passed) closes the program's event stream, which aborts the run."""

    def __init__(self, ctx: ServerContext, program: HostedProgram, args: dict[str, Any],
                 timeout: float | None, admission: Admission, include_trace: bool = False) -> None:
        self.ctx = ctx
        self.admission = admission  # NOTE: a run's tokens are billed as its generations end
        self.program = program
        self.args = args
        self.timeout = timeout
        self.include_trace = include_trace
        self.on_generation: GenerationListener | None = None
        self.run_id = ctx.metrics.runs.new_id()
        self.labels = ctx.metrics.labels("program", None, admission.caller.tenant)

    async def result(self) -> ProgramResult:
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout):  # NOTE: not wait_for (serving._next)
                outcome = await self._outcome()
        except TimeoutError:
            message = f"program {self.program.name} timed out after {self.timeout} s"
            self._record(started, "timeout", message)
            raise RequestTimeoutError(message) from None
        except ProgramRunFailedError as exc:
            self._record(started, "failed", str(exc), exc.trace)
            raise
        except asyncio.CancelledError:
            self._record(started, "cancelled", "the client left or the run was cancelled")
            raise
        self._record(started, "ok", None, outcome.trace)
        self.ctx.metrics.requests.labels("program", "200").inc()
        self.ctx.metrics.e2e.labels(*self.labels).observe(time.monotonic() - started)
        return ProgramResult(program=self.program.name, variables=outcome.variables,
                             text=outcome.text, latency=time.monotonic() - started, run_id=self.run_id,
                             trace=outcome.trace if self.include_trace else None)

    def _record(self, started: float, status: str, error: str | None,
                trace: dict[str, Any] | None = None) -> None:
        self.ctx.metrics.runs.add(self.run_id, self.program.name, self.args, started, status, error, trace)

    async def _outcome(self) -> ProgramOutcome:
        engine = TimedEngine(self.ctx.engine, self.ctx.metrics, self.labels[2], self.admission.caller)
        async with contextlib.aclosing(self.program.run_hosted(engine, self.args)) as events:  # type: ignore[arg-type]
            async for event in events:
                if isinstance(event, ProgramOutcome):
                    return event
                self.admission.charge(event.num_completion_tokens)
                if self.on_generation is not None:
                    self.on_generation(event)
        raise ProgramRunFailedError(f"program {self.program.name} ended without a result")


class TimedEngine:
    """The engine as a hosted program gets it: each of the run's engine requests is timed
    like an HTTP one (TTFT, ITL, end to end; endpoint ``program_gen``, the request's prompt
    bucket, the run's tenant label), and sent as the run's caller: its tenant and cache salt
    (so the run shares cached prefixes only within them). Everything else is the engine's own."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, tenant_label: str, caller: Caller) -> None:
        self._engine = engine
        self._metrics = metrics
        self._tenant_label = tenant_label
        self._caller = caller

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate_stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                              input_ids: list[int] | None = None,
                              request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        bucket = prompt_bucket(len(input_ids)) if input_ids is not None else NO_PROMPT
        timer = TokenTimer(self._metrics, ("program_gen", bucket, self._tenant_label))
        async for out in self._engine.generate_stream(prompt, sampling_params, input_ids=input_ids,
                                                      request_id=request_id, tenant=self._caller.tenant,
                                                      cache_salt=self._caller.cache_salt):
            timer.observe(len(out.delta_token_ids), out.finished)
            yield out


async def _stream_run(run: _Run) -> EventStreamResponse:
    """SSE: ``{"event": "gen", ...}`` as each generation completes, then ``"result"``."""
    ctx = run.ctx
    events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    counter = itertools.count()

    def on_generation(done: GenerationDone) -> None:
        events.put_nowait({"event": "gen", "index": next(counter), "text": done.text,
                           "finish_reason": done.finish_reason,
                           "completion_tokens": done.num_completion_tokens})

    run.on_generation = on_generation
    admission = run.admission
    await admission.__aenter__()
    task = asyncio.ensure_future(run.result())

    async def body() -> AsyncIterator[str]:
        while not (task.done() and events.empty()):
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield sse(getter.result())
            else:
                getter.cancel()
        try:
            yield sse({"event": "result", **task.result().model_dump()})
        except Exception as exc:
            yield sse({"event": "error", **stream_error_event(exc, ctx)})
        yield SSE_DONE

    async def on_close() -> None:
        if not task.done():
            task.cancel()  # closes the program's event stream: the run aborts its requests
        await admission.__aexit__()

    return EventStreamResponse(body(), on_close)
