"""The JSON API under /api/v1/: everything the pages show, plus the retune action. The route table below is
also the source of the OpenAPI schema served at /api/v1/openapi.json, so a route cannot be left out of it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgetune import __version__
from edgetune.errors import BadInput, EdgetuneError
from fleet.web import views
from fleet import rollout_store as rs
from fleet.commands import MAX_TTL_S
from fleet.web.actions import retry_devices, retune_request, rollout_reason, send_retunes
from fleet.web.app import Handler, api_error, fleet_of, guarded, with_arg
from fleet.web.auth import COOKIE, CSRF_HEADER, Principal
from fleet.web.views import BadQuery

PREFIX = "/api/v1"
MAX_BODY = 1 << 20


@dataclass(frozen=True)
class ApiRoute:
    path: str
    method: str
    role: str | None
    handler: Handler
    summary: str
    params: tuple[str, ...] = ()  # query parameters
    body: dict | None = None  # JSON schema of the request body
    responses: dict[str, str] = field(default_factory=dict)  # status -> description, beyond 200


def _json(data: Any, status: int = 200) -> JSONResponse:
    # strict JSON has no NaN or infinity, which a device may once have sent inside a record: they become null
    return JSONResponse(json.loads(json.dumps(data, default=str), parse_constant=lambda _: None), status_code=status)


async def _device_or_404(request: Request, fn: Any, *args: Any) -> Response:
    device = request.path_params["device"]
    fleet = fleet_of(request)
    if await fleet.read(lambda s: s.device(device)) is None:
        return api_error(404, f"no device {device!r} in the fleet DB; GET {PREFIX}/devices lists them")
    return _json(await fleet.read(fn, *args))


async def overview(request: Request, p: Principal) -> Response:
    fleet = fleet_of(request)
    return _json(await fleet.read(views.overview, fleet.limits))


async def devices(request: Request, p: Principal) -> Response:
    fleet = fleet_of(request)
    try:
        return _json(await fleet.read(views.device_list, fleet.limits, dict(request.query_params)))
    except BadInput as e:
        return api_error(400, str(e))


async def device(request: Request, p: Principal) -> Response:
    fleet = fleet_of(request)
    return await _device_or_404(request, views.device_detail, fleet.limits, request.path_params["device"])


async def telemetry(request: Request, p: Principal) -> Response:
    fleet = fleet_of(request)
    try:
        limit = views.count_param(request.query_params, "limit", 2000, 1, 100_000)
    except BadQuery as e:
        return api_error(400, str(e))
    return await _device_or_404(request, views.telemetry, fleet.limits, request.path_params["device"], limit)


async def records(request: Request, p: Principal) -> Response:
    return await _device_or_404(request, views.records, request.path_params["device"])


async def commands(request: Request, p: Principal) -> Response:
    return await _device_or_404(request, views.commands, request.path_params["device"])


async def command(request: Request, p: Principal) -> Response:
    d, cid = request.path_params["device"], request.path_params["command"]
    found = await fleet_of(request).read(lambda s: s.command(d, cid))
    return _json(found) if found else api_error(404, f"no command {cid!r} of device {d!r} in the fleet DB")


async def speedups(request: Request, p: Principal) -> Response:
    return _json(await fleet_of(request).read(views.speedups))


async def me(request: Request, p: Principal) -> Response:
    return _json({"name": p.name, "role": p.role, "via": p.via, "version": __version__})


async def _body(request: Request) -> Any:
    if not request.headers.get("content-type", "").startswith("application/json"):
        raise BadInput("send the body as JSON with Content-Type: application/json")
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise BadInput(f"body of {len(raw)} bytes is over the {MAX_BODY}-byte limit")
    try:
        return json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError is one too
        raise BadInput(f"body is not valid JSON: {e}") from None


async def _retune(request: Request, device: str | None) -> Response:
    fleet = fleet_of(request)
    try:
        r = retune_request(await _body(request), device)
    except BadInput as e:
        return api_error(400, str(e))
    known = await fleet.read(lambda s: {d for d in r.devices if s.device(d) is not None})
    unknown = [d for d in r.devices if d not in known]
    if unknown:
        return api_error(404, f"no device {unknown[0]!r} in the fleet DB; nothing was sent")
    try:
        sent = await run_in_threadpool(send_retunes, fleet.send, r)
    except EdgetuneError as e:
        return api_error(502, f"could not publish the command: {e}")
    return _json({"commands": sent}, 202)


async def retune_one(request: Request, p: Principal) -> Response:
    return await _retune(request, request.path_params["device"])


async def retune_many(request: Request, p: Principal) -> Response:
    return await _retune(request, None)


async def rollouts(request: Request, p: Principal) -> Response:
    return _json(await fleet_of(request).read(views.rollouts))


async def rollout(request: Request, p: Principal) -> Response:
    rid = request.path_params["rollout"]
    found = await fleet_of(request).read(views.rollout, rid)
    return _json(found) if found else api_error(404, f"no rollout {rid!r}; GET {PREFIX}/rollouts lists them")


async def _optional_body(request: Request) -> Any:
    """A rollout action's body: optional, {} when empty."""
    return await _body(request) if await request.body() else {}


async def _rollout_action(request: Request, p: Principal, action: str) -> Response:
    rid = request.path_params["rollout"]
    try:
        reason = rollout_reason(await _optional_body(request))
    except BadInput as e:
        return api_error(400, str(e))
    try:
        done = await fleet_of(request).read(rs.act, rid, action, time.time(), p.name, reason)
    except BadInput as e:
        return api_error(views.refusal_status(e), str(e))
    if done is None:
        return api_error(404, f"no rollout {rid!r}; nothing changed")
    return _json(await fleet_of(request).read(views.rollout, rid))


pause_rollout, resume_rollout, abort_rollout = (with_arg(_rollout_action, a, f"{a}_rollout")
                                                for a in ("pause", "resume", "abort"))


async def retry_rollout(request: Request, p: Principal) -> Response:
    rid = request.path_params["rollout"]
    try:
        devices = retry_devices(await _optional_body(request))
    except BadInput as e:
        return api_error(400, str(e))
    try:
        retried = await fleet_of(request).read(rs.retry, rid, devices, time.time(), p.name)
    except BadInput as e:
        return api_error(views.refusal_status(e), str(e))
    return _json({"retried": retried, "rollout": await fleet_of(request).read(views.rollout, rid)})


async def openapi(request: Request, p: Principal) -> Response:
    return JSONResponse(schema())


_NAMES = {"type": "array", "items": {"type": "string", "minLength": 1}}
RETUNE_FIELDS = {
    "kernels": {**_NAMES, "description": "only these kernels"},
    "workloads": {**_NAMES, "description": "only these workloads"},
    "strategy": {"type": "string", "description": "search strategy on the device, e.g. anneal, random, llm"},
    "budget": {"type": "integer", "minimum": 1, "maximum": 100000, "description": "evaluations per workload"},
    "force": {"type": "boolean", "description": "retune even when a result for this hw/fw/model exists"},
    "ttl_s": {"type": "number", "minimum": 1, "maximum": MAX_TTL_S,
              "description": "the device rejects the command if it arrives later (default 600)"},
}
RETUNE_RESPONSES = {"202": "sent: the command ids to follow under .../commands/{command}",
                    "400": "bad body (the error names the field)", "404": "unknown device; nothing sent",
                    "502": "the broker did not take the command"}
DEVICE_404 = {"404": "no such device"}
ROLLOUT_ACTION_BODY = {"type": "object", "additionalProperties": False, "properties": {
    "reason": {"type": "string", "maxLength": 500, "description": "why (kept in the rollout's events)"}}}
ROLLOUT_ACTION_RESPONSES = {"200": "done: the rollout afterwards", "400": "bad body", "404": "no such rollout",
                            "409": "the rollout's state does not allow it (e.g. resuming an active one)"}

API: list[ApiRoute] = [
    ApiRoute("/overview", "GET", "viewer", overview, "device counts by status, breakdowns by version, model, fw, "
             "cpu, isa"),
    ApiRoute("/devices", "GET", "viewer", devices, "devices, filtered and sorted, a page of them (limit, offset; "
             "total counts all that match)", (*views.FILTERS, "missing", "q", "sort", "order", "limit", "offset"),
             responses={"400": "bad query parameter"}),
    ApiRoute("/devices/{device}", "GET", "viewer", device, "one device: summary, descriptor, active configs, "
             "status history, command log", responses=DEVICE_404),
    ApiRoute("/devices/{device}/telemetry", "GET", "viewer", telemetry, "telemetry samples within the retention, "
             "oldest first", ("limit",), responses=DEVICE_404),
    ApiRoute("/devices/{device}/records", "GET", "viewer", records, "tuning records with their measurements",
             responses=DEVICE_404),
    ApiRoute("/devices/{device}/commands", "GET", "viewer", commands, "the command log, newest first",
             responses=DEVICE_404),
    ApiRoute("/devices/{device}/commands/{command}", "GET", "viewer", command, "one command and every response",
             responses={"404": "no such command"}),
    ApiRoute("/devices/{device}/retune", "POST", "operator", retune_one, "ask one device to retune",
             body={"type": "object", "properties": RETUNE_FIELDS, "additionalProperties": False},
             responses=RETUNE_RESPONSES),
    ApiRoute("/retune", "POST", "operator", retune_many, "ask several devices to retune",
             body={"type": "object", "required": ["devices"], "additionalProperties": False,
                   "properties": {"devices": _NAMES, **RETUNE_FIELDS}}, responses=RETUNE_RESPONSES),
    ApiRoute("/rollouts", "GET", "viewer", rollouts, "model rollouts, newest first, with per-phase progress (devices "
             "pending, downloading, verifying, evaluating, committed, rolled back, failed with reasons); the "
             "model registry"),
    ApiRoute("/rollouts/{rollout}", "GET", "viewer", rollout, "one rollout: phases, every target device with its "
             "state and reason, events, the signed manifests", responses={"404": "no such rollout"}),
    ApiRoute("/rollouts/{rollout}/pause", "POST", "operator", pause_rollout, "stop releasing further phases "
             "(devices already sent the release continue)", body=ROLLOUT_ACTION_BODY,
             responses=ROLLOUT_ACTION_RESPONSES),
    ApiRoute("/rollouts/{rollout}/resume", "POST", "operator", resume_rollout, "continue a paused rollout; the "
             "phase dwells again from now", body=ROLLOUT_ACTION_BODY, responses=ROLLOUT_ACTION_RESPONSES),
    ApiRoute("/rollouts/{rollout}/abort", "POST", "operator", abort_rollout, "stop the rollout and send the signed "
             "rollback to every device that was sent the release", body=ROLLOUT_ACTION_BODY,
             responses=ROLLOUT_ACTION_RESPONSES),
    ApiRoute("/rollouts/{rollout}/retry", "POST", "operator", retry_rollout, "send the release again (under the "
             "next attempt's rollout_id) to the devices whose download or staging failed: all, or `devices`",
             body={"type": "object", "additionalProperties": False, "properties": {"devices": _NAMES}},
             responses={"200": "the devices retried (none: nothing had failed) and the rollout",
                        "400": "bad body", "409": "the rollout is completed or aborted",
                        "404": "no such rollout, or a named device is not one of its targets; nothing retried"}),
    ApiRoute("/speedups", "GET", "viewer", speedups, "per kernel/workload, the speedups across devices"),
    ApiRoute("/me", "GET", "viewer", me, "who the credentials belong to"),
    ApiRoute("/openapi.json", "GET", None, openapi, "this schema"),
]


def routes() -> list[Route]:
    return [Route(PREFIX + r.path, guarded(r.role, r.handler, api=True), methods=[r.method]) for r in API]


def schema() -> dict:
    paths: dict[str, dict] = {}
    for r in API:
        ok = "200" if r.method == "GET" or "200" in r.responses else "202"
        op: dict[str, Any] = {"summary": r.summary, "operationId": r.handler.__name__, "responses": {
            ok: {"description": r.responses.get(ok, "ok")},
            **({"401": {"description": "no or unknown token"}, "403": {"description": f"needs the {r.role} role"}}
               if r.role else {}),
            **{k: {"description": v} for k, v in r.responses.items() if k != ok}}}
        if r.role:
            op["security"] = [{"bearer": []}, {"session": []}]
        params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                  for n in _path_params(r.path)]
        params += [{"name": n, "in": "query", "required": False, "schema": {"type": "string"}} for n in r.params]
        if params:
            op["parameters"] = params
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": r.body}}}
            op["description"] = (f"With a session cookie instead of a bearer token, send the page's CSRF token "
                                 f"as {CSRF_HEADER}.")
        paths.setdefault(PREFIX + r.path, {})[r.method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": "edgetune fleet", "version": __version__}, "paths": paths,
            "components": {"securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "a token from `edgetune fleet token create --role viewer|operator`"},
                "session": {"type": "apiKey", "in": "cookie", "name": COOKIE}}}}


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]
