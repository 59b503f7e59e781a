"""``create_router_app``: the HTTP front of data-parallel workers.

It speaks the workers' API (``arbor serve``: native ``/generate``, the OpenAI API,
``/programs`` and the rest) by relaying every route it does not own to one worker chosen
by the routing policy, so a client cannot tell a router from a single server. Its own
routes:

    GET /health    200 while at least one worker is healthy (503 otherwise), with each
                   worker's URL, health, load and last error
    GET /metrics   the router's metrics (``metrics.py``); each worker keeps its own
    GET|POST /flush_cache  SGLang's cache flush, sent to every healthy worker
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runtime.router.config import HealthConfig, PolicyConfig
from runtime.router.metrics import RouterStats
from runtime.router.policy import make_policy
from runtime.router.proxy import Router, forward
from runtime.router.workers import WorkerPool
from runtime.server.auth import ApiKeyMiddleware
from runtime.server.limits import BodyLimitMiddleware, ServerLimits

KEEPALIVE_S = 2.0  # below `arbor serve --timeout-keep-alive`'s default (5)
CONNECT_TIMEOUT_S = 10.0  # a loaded 2-core machine can take seconds to accept


def create_router_app(
    worker_urls: list[str],
    policy: PolicyConfig | None = None,
    health: HealthConfig | None = None,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
) -> FastAPI:
    """Build the router app in front of ``worker_urls``.

    Args:
        worker_urls: base URLs of ``arbor serve`` workers (the index of each is its id).
        policy: routing policy and its thresholds (default: cache-aware).
        health: probe interval, timeout and failures before a worker is taken out.
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <key>``
            (the header is also relayed, so workers started with the same key accept it).
        max_body_bytes: request bodies above this are refused with 413 (default: the
            server's own limit).
    """
    policy = policy or PolicyConfig()
    routing = make_policy(policy, len(worker_urls))
    pool = WorkerPool(worker_urls, health or HealthConfig(), on_down=routing.forget)
    stats = RouterStats(pool)
    holder: dict[str, Router] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # NOTE: no read timeout: a generation takes as long as it takes (each worker has
        # its own request timeout); a worker that stops answering is caught by the probes.
        timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=30.0, pool=None)
        # NOTE: idle pooled connections are dropped before a worker's own keep-alive (5 s
        # by default) would close them, which would race a reuse and fail a request.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256,
                              keepalive_expiry=KEEPALIVE_S)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            holder["router"] = Router(pool, routing, stats, client)
            await pool.probe_all(client)
            pool.start(client)
            try:
                yield
            finally:
                await pool.stop()

    app = FastAPI(title="Arbor router", lifespan=lifespan)
    app.state.pool, app.state.stats, app.state.policy = pool, stats, routing

    @app.get("/health")
    async def health_route() -> JSONResponse:
        workers: list[dict[str, Any]] = [
            {"url": w.url, "healthy": w.healthy, "load": w.load, "last_error": w.last_error}
            for w in pool.workers]
        ok = any(w.healthy for w in pool.workers)
        return JSONResponse({"status": "ok" if ok else "unavailable", "policy": policy.policy,
                             "workers": workers}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(stats.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_route(request: Request) -> JSONResponse:
        """SGLang's ``/flush_cache`` on every healthy worker (each has its own prefix cache);
        the policy forgets what it knew of their caches."""
        client = holder["router"].client
        headers = {k: v for k in ("authorization", "x-api-key") if (v := request.headers.get(k)) is not None}
        healthy = [w for w in pool.workers if w.healthy]
        answers = await asyncio.gather(*(client.post(w.url + "/flush_cache", headers=headers) for w in healthy),
                                       return_exceptions=True)
        flushed = []
        for worker, answer in zip(healthy, answers, strict=True):
            if isinstance(answer, httpx.Response) and answer.status_code == 200:
                routing.forget(worker.index)
                flushed.append(worker.url)
        ok = len(flushed) == len(healthy)
        return JSONResponse({"flushed": flushed, "workers": len(pool.workers)}, status_code=200 if ok else 502)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def relay(request: Request) -> Response:
        return await forward(holder["router"], request)

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes or ServerLimits().max_body_bytes)
    return app
