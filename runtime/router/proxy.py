"""Forwarding one HTTP request to a worker and its answer back, unchanged.

The router does not parse answers: a JSON answer is relayed whole, an event stream chunk
by chunk. What it adds is failure handling:

- a worker that fails before anything reached the client (connection refused or reset,
  taken out by the health loop while the request waited) is taken out and the request
  is sent to another worker (``retries``), up to once per worker; a connection that
  timed out is retried elsewhere too, but only the health probes take a slow worker out;
- a stream whose worker fails after its first event ends with an error event
  (``{"error": {..., "code": 503}}``) and ``data: [DONE]``, as the workers end theirs;
- a client that leaves makes the router close the worker connection, and the worker then
  aborts the request and frees its KV (its own disconnect handling).

NOTE: an event stream is relayed only after its first chunk arrived (the worker sends it
with the first token), so a worker dying before then still gets the request retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.router.metrics import RouterStats
from runtime.router.policy import NoWorkerError, Route, RoutingPolicy
from runtime.router.routing_key import routing_key
from runtime.router.workers import Worker, WorkerPool
from runtime.server.limits import error_body

T = TypeVar("T")
HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                        "te", "trailer", "upgrade"})
# Failures of a worker (not of the request): the worker is taken out, the request retried.
WORKER_FAILURES = (httpx.TransportError,)


class WorkerGoneError(Exception):
    """The worker was taken out while this request was on it."""


class ClientGoneError(Exception):
    """The client disconnected; the worker connection was closed (the worker aborts)."""


@dataclass
class Router:
    """What the proxy needs; built once by ``create_router_app``."""

    pool: WorkerPool
    policy: RoutingPolicy
    stats: RouterStats
    client: httpx.AsyncClient


@dataclass
class _Attempt:
    worker: Worker
    route: Route
    upstream: httpx.Response
    first: bytes | None  # first chunk of an event stream; None for a whole answer
    content: bytes  # a whole answer's body
    chunks: AsyncIterator[bytes] | None = None  # the rest of an event stream
    released: bool = False

    async def release(self) -> None:
        """Give the worker's load slot back and close its connection (idempotent).
        NOTE: shielded: it runs when a stream is cancelled because the client left."""
        if self.released:
            return
        self.released = True
        self.worker.load -= 1
        with anyio.CancelScope(shield=True), contextlib.suppress(httpx.HTTPError, OSError):
            await self.upstream.aclose()  # NOTE: a dead worker's connection may fail to close


class _RelayResponse(StreamingResponse):
    """A relayed event stream that releases its worker however it ends (a body never
    started, because the client left first, runs no ``finally`` of its own)."""

    def __init__(self, attempt: _Attempt, body: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(body, attempt.upstream.status_code, headers)
        self.attempt = attempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.attempt.release()


async def forward(router: Router, request: Request) -> Response:
    """Send ``request`` to a worker chosen by the policy; relay the answer."""
    body = await request.body()
    key = routing_key(request.url.path, _json(body)) if request.method == "POST" else None
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        attempt = await _attempts(router, request, body, key, disconnect)
    except NoWorkerError as exc:
        return _error(router, 503, "service_unavailable", str(exc))
    except ClientGoneError:
        return _error(router, 499, "client_closed_request", "the client disconnected")
    finally:
        disconnect.cancel()  # NOTE: a streaming response listens for the disconnect itself
    router.stats.observe(attempt.route)
    headers = {k: v for k, v in attempt.upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    headers["x-arbor-worker"] = attempt.worker.url
    if attempt.first is None:
        await attempt.release()
        return Response(attempt.content, attempt.upstream.status_code, headers)
    return _RelayResponse(attempt, _relay(router, attempt), headers)


async def _attempts(router: Router, request: Request, body: bytes, key: list[int] | None,
                    disconnect: asyncio.Future[None]) -> _Attempt:
    tried: set[int] = set()
    errors: list[str] = []
    while True:
        candidates = router.pool.candidates(exclude=tried)
        if not candidates:
            raise NoWorkerError(_no_worker_message(router.pool, errors))
        route = router.policy.route(key, router.pool.loads, candidates)
        worker = router.pool.workers[route.worker]
        tried.add(worker.index)
        worker.load += 1
        try:
            return await _attempt(router, worker, route, request, body, disconnect)
        except (*WORKER_FAILURES, WorkerGoneError) as exc:
            worker.load -= 1
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if not isinstance(exc, httpx.TimeoutException):  # a slow worker: its probes decide
                router.pool.mark_down(worker, reason)
            errors.append(f"{worker.url}: {reason}")
            router.stats.retries += 1
        except BaseException:
            worker.load -= 1
            raise


async def _attempt(router: Router, worker: Worker, route: Route, request: Request, body: bytes,
                   disconnect: asyncio.Future[None]) -> _Attempt:
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
    sent = router.client.build_request(request.method, worker.url + request.url.path, content=body,
                                       headers=headers, params=request.query_params)
    upstream = await _guarded(router.client.send(sent, stream=True), worker, disconnect)
    try:
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            chunks = upstream.aiter_raw()
            first = await _guarded(_first_chunk(chunks), worker, disconnect)
            return _Attempt(worker, route, upstream, first, b"", chunks)
        content = await _guarded(_read_all(upstream), worker, disconnect)
    except BaseException:
        with contextlib.suppress(httpx.HTTPError, OSError):
            await upstream.aclose()
        raise
    return _Attempt(worker, route, upstream, None, content)


async def _relay(router: Router, attempt: _Attempt) -> AsyncIterator[bytes]:
    """The body of a relayed event stream; always closes the worker connection (a client
    gone mid-stream cancels this generator, and the close makes the worker abort)."""
    worker, chunks = attempt.worker, attempt.chunks
    assert chunks is not None
    tail = attempt.first or b""
    try:
        yield tail
        while True:
            try:
                chunk = await _guarded(anext(chunks), worker, None)
            except StopAsyncIteration:
                return
            except (*WORKER_FAILURES, WorkerGoneError) as exc:
                router.pool.mark_down(worker, f"{type(exc).__name__}: {exc}")
                router.stats.errors["worker_failed_mid_stream"] += 1
                message = f"worker {worker.url} failed mid-stream: {type(exc).__name__}: {exc}"
                # NOTE: end a half-relayed event first so the error event parses on its own
                yield (b"" if tail.endswith(b"\n\n") else b"\n\n") + _error_event(message)
                return
            tail = chunk or tail
            yield chunk
    finally:
        await attempt.release()


async def _first_chunk(chunks: AsyncIterator[bytes]) -> bytes:
    async for chunk in chunks:
        if chunk:
            return chunk
    return b""


async def _read_all(upstream: httpx.Response) -> bytes:
    return b"".join([chunk async for chunk in upstream.aiter_raw()])


async def _guarded(work: Awaitable[T], worker: Worker, disconnect: asyncio.Future[None] | None) -> T:
    """Await ``work`` unless the worker is taken out or the client leaves first."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_consume)
    gone = asyncio.ensure_future(worker.gone.wait())
    watched: set[asyncio.Future[Any]] = {task, gone} | ({disconnect} if disconnect else set())
    try:
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # NOTE: a no-op when done; else we are being cancelled (the client left)
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    if disconnect is not None and disconnect in done:
        raise ClientGoneError("the client disconnected")
    raise WorkerGoneError(worker.last_error or "the worker was taken out")


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a cancelled read's late failure (the connection closed under it)."""
    if not task.cancelled():
        task.exception()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None  # the worker answers it with its own 400


def _no_worker_message(pool: WorkerPool, errors: list[str]) -> str:
    if errors:
        return f"no healthy worker could take the request (tried: {'; '.join(errors)})"
    down = "; ".join(f"{w.url}: {w.last_error or 'not yet healthy'}" for w in pool.workers)
    return f"no healthy worker ({down})"


def _error(router: Router, status: int, kind: str, message: str) -> Response:
    router.stats.errors[kind] += 1
    return Response(json.dumps(error_body(message, kind, status)), status, media_type="application/json")


def _error_event(message: str) -> bytes:
    payload = json.dumps(error_body(message, "service_unavailable", 503), separators=(",", ":"))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()
