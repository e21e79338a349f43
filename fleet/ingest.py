"""One MQTT message into the fleet DB.

Topics and payloads follow the wire protocol (edgetune.protocol, docs/protocol.md). Validation is lenient about extra or missing
optional fields and strict only where storage needs it (a status state, a telemetry seq, a record's kernel and
workload, a response status). Anything else that is wrong with a payload makes it "malformed": logged, noted in
the `malformed` table and skipped. `ingest` (one message) and `ingest_batch` (many, in one transaction) never
raise for a payload; they raise only `DBError` (disk full, DB locked, damaged pages), which the listener treats as
"do not acknowledge, retry later".
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from edgetune import protocol as wire
from edgetune.protocol import CMD_RES, COMMAND_STATES, STATUS_STATES, TERMINAL_STATES, ProtocolError
from edgetune.sqlite import DBError
from fleet import rollout_store
from fleet.store import FleetStore, Sample, Started

log = logging.getLogger("fleet.ingest")

Incoming = tuple[str, bytes, bool]  # a message as the listener hands it over: topic, payload, retained
OTHERS_PER_TX = 50  # non-telemetry messages per transaction: they hold their devices' rows until its commit
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
MAX_SPEEDUP = 1e6  # a million times faster (or slower) than the default is a device's clock or unit bug, not a result
# device times outside 2000-01-01 .. 2100-01-01 UTC are a clock never set or a unit bug (ms, µs), not a time
DEVICE_TIME_RANGE = (946684800.0, 4102444800.0)


class Malformed(ProtocolError):
    """The payload (or topic) cannot be stored; the message says why."""


@dataclass(frozen=True)
class Outcome:
    kind: str  # status | info | active | record | telemetry | cmd_req | cmd_res | model_state | ignored | malformed
    device: str | None
    detail: str = ""  # new | duplicate | updated | stale | changed | same | cleared | stored
    error: str | None = None
    ack: str | None = None  # the protocol ack key to publish to the device now that the DB committed it


# ---- lenient field readers -------------------------------------------------------------------------------------

def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        f = float(x)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _time(x: Any) -> float | None:
    """A device's unix time, or None when it cannot be one (DEVICE_TIME_RANGE): stored as it came, a time like
    -1e20 overflowed the platform's time_t wherever a page showed it, and a clock left at 1970 made a live device
    look gone for decades."""
    t = _num(x)
    lo, hi = DEVICE_TIME_RANGE
    if t is not None and not lo <= t <= hi:
        log.debug("device time %r is outside %s..%s; taken as unknown", t, lo, hi)
        return None
    return t


def _int(x: Any) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, float) and math.isfinite(x) and x.is_integer():
        x = int(x)
    if isinstance(x, int) and _INT_MIN <= x <= _INT_MAX:
        return x
    return None


def plausible_speedup(x: float | None) -> bool:
    """Whether a speedup can be a measurement: a finite ratio within MAX_SPEEDUP either way. Anything else
    (0, 1e308, inf) would only wreck the fleet's medians and plots."""
    return x is not None and 1 / MAX_SPEEDUP <= x <= MAX_SPEEDUP


def _text(x: Any, limit: int = 500) -> str | None:
    if isinstance(x, str):
        return x[:limit]
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return str(x)
    return None


def _ident(x: Any) -> str | None:
    """An id: a non-empty string or an integer."""
    if isinstance(x, str) and x and len(x) <= 256:
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)
    return None


def _seen(ts: float | None, retained: bool, now: float) -> float | None:
    """When the device was last alive, as far as this message tells: its own ts (never in our future), else the
    receive time of a live message. A retained message without a plausible ts proves nothing about liveness."""
    ts = _time(ts)
    if ts is not None:
        return min(ts, now)
    return None if retained else now


# ---- per-topic handlers ----------------------------------------------------------------------------------------
# A handler validates a message, raising Malformed (or whatever an odd payload provokes) before anything is written,
# and returns the write that stores it: a batch checks every message before its transaction, so a rejected one
# creates no device row.

Write = Callable[[FleetStore], Outcome]


def _done(outcome: Outcome) -> Write:
    """The write of a message that stores nothing."""
    return lambda store: outcome


def _status(device: str, sub: str, payload: bytes, retained: bool, now: float) -> Write:
    if not payload:  # a retained status was cleared
        return _done(Outcome("status", device, "cleared"))
    obj = wire.decode(payload, wire.STATUS.sub)
    state = obj.get("state")
    if state not in STATUS_STATES:
        raise Malformed(f"status: state {str(state)[:50]!r} is not one of {', '.join(STATUS_STATES)}")
    ts = _time(obj.get("ts"))
    # `lost` is the broker speaking (the last will): it proves nothing about when the device was alive
    seen = (min(ts, now) if ts is not None else None) if state == "lost" else _seen(ts, retained, now)

    def write(store: FleetStore) -> Outcome:
        changed = store.put_status(device, state, _int(obj.get("session")), _text(obj.get("version"), 100), ts,
                                   retained, now, seen)
        if changed:
            log.info("device %s is %s", device, state)
        return Outcome("status", device, "changed" if changed else "same")
    return write


def _descriptor(info: dict) -> dict:
    for key in ("hw", "hardware", "descriptor", "hw_descriptor"):
        if isinstance(info.get(key), dict):
            return info[key]
    return info if "cpu_model" in info else {}


def _info(device: str, sub: str, payload: bytes, retained: bool, now: float) -> Write:
    if not payload:
        return _done(Outcome("info", device, "cleared"))
    obj = wire.decode(payload, wire.INFO.sub)
    declared = _ident(obj.get("device_id", obj.get("device")))
    if declared is not None and declared != device:
        log.warning("info on %s's topic names device %r; the topic wins", device, declared)
    hw = _descriptor(obj)
    model = obj.get("model")
    summary = {
        "cpu_model": _text(hw.get("cpu_model")), "arch": _text(hw.get("arch"), 50), "isa": _text(hw.get("isa"), 100),
        "vector_bits": _int(hw.get("vector_bits")), "cores": _int(hw.get("cores")),
        "hw_fingerprint": _text(obj.get("hw_fingerprint"), 200) or _text(hw.get("hw_fingerprint"), 200),
        "fw_fingerprint": _text(obj.get("fw_fingerprint"), 200) or _text(hw.get("fw_fingerprint"), 200),
        "model_version": _text(model.get("version"), 200) if isinstance(model, dict) else _text(obj.get("model_version")),
        "descriptor": hw or None,
    }
    seen = _seen(_num(obj.get("ts")), retained, now)

    def write(store: FleetStore) -> Outcome:
        store.put_info(device, obj, summary, now, seen)
        return Outcome("info", device, "stored")
    return write


def _active(device: str, sub: str, payload: bytes, retained: bool, now: float) -> Write:
    seen = _seen(None, retained, now)
    if not payload:
        return _active_write(device, None, {}, [], now, seen, "cleared")
    obj = wire.decode(payload, wire.CONFIG_ACTIVE.sub)
    kernels = obj.get("kernels") or {}
    if not isinstance(kernels, dict):
        raise Malformed(f"config/active: kernels is a {type(kernels).__name__}, expected an object")
    entries, skipped = [], 0
    for slot, e in kernels.items():
        if not isinstance(e, dict):
            skipped += 1
            continue
        kernel, _, workload = str(slot).partition("/")
        ms, default_ms, speedup = _num(e.get("ms")), _num(e.get("default_ms")), _num(e.get("speedup"))
        if speedup is None and ms and default_ms:
            speedup = default_ms / ms
        if speedup is not None and not plausible_speedup(speedup):
            log.warning("config/active of %s: %s speedup %g is not a measurement; stored as unknown", device,
                        str(slot)[:100], speedup)
            speedup = None
        entries.append({
            "slot": str(slot)[:300], "kernel": _text(e.get("kernel"), 100) or kernel,
            "workload": _text(e.get("workload"), 200) or workload or None,
            "config": e.get("config"), "ms": ms, "default_ms": default_ms, "speedup": speedup,
            "evals": _int(e.get("evals")), "tuning_s": _num(e.get("tuning_s")),
            "strategy": _text(e.get("strategy"), 100), "tuned_at": _time(e.get("tuned_at")), "entry": e,
        })
    if skipped:
        log.warning("config/active of %s: skipped %d entries that are not objects", device, skipped)
    meta = {"model_version": _text(obj.get("model_version"), 200),
            "hw_fingerprint": _text(obj.get("hw_fingerprint"), 200),
            "fw_fingerprint": _text(obj.get("fw_fingerprint"), 200)}
    return _active_write(device, obj, meta, entries, now, seen, "stored")


def _active_write(device: str, obj: dict | None, meta: dict, entries: list[dict], now: float, seen: float | None,
                  detail: str) -> Write:
    def write(store: FleetStore) -> Outcome:
        store.put_active(device, obj, meta, entries, now, seen)
        return Outcome("active", device, detail)
    return write


def record_uid(obj: dict) -> str:
    """A tuning record's identity on its device: its id (record_id, else the session id) qualified by started_at,
    so that a device whose results DB restarted its ids does not collide with itself; else a content hash."""
    session = obj.get("session") if isinstance(obj.get("session"), dict) else {}
    rid = _ident(obj.get("record_id")) or _ident(obj.get("id")) or _ident(session.get("id"))
    started = _num(obj.get("started_at", session.get("started_at")))
    if rid is None:
        return "sha256:" + hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
    return f"{rid}@{started!r}" if started is not None else rid


def _record(device: str, sub: str, payload: bytes, retained: bool, now: float) -> Write:
    obj = wire.decode(payload, wire.TUNING_RECORD.sub)
    # the session fields sit at the top level; accept them nested under "session" too
    src = {**obj["session"], **obj} if isinstance(obj.get("session"), dict) else obj
    kernel, workload = _text(src.get("kernel"), 100), _text(src.get("workload"), 200)
    if not kernel or not workload:
        raise Malformed("tuning/record: no kernel or workload")
    measurements = obj.get("measurements", [])
    if not isinstance(measurements, list):
        raise Malformed(f"tuning/record: measurements is a {type(measurements).__name__}, expected a list")
    sid = _ident(src.get("record_id")) or _ident(src.get("id"))
    fields = {
        "session_id": sid, "key": _text(src.get("key"), 200), "kernel": kernel, "workload": workload,
        "hw_fingerprint": _text(src.get("hw_fingerprint"), 200), "fw_fingerprint": _text(src.get("fw_fingerprint"), 200),
        "strategy": _text(src.get("strategy"), 100), "state": _text(src.get("state"), 50),
        "started_at": _time(src.get("started_at")), "n_measurements": len(measurements),
    }
    ts = _time(obj.get("ts")) or _time(src.get("finished_at")) or fields["started_at"]
    uid = record_uid(obj)
    rid = _ident(obj.get("record_id"))

    def write(store: FleetStore) -> Outcome:
        detail = store.put_record(device, uid, fields, obj, now, _seen(ts, retained, now))
        if detail == "new":
            log.info("record %s/%s from %s: %d measurements", kernel, workload, device, len(measurements))
        else:
            log.debug("record %s from %s: %s", uid, device, detail)
        return Outcome("record", device, detail, ack=wire.record_ack_key(rid) if rid else None)
    return write


def _sample(device: str, payload: bytes, retained: bool, now: float) -> tuple[Sample, float | None]:
    """A telemetry payload, validated, and the device's last-seen time it proves; Malformed when it cannot be."""
    obj = wire.decode(payload, wire.TELEMETRY.sub)
    seq = _int(obj.get("seq"))
    if seq is None:
        raise Malformed("telemetry: no integer seq")
    t = {"seq": seq, "boot_id": _text(obj.get("boot_id"), 100) or "", "ts": _time(obj.get("ts")),
         "state": _text(obj.get("state"), 50)}
    for k in ("cpu_percent", "load1", "temp_c", "freq_mhz", "mem_used", "rss"):
        t[k] = _num(obj.get(k))
    return Sample(device, t, obj), _seen(t["ts"], retained, now)


def _telemetry(device: str, sub: str, payload: bytes, retained: bool, now: float) -> Write:
    x, seen = _sample(device, payload, retained, now)

    def write(store: FleetStore) -> Outcome:
        new = store.put_telemetry(device, x.fields, x.payload, now, seen)
        return Outcome("telemetry", device, "new" if new else "duplicate")
    return write


def _cmd_req(device: str, sub: str, payload: bytes, retained: bool, now: float) -> Write:
    obj = wire.decode(payload, wire.CMD_REQ.sub)
    cid = _ident(obj.get("id"))
    if cid is None:
        raise Malformed("cmd/req: no id")

    def write(store: FleetStore) -> Outcome:
        store.put_command(device, cid, _text(obj.get("op"), 50), obj.get("args"), _num(obj.get("expires_at")), now)
        return Outcome("cmd_req", device, "stored")
    return write


def _cmd_res(device: str, sub: str, payload: bytes, retained: bool, now: float) -> Write:
    cid = sub[len(CMD_RES.stem):]  # checked by parse_topic
    obj = wire.decode(payload, CMD_RES.sub)
    status = obj.get("status")
    if status not in COMMAND_STATES:
        raise Malformed(f"cmd/res: status {str(status)[:50]!r} is not one of {', '.join(COMMAND_STATES)}")
    if _ident(obj.get("id")) not in (None, cid):
        log.warning("cmd/res/%s from %s carries id %r; the topic wins", cid, device, obj.get("id"))

    def write(store: FleetStore) -> Outcome:
        started = Started(_text(obj.get("op"), 50), _text(obj.get("origin"), 50), _text(obj.get("note"), 500))
        store.put_response(device, cid, status, obj.get("progress"), _text(obj.get("reason"), 2000),
                           obj.get("result"), now, started)
        return Outcome("cmd_res", device, status, ack=wire.result_ack_key(cid) if status in TERMINAL_STATES else None)
    return write


def _model_state(device: str, sub: str, payload: bytes, retained: bool, now: float) -> Write:
    if not payload:
        return _done(Outcome("model_state", device, "cleared"))
    obj = wire.decode(payload, wire.MODEL_STATE.sub)
    state = obj.get("state")
    if state not in wire.MODEL_STATES:
        raise Malformed(f"model/state: state {str(state)[:50]!r} is not one of {', '.join(wire.MODEL_STATES)}")
    fields = {"state": state, "rollout_id": _ident(obj.get("rollout_id")), "phase": _text(obj.get("phase"), 50),
              "version": _int(obj.get("version")), "reason": _text(obj.get("reason"), 100),
              "detail": _text(obj.get("detail"), 2000), "ts": _num(obj.get("ts"))}

    def write(store: FleetStore) -> Outcome:
        moved = rollout_store.put_model_state(store, device, obj, fields, now, _seen(fields["ts"], retained, now))
        return Outcome("model_state", device, "rollout" if moved else "stored")
    return write


Handler = Callable[[str, str, bytes, bool, float], Write]
_HANDLERS: dict[wire.TopicSpec, Handler] = {
    wire.STATUS: _status, wire.INFO: _info, wire.CONFIG_ACTIVE: _active, wire.TUNING_RECORD: _record,
    wire.TELEMETRY: _telemetry, wire.CMD_REQ: _cmd_req, wire.CMD_RES: _cmd_res, wire.MODEL_STATE: _model_state,
}


def subscriptions(share: str | None = None) -> tuple[str, ...]:
    """One filter per topic a receiver stores, every device: not `+/#`, which would also bring every model chunk
    (64 KiB each, per downloading device), release and ack the fleet itself sends, to every receiver."""
    return tuple(wire.topic_filter(t.filter_sub, share=share) for t in _HANDLERS)


def retired_subscriptions(share: str | None = None) -> tuple[str, ...]:
    """What receivers before the per-topic filters subscribed: a persistent session they created still holds it on
    the broker, so a receiver resuming one drops it."""
    return (wire.topic_filter("#", share=share),)


def ingest(store: FleetStore, topic: str, payload: bytes, retained: bool = False, now: float | None = None) -> Outcome:
    """Store one message in its own transaction. Never raises for a bad topic or payload; raises DBError only."""
    now = time.time() if now is None else now
    payload = bytes(payload or b"")
    try:
        return _dispatch(topic, payload, retained, now)(store)
    except DBError:
        raise  # the DB, not the payload: the caller retries
    except Exception as e:  # Malformed, or whatever else an odd payload provoked: skip it, keep running
        return _malformed(store, topic, payload, now, e)


def ingest_batch(store: FleetStore, messages: Sequence[Incoming], now: float | None = None) -> list[Outcome]:
    """Store many messages with the outcomes `ingest` gives each in turn, in few transactions (FleetStore.batch):
    the telemetry, nearly all of the traffic, in one, validated before it opens and inserted with one statement,
    its devices touched last (the rows other receivers wait for stay locked only until the commit); the other
    messages in transactions of at most OTHERS_PER_TX, each touching its devices first, so that a burst of
    announcements does not hold every device row for seconds. Raises DBError only (what committed before stays:
    every write is idempotent or deduplicated, so the redelivery is harmless).

    A value the database refuses (PostgreSQL text cannot hold NUL) aborts a whole transaction, and which message
    held it is not known: those messages are then stored one per transaction, so that one is skipped as malformed
    and the others are stored."""
    now = time.time() if now is None else now
    messages = [(topic, bytes(payload or b""), retained) for topic, payload, retained in messages]
    plans = [_plan(topic, payload, retained, now) for topic, payload, retained in messages]
    out: list[Outcome | None] = [None] * len(messages)
    others = [i for i, p in enumerate(plans) if p.sample is None]
    for k in range(0, len(others), OTHERS_PER_TX):
        _transaction(store, _store_others, others[k:k + OTHERS_PER_TX], messages, plans, out, now)
    telemetry = [i for i, p in enumerate(plans) if p.sample is not None]
    if telemetry:
        _transaction(store, _store_telemetry, telemetry, messages, plans, out, now)
    return out  # type: ignore[return-value]  # every slot is filled


@dataclass(frozen=True)
class _Plan:
    """What a batch knows about a message before its transaction, all of it validated: the device it is about
    (None: no device row to touch), and for telemetry the sample, for another message its write, or why it is
    malformed."""

    device: str | None
    sample: Sample | None = None
    seen: float | None = None
    write: Write | None = None
    error: Exception | None = None


def _plan(topic: str, payload: bytes, retained: bool, now: float) -> _Plan:
    try:
        parsed = wire.parse_topic(topic)
        if parsed.spec is wire.TELEMETRY:
            x, seen = _sample(parsed.device_id, payload, retained, now)
            return _Plan(parsed.device_id, sample=x, seen=seen)
        write = _dispatch(topic, payload, retained, now)
    except Exception as e:  # whatever a payload provokes in validation makes it malformed, as in `ingest`
        return _Plan(None, error=e)
    return _Plan(parsed.device_id if parsed.spec in _HANDLERS else None, write=write)


def _transaction(store: FleetStore, write: Callable[..., None], idx: list[int], messages: list[Incoming],
                 plans: list[_Plan], out: list[Outcome | None], now: float) -> None:
    try:
        with store.batch():
            write(store, idx, messages, plans, out, now)
    except DBError:
        raise
    except Exception as e:
        log.warning("the fleet DB refused a batch of %d messages (%s: %s); storing them one at a time",
                    len(idx), type(e).__name__, str(e)[:200])
        for i in idx:
            out[i] = ingest(store, *messages[i], now)


def _store_others(store: FleetStore, idx: list[int], messages: list[Incoming], plans: list[_Plan],
                  out: list[Outcome | None], now: float) -> None:
    store.touch_devices({plans[i].device: None for i in idx if plans[i].device is not None}, now)
    for i in idx:
        topic, payload, _ = messages[i]
        p = plans[i]
        out[i] = _malformed(store, topic, payload, now, p.error) if p.write is None else p.write(store)


def _store_telemetry(store: FleetStore, idx: list[int], messages: list[Incoming], plans: list[_Plan],
                     out: list[Outcome | None], now: float) -> None:
    samples = [plans[i].sample for i in idx]
    for i, x, new in zip(idx, samples, store.put_telemetry_many(samples, now)):
        out[i] = Outcome("telemetry", x.device, "new" if new else "duplicate")
    seen: dict[str, float | None] = {}
    for i in idx:
        p = plans[i]
        seen[p.device] = max((t for t in (seen.get(p.device), p.seen) if t is not None), default=None)
    store.touch_devices(seen, now)  # last: the device rows stay locked only until the commit that follows


def _dispatch(topic: str, payload: bytes, retained: bool, now: float) -> Write:
    """The message validated by its topic's handler; its write."""
    parsed = wire.parse_topic(topic)
    handler = _HANDLERS.get(parsed.spec) if parsed.spec else None
    if handler is None:
        log.debug("ignoring %s: not a topic this fleet receiver knows", topic)
        return _done(Outcome("ignored", parsed.device_id, parsed.sub))
    return handler(parsed.device_id, parsed.sub, payload, retained, now)


def _malformed(store: FleetStore, topic: str, payload: bytes, now: float, e: Exception) -> Outcome:
    err = str(e) if isinstance(e, ProtocolError) else f"{type(e).__name__}: {str(e)[:300]}"
    log.warning("skipped a malformed message on %s: %s", topic[:300], err)
    try:
        device = wire.parse_topic(topic).device_id
    except Exception:
        device = None
    store.put_malformed(device, topic[:1000], err, payload, now)
    return Outcome("malformed", device, error=err)
