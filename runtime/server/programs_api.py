"""Compiled-program endpoints: run ``@program`` functions registered at server start.

    GET  /programs          the registered programs with their argument JSON schemas
    POST /programs/{name}   {"arguments": {...}, "stream": false, "timeout": null}
                            → {"program", "variables", "text", "latency"}
                            stream=true: an SSE event per completed gen, then the result

Only programs loaded from the ``--programs`` file at start can run; a client sends
arguments (validated against the program's signature), never code. Each run drives the
server's own engine through the DSL's ``EngineBackend``, over a ``_RunEngine`` view that
records the run's requests so a run that is cancelled (client gone, timeout) aborts them.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import time
import typing
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder

from runtime.errors import InvalidRequestError
from runtime.outputs import RequestOutput
from runtime.server.errors import ProgramNotFoundError, ProgramRunFailedError, stream_error_event
from runtime.server.protocol import ProgramInfo, ProgramResult, ProgramsResponse, Strict
from runtime.server.serving import (
    Admission,
    RequestTimeoutError,
    ServerContext,
    new_id,
    until_disconnect,
)
from runtime.server.sse import SSE_DONE, EventStreamResponse, sse

GenListener = Callable[[RequestOutput], None]


class ProgramRunRequest(Strict):
    arguments: dict[str, Any] = pydantic.Field(default_factory=dict)
    stream: bool = False
    timeout: float | None = pydantic.Field(default=None, gt=0)


def load_programs(path: str | Path) -> dict[str, Any]:
    """The programs of the Python file ``path``: its ``PROGRAMS`` (a dict by name, or a
    list) if it defines one, else every ``@program`` object at its top level."""
    from frontend_dsl import Program

    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"programs file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"arbor_programs_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    declared = getattr(module, "PROGRAMS", None)
    found = declared.values() if isinstance(declared, dict) else declared or vars(module).values()
    programs = {p.name: p for p in found if isinstance(p, Program)}
    if declared is not None and len(programs) != len(declared):
        raise InvalidRequestError(f"{path}: PROGRAMS must hold only @program objects")
    return programs


def arguments_model(program: Any) -> type[pydantic.BaseModel]:
    """A pydantic model of the program's arguments (its signature after the state)."""
    fn = program.fn
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: accept any JSON value
        hints = {}
    fields: dict[str, Any] = {}
    for param in list(inspect.signature(fn).parameters.values())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (hints.get(param.name, Any), default)
    model: type[pydantic.BaseModel] = pydantic.create_model(
        f"{program.name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields)
    return model


class _RunEngine:
    """The engine as one program run sees it: requests are recorded (for ``cancel``) and
    every finished generation is reported to ``on_gen``. Everything else is delegated."""

    def __init__(self, engine: Any, on_gen: GenListener | None) -> None:
        self._engine = engine
        self.on_gen = on_gen
        self._active: set[str] = set()
        self.cancelled = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate_stream(self, prompt: str | None = None, sampling_params: Any = None, *,
                              input_ids: list[int] | None = None,
                              request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if self.cancelled:
            raise asyncio.CancelledError("the program run was cancelled")
        rid = request_id or new_id("prog")
        self._active.add(rid)
        try:
            async for out in self._engine.generate_stream(prompt, sampling_params, input_ids=input_ids,
                                                          request_id=rid):
                yield out
                if out.finished and self.on_gen is not None and out.token_ids:
                    self.on_gen(out)
        finally:
            self._active.discard(rid)

    async def agenerate(self, prompt: str | None = None, sampling_params: Any = None, *,
                        input_ids: list[int] | None = None, request_id: str | None = None) -> RequestOutput:
        last: RequestOutput | None = None
        async for out in self.generate_stream(prompt, sampling_params, input_ids=input_ids,
                                              request_id=request_id):
            last = out
        assert last is not None
        return last

    def cancel(self) -> None:
        """Abort every request of the run and refuse new ones. Thread-safe."""
        self.cancelled = True
        for rid in list(self._active):
            self._engine.abort(rid)


def build_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    models = {name: arguments_model(p) for name, p in ctx.programs.items()}
    # NOTE: a pool per app, sized like the in-flight limit: the loop's default executor has
    # only a few threads on a small machine and would queue runs silently.
    pool = ThreadPoolExecutor(max_workers=min(256, ctx.limits.max_inflight),
                              thread_name_prefix="arbor-program")

    @router.get("/programs")
    async def list_programs() -> ProgramsResponse:
        return ProgramsResponse(programs=[
            ProgramInfo(name=name, description=inspect.getdoc(p.fn) or "",
                        arguments_schema=models[name].model_json_schema())
            for name, p in sorted(ctx.programs.items())])

    @router.post("/programs/{name}", response_model=None)
    async def run_program(name: str, body: ProgramRunRequest,
                          request: Request) -> ProgramResult | EventStreamResponse:
        if name not in ctx.programs:
            raise ProgramNotFoundError(f"no program named {name!r} is registered "
                                       f"(registered: {sorted(ctx.programs) or 'none'})")
        args = _validate(models[name], body.arguments)
        timeout = ctx.limits.program_timeout_s if body.timeout is None else min(
            body.timeout, ctx.limits.program_timeout_s or body.timeout)
        if body.stream:
            return await _stream_run(_Run(ctx, pool, name, args, timeout, on_gen=None))
        async with Admission(ctx):
            run = _Run(ctx, pool, name, args, timeout, on_gen=None)
            return await until_disconnect(request, run.result())

    return router


def _validate(model: type[pydantic.BaseModel], arguments: dict[str, Any]) -> dict[str, Any]:
    try:
        return dict(model.model_validate(arguments))
    except pydantic.ValidationError as exc:
        from fastapi.exceptions import RequestValidationError

        errors = [{**e, "loc": ("arguments", *e["loc"])} for e in exc.errors()]
        raise RequestValidationError(errors) from None


class _Run:
    """One program run (``Program.run``) on a worker thread of ``pool``, cancellable here."""

    def __init__(self, ctx: ServerContext, pool: ThreadPoolExecutor, name: str, args: dict[str, Any],
                 timeout: float | None, on_gen: GenListener | None) -> None:
        self.ctx = ctx
        self.pool = pool
        self.name = name
        self.args = args
        self.timeout = timeout
        self.engine = _RunEngine(ctx.engine, on_gen)

    async def result(self) -> ProgramResult:
        from frontend_dsl import ProgramError
        from frontend_dsl.engine_backend import EngineBackend

        started = time.monotonic()
        program = self.ctx.programs[self.name]
        try:
            run = functools.partial(program.run, EngineBackend(self.engine), **self.args)
            state = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self.pool, run),
                                           self.timeout)
        except TimeoutError:
            self.engine.cancel()
            raise RequestTimeoutError(f"program {self.name} timed out after {self.timeout} s") from None
        except ProgramError as exc:
            raise ProgramRunFailedError(str(exc)) from exc
        except BaseException:
            self.engine.cancel()
            raise
        self.ctx.metrics.requests.labels("program", "200").inc()
        self.ctx.metrics.e2e.labels("program").observe(time.monotonic() - started)
        return ProgramResult(program=self.name, variables=_jsonable(state.variables()),
                             text=state.text(), latency=time.monotonic() - started)


async def _stream_run(run: _Run) -> EventStreamResponse:
    """SSE: ``{"event": "gen", ...}`` as each generation completes, then ``"result"``."""
    ctx = run.ctx
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    counter = iter(range(1 << 30))

    def on_gen(out: RequestOutput) -> None:  # called on the DSL loop thread
        event = {"event": "gen", "index": next(counter), "text": out.text,
                 "finish_reason": out.finish_reason, "completion_tokens": len(out.token_ids)}
        loop.call_soon_threadsafe(events.put_nowait, event)

    run.engine.on_gen = on_gen
    admission = Admission(ctx)
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
            task.cancel()
            run.engine.cancel()
        await admission.__aexit__()

    return EventStreamResponse(body(), on_close)


def _jsonable(variables: dict[str, Any]) -> dict[str, Any]:
    """Variables as JSON values (pydantic models and dataclasses become objects)."""
    out: dict[str, Any] = {}
    for key, value in variables.items():
        try:
            out[key] = jsonable_encoder(value)
        except (TypeError, ValueError):
            out[key] = repr(value)
    return out
