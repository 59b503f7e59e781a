"""Who a request is for: its tenant, from an ``X-Tenant`` header or the OpenAI ``user`` field.

``tenant_of(headers, body)`` is the one rule (the header wins; the body's ``user`` string
otherwise; None when neither names one). ``TenantMiddleware`` applies it to every HTTP
request and leaves the answer in ``current_tenant`` (a context variable), where the code
that observes a request's latency reads it, so no route has to pass it along.

Tenants are client-chosen strings: a metric label per tenant would let clients grow the
label set without bound. ``TenantLabels`` keeps it bounded: the first ``max_labels``
tenants seen get a label of their own, every later one (and any name that is not a short
plain identifier) folds into ``"other"``; a request that names none is ``"none"``.
"""

from __future__ import annotations

import contextvars
import json
import re
import threading
from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

TENANT_HEADER = "x-tenant"
NO_TENANT = "none"
OTHER_TENANT = "other"
_LABEL_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")

current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("arbor_tenant", default=None)


def tenant_of(headers: Mapping[str, str], body: Any) -> str | None:
    """The tenant a request names: ``X-Tenant`` header, else the JSON body's ``user``."""
    header = headers.get(TENANT_HEADER)
    if header and header.strip():
        return header.strip()
    user = body.get("user") if isinstance(body, dict) else None
    return user.strip() if isinstance(user, str) and user.strip() else None


class TenantLabels:
    """A bounded set of metric label values for tenants. Thread-safe."""

    def __init__(self, max_labels: int = 16) -> None:
        self.max_labels = max_labels
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def label(self, tenant: str | None) -> str:
        if tenant is None:
            return NO_TENANT
        if not _LABEL_RE.match(tenant) or tenant in (NO_TENANT, OTHER_TENANT):
            return OTHER_TENANT
        with self._lock:
            if tenant in self._known:
                return tenant
            if len(self._known) < self.max_labels:
                self._known.add(tenant)
                return tenant
        return OTHER_TENANT


class TenantMiddleware:
    """Sets ``current_tenant`` for the request. Reads the body only when it is JSON and
    mentions ``"user"``; the body is then replayed to the app unchanged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        buffered: list[Message] = []
        body: Any = None
        if scope["method"] == "POST" and "json" in headers.get("content-type", ""):
            raw = b""
            while not buffered or buffered[-1].get("more_body", False):
                message = await receive()
                buffered.append(message)
                if message["type"] != "http.request":
                    break
                raw += message.get("body", b"")
            body = _json_with_user(raw)

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        token = current_tenant.set(tenant_of(headers, body))
        try:
            await self.app(scope, replay, send)
        finally:
            current_tenant.reset(token)


def _json_with_user(raw: bytes) -> Any:
    """The parsed body when it may carry a ``user`` field (a cheap test first)."""
    if b'"user"' not in raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None  # the route reports the bad body
