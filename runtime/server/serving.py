"""The one path from an HTTP request to the engine and back, shared by every endpoint.

``ServerContext`` holds what the routes share (engine, limits, gate, metrics, programs).
``Admission`` takes an in-flight slot for a whole HTTP request. ``EngineStream`` is one
engine request seen as an async iterator of ``RequestOutput``: it applies the deadline,
observes TTFT / ITL / end-to-end latency, and aborts the engine request when left early
(client gone, timeout, error), so its KV pages go back to the pool on the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

from starlette.requests import Request as HttpRequest

from runtime.engine import Engine
from runtime.errors import InvalidRequestError, PromptTooLongError, check_unicode
from runtime.output.request_output import RequestOutput
from runtime.sampling.params import SamplingParams
from runtime.server.hosting import HostedProgram
from runtime.server.limits import AdmissionGate, ServerLimits
from runtime.server.metrics import ServerMetrics, TokenTimer
from runtime.server.tenants import Caller

T = TypeVar("T")


@dataclass
class ServerContext:
    """Everything the routes of one app share; built once by ``create_app``."""

    engine: Engine
    model_name: str
    limits: ServerLimits
    gate: AdmissionGate
    metrics: ServerMetrics
    programs: dict[str, HostedProgram] = field(default_factory=dict)  # by name
    # Every name a request's ``model`` may give (``model_name`` first); like vLLM, any
    # other name is a 404, never served by the loaded model as if it were asked for.
    served_model_names: tuple[str, ...] = ()

    def check_model(self, asked: str | None) -> None:
        """Raise ``ModelNotFoundError`` unless ``asked`` (a request's ``model``) is served;
        a request without one gets the served model."""
        if asked is not None and asked not in (self.served_model_names or (self.model_name,)):
            raise ModelNotFoundError(
                f"the model {asked!r} does not exist on this server; it serves "
                f"{', '.join(repr(n) for n in self.served_model_names or (self.model_name,))}")


class ModelNotFoundError(LookupError):
    """A request named a model this server does not serve (HTTP 404)."""


class RequestTimeoutError(Exception):
    """The request ran past its deadline; it was aborted (HTTP 504)."""


class ClientGoneError(Exception):
    """The client disconnected before the answer was ready; the work was aborted."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def encode_prompt(engine: Engine, text: str) -> list[int]:
    """Token ids of a prompt string, as ``Engine.add_request(prompt)`` would compute them."""
    if not text:
        raise InvalidRequestError("the prompt is empty")
    check_unicode(text, "the prompt")
    ids: list[int] = engine.tokenizer(text, add_special_tokens=True)["input_ids"]
    return ids


def check_budget(engine: Engine, limits: ServerLimits, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse up front what can never be served: too many tokens asked, or no room left."""
    if max_new_tokens > limits.max_tokens:
        raise InvalidRequestError(f"max_tokens is {max_new_tokens}; this server allows at most "
                                  f"{limits.max_tokens}")
    if limits.max_prompt_tokens is not None and prompt_len > limits.max_prompt_tokens:
        raise PromptTooLongError(f"the prompt has {prompt_len} tokens; this server allows at most "
                                 f"{limits.max_prompt_tokens}")
    if prompt_len + max_new_tokens > engine.max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {engine.max_model_len} tokens; the request "
            f"has {prompt_len} prompt tokens and asks for {max_new_tokens} more")


class Admission:
    """``async with Admission(ctx, caller):`` holds one in-flight slot for the block
    (429/503 if none; ``deadline_s``: the run's own timeout, see ``AdmissionGate.admit``).
    ``charge`` bills the caller's tenant for tokens used meanwhile."""

    def __init__(self, ctx: ServerContext, caller: Caller, deadline_s: float | None = None) -> None:
        self.gate = ctx.gate
        self.caller = caller
        self.deadline_s = deadline_s

    def charge(self, tokens: int) -> None:
        self.gate.tenants.charge(self.caller.tenant, tokens)

    async def __aenter__(self) -> Admission:
        self.gate.admit(self.caller, deadline_s=self.deadline_s)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.gate.release(self.caller)


class StreamGroup:
    """One HTTP request's engine requests (``n`` choices): one in-flight slot, opened
    together, closed together. ``close`` is idempotent, so both a stream body's ``finally``
    and the response's own teardown may call it.
    """

    def __init__(self, ctx: ServerContext, endpoint: str,
                 jobs: list[tuple[list[int], SamplingParams]], timeout_s: float | None,
                 caller: Caller) -> None:
        self.ctx = ctx
        self.caller = caller
        self.timeout_s = timeout_s
        self.streams = [EngineStream(ctx, endpoint, ids, p, timeout_s, caller) for ids, p in jobs]
        # Tokens reserved from the tenant's budget: every prompt and every max_tokens.
        self.reserved = sum(len(ids) + p.max_new_tokens for ids, p in jobs)
        self.admitted = False

    async def open(self) -> list[EngineStream]:
        """Compile the constraints, then admit and submit every request; on any failure
        nothing stays submitted. NOTE: compiling first makes a refused constraint (a strict
        schema the grammar could only relax, a regex the backend rejects) a 400 before
        anything is admitted, not a failed generation."""
        constraints = {id(c): c for s in self.streams if (c := s.params.constraint) is not None}
        for constraint in constraints.values():
            await asyncio.wrap_future(self.ctx.engine.grammar_compiler.compile_async(constraint))
        self.ctx.gate.admit(self.caller, self.reserved, deadline_s=self.timeout_s)
        self.admitted = True
        try:
            for stream in self.streams:
                await stream.__aenter__()
        except BaseException:
            await self.close()
            raise
        return self.streams

    async def close(self) -> None:
        for stream in self.streams:
            if stream.submitted:
                await stream.__aexit__(None, None, None)
                stream.submitted = False
        if self.admitted:
            self.admitted = False
            used = sum(len(s.input_ids) + s.num_generated for s in self.streams)
            self.ctx.gate.release(self.caller, self.reserved - used)

    async def __aenter__(self) -> list[EngineStream]:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class EngineStream:
    """One engine request as an async iterator of its outputs; use as a context manager.

    Leaving the ``async with`` block before the final output aborts the request.
    """

    def __init__(self, ctx: ServerContext, endpoint: str, input_ids: list[int],
                 params: SamplingParams, timeout_s: float | None, caller: Caller) -> None:
        self.ctx = ctx
        self.caller = caller
        self.num_generated = 0
        self.endpoint = endpoint
        self.input_ids = input_ids
        ttft, itl = ctx.limits.slo_of(caller.tenant)
        if (ttft is not None and params.ttft_slo is None) or (itl is not None and params.itl_slo is None):
            params = dataclasses.replace(params, ttft_slo=params.ttft_slo or ttft, itl_slo=params.itl_slo or itl)
        self.params = params
        self.request_id = new_id("arbor")
        self.timer = TokenTimer(ctx.metrics, ctx.metrics.labels(endpoint, len(input_ids), caller.tenant))
        self.started = time.monotonic()
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else self.started + timeout_s
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.last_token_at: float | None = None
        self.finished = False
        self.submitted = False

    async def __aenter__(self) -> EngineStream:
        loop = asyncio.get_running_loop()

        def deliver(out: RequestOutput) -> None:  # on the engine thread
            loop.call_soon_threadsafe(self.queue.put_nowait, out)

        self.ctx.engine.add_request(input_ids=self.input_ids, params=self.params,
                                    request_id=self.request_id, callback=deliver,
                                    tenant=self.caller.tenant, priority=self.caller.priority,
                                    cache_salt=self.caller.cache_salt)
        self.submitted = True
        self.ctx.gate.wait_started()
        self.ctx.metrics.prompt_tokens.inc(len(self.input_ids))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.last_token_at is None:
            self.ctx.gate.wait_ended(first_token=False)
            self.last_token_at = time.monotonic()  # counted once even if never started
        if not self.finished:
            self.ctx.engine.abort(self.request_id)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            out = await self._next()
            self.finished = out.finished
            self._observe(out)
            yield out

    async def _next(self) -> RequestOutput:
        # NOTE: asyncio.timeout, never asyncio.wait_for: on Python 3.11 wait_for swallows a
        # cancellation that lands in the loop turn where the queue hands over an output (it
        # returns the output instead), and the token stream kept the cancelled task running:
        # a client that hung up on a non-streamed /generate was then served to the end.
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            async with asyncio.timeout(left):
                return await self.queue.get()
        except TimeoutError:
            raise RequestTimeoutError(f"request timed out after {self.timeout_s:.3g} s") from None

    def _observe(self, out: RequestOutput) -> None:
        num_new = len(out.delta_token_ids)
        self.num_generated += num_new
        if num_new and self.last_token_at is None:
            self.ctx.gate.wait_ended(first_token=True)
            self.last_token_at = time.monotonic()
        self.timer.observe(num_new, out.finished)


async def until_disconnect(request: HttpRequest, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientGoneError``.

    NOTE: the body has been read by then, so the next ASGI message is ``http.disconnect``.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGoneError("the client disconnected")


async def _wait_disconnect(request: HttpRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(stream: EngineStream) -> RequestOutput:
    """The final output of a stream."""
    last: RequestOutput | None = None
    async for out in stream:
        last = out
    assert last is not None
    return last


async def merge_streams(streams: list[EngineStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(i: int, stream: EngineStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
