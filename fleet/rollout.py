"""Staged rollouts of signed tuner models: who gets a release when, and when a rollout advances, completes or
aborts.

A rollout releases one model version to a set of target devices in phases of cumulative shares (e.g. 5% → 25% →
100%). The cohorts are drawn once, at publish time: the targets sorted by sha256(rollout id, device id), phase i
taking the first ceil(share_i × n) of them (at least one), so the draw is reproducible and unrelated between
rollouts. The fleet server's controller (fleet.rollout_controller) applies `decide` to each open rollout:

- abort, in the style of AWS IoT Jobs' abort criteria: once at least `abort_min` released devices reported a final
  state, a share of failures (rejected, failed, or rolled back by the health check: a regression among them) over
  `abort_pct` stops the rollout; the server then publishes the rollback signed at publish time, to every device
  the release was sent to;
- timeout: a device that was sent the release and reported no state within `report_timeout_s` is counted
  `timed_out` (a failure, for the abort rule too; its late report still counts when it comes);
- advance: when the phase has dwelt `min_dwell_s` and at least `advance_pct` of the released devices reported a
  final state (and the abort rule holds), the next phase is released; after the last, the rollout completes and
  its model becomes the fleet's baseline, the version the next rollout's rollback returns to.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from edgetune import __version__
from edgetune import release as rel
from edgetune.errors import BadInput
from edgetune.protocol import CHUNK_BYTES, MODEL_FINAL_STATES, Topics, check_id, encode
from fleet.store import FleetStore
from fleet.text import whole_number

DEFAULT_PHASES = (5.0, 25.0, 100.0)
SELECT_FIELDS = ("isa", "arch", "cpu_model", "version", "model_version", "hw_fingerprint", "fw_fingerprint", "state")
TIMED_OUT = "timed_out"  # the fleet's verdict on a released device that never reported (never sent by a device)
REPORT_TIMEOUT = "report_timeout"  # its reason
FINAL = (*MODEL_FINAL_STATES, TIMED_OUT)
FAILED = ("rolled_back", "rejected", "failed", TIMED_OUT)  # final states that count against a release
BUCKETS = ("pending", "downloading", "verifying", "evaluating", "committed", "rolled_back", "failed", TIMED_OUT)
ROLLBACK_PHASE = "rollback"  # the `phase` of the signed rollback's model/release message
RETRY_SEP = ":retry"  # a retried release's rollout_id: "<rollout id>:retry<attempt>"
RETRYABLE = ("failed", TIMED_OUT)  # a verdict on the manifest, the file or the model (rejected, rolled_back) is final


@dataclass(frozen=True)
class Policy:
    phases: tuple[float, ...]  # cumulative percent of the targets, ending at 100
    min_dwell_s: float = 600.0
    advance_pct: float = 100.0
    abort_pct: float = 10.0
    abort_min: int = 1
    report_timeout_s: float = 3600.0

    def check(self) -> "Policy":
        """The policy, or BadInput naming the `fleet model publish` flag each bad value came from, the value and a
        valid one: the operator typed flags, not these field names."""
        p = self.phases
        if not p or any(not 0 < x <= 100 for x in p) or list(p) != sorted(set(p)) or p[-1] != 100:
            raise BadInput(f"--phases {','.join(f'{x:g}' for x in p)}: rising percentages in (0, 100] that end at "
                           "100, e.g. 5,25,100")
        if self.min_dwell_s < 0:
            raise BadInput(f"--min-dwell {self.min_dwell_s:g}s: must be >= 0, e.g. 10m")
        for flag, v, example in (("--advance-at", self.advance_pct, "100%"), ("--abort-above", self.abort_pct, "10%")):
            if not 0 <= v <= 100:
                raise BadInput(f"{flag} {v:g}%: must be 0-100%, e.g. {example}")
        if self.abort_min < 1:
            raise BadInput(f"--abort-after {self.abort_min}: must be at least 1 device, e.g. 1")
        if self.report_timeout_s <= 0:
            raise BadInput(f"--report-timeout {self.report_timeout_s:g}s: must be > 0, e.g. 1h")
        return self


def percent(text: str, what: str) -> float:
    """`5%` or `5` -> 5.0; BadInput naming `what` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%?\s*", str(text))
    if not m:
        raise BadInput(f"{what} {text!r}: a percentage such as 5%")
    return float(m[1])


def duration(text: str, what: str) -> float:
    """`90`, `90s`, `10m`, `2h`, `30d` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m:
        raise BadInput(f"{what} {text!r}: a duration such as 90s, 10m, 2h or 30d")
    return float(m[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]


def phases_from(cohort: str | None, phases: str | None) -> tuple[float, ...]:
    """`--phases 5,25,100` as given, else the default phases starting at `--cohort` (5%)."""
    if phases:
        return tuple(percent(x, "--phases item") for x in phases.split(","))
    first = percent(cohort, "--cohort") if cohort else DEFAULT_PHASES[0]
    if not 0 < first <= 100:  # 150% would silently become one phase of every target: the opposite of a canary
        raise BadInput(f"--cohort {cohort}: the first phase's share of the targets, above 0% and at most 100%, "
                       "e.g. 5%")
    return (first, *(p for p in DEFAULT_PHASES[1:] if p > first)) if first < 100 else (100.0,)


def phase_label(policy_phases: Iterable[float], i: int) -> str:
    return f"{list(policy_phases)[i]:g}%"


# ---- targets and cohorts -----------------------------------------------------------------------------------------

def parse_where(items: list[str] | None) -> dict[str, str]:
    """`--where isa=x86-64-v2` (repeatable) -> {"isa": "x86-64-v2"}."""
    out: dict[str, str] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or k.strip() not in SELECT_FIELDS or not v.strip():
            raise BadInput(f"--where {item!r}: FIELD=VALUE with FIELD one of {', '.join(SELECT_FIELDS)}")
        out[k.strip()] = v.strip()
    return out


def select_devices(store: FleetStore, devices: list[str] | None, where: dict[str, str]) -> list[str]:
    """The fleet DB's devices named in `devices` (all when None) whose fields match `where`; BadInput for a named
    device the fleet has never heard of."""
    known = {d["id"]: d for d in store.devices()}
    if devices:
        for d in devices:
            check_id(d, "device id")
            if d not in known:
                raise BadInput(f"no device {d!r} in the fleet DB; see `edgetune fleet devices`")
    pool = devices if devices else sorted(known)
    return [d for d in dict.fromkeys(pool) if all(str(known[d].get(k)) == v for k, v in where.items())]


def cohort_rank(rollout_id: str, device: str) -> bytes:
    return hashlib.sha256(f"{rollout_id}\0{device}".encode()).digest()


def cohorts(rollout_id: str, devices: list[str], phases: tuple[float, ...]) -> list[tuple[str, int, int]]:
    """(device, rank, first phase) for every target: a reproducible draw, independent between rollouts."""
    ordered = sorted(devices, key=lambda d: cohort_rank(rollout_id, d))
    cuts = [max(1, math.ceil(p * len(ordered) / 100 - 1e-9)) for p in phases]
    return [(d, rank, next(i for i, cut in enumerate(cuts) if rank < cut)) for rank, d in enumerate(ordered)]


# ---- manifests ---------------------------------------------------------------------------------------------------

def manifest(model: dict, *, key_id: str, now: float, expires_at: float, min_edgetune: str,
             target_isa: list[str], rollback: bool) -> dict:
    return {"name": model["name"], "version": model["version"], "sha256": model["sha256"], "size": model["size"],
            "prompt_format": model["prompt_format"], "spaces": model["spaces"], "min_edgetune": min_edgetune,
            "expires_at": expires_at, "key_id": key_id, "url": f"/releases/{model['sha256']}", "issued_at": now,
            "rollback": rollback, "target_isa": target_isa, "mqtt": {"chunk_size": CHUNK_BYTES}}


def new_rollout_id(version: int) -> str:
    return f"r{version}-{time.strftime('%Y%m%d')}-{secrets.token_hex(3)}"


def plan(model: dict, previous: dict, private_key: Any, policy: Policy, targets: list[str], *,
         expires_at: float, min_edgetune: str = __version__, target_isa: list[str] | None = None,
         selector: dict, now: float | None = None) -> tuple[dict, list[tuple[str, int, int]]]:
    """The rollouts row (release and rollback signed now) and its cohorts; nothing is written."""
    now = time.time() if now is None else now
    if not targets:
        raise BadInput("no device matches: nothing to roll out to (see `edgetune fleet devices`)")
    if expires_at <= now:
        raise BadInput("the release would be expired already: give a positive --expires-in")
    kid = rel.key_id(rel.raw_public(private_key.public_key()))
    common = dict(key_id=kid, now=now, expires_at=expires_at, min_edgetune=min_edgetune,
                  target_isa=list(target_isa or []))
    release, rollback = manifest(model, rollback=False, **common), manifest(previous, rollback=True, **common)
    for m in (release, rollback):
        rel.parse_manifest(m)  # the device's own check, before anything is signed
    rid = new_rollout_id(model["version"])
    row = {"id": rid, "version": model["version"], "rollback_version": previous["version"], "state": "active",
           "phases_json": json.dumps(list(policy.phases)), "phase": 0, "phase_started_at": now,
           "min_dwell_s": policy.min_dwell_s, "advance_pct": policy.advance_pct, "abort_pct": policy.abort_pct,
           "abort_min": policy.abort_min, "report_timeout_s": policy.report_timeout_s, "selector_json": json.dumps(selector, sort_keys=True),
           "manifest_json": json.dumps(release, sort_keys=True), "signature": rel.sign(release, private_key),
           "rollback_manifest_json": json.dumps(rollback, sort_keys=True),
           "rollback_signature": rel.sign(rollback, private_key), "reason": None, "created_at": now,
           "updated_at": now, "ended_at": None}
    return row, cohorts(rid, targets, policy.phases)


def wire_rollout_id(rollout_id: str, attempt: int) -> str:
    """The `rollout_id` a release carries: a retry must differ, or the device takes it for the release it
    finished already (docs/protocol.md)."""
    return rollout_id if attempt == 0 else f"{rollout_id}{RETRY_SEP}{attempt}"


def parse_rollout_id(wire_id: str) -> tuple[str, int]:
    """(rollout id, attempt) of a `rollout_id` a device reported."""
    base, sep, n = wire_id.rpartition(RETRY_SEP)
    attempt = whole_number(n) if sep else None
    return (base, attempt) if attempt is not None else (wire_id, 0)


def release_message(r: dict, rollback: bool, attempt: int = 0) -> bytes:
    """The retained model/release payload for one device of rollout `r`."""
    if rollback:
        return encode({"manifest": r["rollback_manifest"], "signature": r["rollback_signature"],
                       "rollout_id": r["id"], "phase": ROLLBACK_PHASE})
    return encode({"manifest": r["manifest"], "signature": r["signature"],
                   "rollout_id": wire_rollout_id(r["id"], attempt), "phase": phase_label(r["phases"], r["phase"])})


def release_topic(device: str) -> str:
    return Topics(device).model_release


# ---- progress and decisions --------------------------------------------------------------------------------------

def bucket(t: dict) -> str:
    """Where one target is with the release, as the rollouts page counts it."""
    if t["rollback_state"] == "committed":
        return "rolled_back"  # returned to the previous model by the fleet's rollback
    s = t["state"]
    if s is None:
        return "pending"
    return "failed" if s in ("rejected", "failed") else s  # timed_out is a bucket of its own


def progress(r: dict, targets: list[dict]) -> list[dict]:
    """Per phase: its share, whether it was released, the count in each bucket, and the failure reasons."""
    out = []
    for i, share in enumerate(r["phases"]):
        mine = [t for t in targets if t["phase"] == i]
        counts = Counter(bucket(t) for t in mine)
        reasons = Counter(f"{t['state']}: {t['reason']}" for t in mine if t["state"] in FAILED and t["reason"])
        out.append({"phase": i, "share": share, "label": f"{share:g}%", "released": i <= r["phase"],
                    "devices": len(mine), "counts": {b: counts.get(b, 0) for b in BUCKETS},
                    "reasons": dict(reasons.most_common())})
    return out


@dataclass(frozen=True)
class Decision:
    action: str  # abort | advance | complete
    detail: str


def decide(r: dict, targets: list[dict], now: float) -> Decision | None:
    """What the controller should do with an open rollout now, if anything (see the module doc)."""
    released = [t for t in targets if t["phase"] <= r["phase"]]
    final = [t for t in released if t["state"] in FINAL]
    bad = [t for t in final if t["state"] in FAILED]
    if len(final) >= r["abort_min"] and len(bad) * 100 > r["abort_pct"] * len(final):
        reasons = Counter(t["reason"] or t["state"] for t in bad)
        return Decision("abort", f"{len(bad)} of {len(final)} reporting devices failed ({len(bad) / len(final):.0%} "
                                 f"> {r['abort_pct']:g}%): " + ", ".join(f"{k} x{n}" for k, n in reasons.most_common()))
    if r["state"] != "active" or not released:
        return None
    dwelt = now - r["phase_started_at"] >= r["min_dwell_s"]
    if not dwelt or len(final) * 100 < r["advance_pct"] * len(released):
        return None
    committed = len(final) - len(bad)
    if r["phase"] + 1 >= len(r["phases"]):
        return Decision("complete", f"{committed} of {len(released)} devices committed v{r['version']}")
    return Decision("advance", f"phase {phase_label(r['phases'], r['phase'])} healthy ({committed} of "
                               f"{len(released)} committed); releasing {phase_label(r['phases'], r['phase'] + 1)}")


def rollout_summary(r: dict, targets: list[dict]) -> dict:
    """A rollout with its per-phase progress: what `fleet rollout list/show`, the API and the page show."""
    phases = progress(r, targets)
    keep = ("id", "version", "rollback_version", "state", "phase", "phase_started_at", "min_dwell_s", "advance_pct",
            "abort_pct", "abort_min", "report_timeout_s", "selector", "reason", "created_at", "updated_at", "ended_at")
    return {**{k: r[k] for k in keep}, "phase_label": phase_label(r["phases"], r["phase"]), "targets": len(targets),
            "totals": {b: sum(p["counts"][b] for p in phases) for b in BUCKETS}, "phases": phases}
