"""What each page and its API twin show, shaped once from the store: the HTML pages render these dicts and the
JSON API returns them as they are, so the two cannot disagree. Every function takes the store as its first
argument (any object with FleetStore's read methods, so another backend can slot in) and runs in a worker
thread."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Mapping

from edgetune import protocol as wire
from edgetune.errors import BadInput
from fleet import rollout_store as rs
from fleet.ingest import plausible_speedup
from fleet.rollout import bucket, rollout_summary
from fleet.store import FleetStore, geomean
from fleet.text import whole_number

FILTERS = ("status", "version", "model_version", "fw_fingerprint", "cpu_model", "isa")
SORTS = ("id", "status", "last_seen", "cpu_model", "isa", "cores", "version", "model_version", "tuned_workloads",
         "mean_speedup", "ort_ratio", "records")
OPEN_COMMAND_STATES = ("accepted", "in_progress")
PAGE = 100  # devices per page of the device list, unless `limit` says otherwise
PAGE_MAX = 1000


class BadQuery(BadInput):
    """A query parameter or body field the API cannot use (HTTP 400); the message names it and what would work."""


def refusal_status(e: BadInput) -> int:
    """The HTTP status of a rollout action the store refused: 404 when the rollout or a named device is unknown,
    409 when the rollout's state does not allow it (a bad request body is a 400 before the store is asked)."""
    return 404 if isinstance(e, rs.Unknown) else 409


@dataclass(frozen=True)
class Limits:
    stale_after_s: float
    retention_s: float


def overview(store: FleetStore, lim: Limits) -> dict:
    return store.overview(stale_after_s=lim.stale_after_s) | {"stale_minutes": lim.stale_after_s / 60}


def device_list(store: FleetStore, lim: Limits, query: Mapping[str, str]) -> dict:
    """Devices filtered by exact FILTERS values (`missing=<field>`: that field unknown) and `q` (a substring of
    the id), sorted by `sort` (`order=desc` to reverse; unknown values last either way); `limit` of them (PAGE
    by default) from `offset`, of `total`. Only the page's devices get their newest telemetry sample."""
    params = (*FILTERS, "missing", "q", "sort", "order", "limit", "offset")
    unknown = set(query) - set(params)
    if unknown:
        raise BadQuery(f"unknown query parameter {sorted(unknown)[0]!r}; parameters: {', '.join(params)}")
    limit, offset = count_param(query, "limit", PAGE, 1, PAGE_MAX), count_param(query, "offset", 0, 0, None)
    sort, order = query.get("sort") or "id", query.get("order") or "asc"
    if sort not in SORTS:
        raise BadQuery(f"sort={sort!r}: sort by one of {', '.join(SORTS)}")
    if order not in ("asc", "desc"):
        raise BadQuery(f"order={order!r}: asc or desc")
    missing = query.get("missing")
    if missing is not None and missing not in FILTERS:
        raise BadQuery(f"missing={missing!r}: one of {', '.join(FILTERS)}")
    wanted = {k: query[k] for k in FILTERS if query.get(k)}
    q = (query.get("q") or "").lower()
    rows = [d for d in store.dashboard_devices(stale_after_s=lim.stale_after_s, newest_sample=False)
            if all(str(d[k]) == v for k, v in wanted.items()) and (missing is None or d[missing] is None)
            and q in d["id"].lower()]
    known = sorted((d for d in rows if d[sort] is not None), key=lambda d: d[sort], reverse=order == "desc")
    page = (known + [d for d in rows if d[sort] is None])[offset:offset + limit]
    samples = store.newest_samples([d["id"] for d in page])
    return {"devices": [d | {"telemetry": samples.get(d["id"])} for d in page], "total": len(rows),
            "offset": offset, "limit": limit,
            "filters": {**wanted, **({"missing": missing} if missing else {}), **({"q": q} if q else {})},
            "sort": sort, "order": order}


def count_param(query: Mapping[str, Any], name: str, default: int | None, low: int, high: int | None) -> int | None:
    """A whole-number query parameter or form field (`default` when absent or blank), BadQuery naming it and the
    range when it is anything else: the one parser of counts the API and the forms take."""
    raw = str(query.get(name) or "").strip()
    if not raw:
        return default
    n = whole_number(raw)
    if n is None or n < low or (high is not None and n > high):
        raise BadQuery(f"{name}={raw!r}: a whole number from {low}" + (f" to {high}" if high is not None else " up"))
    return n


def device_detail(store: FleetStore, lim: Limits, device: str) -> dict | None:
    summary = next(iter(store.dashboard_devices(stale_after_s=lim.stale_after_s, device=device)), None)
    if summary is None:
        return None
    info = (store.device(device) or {}).get("info") or {}
    hw = next((info[k] for k in ("hw", "hardware", "descriptor") if isinstance(info.get(k), dict)), {})
    return {**summary, "descriptor": hw, "info": info, "active": store.active_config_rows(device),
            "status_history": store.status_history(device)[-50:][::-1], "commands": commands(store, device),
            "model_state": model_state(store, device)}


def model_state(store: FleetStore, device: str) -> dict | None:
    """The device's last model/state report with every protocol field present: only `state` is required
    (docs/protocol.md; `current` and `previous` may be null or left out), and the page reads the others."""
    ms = rs.model_state(store, device)
    if ms is None:
        return None
    out = {**dict.fromkeys(wire.MODEL_STATE.fields), **ms}
    for k in ("current", "previous"):
        m = out[k]
        out[k] = {f: m.get(f) for f in ("name", "version", "sha256")} if isinstance(m, dict) else None
    rid = out["rollout_id"]
    out["rollout_id"] = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None
    return out


def commands(store: FleetStore, device: str) -> list[dict]:
    """The command log, newest first, each with its newest status and progress (0..1 when the device said)."""
    out = []
    for c in store.commands(device)[::-1][:50]:
        p = c.get("progress")
        frac = float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 1 else None
        out.append({**c, "status": c.get("status") or "sent", "fraction": frac,
                    "open": (c.get("status") or "sent") in ("sent", *OPEN_COMMAND_STATES)})
    return out


def telemetry(store: FleetStore, lim: Limits, device: str, limit: int = 2000) -> list[dict]:
    return store.telemetry_window(device, since=time.time() - lim.retention_s, limit=limit)


def records(store: FleetStore, device: str) -> list[dict]:
    """Tuning records newest first, each with its measurements as the device sent them."""
    out = []
    for r in store.records(device)[::-1]:
        rec = r.pop("record")
        ms = rec.get("measurements") if isinstance(rec.get("measurements"), list) else []
        out.append({**r, "measurements": [m for m in ms if isinstance(m, dict)], "result": rec.get("result")})
    return out


def speedups(store: FleetStore) -> list[dict]:
    """Per kernel/workload: how its speedup is spread across devices, and the devices far from the rest
    (under half or over twice the median), which is where an operator looks first."""
    by_slot: dict[str, list[dict]] = {}
    for r in store.speedups():
        if plausible_speedup(r["speedup"]):  # what an older receiver stored unchecked stays off the plots
            by_slot.setdefault(r["slot"], []).append(r)
    out = []
    for slot, rows in sorted(by_slot.items()):
        xs = [r["speedup"] for r in rows]
        med = statistics.median(xs)
        out.append({"slot": slot, "kernel": rows[0]["kernel"], "workload": rows[0]["workload"], "devices": len(rows),
                    "min": min(xs), "median": med, "geomean": geomean(xs), "max": max(xs),
                    "points": [{"device_id": r["device_id"], "speedup": r["speedup"]} for r in rows],
                    "outliers": [r["device_id"] for r in rows if r["speedup"] < med / 2 or r["speedup"] > med * 2]})
    return out


def strip_scale(rows: list[dict]) -> dict[str, Any]:
    """A shared log2 axis for the speedup strip plots: its bounds (whole powers of two around every value)."""
    xs = [p["speedup"] for r in rows for p in r["points"]] or [1.0]
    lo, hi = math.floor(math.log2(min(min(xs), 1.0))), math.ceil(math.log2(max(max(xs), 1.0)))
    if lo == hi:
        hi += 1
    return {"lo": lo, "hi": hi, "ticks": [2.0 ** e for e in range(lo, hi + 1)]}


# ---- model rollouts ----------------------------------------------------------------------------------------------

def rollouts(store: FleetStore) -> dict:
    """Every rollout, newest first, with its progress per phase; and the model registry."""
    return {"rollouts": [rollout_summary(r, rs.targets(store, r["id"])) for r in rs.rollouts(store)],
            "models": [{k: v for k, v in m.items() if k != "card"} for m in rs.models(store)],
            "baseline": rs.baseline_version(store)}


def rollout(store: FleetStore, rollout_id: str) -> dict | None:
    """One rollout: its progress per phase, every target with its state and reason, the events, the manifests."""
    r = rs.rollout(store, rollout_id)
    if r is None:
        return None
    targets = rs.targets(store, rollout_id)
    labels = [f"{p:g}%" for p in r["phases"]]
    devices = [{**t, "phase_label": labels[t["phase"]], "bucket": bucket(t), "released": t["phase"] <= r["phase"]}
               for t in targets]
    return {**rollout_summary(r, targets), "devices": devices, "events": rs.events(store, rollout_id)[::-1],
            "manifest": r["manifest"], "rollback_manifest": r["rollback_manifest"]}
