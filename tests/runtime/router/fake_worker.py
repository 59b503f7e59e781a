"""A stand-in for ``arbor serve`` with switches for failure: answers ``/health`` and
``/generate`` (whole or streamed), records what it got and which streams were cut."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


class FakeWorker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.healthy = True  # False: /health answers 503
        self.stall = False  # True: /generate and streams stop answering (a hung worker)
        self.texts: list[str] = []
        self.aborted = 0  # requests whose client (the router) went away before the end
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({"status": "ok" if self.healthy else "down"},
                                status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.name}]}

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            body = await request.json()
            self.texts.append(body.get("text", ""))
            num = int(body.get("num_events", 3))
            delay = float(body.get("delay", 0.0))
            if body.get("stream"):
                return StreamingResponse(self._events(num, delay), media_type="text/event-stream")
            if delay:
                await self._wait_or_disconnect(request, delay)
            return JSONResponse({"worker": self.name, "text": body.get("text"),
                                 "auth": request.headers.get("authorization")})

        return app

    async def _events(self, num: int, delay: float) -> AsyncIterator[str]:
        done = False
        try:
            for i in range(num):
                while self.stall:
                    await asyncio.sleep(0.05)
                yield f"data: {json.dumps({'worker': self.name, 'i': i})}\n\n"
                await asyncio.sleep(delay)
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                self.aborted += 1

    async def _wait_or_disconnect(self, request: Request, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end or self.stall:
            if await request.is_disconnected():
                self.aborted += 1
                return
            await asyncio.sleep(0.05)
