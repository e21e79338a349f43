"""What every page and API handler shares: the guard that checks role and CSRF before a handler runs, page
rendering, error answers, and the per-thread store connections. Store calls are blocking and run in Starlette's
worker threads, each thread with its own connection."""

from __future__ import annotations

import logging
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import jinja2
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from edgetune import __version__
from edgetune.sqlite import DBError
from fleet.store import FleetStore
from fleet.web.actions import Send
from fleet.web.auth import CSRF_FIELD, CSRF_HEADER, Auth, Principal
from fleet.web.views import Limits

HERE = Path(__file__).resolve().parent
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
RETRY_AFTER_S = "5"  # what a 503 tells clients: about how often the receiver retries the fleet DB

log = logging.getLogger("fleet.web")


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
    health: Callable[[], dict]  # what /healthz says; every page shows it when the receiver lost the broker or DB

    async def read(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(store, *args) in a worker thread."""
        return await run_in_threadpool(lambda: fn(self.stores(), *args))


Handler = Callable[[Request, Principal], Awaitable[Response]]
ANONYMOUS = Principal(None, "anonymous", "anonymous")


def with_arg(fn: Callable[[Request, Principal, Any], Awaitable[Response]], arg: Any, name: str) -> Handler:
    """A handler calling fn(request, principal, arg), named `name` (routes and the OpenAPI operationId use it)."""
    async def handler(request: Request, p: Principal) -> Response:
        return await fn(request, p, arg)

    handler.__name__ = name
    return handler


def fleet_of(request: Request) -> Fleet:
    return request.app.state.fleet


def api_error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def page_error(request: Request, p: Principal, status: int, message: str) -> Response:
    return render(request, p, "error.html", {"status": status, "message": message}, status=status)


def db_unavailable(request: Request, p: Principal | None, e: DBError, *, api: bool) -> Response:
    """503 while the fleet DB (or the auth DB) cannot answer: the server's trouble, not the request's, and a
    passing one (PostgreSQL restarting, a disk freed), so the answer says what failed and to try again. `p` is
    None when the auth DB failed before the request was identified."""
    log.warning("%s %s: %s", request.method, request.url.path, e)
    msg = f"database unavailable: {e}. The fleet server retries by itself; try again in a moment"
    if api:
        return api_error(503, msg, **{"Retry-After": RETRY_AFTER_S})
    context = {"status": 503, "message": msg[0].upper() + msg[1:] + "."}
    response = render(request, p or ANONYMOUS, "error.html", context, status=503, new_session=p is not None)
    response.headers["Retry-After"] = RETRY_AFTER_S
    return response


def guarded(role: str | None, handler: Handler, *, api: bool) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint: who is asking, then `checked`; a 503 when a database either needs cannot answer."""
    async def endpoint(request: Request) -> Response:
        try:
            p = await run_in_threadpool(fleet_of(request).auth.identify, request)
        except DBError as e:
            return db_unavailable(request, None, e, api=api)
        try:
            return await checked(request, p, role, handler, api=api)
        except DBError as e:
            return db_unavailable(request, p, e, api=api)

    endpoint.__name__ = handler.__name__
    return endpoint


async def checked(request: Request, p: Principal, role: str | None, handler: Handler, *, api: bool) -> Response:
    """401 without credentials, 403 without the role, then for a POST that a cookie authenticates the CSRF token
    (403 without it), and only then the handler, so nothing changes for a request that fails a check."""
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


def render(request: Request, p: Principal, template: str, context: dict, status: int = 200, *,
           new_session: bool = True) -> Response:
    """A page. A visitor without a session gets one here, so every form on it carries a CSRF token; not with
    `new_session=False`, for a page answering a request whose session could not be read, whose cookie a new one
    would replace."""
    fleet = fleet_of(request)
    session = p.session or fleet.auth.new_session(None)
    html = fleet.templates.get_template(template).render(
        **context, me=p, csrf=session.csrf, path=request.url.path, version=__version__, health=fleet.health())
    response = HTMLResponse(html, status_code=status)
    if p.session is None and new_session:
        fleet.auth.set_cookie(response, session)
    return response
