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
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.router.canary import Assignment, Canary
from runtime.router.metrics import RouterStats
from runtime.router.policy import NoWorkerError, Route, RoutingPolicy
from runtime.router.routing_key import namespaced_key
from runtime.router.shadow import ShadowJob
from runtime.router.split_metrics import Outcome
from runtime.router.workers import Worker, WorkerPool
from runtime.server.limits import error_body

T = TypeVar("T")
HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                        "te", "trailer", "upgrade"})
SHADOW_TIMEOUT_S = 300.0  # one shadow request at most (it runs alone: see shadow.py)
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
    canary: Canary
    share_across_tenants: bool = False  # PolicyConfig's: the key namespace ignores tenants


@dataclass
class _Watch:
    """What one relayed request came to: its pool, status and timings (one per request)."""

    assignment: Assignment
    body: Any  # the parsed request (None: not JSON)
    started: float  # time.monotonic()
    first_at: float | None = None  # the answer's first byte
    last_at: float | None = None  # the last data event
    num_events: int = 0  # data events of an event stream ([DONE] aside)
    last_event: bytes = b""  # the last data event but [DONE] (its meta / usage)
    failed_mid_stream: bool = False


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
    """Send ``request`` to a worker chosen by the policy (within the pool the rollout
    assigns it to); relay the answer and record what it came to."""
    body = await request.body()
    parsed = _json(body) if request.method == "POST" else None
    share = router.share_across_tenants
    key = namespaced_key(request.url.path, parsed, request.headers, share) if request.method == "POST" else None
    watch = _Watch(router.canary.assign(request.url.path, request.headers, parsed), parsed, time.monotonic())
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        attempt = await _attempts(router, request, body, key, disconnect, watch)
    except NoWorkerError as exc:
        return _finish_error(router, watch, 503, "service_unavailable", str(exc))
    except ClientGoneError:
        return _error(router, 499, "client_closed_request", "the client disconnected")
    finally:
        disconnect.cancel()  # NOTE: a streaming response listens for the disconnect itself
    router.stats.observe(attempt.route)
    headers = {k: v for k, v in attempt.upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    headers["x-arbor-worker"] = attempt.worker.url
    if attempt.first is None:
        await attempt.release()
        watch.first_at = watch.last_at = time.monotonic()
        answer = _observe(router, watch, attempt, attempt.content)
        _maybe_shadow(router, watch, request, attempt, answer)
        return Response(attempt.content, attempt.upstream.status_code, headers)
    return _RelayResponse(attempt, _relay(router, attempt, watch), headers)


async def _attempts(router: Router, request: Request, body: bytes, key: list[int] | None,
                    disconnect: asyncio.Future[None], watch: _Watch) -> _Attempt:
    tried: set[int] = set()
    errors: list[str] = []
    allowed = router.canary.allowed(watch.assignment)
    while True:
        healthy = router.pool.candidates(exclude=tried)
        # NOTE: the assigned pool's workers first; when none is left, the baseline's
        candidates = next((c for c in ([w for w in healthy if w in group] for group in allowed) if c), [])
        if not candidates:
            raise NoWorkerError(_no_worker_message(router.pool, errors))
        route = router.policy.route(key, router.pool.loads, candidates)
        worker = router.pool.workers[route.worker]
        tried.add(worker.index)
        worker.load += 1
        try:
            attempt = await _attempt(router, worker, route, request, body, disconnect)
        except (*WORKER_FAILURES, WorkerGoneError) as exc:
            worker.load -= 1
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if not isinstance(exc, httpx.TimeoutException):  # a slow worker: its probes decide
                router.pool.mark_down(worker, reason)
            errors.append(f"{worker.url}: {reason}")
            router.stats.retries += 1
            router.canary.attempt_failed(worker.index)
        except BaseException:
            worker.load -= 1
            raise
        else:
            if attempt.upstream.status_code < 500 or not router.canary.is_candidate(worker.index):
                return attempt
            # NOTE: a candidate's 5xx reached no client yet: an error of the candidate's
            # (its gates see it), and the request goes to the baseline instead
            await attempt.release()
            errors.append(f"{worker.url}: answered {attempt.upstream.status_code}")
            router.canary.attempt_failed(worker.index)


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


async def _relay(router: Router, attempt: _Attempt, watch: _Watch) -> AsyncIterator[bytes]:
    """The body of a relayed event stream; always closes the worker connection (a client
    gone mid-stream cancels this generator, and the close makes the worker abort)."""
    worker, chunks = attempt.worker, attempt.chunks
    assert chunks is not None
    tail = attempt.first or b""
    _watch_chunk(watch, tail)
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
                watch.failed_mid_stream = True
                message = f"worker {worker.url} failed mid-stream: {type(exc).__name__}: {exc}"
                # NOTE: end a half-relayed event first so the error event parses on its own
                yield (b"" if tail.endswith(b"\n\n") else b"\n\n") + _error_event(message)
                return
            tail = chunk or tail
            _watch_chunk(watch, chunk)
            yield chunk
    finally:
        await attempt.release()
        _observe(router, watch, attempt, watch.last_event)


def _watch_chunk(watch: _Watch, chunk: bytes) -> None:
    """Count a stream's events and keep its last data event (a chunk may hold several, or
    a part of one: only whole ``data: {...}`` lines are kept)."""
    now = time.monotonic()
    for line in chunk.split(b"\n"):
        payload = line[5:].strip() if line.startswith(b"data:") else b""
        if payload and payload != b"[DONE]":
            watch.num_events += 1
            watch.last_at = now
            if payload.startswith(b"{") and payload.endswith(b"}"):
                watch.last_event = payload
    if watch.first_at is None:
        watch.first_at = now


def _observe(router: Router, watch: _Watch, attempt: _Attempt, payload: bytes) -> dict[str, Any] | None:
    """Record the request's outcome; returns the parsed answer (None: not a JSON object)."""
    now = time.monotonic()
    answer = _json(payload)
    answer = answer if isinstance(answer, dict) else None
    prompt, output, cached, valid = _answer_facts(answer)
    headers = attempt.upstream.headers
    status = 503 if watch.failed_mid_stream else attempt.upstream.status_code
    itl = None
    if watch.num_events > 1 and watch.first_at is not None and watch.last_at is not None:
        itl = (watch.last_at - watch.first_at) / (watch.num_events - 1)
    ttft = watch.first_at - watch.started if watch.first_at is not None else None
    labels = router.canary.labels(watch.assignment, attempt.worker.index, headers.get("x-arbor-model", ""),
                                  headers.get("x-arbor-config-version", ""), prompt)
    router.canary.observe(watch.assignment, attempt.worker.index,
                          Outcome(labels, status, ttft, itl, now - watch.started, prompt, output, cached, valid))
    return answer


def _answer_facts(answer: dict[str, Any] | None) -> tuple[int | None, int | None, int | None, bool | None]:
    """(prompt tokens, output tokens, cached tokens, constraint valid) of a native answer
    (``meta``) or an OpenAI one (``usage``); None where it does not say."""
    if answer is None:
        return None, None, None, None
    meta = answer.get("meta")
    if isinstance(meta, dict):
        check = meta.get("constraint_check")
        valid = check.get("valid") if isinstance(check, dict) else None
        return meta.get("prompt_tokens"), meta.get("completion_tokens"), meta.get("cached_tokens"), valid
    usage = answer.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return usage.get("prompt_tokens"), usage.get("completion_tokens"), cached, None
    return None, None, None, None


def _maybe_shadow(router: Router, watch: _Watch, request: Request, attempt: _Attempt,
                  answer: dict[str, Any] | None) -> None:
    body = watch.body
    if (answer is None or attempt.upstream.status_code != 200 or not isinstance(body, dict)
            or not router.canary.shadow_wanted(watch.assignment, request.url.path, body)):
        return
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
    assert router.canary.shadow is not None
    router.canary.shadow.offer(ShadowJob(request.url.path, body, headers, answer))


async def send_shadow(router: Router, job: ShadowJob) -> dict[str, Any] | None:
    """Run one shadow job on the least loaded healthy candidate worker (not counted as
    user traffic: no metrics, no routing record)."""
    plan = router.canary.plan
    assert plan is not None
    members = router.canary.pools.members[plan.candidate]
    healthy = [i for i in router.pool.candidates() if i in members]
    if not healthy:
        return None
    worker = router.pool.workers[min(healthy, key=lambda i: router.pool.workers[i].load)]
    # NOTE: a bound on the wait: one hung shadow job would otherwise stop them all
    resp = await router.client.post(worker.url + job.path, json={**job.body, "stream": False},
                                    headers=job.headers, timeout=SHADOW_TIMEOUT_S)
    answer = resp.json() if resp.status_code == 200 else None
    return answer if isinstance(answer, dict) else None


def _finish_error(router: Router, watch: _Watch, status: int, kind: str, message: str) -> Response:
    labels = router.canary.labels(watch.assignment, None, "", "", None)
    router.canary.observe(watch.assignment, None, Outcome(labels, status, None, None,
                                                          time.monotonic() - watch.started, None, None, None, None))
    return _error(router, status, kind, message)


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
