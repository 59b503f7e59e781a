"""``GET /ui``: the router's rollout page, served by the router itself.

One static page (``static/``: HTML and hand-written JS, the server page's stylesheet; no
build step, no CDN, so it works offline) polls ``/ui/api/rollout`` every second and draws
the rollout side by side: baseline vs candidate p50/p99 of TTFT, ITL and end-to-end latency
with the number of samples behind each, requests and errors, the versions seen, the shadow
figures, the plan's current step and share, the gates, and the event log (rollbacks with
the gate, its figures and the time).

    GET  /ui                 the page (the login page when a key is set and missing)
    POST /ui/login           form field ``key`` → cookie (``runtime/server/auth.py``), 303 to /ui
    GET  /ui/static/{file}   the page's JS and CSS
    GET  /ui/api/rollout     the same JSON as ``GET /rollout`` (404 without a plan)

Any other ``/ui/...`` path is answered 404 here, never relayed to a worker.

NOTE: the page reads ``/ui/api/rollout``, not ``/rollout``: with ``--api-key`` a browser
holds only the login cookie, which opens ``/ui`` paths and nothing else (the same rule as
the server's page), so the admin API itself still needs the key in the header.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from runtime.server.auth import UI_COOKIE, UI_STATIC, login_response, ui_token

STATIC = Path(__file__).parent / "static"
# name -> (file, media type); the stylesheet is the server page's, so the two pages look alike
STATIC_FILES = {"rollout.js": (STATIC / "rollout.js", "text/javascript"),
                "rollout.css": (STATIC / "rollout.css", "text/css"),
                "ui.css": (UI_STATIC / "ui.css", "text/css")}
LOGIN_PAGE = (UI_STATIC / "login.html").read_bytes().replace(b"Arbor server", b"Arbor router")


def build_router(status: Callable[[], JSONResponse], api_key: str | None) -> APIRouter:
    """The ``/ui`` routes. ``status``: what ``GET /rollout`` answers (also without a plan)."""
    router = APIRouter()
    cookie_value = ui_token(api_key) if api_key else None

    @router.get("/ui", response_model=None)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @router.post("/ui/login", response_model=None)
    async def login(request: Request) -> Response:
        return login_response(await request.body(), api_key, UI_COOKIE, cookie_value, LOGIN_PAGE)

    @router.get("/ui/static/{name}", response_model=None)
    async def static(name: str) -> FileResponse:
        if name not in STATIC_FILES:
            raise HTTPException(404, f"no static file {name!r}")
        path, media_type = STATIC_FILES[name]
        return FileResponse(path, media_type=media_type)

    @router.get("/ui/api/rollout")
    async def rollout() -> JSONResponse:
        return status()

    # NOTE: never relayed: the login cookie opens /ui paths, and the workers' own /ui
    # (their programs form) must not be reachable through the router with it
    @router.api_route("/ui/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], response_model=None)
    async def not_ours(rest: str) -> Response:
        raise HTTPException(404, f"the router has no /ui/{rest}")

    return router
