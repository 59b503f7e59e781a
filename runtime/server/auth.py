"""Optional API key: ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``)
on every route but ``/health``.

The ``/ui`` page is opened by a browser, which cannot add that header to a navigation, so
its paths also accept a cookie: ``POST /ui/login`` with the key sets ``arbor_ui`` to a
token derived from the key (an HMAC, so the cookie never holds the key itself), HttpOnly
and SameSite=Strict (no other site's page can make the browser send it). The cookie opens
``/ui`` and ``/ui/...`` only; every other route still needs the header.
"""

from __future__ import annotations

import hashlib
import hmac
import urllib.parse
from http.cookies import SimpleCookie
from pathlib import Path

from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.server.limits import send_error

OPEN_PATHS = frozenset({"/health", "/ui/login"})
UI_PREFIX = "/ui"
UI_COOKIE = "arbor_ui"
# NOTE: the /ui pages' shared files (login page, stylesheet), read by path so that the
# router (torch-free) can serve them without importing the server's page module
UI_STATIC = Path(__file__).parent / "ui" / "static"


def ui_token(api_key: str) -> str:
    """The ``/ui`` cookie's value for ``api_key``."""
    return hmac.new(api_key.encode(), b"arbor-ui-cookie", hashlib.sha256).hexdigest()


def is_ui_path(path: str) -> bool:
    return path == UI_PREFIX or path.startswith(UI_PREFIX + "/")


def ui_cookie(headers: dict[bytes, bytes]) -> str | None:
    raw = headers.get(b"cookie")
    if not raw:
        return None
    cookie: SimpleCookie = SimpleCookie()
    try:
        cookie.load(raw.decode("latin-1"))
    except Exception:  # noqa: BLE001 - a malformed cookie header authorizes nothing
        return None
    morsel = cookie.get(UI_COOKIE)
    return morsel.value if morsel is not None else None


class ApiKeyMiddleware:
    """Answers 401 unless the request carries the key (compared in constant time); an
    unauthenticated browser on ``/ui`` gets the login page instead."""

    def __init__(self, app: ASGIApp, api_key: str, login_page: bytes | None = None) -> None:
        self.app = app
        self.login_page = login_page
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()  # NOTE: Anthropic's clients send it as x-api-key
        self.ui_token = ui_token(api_key).encode()

    def authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        if hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return True
        if b"x-api-key" in headers and hmac.compare_digest(headers[b"x-api-key"], self.key):
            return True
        cookie = ui_cookie(headers) if is_ui_path(scope["path"]) else None
        return cookie is not None and hmac.compare_digest(cookie.encode(), self.ui_token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["path"] == UI_PREFIX and scope["method"] == "GET" and self.login_page is not None:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/html; charset=utf-8"),
                                    (b"content-length", str(len(self.login_page)).encode())]})
            await send({"type": "http.response.body", "body": self.login_page})
            return
        await send_error(send, 401, "missing or invalid API key (Authorization: Bearer <key>)",
                         "authentication_error", [(b"www-authenticate", b"Bearer")])


def login_response(form: bytes, api_key: str | None, cookie_name: str, cookie_value: str | None,
                   login_page: bytes) -> Response:
    """``POST /ui/login`` (the server's and the router's): the form's ``key`` checked in
    constant time; a match sets the ``/ui`` cookie and goes to ``/ui``."""
    key = urllib.parse.parse_qs(form.decode("utf-8", "replace")).get("key", [""])[0]
    if api_key is None or cookie_value is None:
        return RedirectResponse("/ui", status_code=303)
    if not hmac.compare_digest(key.encode(), api_key.encode()):
        return HTMLResponse(login_page.replace(b"<!--error-->", b'<p class="error">Wrong key.</p>'),
                            status_code=401)
    response = RedirectResponse("/ui", status_code=303)
    response.set_cookie(cookie_name, cookie_value, httponly=True, samesite="strict", path="/ui")
    return response
