"""`edgetune fleet listen`: subscribe to every device's topics and store what arrives in the fleet DB.

- Subscribes every device's topics that it stores (`edgetune/v1/+/status`, `…/+/cmd/res/+`, …: fleet.ingest
  .subscriptions; not `+/#`, which would bring every model chunk too, and which a session resumed from an older
  receiver has dropped on connect) at QoS 1 on a persistent session under a
  fixed client id (`edgetune-fleet-<hostname>`), so the broker queues messages while the listener is down. With a
  share group it subscribes `$share/<group>/edgetune/v1/+/…` instead (MQTT 5 shared subscriptions): the broker
  hands each message to one of the receivers in the group, which then write to one PostgreSQL (each needs its own
  client id). mosquitto keeps dealing a share to a member that is away (its persistent session queues it), so
  what a killed receiver was sent waits for it to come back: restart it promptly. The retained messages (every
  device's status, info, config/active) come with a new subscription only, not again on each reconnect of a
  resumed session (MQTT 5 Retain Handling 1): a receiver restarted beside a large fleet would otherwise re-store
  them all before its backlog. A new fleet DB under an old session therefore gets no retained state: give it a
  new client id.
- Two threads: the broker client's only enqueues what arrives; a writer takes what is queued (up to BATCH_MAX,
  waiting at most BATCH_LINGER_S for more, so a lone message is not held up), stores it (fleet.ingest.ingest_batch:
  the telemetry in one transaction, the rest in small ones), and then hands the acknowledgements back to the
  client's thread: the protocol acks, then a manual PUBACK of exactly those messages, on the connection they came
  on. Nothing is acknowledged before its transaction committed.
- Flow control: the listener asks the broker (MQTT 5 Receive Maximum) for at most RECEIVE_MAXIMUM unacknowledged
  messages, which is what a batch can grow to while the previous one commits (a client that does not ask gets the
  broker's own limit: mosquitto's max_inflight_messages, 20 by default, which mosquitto 2.0.11 keeps strictly
  only until acknowledgements flow). The queue holds at most QUEUE_MAX; when it is full (a broker that ignores
  the limit, MQTT 3.1.1) the client stops reading until the writer catches up.
- When the DB cannot be written (disk full, locked, unreachable, damaged pages: any DBError, which is never a
  payload's fault), it stops acknowledging, raises the alarm (`alarm` holds the error, `counts["retry"]` counts
  the failures; the log says it once, reminds at most once a minute while it lasts and says when it is over:
  fleet.downlog), drops what is queued, reconnects after a backoff of at most DB_BACKOFF_MAX_S and gets the
  unacknowledged messages again; the first write that works afterwards (a batch stored, or commands expired) clears
  the alarm.
- A malformed payload is logged, noted in the `malformed` table, acknowledged and skipped: it never stops the
  listener.
- End-to-end delivery: after committing a tuning record or a final command response it publishes the protocol
  `ack` to the device, which keeps those in its outbox until then. Every receiver that committed a message acks it
  itself, so N receivers on one shared subscription need no coordination, and a duplicate (already stored) is
  acked again, since the device resends when an ack was lost.
- Commands whose expires_at passed with no final answer are marked `expired` (checked every EXPIRE_EVERY_S).
- The shared broker client (edgetune.broker) reconnects with backoff and jitter capped at RECONNECT_MAX_S (the
  broker's queue for us fills while we are away), resubscribes on every connect, speaks MQTT 5 and falls back to
  3.1.1 when the broker refuses 5.

`Listener(...).start()` runs it in its threads (tests); `run()` blocks until `request_stop()` (the CLI, with
signals).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Callable

from edgetune.broker import BrokerSettings, Client, Connection, Handler, Message, backoff
from edgetune.protocol import Topics, encode
from edgetune.sqlite import DBBusy, DBError
from edgetune.wakeup import Wakeup
from fleet.downlog import DownLog
from fleet.ingest import Outcome, ingest_batch, retired_subscriptions, subscriptions
from fleet.mqtt import hostname
from fleet.store import open_fleet_store

log = logging.getLogger("fleet.listener")

DEFAULT_SESSION_EXPIRY_S = 7 * 24 * 3600  # the broker keeps our queue this long while we are away
RECONNECT_MAX_S = 5.0  # reconnect backoff cap: every second away is queued at the broker, up to its limit
DB_BACKOFF_MAX_S = 5.0  # a DB that fails is retried at least this often
EXPIRE_EVERY_S = 10.0
RECEIVE_MAXIMUM = 2000  # unacknowledged messages the broker may have out to us (MQTT 5)
QUEUE_MAX = RECEIVE_MAXIMUM  # messages waiting for the writer before the client stops reading
BATCH_MAX = 1000  # messages per transaction
BATCH_LINGER_S = 0.005  # how long a batch waits for company once it has a message
TX_SAMPLES = 4096  # recent batch durations kept for `stats`


def default_client_id() -> str:
    return f"edgetune-fleet-{hostname()}"


@dataclasses.dataclass(frozen=True)
class _Received:
    conn: Connection  # the connection it came on: its PUBACK means nothing on another
    msg: Message


class Listener(Handler):
    def __init__(self, settings: BrokerSettings, db: Path | str | None = None, *, client_id: str | None = None,
                 session_expiry_s: int = DEFAULT_SESSION_EXPIRY_S, on_outcome: Callable[[Outcome], None] | None = None,
                 share: str | None = None):
        self.settings = dataclasses.replace(settings, reconnect_max_s=min(settings.reconnect_max_s, RECONNECT_MAX_S))
        self.store = open_fleet_store(db, threads=True)  # used only by the writer thread once started
        self.client_id = client_id or default_client_id()
        self.subscriptions = subscriptions(share or None)
        self.client = Client(self.settings, self.client_id, self, subscriptions=self.subscriptions,
                             session_expiry_s=session_expiry_s, manual_ack=True, receive_maximum=RECEIVE_MAXIMUM,
                             retained_on_resume=False, retired=retired_subscriptions(share or None),
                             name="fleet-listener")
        self.alarm: str | None = None  # the fleet DB's error while it cannot store; None when it works
        self.db_down = DownLog(f"the fleet DB {self.store.path}", "storing and acknowledging", log, alarm="ALARM ")
        self._expired_at = 0.0
        self.on_outcome = on_outcome
        self.counts: Counter[str] = Counter()
        self.connected = threading.Event()
        self.disconnected_since: float | None = time.time()  # since when not connected (None: connected)
        self.subscribed = threading.Event()
        self._cond = threading.Condition()  # guards counts
        self._stop = Wakeup()  # request_stop sets it from a signal handler
        self._queue: deque[_Received] = deque()
        self._queued = threading.Condition()  # guards _queue and _retry
        self._retry = False  # a DB write failed: take nothing more until the reconnect brings it all again
        self._tx_s: deque[float] = deque(maxlen=TX_SAMPLES)
        self._batch_max = 0
        self._writer = threading.Thread(target=self._write_loop, name="fleet-writer", daemon=True)

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> "Listener":
        log.info("fleet listener %s → %s, client id %s, db %s", self.settings.label, " ".join(self.subscriptions),
                 self.client_id, self.store.path)
        self._writer.start()
        self.client.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._halt(timeout):
            self.store.close()

    def _halt(self, timeout: float) -> bool:
        """The writer finishes its batch (what is still queued stays unacknowledged: the broker sends it again),
        then the client sends the acknowledgements handed to it and disconnects. False if a thread hung."""
        self._stop.set()
        with self._queued:
            self._queued.notify_all()
        if self._writer.is_alive():
            self._writer.join(timeout)
        self.client.stop(timeout)
        if self.client.alive() or self._writer.is_alive():
            log.warning("fleet listener threads did not stop within %.0f s", timeout)
            return False
        return True

    def request_stop(self) -> None:
        """Safe from a signal handler (edgetune.wakeup): `run` wakes and disconnects cleanly."""
        self._stop.set()

    @property
    def backlog(self) -> int:
        """Messages received and waiting for the writer (unacknowledged)."""
        return len(self._queue)

    @property
    def alive(self) -> bool:
        return self.client.alive() and self._writer.is_alive()

    def wait_for(self, predicate: Callable[[Counter], bool], timeout: float) -> bool:
        """Block until predicate(counts) holds, or timeout. Counts: messages, <kind>, <kind>:<detail> (e.g.
        record:duplicate), retry (DB writes that failed and will come again), acks (sent to devices), expired,
        subscribes (one per connect), batches (transactions that stored messages)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.counts), timeout)

    def run(self) -> None:
        """Until `request_stop` (the CLI, with signals); the store stays open for the caller's summary."""
        self.start()
        self._stop.wait()
        self._halt(10.0)
        log.info("fleet listener stopped: %s", dict(self.counts))

    def stats(self) -> dict:
        """Batches so far and the duration of recent ones (transactions through commit), for `fleet listen --json`."""
        tx = sorted(self._tx_s)
        at = lambda q: round(1000 * tx[min(len(tx) - 1, int(q * len(tx)))], 1) if tx else None  # noqa: E731
        batches = self.counts["batches"]
        per = round(self.counts["messages"] / batches, 1) if batches else None
        return {"batches": batches, "messages_per_batch": per,
                "batch_max": self._batch_max, "tx_ms_p50": at(0.5), "tx_ms_p99": at(0.99), "tx_ms_max": at(1.0)}

    # ---- the broker client's callbacks (its thread) --------------------------------------------------------

    def on_connect(self, conn: Connection, session_present: bool) -> None:
        with self._queued:
            self._retry = False
        self.disconnected_since = None
        self.connected.set()

    def on_subscribe(self, conn: Connection, error: str | None) -> None:
        if error:
            return  # the client logged it
        log.debug("subscribed to %s", " ".join(self.subscriptions))
        self._count(subscribes=1)
        self.subscribed.set()

    def on_disconnect(self) -> None:
        if self.connected.is_set():
            self.disconnected_since = time.time()
        self.connected.clear()
        self.subscribed.clear()

    def on_message(self, conn: Connection, msg: Message) -> None:
        with self._queued:
            if self._retry:
                return  # not acknowledged: the broker sends it again after the reconnect, in order
            self._queue.append(_Received(conn, msg))
            if len(self._queue) in (1, BATCH_MAX):  # the writer waits for a first message, or lingers for a batch
                self._queued.notify()

    def accepting(self) -> bool:
        return self.backlog < QUEUE_MAX

    def _acknowledge(self, batch: list[_Received], outcomes: list[Outcome], conn: Connection) -> None:
        """After the commit: the protocol acks, then the PUBACKs of the messages that came on this connection
        (the others will come again, and are stored once)."""
        acks = 0
        for r, out in zip(batch, outcomes):
            if out.ack and out.device:
                # before the PUBACK: if we die in between, the device's resend gets a duplicate, which is acked again
                acks += conn.publish(Topics(out.device).ack, encode({"keys": [out.ack], "ts": time.time()})) is not None
            if r.conn is conn:
                conn.ack(r.msg)
        if acks:
            self._count(acks=acks)

    # ---- the writer thread ---------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._write_once()
            except Exception:  # a bug must cost what was taken (unacknowledged, so it comes again), not the writer
                log.exception("the fleet writer failed; getting the unacknowledged messages again")
                self._retry_later("internal error in the writer")

    def _write_once(self) -> None:
        batch = self._take()
        if self._stop.is_set():
            return  # what was taken stays unacknowledged: the broker sends it again
        self._expire_due()
        if batch:
            self._store(batch)

    def _take(self) -> list[_Received]:
        """Up to BATCH_MAX queued messages: waits for the first (at most a second, for the periodic work), then at
        most BATCH_LINGER_S for more (woken early only by a full batch: a wake-up per message costs more CPU than
        storing it)."""
        with self._queued:
            if not self._queued.wait_for(lambda: self._queue or self._stop.is_set(), 1.0):
                return []
            if len(self._queue) < BATCH_MAX:
                self._queued.wait(BATCH_LINGER_S)
            full = len(self._queue) >= QUEUE_MAX
            batch = [self._queue.popleft() for _ in range(min(BATCH_MAX, len(self._queue)))]
        if full:
            self.client.wake()  # it stopped reading; there is room again
        return batch

    def _store(self, batch: list[_Received]) -> None:
        t0 = time.monotonic()
        messages = [(r.msg.topic, r.msg.payload, r.msg.retain) for r in batch]
        try:
            try:
                outcomes = ingest_batch(self.store, messages)
            except DBBusy as e:  # a deadlock the database broke, or a lock wait that timed out: once more, at once
                log.info("retrying a batch of %d: %s", len(batch), e)
                outcomes = ingest_batch(self.store, messages)
        except DBError as e:
            self._db_failed(e, f"storing {len(batch)} message(s)")
            return
        self._tx_s.append(time.monotonic() - t0)
        self._db_works()
        self.client.call_soon(lambda conn: self._acknowledge(batch, outcomes, conn))
        self._batch_max = max(self._batch_max, len(batch))
        counts = Counter(messages=len(batch), batches=1)
        for out in outcomes:
            counts[out.kind] += 1
            if out.detail:
                counts[f"{out.kind}:{out.detail}"] += 1
        self._count(**counts)
        if self.on_outcome is not None:
            for out in outcomes:
                try:
                    self.on_outcome(out)
                except Exception:
                    log.exception("on_outcome callback failed")

    def _expire_due(self) -> None:
        now = time.monotonic()
        if self._retry or now - self._expired_at < EXPIRE_EVERY_S:
            return
        self._expired_at = now
        try:
            n = self.store.expire_commands(time.time())
        except DBError as e:
            self._db_failed(e, "expiring commands")
            return
        if n:  # only a write that changed rows proves the DB works: on a full disk a no-op UPDATE still commits
            self._db_works()
            log.info("%d command(s) expired unanswered", n)
            self._count(expired=n)

    def _db_failed(self, e: DBError, doing: str) -> None:
        """Stop acknowledging, alarm, and reconnect after a backoff: the broker sends the unacknowledged again."""
        self.db_down.failed(f"{doing}: {e}")
        self.alarm = str(e)
        self._count(retry=1)
        self._retry_later(str(e))

    def _db_works(self) -> None:
        """A write committed: the alarm is over (and the log says so once)."""
        self.alarm = None
        self.db_down.ok()

    def _retry_later(self, why: str) -> None:
        """Drop what is queued (unacknowledged) and reconnect after a backoff, to be sent it all again."""
        with self._queued:
            self._retry = True
            self._queue.clear()
        log.debug("reconnecting to get the unacknowledged messages again: %s", why)
        self.client.drop(backoff(max(1, self.db_down.failures), self.settings.reconnect_min_s, DB_BACKOFF_MAX_S))

    def _count(self, **n: int) -> None:
        with self._cond:
            self.counts.update(n)
            self._cond.notify_all()
