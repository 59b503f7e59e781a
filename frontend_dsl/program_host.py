"""The DSL side of the server's hosting protocol (``runtime.server.hosting``).

``Program`` satisfies ``HostedProgram`` by handing the protocol's calls to its
``ProgramHost``: the JSON schema of its arguments (the signature after the state), their
validation, and a run on the server's engine as a stream of events.

A hosted run executes ``Program.run`` on a thread of its own (the body is synchronous
Python) over ``EngineBackend(RunEngine(engine))``. ``RunEngine`` is the engine as that
one run sees it: it records the run's requests, so closing the stream early aborts them,
and it reports every finished generation, which the stream passes on as a
``GenerationDone``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import typing
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pydantic
import pydantic_core

from frontend_dsl.engine_backend import EngineBackend
from frontend_dsl.errors import ProgramError, ProgramLimitError
from frontend_dsl.state import ProgramState
from runtime.output.request_output import RequestOutput, final_output
from runtime.server.hosting import (
    ArgumentProblem,
    GenerationDone,
    InvalidArgumentsError,
    ProgramLimitExceededError,
    ProgramOutcome,
    ProgramRunFailedError,
    RunEvent,
)

ProgramRunner = Callable[..., ProgramState]  # Program.run: (backend, **arguments) → state
GenListener = Callable[[RequestOutput], None]


class ProgramHost:
    """One ``@program`` as the server hosts it.

    Args:
        name: the program's name.
        fn: the program's function; its parameters after the state are the arguments.
        run: runs the program once, ``run(backend, **arguments)`` (``Program.run``).
    """

    def __init__(self, name: str, fn: Callable[..., Any], run: ProgramRunner) -> None:
        self.name = name
        self.fn = fn
        self._run = run

    @functools.cached_property
    def arguments_model(self) -> type[pydantic.BaseModel]:
        return arguments_model(self.name, self.fn)

    def arguments_schema(self) -> dict[str, Any]:
        return self.arguments_model.model_json_schema()

    def validate_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            return dict(self.arguments_model.model_validate(arguments))
        except pydantic.ValidationError as exc:
            problems = [ArgumentProblem(tuple(e["loc"]), e["msg"], e["type"]) for e in exc.errors()]
            raise InvalidArgumentsError(problems) from None

    async def run(self, engine: Any, arguments: dict[str, Any]) -> AsyncGenerator[RunEvent, None]:
        """``HostedProgram.run_hosted``: see ``runtime.server.hosting``."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[GenerationDone | _Finished] = asyncio.Queue()

        def post(event: GenerationDone | _Finished) -> None:  # from the DSL loop or the run's thread
            with contextlib.suppress(RuntimeError):  # the server's loop is closed: nobody listens
                loop.call_soon_threadsafe(events.put_nowait, event)

        def on_gen(out: RequestOutput) -> None:
            post(GenerationDone(out.text, out.finish_reason, len(out.token_ids)))

        run_engine = RunEngine(engine, on_gen)
        threading.Thread(target=self._run_in_thread, args=(EngineBackend(run_engine), arguments, post),
                         name=f"arbor-program-{self.name}", daemon=True).start()
        ended = False
        try:
            while not isinstance(event := await events.get(), _Finished):
                yield event
            ended = True
            yield event.outcome()
        finally:
            if not ended:  # closed early: client gone or deadline passed
                run_engine.cancel()

    def _run_in_thread(self, backend: EngineBackend, arguments: dict[str, Any],
                       post: Callable[[_Finished], None]) -> None:
        try:
            state = self._run(backend, **arguments)
            trace = state.run_trace().to_json()
            post(_Finished(ProgramOutcome(jsonable(state.variables()), state.text(), trace), None))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the server's loop
            post(_Finished(None, exc))


@dataclass(frozen=True)
class _Finished:
    """The end of a run, from its thread: an outcome or the error it raised."""

    result: ProgramOutcome | None
    error: BaseException | None

    def outcome(self) -> ProgramOutcome:
        if isinstance(self.error, ProgramError) and isinstance(self.error.__cause__, ProgramLimitError):
            raise ProgramLimitExceededError(str(self.error.__cause__)) from self.error
        if isinstance(self.error, ProgramError):
            trace = self.error.state.run_trace().to_json() if isinstance(self.error.state, ProgramState) else None
            raise ProgramRunFailedError(str(self.error), trace) from self.error
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class RunEngine:
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
        rid = request_id or f"prog-{uuid.uuid4().hex[:24]}"
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
        return await final_output(self.generate_stream(prompt, sampling_params, input_ids=input_ids,
                                                       request_id=request_id))

    def cancel(self) -> None:
        """Abort every request of the run and refuse new ones. Thread-safe."""
        self.cancelled = True
        for rid in list(self._active):
            self._engine.abort(rid)


def arguments_model(name: str, fn: Callable[..., Any]) -> type[pydantic.BaseModel]:
    """A pydantic model of a program's arguments (``fn``'s signature after the state)."""
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
        f"{name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields)
    return model


def jsonable(variables: dict[str, Any]) -> dict[str, Any]:
    """Variables as JSON values (pydantic models and dataclasses become objects; a value
    that has no JSON form becomes its ``repr``)."""
    out: dict[str, Any] = {}
    for key, value in variables.items():
        try:
            out[key] = pydantic_core.to_jsonable_python(value)
        except (pydantic_core.PydanticSerializationError, TypeError, ValueError):
            out[key] = repr(value)
    return out
