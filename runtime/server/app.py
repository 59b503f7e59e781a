"""``create_app``: the FastAPI app around one engine.

The app only mounts the API families (``API_FAMILIES``: each ``api/<family>/routes.py``
translates its wire schemas into engine requests and back); the engine's own background
thread runs every step. Middleware, outermost first: the version headers
(``X-Arbor-Model``, ``X-Arbor-Config-Version``) on every answer, body size limit (413) and
lone-surrogate check (400), API key (401, all routes but ``/health``; ``/ui`` also by
cookie). Tenant and priority come from each request (``tenants.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from runtime.engine import Engine
from runtime.server import ui
from runtime.server.api.anthropic import routes as anthropic_routes
from runtime.server.api.embeddings import routes as embeddings_routes
from runtime.server.api.native import routes as native_routes
from runtime.server.api.openai import routes as openai_routes
from runtime.server.api.programs import routes as programs_routes
from runtime.server.api.responses import routes as responses_routes
from runtime.server.api.sglang import routes as sglang_routes
from runtime.server.auth import UI_COOKIE, ApiKeyMiddleware, ui_token
from runtime.server.errors import install_error_handlers
from runtime.server.hosting import HostedProgram
from runtime.server.limits import AdmissionGate, BodyLimitMiddleware, ServerLimits
from runtime.server.metrics import ServerMetrics
from runtime.server.serving import ServerContext
from runtime.server.versions import VersionHeadersMiddleware, VersionLabels

# Every API the server speaks, mounted in this order: each is ``api/<family>/routes.py``
# with ``build_router(ctx)``; adding an API is one folder and one entry here
# (tests/test_architecture.py checks both).
API_FAMILIES = (
    sglang_routes,  # /generate (Arbor's fields and SGLang's), SGLang's info endpoints
    native_routes,  # tokenizer endpoints, sessions, engine metrics
    openai_routes,  # /v1/completions, /v1/chat/completions, /v1/models
    responses_routes,  # /v1/responses
    anthropic_routes,  # /v1/messages
    embeddings_routes,  # /v1/embeddings
    programs_routes,  # /programs
)


def create_app(
    engine: Engine,
    programs: dict[str, HostedProgram] | None = None,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    model_name: str | Sequence[str] | None = None,
) -> FastAPI:
    """Build the HTTP app for ``engine``.

    Args:
        engine: the one engine every route drives (not closed by the app).
        programs: hosted programs by name (``hosting.load_programs``: the ``@program``
            objects of a file); the only programs clients can run.
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <key>``.
        limits: body size, token caps, timeouts and queue bounds (defaults: ``ServerLimits()``).
        model_name: the id served by ``/v1/models`` (default: the engine's model setting),
            or several (the first is the one answers name); a request's ``model`` must be
            one of them (else 404).
    """
    limits = limits or ServerLimits()
    gate = AdmissionGate(limits)
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name or (engine.config.model,))
    versions = VersionLabels(names[0], engine.config.version())
    metrics = ServerMetrics(engine.metrics, lambda: {"requests_inflight": gate.num_inflight,
                                                     "requests_waiting_first_token": gate.num_waiting,
                                                     "expected_queue_wait_seconds": gate.expected_wait()},
                            versions.labels())
    ctx = ServerContext(engine, names[0], limits, gate, metrics, dict(programs or {}), names)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        gate.closing = True  # refuse new work (503) while uvicorn drains

    app = FastAPI(title="Arbor", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app, ctx)
    for family in API_FAMILIES:
        app.include_router(family.build_router(ctx))
    app.include_router(programs_routes.build_router(ctx), prefix="/ui/api")  # the page's form (cookie auth)
    app.include_router(ui.build_router(ctx, api_key, UI_COOKIE, ui_token(api_key) if api_key else None))

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine serves; 503 ``unhealthy`` with the reason once it cannot."""
        failure = getattr(ctx.engine, "failure", None)
        status = "unhealthy" if failure is not None else "closing" if gate.closing else "ok"
        body = {"status": status, "model": ctx.model_name, "config_version": versions.config_version,
                "requests_inflight": gate.num_inflight, **({"reason": failure} if failure else {})}
        return JSONResponse(body, status_code=503 if failure is not None else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, login_page=ui.LOGIN_PAGE)
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes,
                       timeout_s=limits.body_timeout_s)
    app.add_middleware(VersionHeadersMiddleware, versions=versions)
    return app


