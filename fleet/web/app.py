"""The fleet server's ASGI app: Starlette routes for the dashboard pages (Jinja2, autoescaped) and the JSON API.

Starlette rather than FastAPI: the API is a dozen routes whose bodies are small and checked by hand with
messages that name the field (fleet.web.actions), so FastAPI's pydantic models would add a large dependency for
validation we already do, and the OpenAPI schema is generated here from the same table the routes are built
from. Starlette, Jinja2 and uvicorn are small and pure Python.

`create_app` takes the store as a factory, not a path: anything with FleetStore's read methods serves the pages,
so a PostgreSQL store can slot in. Store calls are blocking and run in Starlette's worker threads, each thread
with its own connection.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send as AsgiSend

from edgetune import __version__
from fleet.store import FleetStore
from fleet.web.actions import Send
from fleet.web.auth import CSRF_FIELD, CSRF_HEADER, Auth, Principal
from fleet.web.views import Limits

HERE = Path(__file__).resolve().parent
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
SECURITY_HEADERS = [
    # a second wall behind autoescaping: no inline script, nothing from elsewhere, no framing
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                 b"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]


class ThreadStores:
    """One store connection per worker thread, opened on first use and closed with the app."""

    def __init__(self, open_store: Callable[[], FleetStore]):
        self.open_store = open_store
        self._local = threading.local()
        self._all: list[FleetStore] = []
        self._lock = threading.Lock()

    def __call__(self) -> FleetStore:
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = self.open_store()
            with self._lock:
                self._all.append(store)
        return store

    def close(self) -> None:
        with self._lock:
            for s in self._all:
                s.close()
            self._all.clear()


@dataclass
class Fleet:
    """What the handlers share: app.state.fleet."""

    stores: ThreadStores
    auth: Auth
    limits: Limits
    send: Send
    templates: jinja2.Environment

    async def read(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(store, *args) in a worker thread."""
        return await run_in_threadpool(lambda: fn(self.stores(), *args))


Handler = Callable[[Request, Principal], Awaitable[Response]]


def fleet_of(request: Request) -> Fleet:
    return request.app.state.fleet


def api_error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def page_error(request: Request, p: Principal, status: int, message: str) -> Response:
    return render(request, p, "error.html", {"status": status, "message": message}, status=status)


def guarded(role: str | None, handler: Handler, *, api: bool) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint: who is asking (401 without credentials, 403 without the role), then for a POST that a
    cookie authenticates the CSRF token (403 without it), and only then the handler, so nothing changes for a
    request that fails a check."""
    async def endpoint(request: Request) -> Response:
        p = await run_in_threadpool(fleet_of(request).auth.identify, request)
        if role is not None and p.role is None:
            if api:
                return api_error(401, "authentication required: send Authorization: Bearer <token> "
                                      "(edgetune fleet token create)", **{"WWW-Authenticate": "Bearer"})
            if request.method == "GET":
                return RedirectResponse("/login?" + urllib.parse.urlencode({"next": request.url.path}), 303)
            return page_error(request, p, 401, "Log in first.")
        if role is not None and not p.allows(role):
            msg = f"this needs the {role} role; your token {p.name!r} is a {p.role}"
            return api_error(403, msg) if api else page_error(request, p, 403, msg)
        if request.method == "POST" and p.via != "bearer":
            sent = request.headers.get(CSRF_HEADER)
            if sent is None and request.headers.get("content-type", "").startswith(FORM_TYPES):
                sent = (await request.form()).get(CSRF_FIELD)
            if not Auth.csrf_ok(p, sent if isinstance(sent, str) else None):
                msg = "CSRF token missing or wrong: reload the page and submit the form again"
                return api_error(403, msg) if api else page_error(request, p, 403, msg)
        return await handler(request, p)

    endpoint.__name__ = handler.__name__
    return endpoint


def render(request: Request, p: Principal, template: str, context: dict, status: int = 200) -> Response:
    """A page. A visitor without a session gets one here, so every form on it carries a CSRF token."""
    fleet = fleet_of(request)
    session = p.session or fleet.auth.new_session(None)
    html = fleet.templates.get_template(template).render(
        **context, me=p, csrf=session.csrf, path=request.url.path, version=__version__)
    response = HTMLResponse(html, status_code=status)
    if p.session is None:
        fleet.auth.set_cookie(response, session)
    return response


def _security_headers(app: ASGIApp) -> ASGIApp:
    async def wrapped(scope: Scope, receive: Receive, send: AsgiSend) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await app(scope, receive, send_with_headers if scope["type"] == "http" else send)

    return wrapped


def _templates() -> jinja2.Environment:
    from fleet.web import filters

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(filters.FILTERS)
    return env


def create_app(open_store: Callable[[], FleetStore], auth: Auth, limits: Limits, send: Send,
               health: Callable[[], dict] = lambda: {}) -> ASGIApp:
    from fleet.web import api, pages

    stores = ThreadStores(open_store)
    routes = [*pages.routes(), *api.routes(), Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
              Route("/healthz", lambda request: JSONResponse({"ok": True, "time": time.time(), **health()}))]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        stores.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.fleet = Fleet(stores, auth, limits, send, _templates())
    return _security_headers(app)
