"""The dashboard pages, server-rendered from fleet.web.views; the forms post here with their CSRF token."""

from __future__ import annotations

import time
import urllib.parse

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from edgetune.errors import BadInput, EdgetuneError
from fleet import rollout_store as rs
from fleet.rollout import BUCKETS
from fleet.web import views
from fleet.web.actions import form_body, retune_request, rollout_reason, send_retunes, text_form
from fleet.web.app import fleet_of, guarded, page_error, render, with_arg
from fleet.web.auth import Principal


async def overview(request: Request, p: Principal) -> Response:
    fleet = fleet_of(request)
    return render(request, p, "overview.html", {"o": await fleet.read(views.overview, fleet.limits)})


async def devices(request: Request, p: Principal) -> Response:
    fleet = fleet_of(request)
    query = {k: v for k, v in request.query_params.items() if k != "sent"}
    try:
        listing = await fleet.read(views.device_list, fleet.limits, query)
    except BadInput as e:
        return page_error(request, p, 400, str(e))
    return render(request, p, "devices.html", {"l": listing, "query": query, "filters": views.FILTERS,
                                                "sent": request.query_params.get("sent")})


async def device(request: Request, p: Principal) -> Response:
    fleet = fleet_of(request)
    d = await fleet.read(views.device_detail, fleet.limits, request.path_params["device"])
    if d is None:
        return page_error(request, p, 404, f"No device {request.path_params['device']!r} in the fleet DB.")
    recs = await fleet.read(views.records, d["id"])
    return render(request, p, "device.html", {"d": d, "records": recs, "sent": request.query_params.get("sent")})


async def speedups(request: Request, p: Principal) -> Response:
    rows = await fleet_of(request).read(views.speedups)
    return render(request, p, "speedups.html", {"rows": rows, "scale": views.strip_scale(rows)})


async def _retune(request: Request, p: Principal, device: str | None) -> Response:
    fleet = fleet_of(request)
    try:
        r = retune_request(form_body(await request.form()), device)
    except BadInput as e:
        return page_error(request, p, 400, str(e))
    if not await fleet.read(lambda s: all(s.device(x) is not None for x in r.devices)):
        return page_error(request, p, 400, "a selected device is not in the fleet DB; nothing was sent")
    try:
        sent = await run_in_threadpool(send_retunes, fleet.send, r)
    except EdgetuneError as e:  # the broker's; a fleet DB failure above is guarded's 503
        return page_error(request, p, 502, f"Could not publish the command: {e}")
    if device is not None:
        return RedirectResponse(f"/devices/{urllib.parse.quote(device, safe='')}?sent={sent[0]['id']}", 303)
    return RedirectResponse(f"/devices?sent={len(sent)}", 303)


async def retune_one(request: Request, p: Principal) -> Response:
    return await _retune(request, p, request.path_params["device"])


async def retune_many(request: Request, p: Principal) -> Response:
    return await _retune(request, p, None)


async def rollouts(request: Request, p: Principal) -> Response:
    r = await fleet_of(request).read(views.rollouts)
    return render(request, p, "rollouts.html", {"r": r, "buckets": BUCKETS})


async def rollout(request: Request, p: Principal) -> Response:
    rid = request.path_params["rollout"]
    r = await fleet_of(request).read(views.rollout, rid)
    if r is None:
        return page_error(request, p, 404, f"No rollout {rid!r} in the fleet DB.")
    return render(request, p, "rollout.html", {"r": r, "buckets": BUCKETS})


async def _rollout_action(request: Request, p: Principal, action: str) -> Response:
    rid = request.path_params["rollout"]
    try:
        form = text_form(await request.form())
        reason = rollout_reason({"reason": form.get("reason")} if form.get("reason") else {})
    except BadInput as e:
        return page_error(request, p, 400, str(e))
    try:
        done = await fleet_of(request).read(rs.act, rid, action, time.time(), p.name, reason)
    except BadInput as e:
        return page_error(request, p, views.refusal_status(e), str(e))
    if done is None:
        return page_error(request, p, 404, f"No rollout {rid!r} in the fleet DB; nothing changed.")
    return RedirectResponse(f"/rollouts/{urllib.parse.quote(rid, safe='')}", 303)


async def retry_rollout(request: Request, p: Principal) -> Response:
    rid = request.path_params["rollout"]
    try:
        await fleet_of(request).read(rs.retry, rid, None, time.time(), p.name)
    except BadInput as e:
        return page_error(request, p, views.refusal_status(e), str(e))
    return RedirectResponse(f"/rollouts/{urllib.parse.quote(rid, safe='')}", 303)


pause_rollout, resume_rollout, abort_rollout = (with_arg(_rollout_action, a, f"{a}_rollout")
                                                for a in ("pause", "resume", "abort"))


def _local(target: str | None) -> str:
    """Only a path on this server: a login link must not bounce the browser elsewhere."""
    return target if target and target.startswith("/") and not target.startswith("//") else "/"


async def login_form(request: Request, p: Principal) -> Response:
    return render(request, p, "login.html", {"next": _local(request.query_params.get("next")), "failed": False})


async def login(request: Request, p: Principal) -> Response:
    fleet = fleet_of(request)
    try:
        form = text_form(await request.form())
    except BadInput as e:
        return page_error(request, p, 400, str(e))
    target = _local(str(form.get("next") or ""))
    secret = str(form.get("token") or "").strip()
    token = await run_in_threadpool(lambda: fleet.auth.tokens().verify(secret)) if secret else None
    if token is None:
        return render(request, p, "login.html", {"next": target, "failed": True}, status=401)
    response = RedirectResponse(target, 303)
    fleet.auth.set_cookie(response, fleet.auth.new_session(token.id))  # a fresh CSRF token with the login
    return response


async def logout(request: Request, p: Principal) -> Response:
    """End the session server-side, not only in this browser: a copy of its cookie must not work afterwards."""
    auth = fleet_of(request).auth
    if p.session is not None:
        await run_in_threadpool(auth.end, p.session)
    response = RedirectResponse("/login", 303)
    auth.set_cookie(response, auth.new_session(None))
    return response


def routes() -> list[Route]:
    page = lambda role, h: guarded(role, h, api=False)  # noqa: E731
    return [
        Route("/", page("viewer", overview)),
        Route("/devices", page("viewer", devices)),
        Route("/devices/retune", page("operator", retune_many), methods=["POST"]),
        Route("/devices/{device}", page("viewer", device)),
        Route("/devices/{device}/retune", page("operator", retune_one), methods=["POST"]),
        Route("/speedups", page("viewer", speedups)),
        Route("/rollouts", page("viewer", rollouts)),
        Route("/rollouts/{rollout}", page("viewer", rollout)),
        Route("/rollouts/{rollout}/pause", page("operator", pause_rollout), methods=["POST"]),
        Route("/rollouts/{rollout}/resume", page("operator", resume_rollout), methods=["POST"]),
        Route("/rollouts/{rollout}/abort", page("operator", abort_rollout), methods=["POST"]),
        Route("/rollouts/{rollout}/retry", page("operator", retry_rollout), methods=["POST"]),
        Route("/login", page(None, login_form)),
        Route("/login", page(None, login), methods=["POST"]),
        Route("/logout", page(None, logout), methods=["POST"]),
    ]
