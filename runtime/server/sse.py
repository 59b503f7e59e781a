"""Server-sent events: the framing, and a response that always releases its requests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    """One event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that runs ``on_close`` however it ends.

    NOTE: a body generator that never started (client gone before the first byte) runs no
    ``finally``; this wrapper is what guarantees the engine requests are aborted then.
    """

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()
