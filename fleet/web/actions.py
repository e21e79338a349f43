"""Operator actions: a retune request checked field by field, then sent on the fleet command path
(fleet.commands: cmd/req at QoS 1). The page follows it through what the receiver stores from cmd/res."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from starlette.datastructures import FormData

from edgetune.protocol import check_id
from fleet.commands import MAX_TTL_S, new_command
from fleet.web.views import BadQuery, count_param

MAX_BUDGET = 100_000
MAX_DEVICES = 1000  # one request; a bigger fleet is retuned in pages, so one click cannot flood the broker


@dataclass(frozen=True)
class Retune:
    devices: list[str]
    args: dict[str, Any]  # the cmd/req args: kernels, workloads, strategy, budget, force
    ttl_s: float


def _names(body: dict, key: str) -> list[str] | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
        raise BadQuery(f"{key}: must be a list of non-empty names, not {v!r:.80}")
    return v


def retune_request(body: Any, device: str | None = None) -> Retune:
    """A retune from a JSON body: {"kernels", "workloads", "strategy", "budget", "force", "ttl_s"} and, without
    a `device` in the path, "devices"."""
    if not isinstance(body, dict):
        raise BadQuery(f"body must be a JSON object, not {type(body).__name__}")
    allowed = {"kernels", "workloads", "strategy", "budget", "force", "ttl_s"} | ({"devices"} if device is None else set())
    unknown = set(body) - allowed
    if unknown:
        raise BadQuery(f"unknown field {sorted(unknown)[0]!r}; fields: {', '.join(sorted(allowed))}")
    devices = [device] if device is not None else _names(body, "devices")
    if not devices:
        raise BadQuery("devices: name at least one device")
    if len(devices) > MAX_DEVICES:
        raise BadQuery(f"devices: {len(devices)} in one request; at most {MAX_DEVICES}")
    for d in devices:
        check_id(d, "device id")  # ProtocolError is a BadInput: a 400 like the rest
    args: dict[str, Any] = {}
    for key in ("kernels", "workloads"):
        names = _names(body, key)
        if names:
            args[key] = names
    strategy = body.get("strategy")
    if strategy is not None:
        if not isinstance(strategy, str) or not strategy.strip():
            raise BadQuery(f"strategy: must be a non-empty name, not {strategy!r:.80}")
        args["strategy"] = strategy
    budget = body.get("budget")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
            raise BadQuery(f"budget: must be an integer 1-{MAX_BUDGET} (evaluations per workload), not {budget!r:.80}")
        args["budget"] = budget
    force = body.get("force", False)
    if not isinstance(force, bool):
        raise BadQuery(f"force: must be true or false, not {force!r:.80}")
    if force:
        args["force"] = True
    ttl = body.get("ttl_s", 600)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 1 <= ttl <= MAX_TTL_S:
        raise BadQuery(f"ttl_s: must be 1-{MAX_TTL_S:.0f} seconds (a device's broker session keeps queued commands "
                       f"that long), not {ttl!r:.80}")
    return Retune(list(dict.fromkeys(devices)), args, float(ttl))


def text_form(form: FormData) -> FormData:
    """The form, once every field is known to be text: the forms here have no file field, and a file posted
    as one (multipart) would reach the checks as an object, where it crashed them or showed up as its repr."""
    for key, value in form.multi_items():
        if not isinstance(value, str):
            raise BadQuery(f"{key}: a file was uploaded; this form takes text only, send {key} as a plain field")
    return form


def form_body(form: FormData) -> dict:
    """The retune form's fields as the JSON body they stand for (blank fields left out)."""
    text_form(form)
    body: dict[str, Any] = {}
    for key in ("kernels", "workloads"):
        names = [n.strip() for n in (form.get(key) or "").split(",") if n.strip()]
        if names:
            body[key] = names
    if (form.get("strategy") or "").strip():
        body["strategy"] = form["strategy"].strip()
    budget = count_param(form, "budget", None, 1, MAX_BUDGET)
    if budget is not None:
        body["budget"] = budget
    body["force"] = form.get("force") in ("on", "true", "1")
    if form.getlist("device"):
        body["devices"] = form.getlist("device")
    return body


Send = Callable[[str, dict], None]  # (device, cmd/req payload): publish it, raise EdgetuneError if it cannot


def send_retunes(send: Send, r: Retune) -> list[dict]:
    """Publish one retune per device; what each device was sent (its command id to follow)."""
    out = []
    for device in r.devices:
        command = new_command("retune", r.args, ttl_s=r.ttl_s)
        send(device, command)
        out.append({"device": device, **command, "status": "sent"})
    return out


MAX_REASON = 500


def rollout_reason(body: Any) -> str | None:
    """The optional {"reason"} of a rollout pause, resume or abort (API body or form)."""
    if not isinstance(body, dict):
        raise BadQuery(f"body must be a JSON object, not {type(body).__name__}")
    unknown = set(body) - {"reason"}
    if unknown:
        raise BadQuery(f"unknown field {sorted(unknown)[0]!r}; the only field is reason")
    reason = body.get("reason")
    if reason is None or reason == "":
        return None
    if not isinstance(reason, str) or len(reason) > MAX_REASON:
        raise BadQuery(f"reason: text of at most {MAX_REASON} characters, not {reason!r:.80}")
    return reason.strip() or None


def retry_devices(body: Any) -> list[str] | None:
    """The optional {"devices"} of a rollout retry (None: every failed device)."""
    if not isinstance(body, dict):
        raise BadQuery(f"body must be a JSON object, not {type(body).__name__}")
    unknown = set(body) - {"devices"}
    if unknown:
        raise BadQuery(f"unknown field {sorted(unknown)[0]!r}; the only field is devices")
    return _names(body, "devices") or None
