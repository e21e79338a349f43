"""Every name on the wire between a device and the fleet: topics, ops, statuses, the id rule, payload encoding.

The daemon and the fleet both import this module, and docs/protocol.md documents it for people who write their
own fleet tooling (tests/test_protocol.py checks the two against each other). A name used on the wire is written
here once; everything else imports it.

The id rule is one rule for device ids and command ids, because both are MQTT topic levels (`{device_id}` and
`cmd/res/{id}`) and a device id is also the MQTT client id: 1-128 of `A-Z a-z 0-9 _ . : -`, starting alphanumeric.
128 is the widest limit any sender enforced before (the daemon's command ids); every id that an edgetune
component produces or accepted from the other side stays valid (device ids were at most 64 in the config, the
fleet's command ids are 32 hex digits, the daemon's local ones under 30 characters), and it keeps a topic well
inside any broker's limits.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from edgetune.errors import BadInput
from edgetune.release import CHUNK_BYTES_MAX, CHUNK_BYTES_MIN, SHA256_RE

VERSION = "v1"
PREFIX = f"edgetune/{VERSION}"
QOS = 1  # every message, both directions: at least once

ID_MAX = 128
ID_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:-]{{0,{ID_MAX - 1}}}")
ID_RULE = f"1-{ID_MAX} of A-Z a-z 0-9 _ . : -, starting with a letter or digit"
INVALID_ID = "invalid"  # cmd/res/invalid: rejections of requests that carry no usable id

MAX_PAYLOAD_BYTES = 32 << 20  # any message; a tuning record with every measurement stays far below
MAX_COMMAND_BYTES = 16 * 1024  # cmd/req: a device rejects a larger request

# status: the device's retained presence; `lost` is its last will, `offline` a clean stop
STATUS_STATES = ("online", "offline", "lost")

# cmd/res: a command's life; the device journals it and dedupes its id
COMMAND_STATES = ("accepted", "in_progress", "succeeded", "failed", "rejected")
TERMINAL_STATES = ("succeeded", "failed", "rejected")  # a command in one of these never changes again
OPEN_STATES = tuple(s for s in COMMAND_STATES if s not in TERMINAL_STATES)
# cmd/res `origin`: who started a command (a cmd/req, the control socket, a firmware hook)
ORIGIN_FLEET, ORIGIN_LOCAL, ORIGIN_FIRMWARE_HOOK = "fleet", "local", "firmware-hook"
# tuning/record `origin` (and the results DB's): what started a tuning session (the command line, the daemon's own
# plan, a command, a firmware hook's retune)
SESSION_CLI, SESSION_DAEMON, SESSION_COMMAND, SESSION_FIRMWARE_HOOK = "cli", "daemon", "cmd", "firmware-hook"
# the fleet's own verdict on a command nobody answered before its expires_at (never sent by a device)
EXPIRED = "expired"

# telemetry `state` values besides the tuner's; `paused` says why in telemetry `paused` and in `edgetune status`
PAUSED = "paused"

# model/state: where a device is with a release; the last four are final for that release
MODEL_STATES = ("downloading", "verifying", "evaluating", "committed", "rolled_back", "rejected", "failed")
MODEL_FINAL_STATES = ("committed", "rolled_back", "rejected", "failed")

# cmd/req: op → the argument names it takes (the device checks values; see docs/protocol.md)
OPS: dict[str, tuple[str, ...]] = {
    "retune": ("kernels", "workloads", "strategy", "budget", "force"),
    "probe": (),
    "report": (),
    "ping": (),
}

DEVICE_TO_FLEET = "device → fleet"
FLEET_TO_DEVICE = "fleet → device"


class ProtocolError(BadInput, ValueError):
    """A topic, id or payload that breaks the contract; the message names the value and what is expected."""


@dataclass(frozen=True)
class TopicSpec:
    """One topic under `edgetune/v1/{device_id}/`. `sub` is the part after the device id; `cmd/res/{id}` has a
    command id level."""

    sub: str
    direction: str
    retained: bool
    fields: tuple[str, ...]  # the payload's top-level fields (a JSON object)

    @property
    def has_id(self) -> bool:
        return self.sub.endswith("/{id}")

    @property
    def stem(self) -> str:
        """`cmd/res/` for `cmd/res/{id}`, else the whole sub-topic."""
        return self.sub[:-len("{id}")] if self.has_id else self.sub

    @property
    def filter_sub(self) -> str:
        """The sub-topic as a subscription filter: `cmd/res/+` for `cmd/res/{id}`."""
        return self.stem + "+" if self.has_id else self.sub


STATUS = TopicSpec("status", DEVICE_TO_FLEET, True, ("state", "session", "version", "ts"))
INFO = TopicSpec("info", DEVICE_TO_FLEET, True,
                 ("device_id", "version", "hw", "hw_fingerprint", "fw_fingerprint", "model", "kernels", "tuning",
                  "commands", "model_update"))
CONFIG_ACTIVE = TopicSpec("config/active", DEVICE_TO_FLEET, True,
                          ("tuned_at", "hw_fingerprint", "fw_fingerprint", "model_version", "kernels"))
TUNING_RECORD = TopicSpec("tuning/record", DEVICE_TO_FLEET, False,
                          ("record_id", "device_id", "id", "key", "kernel", "workload", "shape", "hw_fingerprint",
                           "fw_fingerprint", "source_hash", "isa", "compiler_id", "strategy", "strategy_version",
                           "objective", "model_version", "params", "origin", "state", "started_at", "finished_at",
                           "result", "hw", "model", "measurements"))
TELEMETRY = TopicSpec("telemetry", DEVICE_TO_FLEET, False,
                      ("seq", "boot_id", "ts", "cpu_percent", "load1", "temp_c", "freq_mhz", "mem_used", "rss",
                       "state"))
CMD_REQ = TopicSpec("cmd/req", FLEET_TO_DEVICE, False, ("id", "op", "args", "expires_at"))
CMD_RES = TopicSpec("cmd/res/{id}", DEVICE_TO_FLEET, False,
                    ("id", "op", "origin", "status", "progress", "reason", "result", "message", "note", "ts",
                     "request_sha256"))
# end-to-end delivery: a fleet receiver publishes this after its DB committed a tuning record or a final command
# response; the device keeps those in its outbox until then (the broker's PUBACK only means the broker has them)
ACK = TopicSpec("ack", FLEET_TO_DEVICE, False, ("keys", "ts"))
# model rollout: the fleet retains one signed release per device (edgetune/release.py: manifest + signature, and
# the rollout it belongs to); an empty retained message withdraws it. The device retains its model state.
MODEL_RELEASE = TopicSpec("model/release", FLEET_TO_DEVICE, True, ("manifest", "signature", "rollout_id", "phase"))
MODEL_STATE = TopicSpec("model/state", DEVICE_TO_FLEET, True,
                        ("state", "current", "previous", "rollout_id", "phase", "version", "reason", "detail",
                         "ts"))
# a release's file over MQTT, for devices that cannot reach the fleet's HTTP server: the device asks for the chunks
# it misses, a window at a time (flow control: nothing is sent that nobody asked for, nothing is retained); the
# fleet answers each request with one model/chunk per chunk, or one carrying `error` when it cannot serve it
MODEL_CHUNK_REQ = TopicSpec("model/chunk/req", DEVICE_TO_FLEET, False, ("sha256", "chunk_size", "first", "count",
                                                                        "ts"))
MODEL_CHUNK = TopicSpec("model/chunk", FLEET_TO_DEVICE, False, ("sha256", "chunk_size", "index", "data", "error",
                                                                 "ts"))
TOPICS = (STATUS, INFO, CONFIG_ACTIVE, TUNING_RECORD, TELEMETRY, CMD_REQ, CMD_RES, ACK, MODEL_RELEASE, MODEL_STATE,
          MODEL_CHUNK_REQ, MODEL_CHUNK)

CHUNK_BYTES = 64 * 1024  # the chunk size the fleet offers in its manifests
CHUNKS_PER_REQUEST = 16  # the most chunks one model/chunk/req may ask for
MAX_CHUNK_REQ_BYTES = 1024


# ---- ids ---------------------------------------------------------------------------------------------------------

def valid_id(value: Any) -> bool:
    return isinstance(value, str) and ID_RE.fullmatch(value) is not None


def check_id(value: Any, what: str = "id") -> str:
    """`value` if it is a usable device or command id, else ProtocolError naming it and the rule."""
    if not valid_id(value):
        shown = value[:ID_MAX + 10] if isinstance(value, str) else value
        raise ProtocolError(f"{what} {shown!r} is not usable: it must be {ID_RULE}")
    return value


# ---- end-to-end acknowledgement keys -----------------------------------------------------------------------------

def record_ack_key(record_id: str) -> str:
    """What `ack` carries for a committed tuning/record."""
    return f"record:{record_id}"


def result_ack_key(command_id: str) -> str:
    """What `ack` carries for a committed final cmd/res (a command has one final status, never undone)."""
    return f"res:{command_id}"


# ---- topics ------------------------------------------------------------------------------------------------------

def _topic(spec: TopicSpec) -> property:
    return property(lambda self: self.of(spec), doc=f"the {spec.sub} topic")


@dataclass(frozen=True)
class Topics:
    """The topics of one device, built from the specs above."""

    device_id: str

    def __post_init__(self) -> None:
        check_id(self.device_id, "device id")

    @property
    def base(self) -> str:
        return f"{PREFIX}/{self.device_id}"

    def of(self, spec: TopicSpec, command_id: str | None = None) -> str:
        if spec.has_id:
            return f"{self.base}/{spec.stem}{command_id or INVALID_ID}"
        return f"{self.base}/{spec.sub}"

    status = _topic(STATUS)
    info = _topic(INFO)
    config_active = _topic(CONFIG_ACTIVE)
    record = _topic(TUNING_RECORD)
    telemetry = _topic(TELEMETRY)
    cmd_req = _topic(CMD_REQ)
    ack = _topic(ACK)
    model_release = _topic(MODEL_RELEASE)
    model_state = _topic(MODEL_STATE)
    model_chunk_req = _topic(MODEL_CHUNK_REQ)
    model_chunk = _topic(MODEL_CHUNK)

    def cmd_res(self, command_id: str | None) -> str:
        """cmd/res/{id}; a request without a usable id is answered on cmd/res/invalid."""
        return self.of(CMD_RES, command_id)


def topic_filter(sub: str = "#", device: str = "+", share: str | None = None) -> str:
    """A subscription filter under the prefix: every device by default, `$share/{share}/…` for an MQTT 5 shared
    subscription (several receivers splitting the load). Messages arrive on their plain topic, so receivers
    dispatch with `parse_topic`, never by matching the filter."""
    if device != "+":
        check_id(device, "device id")
    if share is not None and not re.fullmatch(r"[^/+#]+", share):
        raise ProtocolError(f"share group {share!r}: must be non-empty, without / + or #")
    f = f"{PREFIX}/{device}/{sub}"
    return f"$share/{share}/{f}" if share is not None else f


@dataclass(frozen=True)
class Parsed:
    device_id: str
    sub: str  # the sub-topic as received, e.g. `status` or `cmd/res/abc`
    spec: TopicSpec | None  # None: a sub-topic this version does not know (a newer device's)
    command_id: str | None = None  # cmd/res/{id}


_BY_SUB = {t.sub: t for t in TOPICS if not t.has_id}


def parse_topic(topic: str) -> Parsed:
    """`edgetune/v1/{device}/{sub}` → its parts; ProtocolError outside the tree or with a bad id."""
    head = PREFIX + "/"
    if not topic.startswith(head):
        raise ProtocolError(f"topic {topic[:200]!r} is outside {head}")
    device, sep, sub = topic[len(head):].partition("/")
    if not device or not sep or not sub:
        raise ProtocolError(f"topic {topic[:200]!r} has no device id or sub-topic")
    check_id(device, "device id")
    spec = _BY_SUB.get(sub)
    if spec is not None:
        return Parsed(device, sub, spec)
    if sub.startswith(CMD_RES.stem):
        return Parsed(device, sub, CMD_RES, check_id(sub[len(CMD_RES.stem):], f"{CMD_RES.stem} command id"))
    return Parsed(device, sub, None)


# ---- payloads ----------------------------------------------------------------------------------------------------

def encode(doc: Any) -> bytes:
    """Strict, compact JSON: NaN and infinities (e.g. the CV of one rep) become null, so every parser reads it."""
    return json.dumps(_finite(doc), separators=(",", ":"), default=str).encode()


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def decode(payload: bytes, what: str, limit: int = MAX_PAYLOAD_BYTES) -> dict:
    """A payload as the JSON object every topic carries; ProtocolError saying what is wrong with it."""
    if len(payload) > limit:
        raise ProtocolError(f"{what}: oversized: {len(payload)} bytes, the limit is {limit}")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{what}: not JSON: the payload is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"{what}: not JSON ({str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: not a JSON object (a JSON {type(obj).__name__})")
    return obj


# ---- model file chunks -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChunkRequest:
    """model/chunk/req: chunks first .. first+count-1 of the file with this sha256, cut at chunk_size bytes."""

    sha256: str
    chunk_size: int
    first: int
    count: int

    def encode(self) -> bytes:
        return encode({"sha256": self.sha256, "chunk_size": self.chunk_size, "first": self.first,
                       "count": self.count, "ts": time.time()})


@dataclass(frozen=True)
class Chunk:
    """model/chunk: chunk `index` of a file (its bytes `data`), or the fleet's `error` for a request of it."""

    sha256: str
    chunk_size: int
    index: int
    data: bytes
    error: str | None = None

    def encode(self) -> bytes:
        return encode({"sha256": self.sha256, "chunk_size": self.chunk_size, "index": self.index,
                       "data": base64.b64encode(self.data).decode(), "error": self.error, "ts": time.time()})


def chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


def _int_field(doc: dict, name: str, low: int, high: int, what: str) -> int:
    v = doc.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
        raise ProtocolError(f"{what}: {name} {str(v)[:40]!r} must be an integer in {low}..{high}")
    return v


def _sha_field(doc: dict, what: str) -> str:
    sha = doc.get("sha256")
    if not isinstance(sha, str) or not SHA256_RE.fullmatch(sha):
        raise ProtocolError(f"{what}: sha256 {str(sha)[:80]!r} must be 64 lowercase hex digits")
    return sha


def parse_chunk_request(payload: bytes) -> ChunkRequest:
    """A model/chunk/req payload, or ProtocolError saying what is wrong with it."""
    what = MODEL_CHUNK_REQ.sub
    doc = decode(payload, what, limit=MAX_CHUNK_REQ_BYTES)
    return ChunkRequest(_sha_field(doc, what), _int_field(doc, "chunk_size", CHUNK_BYTES_MIN, CHUNK_BYTES_MAX, what),
                        _int_field(doc, "first", 0, 1 << 31, what),
                        _int_field(doc, "count", 1, CHUNKS_PER_REQUEST, what))


def max_chunk_message(chunk_size: int) -> int:
    """The largest model/chunk payload of this chunk size: base64 of the bytes plus the other fields."""
    return 4 * chunk_count(chunk_size, 3) + 1024


def parse_chunk(payload: bytes, chunk_size: int) -> Chunk:
    """A model/chunk payload for a transfer cut at `chunk_size`, or ProtocolError (oversized, not JSON, a bad
    field, data that is not base64 or longer than a chunk)."""
    what = MODEL_CHUNK.sub
    doc = decode(payload, what, limit=max_chunk_message(chunk_size))
    sha, error = _sha_field(doc, what), doc.get("error")
    if error is not None:
        return Chunk(sha, chunk_size, -1, b"", str(error)[:500])
    size = _int_field(doc, "chunk_size", chunk_size, chunk_size, what)
    index = _int_field(doc, "index", 0, 1 << 31, what)
    try:
        data = base64.b64decode(doc.get("data") if isinstance(doc.get("data"), str) else "-", validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"{what}: data of chunk {index} is not base64") from None
    if not data or len(data) > size:
        raise ProtocolError(f"{what}: chunk {index} holds {len(data)} bytes, not 1..{size}")
    return Chunk(sha, size, index, data)
