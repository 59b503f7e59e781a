"""Optional API key: ``Authorization: Bearer <key>`` on every route but ``/health``."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.server.limits import send_error

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    """Answers 401 unless the request carries the key (compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            await send_error(send, 401, "missing or invalid API key (Authorization: Bearer <key>)",
                             "authentication_error", [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)
