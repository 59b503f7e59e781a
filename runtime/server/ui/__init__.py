"""``GET /ui``: the server's own live page, and the JSON it reads.

One static page (``static/``: HTML, CSS and hand-written JS; no build step, no CDN, so it
works offline) polls ``/ui/api/live`` every second and draws the engine's gauges (running
and waiting requests, KV pages used/evictable/free, prefix-cache hit rate, speculative
acceptance), TTFT/ITL percentiles over the last minutes, and the recent program runs with
their trace timelines (SVG drawn by ``runtime.trace.timeline``). Its form runs a
registered program with arguments built from the program's JSON schema and shows the run's
events as they stream in (the programs API, also mounted under ``/ui/api``).

    GET  /ui                          the page (the login page when a key is set and missing)
    POST /ui/login                    form field ``key`` → cookie (see ``auth.py``), 303 to /ui
    GET  /ui/static/{file}            the page's JS and CSS
    GET  /ui/api/live                 live figures (JSON)
    GET  /ui/api/runs                 recent program runs (summaries)
    GET  /ui/api/runs/{id}            one run with its trace
    GET  /ui/api/runs/{id}/timeline.svg
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.exceptions import HTTPException

from runtime.server.auth import UI_STATIC, login_response
from runtime.server.run_log import RunRecord
from runtime.server.serving import ServerContext
from runtime.trace.timeline import render_timeline

STATIC = UI_STATIC
STATIC_FILES = {"ui.js": "text/javascript", "ui.css": "text/css"}
LOGIN_PAGE = (STATIC / "login.html").read_bytes()
WINDOWS_S = (60.0, 300.0)  # the percentile windows shown


def build_router(ctx: ServerContext, api_key: str | None, cookie_name: str, cookie_value: str | None) -> APIRouter:
    """The ``/ui`` routes. ``cookie_value``: what ``POST /ui/login`` sets when the key
    matches (None: no key, the page is open)."""
    router = APIRouter()

    @router.get("/ui", response_model=None)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @router.post("/ui/login", response_model=None)
    async def login(request: Request) -> Response:
        return login_response(await request.body(), api_key, cookie_name, cookie_value, LOGIN_PAGE)

    @router.get("/ui/static/{name}", response_model=None)
    async def static(name: str) -> FileResponse:
        if name not in STATIC_FILES:
            raise HTTPException(404, f"no static file {name!r}")
        return FileResponse(STATIC / name, media_type=STATIC_FILES[name])

    @router.get("/ui/api/live")
    async def live() -> dict[str, Any]:
        return live_figures(ctx)

    @router.get("/ui/api/runs")
    async def runs() -> dict[str, Any]:
        return {"runs": [r.summary() for r in ctx.metrics.runs.recent()]}

    @router.get("/ui/api/runs/{run_id}")
    async def run(run_id: str) -> dict[str, Any]:
        record = _record(ctx, run_id)
        return {**record.summary(), "trace": record.trace}

    @router.get("/ui/api/runs/{run_id}/timeline.svg", response_model=None)
    async def timeline(run_id: str) -> Response:
        record = _record(ctx, run_id)
        if record.trace is None:
            raise HTTPException(404, f"run {run_id} has no trace (status {record.status})")
        return Response(render_timeline(record.trace), media_type="image/svg+xml")

    return router


def _record(ctx: ServerContext, run_id: str) -> RunRecord:
    record = ctx.metrics.runs.get(run_id)
    if record is None:
        raise HTTPException(404, f"no recent run {run_id!r} (the server keeps the last few only)")
    return record


def live_figures(ctx: ServerContext) -> dict[str, Any]:
    """Everything the page's gauges show, read now."""
    m = dict(ctx.metrics.engine_metrics())
    total = m.get("kv_pages_total", 0.0)
    free = m.get("kv_pages_free", 0.0)
    used = m.get("kv_pages_used", 0.0)
    drafted = m.get("spec_draft_tokens", 0.0)
    return {
        "time": time.time(), "model": ctx.model_name,
        "requests": {"running": m.get("num_running", 0), "waiting": m.get("num_waiting", 0),
                     **ctx.metrics.gate_state(), "finished": m.get("num_finished", 0)},
        "kv_pages": {"total": total, "used": used, "free": free,
                     "evictable": max(0.0, total - used - free)},
        "prefix_cache": {"hit_rate": m.get("cache_hit_rate", 0.0), "prompt_tokens": m.get("prompt_tokens", 0),
                         "cached_prompt_tokens": m.get("cached_prompt_tokens", 0)},
        "speculation": {"draft_tokens": drafted, "accepted_tokens": m.get("spec_accepted_tokens", 0),
                        "forced_tokens": m.get("spec_forced_tokens", 0),
                        "acceptance_rate": m.get("spec_acceptance_rate", 0.0)},
        "latency": {f"{int(w)}s": {"ttft": ctx.metrics.recent_ttft.percentiles(w),
                                   "itl": ctx.metrics.recent_itl.percentiles(w)} for w in WINDOWS_S},
        "programs": sorted(ctx.programs),
        "runs": [r.summary() for r in ctx.metrics.runs.recent()[:10]],
    }
