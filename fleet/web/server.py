"""The fleet server's ASGI app: Starlette routes for the dashboard pages (Jinja2, autoescaped) and the JSON API.

Starlette rather than FastAPI: the API is a dozen routes whose bodies are small and checked by hand with
messages that name the field (fleet.web.actions), so FastAPI's pydantic models would add a large dependency for
validation we already do, and the OpenAPI schema is generated from the same table the routes are built from
(fleet.web.api). Starlette, Jinja2 and uvicorn are small and pure Python.

`create_app` takes the store as a factory, not a path: anything with FleetStore's read methods serves the pages,
so a PostgreSQL store can slot in.
"""

from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator, Awaitable, Callable

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send as AsgiSend

from fleet.store import FleetStore
from fleet.web import api, filters, pages, releases
from fleet.web.actions import Send
from fleet.web.app import HERE, Fleet, ThreadStores, api_error
from fleet.web.auth import Auth
from fleet.web.views import Limits

SECURITY_HEADERS = [
    # a second wall behind autoescaping: no inline script, nothing from elsewhere, no framing
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                 b"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]


def _security_headers(app: ASGIApp) -> ASGIApp:
    async def wrapped(scope: Scope, receive: Receive, send: AsgiSend) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await app(scope, receive, send_with_headers if scope["type"] == "http" else send)

    return wrapped


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(filters.FILTERS)
    return env


def _healthz(health: Callable[[], dict]) -> Callable[[Request], Awaitable[Response]]:
    """`/healthz`, no credentials: 200 while `health()` says ok (the receiver is connected to the broker and its
    fleet DB stores), 503 while not, so a systemd or Kubernetes probe sees what the body says."""
    async def endpoint(request: Request) -> Response:
        h = {"ok": True, "time": time.time(), **health()}
        return JSONResponse(h, status_code=200 if h["ok"] else 503)

    return endpoint


def _under_api(request: Request) -> bool:
    return (request.url.path + "/").startswith(api.PREFIX + "/")


async def _no_route(request: Request, exc: Exception) -> Response:
    """An unmatched path or method: under /api/ a JSON error like every other API answer, elsewhere plain text."""
    assert isinstance(exc, HTTPException)
    if not _under_api(request):
        return PlainTextResponse(exc.detail, exc.status_code, headers=exc.headers)
    if exc.status_code == 405:
        return api_error(405, f"{request.method} is not allowed on {request.url.path}; allowed: "
                              f"{(exc.headers or {}).get('Allow', '?')}", **(exc.headers or {}))
    return api_error(exc.status_code, f"no API route {request.url.path}; GET {api.PREFIX}/openapi.json lists them")


async def _server_error(request: Request, exc: Exception) -> Response:
    """What no handler expected (a bug): a 500 naming nothing of the server's insides, under /api/ in the API's
    JSON error shape; the traceback goes to the log (uvicorn logs the exception after this answer)."""
    msg = "internal error in the fleet server; its log has the details"
    return api_error(500, msg) if _under_api(request) else PlainTextResponse(msg[0].upper() + msg[1:] + ".\n", 500)


def create_app(open_store: Callable[[], FleetStore], auth: Auth, limits: Limits, send: Send,
               health: Callable[[], dict] = lambda: {}) -> ASGIApp:
    stores = ThreadStores(open_store)
    routes = [*pages.routes(), *api.routes(), *releases.routes(),
              Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
              Route("/healthz", _healthz(health))]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        stores.close()

    handlers = {404: _no_route, 405: _no_route, 500: _server_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.fleet = Fleet(stores, auth, limits, send, _templates(), health)
    return _security_headers(app)
