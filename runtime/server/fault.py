"""A test hook, not a feature: ``arbor serve --fault-delay-ms N`` makes every generation
request (``POST /generate``, ``/v1/*``, ``/programs/*``) wait N ms before it is handled.

It exists so a rollout's guard rails can be shown honestly against a worker that is
really slower (``tests/runtime/router/test_rollout_live.py``,
``benchmarks/bench_rollout.py``): the answers stay the same, only the latency grows.
Never set it in production.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

DELAYED_PREFIXES = ("/generate", "/v1/", "/programs/")


class FaultDelayMiddleware:
    def __init__(self, app: ASGIApp, delay_s: float) -> None:
        self.app = app
        self.delay_s = delay_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope.get("method") == "POST"
                and str(scope.get("path", "")).startswith(DELAYED_PREFIXES)):
            await asyncio.sleep(self.delay_s)
        await self.app(scope, receive, send)
