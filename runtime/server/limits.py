"""Server-side safety limits: body size, token caps, timeouts and the bounded queue.

The server counts the requests it has in flight (admitted, not yet answered). Beyond
``max_inflight`` a new request is refused with 429 at once, and so is one that would wait
longer than ``max_queue_wait_s`` for its first token by the server's measured pace
(``queue_wait.QueueWaitEstimator``), or longer than ``queue_wait_deadline_share`` of its
own deadline (so what is admitted has the rest of its deadline to generate): past saturation the answer is a prompt 429 with
``Retry-After``, not an admission that times out later. When too many admitted requests
are still waiting for their first token (``max_waiting``, the bound while the pace is not
yet known) or the engine is closing, the answer is 503. Nothing queues without bound.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.errors import InvalidRequestError
from runtime.server.queue_wait import QueueWaitEstimator
from runtime.server.tenants import Caller, TenantLimiter, TenantLimitError

ANONYMOUS = Caller()


@dataclass(frozen=True)
class ServerLimits:
    """Every limit the server enforces. Construct once; never mutated afterwards."""

    max_inflight: int = 256  # requests admitted at once (streams and programs included); beyond: 429
    max_waiting: int = 1024  # admitted requests still without a first token; beyond: 503
    max_body_bytes: int = 4 * 1024 * 1024  # request body size; beyond: 413
    max_tokens: int = 4096  # cap on max_tokens / max_new_tokens of one request
    default_max_tokens: int = 256  # OpenAI chat requests without max_tokens
    max_n: int = 16  # choices per OpenAI request
    request_timeout_s: float | None = 600.0  # per-request deadline (a request may ask for less)
    program_timeout_s: float | None = 600.0  # deadline of one program run
    max_prompt_tokens: int | None = None  # prompt tokens of one request; None: the model's context
    tenant_max_concurrent: int | None = None  # requests in flight per tenant; beyond: 429
    tenant_tokens_per_minute: int | None = None  # prompt + max_tokens per tenant; beyond: 429
    # Latency targets per tenant: (tenant, ttft_slo, itl_slo) in seconds, None: the engine's.
    # A request's own targets win over its tenant's (docs/serving-slo.md).
    tenant_slo: tuple[tuple[str, float | None, float | None], ...] = ()
    # SIGTERM: stop admitting (503), let requests in flight finish for this long, then
    # abort the rest and exit 0.
    shutdown_timeout_s: float = 30.0
    # A request field the server does not understand: "error" (400 naming it) or "warn"
    # (ignored, named in the X-Arbor-Ignored-Fields answer header); see api/common/fields.py.
    unknown_fields: str = "error"
    # A request body not received whole within this many seconds of its headers is
    # answered 408 (a client that trickles or stalls its body holds no connection forever).
    body_timeout_s: float = 30.0
    # A request that would wait longer than this for its first token, by the server's
    # measured pace (queue_wait.py), is refused with 429 at once; None: no such bound.
    max_queue_wait_s: float | None = 30.0
    # ... or longer than this share of its own deadline (its timeout, else
    # request_timeout_s): a request admitted at the edge of its deadline would time out
    # while generating, after holding a slot and its KV pages (docs/operations-limits.md).
    queue_wait_deadline_share: float = 0.25

    def __post_init__(self) -> None:
        for name in ("max_inflight", "max_waiting", "max_body_bytes", "max_tokens",
                     "default_max_tokens", "max_n", "max_prompt_tokens", "tenant_max_concurrent",
                     "tenant_tokens_per_minute"):
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        if self.unknown_fields not in ("error", "warn"):
            raise InvalidRequestError(f"unknown_fields must be 'error' or 'warn', got {self.unknown_fields!r}")
        if not self.shutdown_timeout_s >= 0:
            raise InvalidRequestError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s!r}")
        if not self.body_timeout_s > 0:
            raise InvalidRequestError(f"body_timeout_s must be > 0, got {self.body_timeout_s!r}")
        if not 0 < self.queue_wait_deadline_share <= 1:
            raise InvalidRequestError("queue_wait_deadline_share must be in (0, 1], got "
                                      f"{self.queue_wait_deadline_share!r}")
        for entry in self.tenant_slo:
            tenant, *targets = entry
            if not isinstance(tenant, str) or not tenant or any(
                    t is not None and not (isinstance(t, (int, float)) and t > 0) for t in targets):
                raise InvalidRequestError(f"tenant_slo entries are (tenant, ttft_slo, itl_slo) with targets "
                                          f"> 0 or None, got {entry!r}")
        for name in ("request_timeout_s", "program_timeout_s", "max_queue_wait_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidRequestError(f"{name} must be > 0 or None, got {value!r}")

    def slo_of(self, tenant: str | None) -> tuple[float | None, float | None]:
        """``(ttft_slo, itl_slo)`` of ``tenant`` (None each: no target of its own)."""
        for name, ttft, itl in self.tenant_slo:
            if name == tenant:
                return ttft, itl
        return None, None

    def deadline(self, asked: float | None) -> float | None:
        """The timeout of one request: what it asked for, never beyond the server's."""
        if asked is None:
            return self.request_timeout_s
        return asked if self.request_timeout_s is None else min(asked, self.request_timeout_s)


_OPTIONAL = frozenset({"max_prompt_tokens", "tenant_max_concurrent", "tenant_tokens_per_minute"})


class Overloaded(Exception):
    """The server refuses new work; ``status`` is 429 (too many in flight, a tenant over
    its limits) or 503 (overloaded, shutting down). ``retry_after``: seconds, for the
    ``Retry-After`` header (None: none sent)."""

    def __init__(self, status: int, message: str, retry_after: float | None = 1.0) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class AdmissionGate:
    """Counts requests in flight (all, and per tenant) and those still waiting for their
    first token; reserves each tenant's tokens (``tenants.TenantLimiter``).

    Only touched from the server's event loop thread, so plain integers suffice.
    """

    def __init__(self, limits: ServerLimits, queue_wait: QueueWaitEstimator | None = None) -> None:
        self.limits = limits
        self.num_inflight = 0
        self.num_waiting = 0
        self.closing = False
        self.tenants = TenantLimiter(limits.tenant_max_concurrent, limits.tenant_tokens_per_minute)
        self.queue_wait = queue_wait or QueueWaitEstimator()

    def expected_wait(self) -> float | None:
        """Seconds a request admitted now would wait for its first token (None: not known yet)."""
        return self.queue_wait.expected_wait(self.num_waiting)

    def wait_started(self) -> None:
        """An admitted engine request starts waiting for its first token."""
        if self.num_waiting == 0:
            self.queue_wait.queue_busy()
        self.num_waiting += 1

    def wait_ended(self, first_token: bool) -> None:
        """It got its first token (``first_token``), or left without one (aborted, failed)."""
        self.num_waiting -= 1
        if first_token:
            self.queue_wait.first_token()

    def admit(self, caller: Caller = ANONYMOUS, tokens: int = 0, deadline_s: float | None = None) -> None:
        """Take one in-flight slot (and ``tokens`` of the caller's tenant) or raise
        ``Overloaded``; pair with ``release``. ``deadline_s``: the request's own timeout
        (``ServerLimits.deadline``); None: no deadline."""
        if self.closing:
            raise Overloaded(503, "the server is shutting down", retry_after=None)
        if self.num_waiting >= self.limits.max_waiting:
            raise Overloaded(503, f"the engine is overloaded ({self.num_waiting} requests "
                                  "waiting for their first token); retry later")
        if self.num_inflight >= self.limits.max_inflight:
            raise Overloaded(429, f"too many requests in flight (limit {self.limits.max_inflight}); "
                                  "retry later")
        self._check_queue_wait(deadline_s)
        try:
            self.tenants.acquire(caller.tenant, tokens)
        except TenantLimitError as exc:
            raise Overloaded(429, str(exc), exc.retry_after) from None
        self.num_inflight += 1

    def release(self, caller: Caller = ANONYMOUS, unused_tokens: int = 0) -> None:
        self.num_inflight -= 1
        self.tenants.release(caller.tenant, unused_tokens)

    def _check_queue_wait(self, deadline_s: float | None) -> None:
        wait = self.expected_wait()
        if wait is None:
            return
        bound, limit = self.limits.max_queue_wait_s, ""
        if bound is not None:
            limit = f"limit {bound:g} s"
        if deadline_s is not None:
            share = self.limits.queue_wait_deadline_share
            if bound is None or share * deadline_s < bound:
                bound, limit = share * deadline_s, f"limit {share:g} of its {deadline_s:g} s deadline"
        if bound is None or wait <= bound:
            return
        # NOTE: Retry-After is when the queue ahead should have drained back under the bound.
        raise Overloaded(429, f"the server is saturated: a new request would wait about {wait:.0f} s "
                              f"for its first token ({limit}); retry later",
                         retry_after=float(max(1, math.ceil(wait - bound))))


class BodyLimitMiddleware:
    """Answers 413 for a body over ``max_bytes``, declared (Content-Length) or streamed,
    408 for a body not received whole within ``timeout_s``, and 400 for a JSON body that
    holds a lone UTF-16 surrogate (``lone_surrogate``).

    The body is read here, up to the limit, before the app sees it, then replayed; later
    ``receive`` calls (disconnect detection) go straight through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, 413, self._message(), "request_too_large")
            return
        buffered: list[Message] = []
        try:
            async with asyncio.timeout(self.timeout_s):
                too_large = await self._read(receive, buffered)
        except TimeoutError:
            await send_error(send, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                             "request_timeout")
            return
        if too_large:
            await send_error(send, 413, self._message(), "request_too_large")
            return

        body = b"".join(m.get("body", b"") for m in buffered if m["type"] == "http.request")
        if (problem := lone_surrogate(body)) is not None:
            await send_error(send, 400, problem, "invalid_json")
            return

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive, buffered: list[Message]) -> bool:
        """Receive the body into ``buffered``; True once it passes ``max_bytes``."""
        received = 0
        while not buffered or buffered[-1].get("more_body", False):
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                return False  # disconnected: let the app see it
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                return True
        return False

    def _message(self) -> str:
        return f"request body exceeds {self.max_bytes} bytes"


def lone_surrogate(body: bytes) -> str | None:
    """Why ``body`` is not Unicode text, if a JSON escape in it is a lone UTF-16 surrogate
    (``"\\udcff"``), else None.

    NOTE: ``json.loads`` accepts such an escape and yields a ``str`` that cannot be encoded
    (the tokenizer, the log, the answer would all fail later, as a 500); RFC 8259 leaves
    it to the receiver, and this server refuses it. The body is parsed a second time only
    when it holds a ``\\uD8``..``\\uDF`` escape, which ordinary text never does.
    """
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON: the app answers that itself
    where = _find_surrogate(value, "body")
    if where is None:
        return None
    return (f"{where} holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), "
            "which is not valid Unicode text")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _find_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) in ``value`` that is not valid Unicode."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, f"{where} (a key)"))
                stack.append((child, f"{where}.{key}"))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return None


async def send_error(send: Send, status: int, message: str, kind: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A JSON error answer in the OpenAI shape, sent from ASGI middleware."""
    body = json.dumps(error_body(message, kind, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def error_body(message: str, kind: str, status: int) -> dict[str, Any]:
    """``{"error": {"message", "type", "code"}}`` — what OpenAI clients expect."""
    return {"error": {"message": message, "type": kind, "code": status}}
