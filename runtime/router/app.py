"""``create_router_app``: the HTTP front of data-parallel workers.

It speaks the workers' API (``arbor serve``: native ``/generate``, the OpenAI API,
``/programs`` and the rest) by relaying every route it does not own to one worker chosen
by the routing policy, so a client cannot tell a router from a single server. Its own
routes:

    GET /health    200 while at least one worker is healthy (503 otherwise), with each
                   worker's URL, health, load and last error
    GET /metrics   the router's metrics (``metrics.py``, ``split_metrics.py``, ``canary.py``);
                   each worker keeps its own
    GET|POST /flush_cache  SGLang's cache flush, sent to every healthy worker
    GET /ui        the rollout page (``ui/``): baseline vs candidate side by side, the
                   shadow figures, the step, the gates and the event log

and, with a rollout plan, the admin API (``docs/rollouts.md``; 404 without a plan)::

    GET  /rollout            state, weights, gates, events, the per-pool panel, shadow figures
    POST /rollout/promote    the next step now ({"full": true}: the last)
    POST /rollout/rollback   0% candidate, held ({"reason": "..."})
    POST /rollout/pause      hold the current weights (gates still roll back)
    POST /rollout/resume
    POST /rollout/weight     {"weight": N}: the candidate's percent, set by an outside controller
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runtime.errors import InvalidRequestError
from runtime.router import ui
from runtime.router.canary import Canary
from runtime.router.config import HealthConfig, PolicyConfig
from runtime.router.metrics import RouterStats
from runtime.router.policy import make_policy
from runtime.router.pools import Pools
from runtime.router.proxy import Router, forward, send_shadow
from runtime.router.rollout_plan import Plan
from runtime.router.rollout_store import RolloutStore
from runtime.router.split_metrics import SplitMetrics
from runtime.router.workers import WorkerPool
from runtime.server.auth import ApiKeyMiddleware
from runtime.server.limits import BodyLimitMiddleware, ServerLimits, error_body

KEEPALIVE_S = 2.0  # below `arbor serve --timeout-keep-alive`'s default (5)
CONNECT_TIMEOUT_S = 10.0  # a loaded 2-core machine can take seconds to accept


def create_router_app(
    worker_urls: list[str],
    policy: PolicyConfig | None = None,
    health: HealthConfig | None = None,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
    pools: Pools | None = None,
    plan: Plan | None = None,
    store: RolloutStore | None = None,
) -> FastAPI:
    """Build the router app in front of ``worker_urls``.

    Args:
        worker_urls: base URLs of ``arbor serve`` workers (the index of each is its id).
        policy: routing policy and its thresholds (default: cache-aware).
        health: probe interval, timeout and failures before a worker is taken out.
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <key>``
            (``/ui`` paths also take the login cookie, as on the server)
            (the header is also relayed, so workers started with the same key accept it).
        max_body_bytes: request bodies above this are refused with 413 (default: the
            server's own limit).
        pools: named pools over ``worker_urls`` (``Pools.parse``); default: one pool "default".
        plan: a rollout plan over ``pools`` (``rollout_plan.load_plan``); None: no rollout.
        store: where the rollout's state is kept (default: in memory only).
    """
    policy = policy or PolicyConfig()
    routing = make_policy(policy, len(worker_urls))
    pool = WorkerPool(worker_urls, health or HealthConfig(), on_down=routing.forget)
    stats = RouterStats(pool)
    pools = pools or Pools({"default": tuple(range(len(worker_urls)))})
    canary = Canary(pools, pool, SplitMetrics(stats.registry), plan, store)
    stats.registry.register(canary)
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
            router = holder["router"] = Router(pool, routing, stats, client, canary, policy.share_across_tenants)
            await pool.probe_all(client)
            pool.start(client)
            canary.start_shadow(lambda job: send_shadow(router, job), lambda: sum(pool.loads))
            canary.start()
            try:
                yield
            finally:
                await canary.stop()
                await pool.stop()

    app = FastAPI(title="Arbor router", lifespan=lifespan)
    app.state.pool, app.state.stats, app.state.policy, app.state.canary = pool, stats, routing, canary

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

    @app.post("/flush_cache", operation_id="flush_cache")
    @app.get("/flush_cache", operation_id="flush_cache_get")
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

    status = _add_rollout_routes(app, canary)
    app.include_router(ui.build_router(status, api_key))

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def relay(request: Request) -> Response:
        return await forward(holder["router"], request)

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, login_page=ui.LOGIN_PAGE)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes or ServerLimits().max_body_bytes)
    return app


def _add_rollout_routes(app: FastAPI, canary: Canary) -> Callable[[], JSONResponse]:
    """The admin API: what ``arbor rollout`` and an outside controller drive. Returns what
    ``GET /rollout`` answers (the ``/ui`` page reads the same)."""

    def no_plan() -> JSONResponse:
        return JSONResponse(error_body("this router has no rollout plan (start it with --plan FILE)",
                                       "no_rollout_plan", 404), status_code=404)

    async def act(request: Request, action: str) -> JSONResponse:
        if canary.rollout is None:
            return no_plan()
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
            if not isinstance(body, dict):
                raise InvalidRequestError("the body is a JSON object")
            rollout = canary.rollout
            if action == "promote":
                rollout.promote(full=bool(body.get("full", False)))
            elif action == "rollback":
                rollout.rollback(str(body.get("reason") or "operator"))
                canary.rollbacks["operator"] += 1
            elif action == "pause":
                rollout.pause(str(body.get("reason") or "operator"))
            elif action == "resume":
                rollout.resume()
            else:
                rollout.set_weight(body.get("weight"))  # type: ignore[arg-type]
        except InvalidRequestError as exc:  # NOTE: before ValueError (it is one)
            return JSONResponse(error_body(str(exc), "conflict", 409), status_code=409)
        except ValueError as exc:
            return JSONResponse(error_body(f"bad request body: {exc}", "invalid_request_error", 400), 400)
        return JSONResponse(canary.status())

    def status() -> JSONResponse:
        return no_plan() if canary.rollout is None else JSONResponse(canary.status())

    @app.get("/rollout")
    async def rollout_status() -> JSONResponse:
        return status()

    def handler(action: str) -> Callable[[Request], Awaitable[JSONResponse]]:
        async def route(request: Request) -> JSONResponse:
            return await act(request, action)
        return route

    for action in ("promote", "rollback", "pause", "resume", "weight"):
        app.add_api_route(f"/rollout/{action}", handler(action), methods=["POST"])
    return status
