"""Remote and local commands: validate, journal, dedupe, respond.

A command is journaled (SQLite, <state_dir>/daemon.db) before it is acknowledged, both by the `accepted` response
and by the MQTT PUBACK, which paho sends only after the message callback returns. The journal is also the dedupe
table: a repeated id re-sends the recorded state and never runs again. Anything unusable gets a `rejected`
response with a reason: on cmd/res/{id} when the payload has a usable id, else on cmd/res/invalid (with the
sha256 of the payload so the sender can match it) and in the log. Execution is the executor's job; this module
never blocks the MQTT thread on it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

from daemon.store import Journal
from edgetune.errors import BadInput, EdgetuneError
from edgetune.protocol import CMD_REQ, ID_RULE, INVALID_ID, MAX_COMMAND_BYTES, OPS, ProtocolError, decode, valid_id
from edgetune.protocol import OPEN_STATES as OPEN, ORIGIN_FLEET, TERMINAL_STATES as TERMINAL

log = logging.getLogger(__name__)

JOURNAL_KEEP_S = 30 * 86400.0  # a repeated id is recognised for this long
MAX_EPOCH_S = 253402300799  # 9999-12-31T23:59:59Z
MAX_REASON = 300  # a reason echoes the sender's input (a name, a value): never more than this many characters
STOPPING = "stopping: the daemon is shutting down; send the command again once it is back"


@dataclass(frozen=True)
class Command:
    id: str
    op: str
    args: dict
    origin: str  # fleet | local | firmware-hook


class Rejected(Exception):
    pass


class Stopping(EdgetuneError):
    """A local command refused because the daemon is shutting down (exit 1: try again later)."""


def bounded(reason: str | None) -> str | None:
    """A reason cut to MAX_REASON characters in its middle: it may quote a 16 KB name the sender gave, which the
    response (and the journal) should not carry back whole, while its end says what was wrong."""
    if reason is None or len(reason) <= MAX_REASON:
        return reason
    return reason[:MAX_REASON // 2] + "…" + reason[-(MAX_REASON // 2 - 1):]  # the tail says why: keep it


def _expired(expires_at: Any, now: float) -> bool:
    """expires_at: epoch seconds or an ISO 8601 time (UTC when it has no offset); null means never."""
    if expires_at is None:
        return False
    if isinstance(expires_at, (int, float)) and not isinstance(expires_at, bool):
        # JSON NaN / Infinity would never expire; an int is compared exactly (math.isfinite overflows on a
        # 400-digit one, and its repr may be too long to print)
        if isinstance(expires_at, float) and not math.isfinite(expires_at):
            raise Rejected(f"bad expires_at {expires_at!r}: give finite epoch seconds or ISO 8601")
        if abs(expires_at) > MAX_EPOCH_S:
            raise Rejected(f"bad expires_at: out of range; give epoch seconds up to {MAX_EPOCH_S} (the year 9999, "
                           "the latest ISO 8601 can say) or ISO 8601")
        return expires_at < now
    if isinstance(expires_at, str):
        try:
            t = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
            return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp() < now
        except (ValueError, OverflowError):
            raise Rejected(f"bad expires_at {expires_at[:40]!r}: give epoch seconds or ISO 8601") from None
    raise Rejected("bad expires_at: give epoch seconds or ISO 8601")


def _str_list(name: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v) or len(v) > 256:
        raise Rejected(f"bad args: {name} must be a non-empty list of names")
    return v


def check_args(op: str, args: Any) -> dict:
    """Shape checks of a command's args; names (kernels, workloads) are checked by the executor."""
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise Rejected("bad args: must be an object")
    unknown = [k for k in args if k not in OPS[op]]
    if unknown:
        takes = ", ".join(OPS[op]) or "no args"
        raise Rejected(f"bad args: unknown {', '.join(map(str, unknown))[:100]}; {op} takes {takes}")
    for k in ("kernels", "workloads"):
        if k in args:
            _str_list(k, args[k])
    if "strategy" in args:
        from tuner.strategies import unknown_strategy

        problem = unknown_strategy(args["strategy"])
        if problem:
            raise Rejected(f"bad args: {problem}")
    if "budget" in args and not (type(args["budget"]) is int and 1 <= args["budget"] <= 100_000):
        raise Rejected(f"bad args: budget {args['budget']!r} must be an integer 1-100000 (evals per workload)")
    if "force" in args and not isinstance(args["force"], bool):
        raise Rejected("bad args: force must be true or false")
    return args


def parse(payload: bytes, now: float) -> tuple[str | None, str | None, Command | None, str | None]:
    """(usable id or None, known op or None, command or None, rejection reason or None). The op is returned
    even when its args or expiry are refused, so the rejection on record says what was refused."""
    try:
        doc = decode(payload, CMD_REQ.sub, MAX_COMMAND_BYTES)
    except ProtocolError as e:
        return None, None, None, str(e)
    cid = doc.get("id")
    if not valid_id(cid) or cid == INVALID_ID:  # cmd/res/invalid carries the rejections that have no id
        return None, None, None, f"missing or unusable id ({ID_RULE}; {INVALID_ID!r} is reserved)"
    op = doc.get("op")
    if not isinstance(op, str) or op not in OPS:
        return cid, None, None, f"unknown op {str(op)[:40]!r}; ops: {', '.join(OPS)}"
    try:
        if _expired(doc.get("expires_at"), now):
            raise Rejected("expired")
        return cid, op, Command(cid, op, check_args(op, doc.get("args")), ORIGIN_FLEET), None
    except Rejected as e:
        return cid, op, None, str(e)


Respond = Callable[[str | None, dict], None]


class Commands:
    """The command front door for MQTT, the control socket and firmware hooks.

    `check` resolves names (kernels, workloads) and raises BadInput, so a bad name is rejected before it is
    accepted; `execute` starts the work and must return quickly.
    """

    def __init__(self, journal: Journal, respond: Respond, check: Callable[[Command], None],
                 execute: Callable[[Command], None]):
        self.journal, self._respond, self._check, self._execute = journal, respond, check, execute
        self._watchers: dict[str, list[Callable[[dict], None]]] = {}
        self._lock = threading.Lock()
        self._intake = threading.Lock()  # held while a command is journaled and handed to the executor
        self._closed = False

    def close(self) -> None:
        """Take no more commands (the daemon is stopping): later ones are rejected with STOPPING. Returns once no
        command is between its journal entry and the executor, so the executor may be shut down after it and a
        command never gets `accepted` and then a second terminal status."""
        with self._intake:
            self._closed = True

    def handle(self, payload: bytes) -> None:
        """One cmd/req message. Never raises: a bad request is a rejection, not a crash."""
        try:
            self._handle(payload)
        except Exception as e:  # a bug here must still answer, and must not reach the MQTT thread
            log.exception("cmd/req handling failed")
            self._respond(None, {"id": None, "status": "rejected", "reason": f"internal error: {type(e).__name__}",
                                 "request_sha256": hashlib.sha256(payload).hexdigest(), "ts": time.time()})

    def _handle(self, payload: bytes) -> None:
        now = time.time()
        cid, op, cmd, reason = parse(payload, now)
        if cid is None:
            digest = hashlib.sha256(payload).hexdigest()
            log.warning("rejected cmd/req (%d bytes, sha256 %s): %s", len(payload), digest[:16], reason)
            self._respond(None, {"id": None, "status": "rejected", "reason": bounded(reason), "request_sha256": digest,
                                 "ts": now})
            return
        known = self.journal.response(cid)
        if known is not None:
            log.info("duplicate command %s: re-sending its recorded state %s", cid, known["status"])
            self._respond(cid, known)
            return
        if cmd is not None:
            reason = self._checked(cmd)
        if cmd is None or reason:
            log.warning("rejected command %s: %s", cid, reason)
            self._record(cid, op, cmd.args if cmd else None, ORIGIN_FLEET, "rejected", reason)
            return
        self._start(cmd)

    def local(self, op: str, args: dict, origin: str, note: str | None = None) -> Command:
        """A command from the control socket or a firmware hook: a generated id, the same checks and journal."""
        cid = f"{origin}-{uuid.uuid4().hex[:12]}"
        try:
            cmd = Command(cid, op, check_args(op, args), origin)
        except Rejected as e:
            cmd, reason = Command(cid, op, args, origin), str(e)
        else:
            reason = self._checked(cmd)
        if reason:
            self._record(cid, op, args, origin, "rejected", reason)
            raise BadInput(bounded(reason))
        if not self._start(cmd, note):
            raise Stopping(f"the daemon is {STOPPING}")
        return cmd

    def _checked(self, cmd: Command) -> str | None:
        try:
            self._check(cmd)
        except BadInput as e:
            return f"bad args: {e}"
        return None

    def _start(self, cmd: Command, note: str | None = None) -> bool:
        """Journal `cmd` as accepted and hand it to the executor; False when the daemon is stopping (then it is
        journaled as rejected)."""
        with self._intake:
            if self._closed:
                log.warning("rejected command %s: the daemon is stopping", cmd.id)
                self._record(cmd.id, cmd.op, cmd.args, cmd.origin, "rejected", STOPPING, note)
                return False
            if self._record(cmd.id, cmd.op, cmd.args, cmd.origin, "accepted", None, note):
                self._execute(cmd)
        return True

    def _record(self, cid: str, op: str | None, args: dict | None, origin: str, status: str, reason: str | None,
                note: str | None = None) -> bool:
        doc = self._doc(cid, op, origin, status, 0.0 if status == "accepted" else None, bounded(reason), None,
                        note=note)
        if not self.journal.insert(cid, op, args, origin, doc):
            return False
        self._emit(cid, doc)
        return True

    @staticmethod
    def _doc(cid: str, op: str | None, origin: str, status: str, progress: float | None, reason: str | None,
             result: Any, message: str | None = None, note: str | None = None) -> dict:
        """`note`: why the device started a command of its own (e.g. a firmware change), on every state, since the
        outbox may replace a state that is not final with the next one before it is sent."""
        return {"id": cid, "op": op, "origin": origin, "status": status, "progress": progress, "reason": reason,
                "result": result, "message": message, "note": note, "ts": time.time()}

    def update(self, cmd_id: str, status: str, *, progress: float | None = None, reason: str | None = None,
               result: Any = None, message: str | None = None) -> None:
        prev = self.journal.response(cmd_id) or {}
        if prev.get("status") in TERMINAL:
            return  # a finished command stays finished (e.g. a late progress tick)
        if status in TERMINAL:
            progress = 1.0 if status == "succeeded" else prev.get("progress")
        doc = self._doc(cmd_id, prev.get("op"), prev.get("origin", ORIGIN_FLEET), status, progress, bounded(reason),
                        result, message, prev.get("note"))
        self.journal.update(cmd_id, doc)
        self._emit(cmd_id, doc)

    def _emit(self, cmd_id: str, doc: dict) -> None:
        self._respond(cmd_id, doc)
        with self._lock:
            watchers = list(self._watchers.get(cmd_id, ()))
        for w in watchers:
            w(doc)

    def watch(self, cmd_id: str, fn: Callable[[dict], None]) -> Callable[[], None]:
        """Call fn on every new state of a command (for `retune --wait`); returns the unwatch function."""
        with self._lock:
            self._watchers.setdefault(cmd_id, []).append(fn)

        def unwatch() -> None:
            with self._lock:
                self._watchers.get(cmd_id, []).remove(fn)
                if not self._watchers.get(cmd_id):
                    self._watchers.pop(cmd_id, None)

        return unwatch

    def interrupted(self) -> list[Command]:
        """At start: what the last run left open is reported failed with reason `interrupted`."""
        cmds = [Command(*row) for row in self.journal.in_status(OPEN)]
        for c in cmds:
            log.warning("command %s (%s) was interrupted by the last stop", c.id, c.op)
            self.update(c.id, "failed", reason="interrupted")
        return cmds
