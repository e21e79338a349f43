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
from typing import AsyncIterator, Callable

import jinja2
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send as AsgiSend

from fleet.store import FleetStore
from fleet.web import api, filters, pages, releases
from fleet.web.actions import Send
from fleet.web.app import HERE, Fleet, ThreadStores
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


def create_app(open_store: Callable[[], FleetStore], auth: Auth, limits: Limits, send: Send,
               health: Callable[[], dict] = lambda: {}) -> ASGIApp:
    stores = ThreadStores(open_store)
    routes = [*pages.routes(), *api.routes(), *releases.routes(),
              Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
              Route("/healthz", lambda request: JSONResponse({"ok": True, "time": time.time(), **health()}))]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        stores.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.fleet = Fleet(stores, auth, limits, send, _templates())
    return _security_headers(app)
