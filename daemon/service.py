"""`edgetune daemon`: keep this device's kernels tuned for its hardware, firmware and model, and report it.

Threads: main (signals, telemetry, watchdog, reload), mqtt (daemon.mqtt.Link), tuner (daemon.scheduler),
control (the local socket), ops (short commands: probe, report, ping), model (daemon.model_update: the fleet's
signed tuner-model releases). Every result goes to the results DB
first and to the broker through the outbox, so neither a broker outage nor a crash loses one.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from edgetune import config as config_mod
from daemon import firmware, records, sdnotify, targets
from daemon.commands import JOURNAL_KEEP_S, TERMINAL, Command, Commands
from edgetune.config import Config
from daemon.control import ControlServer
from daemon.info import info_doc, model_info
from daemon.model_update import Updater
from daemon.mqtt import Link
from daemon.outbox import Outbox
from daemon.publisher import Publisher, status_doc
from daemon.scheduler import Job, Outcome, Scheduler, load_per_core
from daemon.store import DaemonStore, Journal, checked, rederivable, results_db
from daemon.telemetry import Telemetry
from edgetune import __version__
from edgetune.broker import CONNECT_TIMEOUT_S
from edgetune.errors import BadInput, EdgetuneError
from edgetune.protocol import (
    ORIGIN_FIRMWARE_HOOK, ORIGIN_FLEET, ORIGIN_LOCAL, PAUSED, SESSION_COMMAND, SESSION_DAEMON, SESSION_FIRMWARE_HOOK,
    TERMINAL_STATES, Topics, encode,
)
from edgetune.sqlite import DBError, DBFull
from edgetune.wakeup import Wakeup
from hwprobe import probe
from tuner.db import ResultsDB
from tuner.model import slots

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 10.0  # at stop: how long to let the broker acknowledge what is queued
DISK_RETRY_S = 5.0  # while paused on a full disk: how often to try again
# what one fleet command may cost a device: custom-shape buffers, and tuning time per workload (the evals budget
# alone allows 100000 evals of anything)
COMMAND_MAX_INPUT_MB = 64.0
COMMAND_MAX_S = 1800.0
PROGRESS_EVERY_S = 0.5  # in_progress responses per command, at most this often


class Daemon:
    def __init__(self, cfg: Config, config_path: str | None):
        self.cfg, self.config_path = cfg, config_path
        self._wake = Wakeup()  # set by the signal handlers: an Event there can deadlock the main loop
        self._halt = threading.Event()  # set by _shutdown: ends the other threads' waits for disk space
        self._marker_lock = threading.Lock()  # the firmware marker: written by commands, cleared by the tuner
        self._stop = False
        self._reload = False
        self._ready = False
        self._local = threading.local()
        self._t0 = time.monotonic()
        self._progress_at = 0.0
        self.link: Link | None = None
        self.scheduler: Scheduler | None = None
        self.commands: Commands | None = None
        self.ops: ThreadPoolExecutor | None = None
        self.publisher: Publisher | None = None
        self.control: ControlServer | None = None
        self.updater: Updater | None = None
        self.paused: str | None = None  # why telemetry and tuning wait (a full disk), or None

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        self.control = ControlServer(self._control)  # first: `edgetune status` answers while we start
        self.control.start()
        try:
            if self._startup():
                self._loop()
        finally:
            self._shutdown()
        return 0

    def _on_stop(self, *_: Any) -> None:
        self._stop = True
        self._wake.set()

    def _on_hup(self, *_: Any) -> None:
        self._reload = True
        self._wake.set()

    def db(self) -> ResultsDB:
        """This thread's results DB connection (sqlite3 connections must stay in their thread)."""
        if not hasattr(self._local, "db"):
            self._local.db = results_db()
        return self._local.db

    def _startup(self) -> bool:
        """False when told to stop while waiting for disk space."""
        sdnotify.notify(STATUS="starting: probing the hardware")
        self.hw = probe(isa_cap=self.cfg.isa or None, measure_bandwidth=True)
        repaired = slots.repair()  # before anything loads the committed model
        if repaired:
            log.error("tuner model: %s", repaired)
        self.model = model_info()
        self.pairs = self._configured()
        if not self._until_space(self._open_state):
            return False
        self._start_link()
        if self.updater:
            self.updater.start()
        self._ready = True
        sdnotify.notify(READY=1, STATUS=self._status_line())
        self.scheduler.start()
        return self._until_space(self._first_plan)

    def _until_space(self, step: Callable[[], None]) -> bool:
        """Run `step`, and while the disk is full, stay paused (status says why) and retry; False on stop."""
        while not self._stop:
            try:
                step()
            except DBFull as e:
                self._pause(str(e))
                self._still_starting()
                self._wake.wait(DISK_RETRY_S)
                self._wake.clear()
                continue
            self._resume()
            return True
        return False

    def _tuner_step(self, step: Callable[[], None]) -> bool:
        """A scheduler event's writes (journal, outbox) on the tuner thread: on a full disk the daemon pauses and the
        tuner waits here, its job held, until there is space again; False when the daemon stops meanwhile (its
        open commands are then reported interrupted at the next start). Tried at least once, also while stopping:
        a stop's own `interrupted` goes this way. Without this a DBFull killed the tuner thread for good."""
        while True:
            try:
                step()
            except DBFull as e:
                self._pause(str(e))
                if self._halt.wait(DISK_RETRY_S):
                    return False
                continue
            self._resume()
            return True

    def _still_starting(self) -> None:
        """Paused before READY: the start would otherwise hit the unit's TimeoutStartSec, and Restart=on-failure
        would loop on a full disk. Each retry extends the start timeout past the next one, and keeps the watchdog
        fed where systemd already counts it."""
        if not self._ready:
            sdnotify.notify(EXTEND_TIMEOUT_USEC=int(3 * DISK_RETRY_S * 1e6),
                            **({"WATCHDOG": 1} if sdnotify.watchdog_interval() else {}))

    def _pause(self, why: str) -> None:
        if self.paused is None:
            log.error("paused: %s; telemetry and tuning wait until there is space again", why)
        self.paused = why
        if self.scheduler:
            self.scheduler.pause(True)
        sdnotify.notify(STATUS=f"paused: {why}")

    def _resume(self) -> None:
        if self.paused is not None:
            log.warning("disk space is back: resuming telemetry and tuning")
            self.paused = None
            if self.scheduler:
                self.scheduler.pause(False)

    def _open_state(self) -> None:
        """The DBs and what the last run left open. daemon.db and outbox.db are re-derivable: a corrupt one is
        moved aside and started afresh. The results DB is training data: a corrupt one stops the daemon, with the
        fix (`edgetune daemon --reset`) in the message. Repeatable: the disk-full retry runs it again."""
        checked(self.db())
        self.active_doc = self.db().active_document()
        if getattr(self, "store", None) is None:
            self.store = rederivable(DaemonStore, DaemonStore.reseed)
        self.session = self.store.next_session()
        if getattr(self, "outbox", None) is None:
            self.outbox = rederivable(lambda: Outbox(max_bytes=self.cfg.outbox.max_bytes,
                                                     max_age_s=self.cfg.outbox.max_age_s,
                                                     resend_s=self.cfg.outbox.resend_s))
        self.journal = Journal(self.store)
        self.telemetry = Telemetry(self.store.next_seq, self.store.get("epoch"))
        self.publisher = Publisher(self.outbox, Topics(self.cfg.device_id), broker=bool(self.cfg.mqtt.host),
                                   fleet_ack=self.cfg.outbox.fleet_ack)
        self.commands = Commands(self.journal, self.publisher.response, self._check, self._execute)
        self.scheduler = Scheduler(self.hw, self, self.cfg.idle_load_threshold)
        self.ops = ThreadPoolExecutor(1, thread_name_prefix="ops")
        if self.cfg.model_update.enabled and self.updater is None:
            self.updater = Updater(self.cfg.model_update, self.store, self.publisher.model_state, self.hw,
                                   lambda: self.pairs, self._model_committed, self._request_chunks)
        log.info("edgetune daemon %s: device %s, session %d, hw %s, fw %s, %d workload(s) configured", __version__,
                 self.cfg.device_id, self.session, self.hw.hw_fingerprint, self.hw.fw_fingerprint, len(self.pairs))
        self.journal.prune(TERMINAL, JOURNAL_KEEP_S)
        self.commands.interrupted()
        records.sweep(self.db(), self.store, self.publisher, self.cfg.device_id, self.hw, self.model)

    def _configured(self) -> list[targets.Pair]:
        try:
            return targets.configured(self.cfg.tuning.workloads)
        except BadInput as e:  # a workloads file broke after the config was checked: tune nothing, say why
            log.error("workloads: %s", e)
            return []

    def _start_link(self) -> None:
        if not self.cfg.mqtt.host:
            log.info("no broker configured: tuning locally, records kept for a broker added later")
            return
        topics = self.publisher.topics
        self.link = Link(self.cfg.mqtt, topics, self.outbox,
                         will=lambda: encode(status_doc("lost", self.session)),
                         on_connected=self._connected, on_command=self.commands.handle,
                         on_release=self.updater.offer if self.updater else None,
                         on_chunk=self.updater.chunk if self.updater else None)
        self.publisher.wake = self.link.wake
        self.link.start()
        self.link.attempted.wait(CONNECT_TIMEOUT_S + 1)

    def _request_chunks(self, payload: bytes) -> None:
        """A model/chunk/req of the updater: sent now, not through the outbox (a stale request is worth nothing;
        the updater asks again when the chunks do not come)."""
        if self.link is not None:
            self.link.send_now(self.publisher.topics.model_chunk_req, payload)

    def _connected(self) -> None:
        """Every (re)connect: status online, and the retained documents afresh (the broker may have lost them)."""
        self.publisher.status("online", self.session)
        self.publisher.info(self._info())
        self.publisher.config_active(self.active_doc)
        state = self.updater.state() if self.updater else None
        if state:
            self.publisher.model_state(state)

    def _info(self) -> dict:
        return info_doc(self.cfg.device_id, self.hw, self.model, self.cfg.tuning, self.pairs) | {
            "model_update": self._model_update()}

    def _model_update(self) -> dict | None:
        """`info`'s model_update: where the model in use came from (`release`: the committed release's version,
        null for the bundled model), the `previous` one kept for a rollback, and the last model/state."""
        if not self.updater:
            return None
        ptr = self.updater.pointer()
        cur, prev = ptr["current"] or {}, ptr["previous"]
        return {"release": cur.get("version"), "slot": cur.get("slot"), "rollout_id": cur.get("rollout_id"),
                "previous": {k: prev.get(k) for k in ("name", "version", "sha256")} if prev else None,
                "state": self.updater.state()}

    def _model_committed(self, better: list[str]) -> None:
        """A new model is current (the model thread): results now name it, `info` says so, and the workloads it
        measured better on are retuned with it (forced: the model is not part of a result's key)."""
        self.model = model_info()
        self.publisher.info(self._info())
        chosen = [targets.Target(s, w, force=True) for s, w in self.pairs if f"{s.name}/{w.name}" in better]
        if chosen:
            log.info("retuning %d workload(s) with the new model: %s", len(chosen), ", ".join(better))
            self.scheduler.submit(Job({t.name: t for t in chosen}, self.cfg.tuning.strategy, self.cfg.tuning.budget,
                                      SESSION_DAEMON, wait_idle=True, objective=self.cfg.tuning.objective,
                                      power=self.cfg.power))

    def _first_plan(self) -> None:
        """A firmware change (marker from an update hook or from a firmware retune a stop interrupted, or a new
        fw_fingerprint) retunes everything; otherwise only what has no current result is tuned, in the
        background. The fingerprint is stored after the retune was queued, which left the marker for it."""
        prev_fw = self.store.get("fw_fingerprint")
        marker = firmware.read_marker()
        if marker or (prev_fw and prev_fw != self.hw.fw_fingerprint):
            self._firmware_changed(str((marker or {}).get("source", "fw_fingerprint")))
        else:
            self._plan()
        self.store.set("fw_fingerprint", self.hw.fw_fingerprint)

    def _plan(self) -> None:
        todo = targets.plan(self.db(), self.hw, self.model, self.pairs)
        for t, why in todo:
            log.info("needs tuning: %s (%s)", t.name, why)
        if todo:
            self.scheduler.submit(Job({t.name: t for t, _ in todo}, self.cfg.tuning.strategy,
                                      self.cfg.tuning.budget, SESSION_DAEMON, wait_idle=True,
                                      objective=self.cfg.tuning.objective, power=self.cfg.power))

    def _firmware_changed(self, source: str) -> Command | None:
        """Retune everything, forced. The old configs stay active until new ones are measured (the tuner replaces
        an entry only when its session finishes). The marker, naming the command, stays until that retune
        finished (see _firmware_settled): a stop before that retunes again at the next start."""
        log.info("firmware changed (%s): retuning every workload", source)
        with self._marker_lock:
            try:
                cmd = self.commands.local("retune", {"force": True}, ORIGIN_FIRMWARE_HOOK,
                                          note=f"firmware changed ({source})")
            except BadInput as e:  # nothing configured to tune: journaled as rejected, nothing else to do
                log.error("firmware retune: %s", e)
                firmware.clear_marker()
                return None
            try:
                firmware.write_marker(source, command=cmd.id)
            except EdgetuneError as e:  # it still runs; only a stop before it finishes would lose it
                log.error("firmware retune %s: %s", cmd.id, e)
        return cmd

    def _firmware_settled(self, finished: list[str]) -> None:
        """Commands `finished` ran to their end (not interrupted): if the marker names one of them, the firmware
        retune it stood for is done. A marker naming no command (an update hook's, for the next boot) or a newer
        retune stays."""
        with self._marker_lock:
            marker = firmware.read_marker()
            if marker and marker.get("command") in finished:
                firmware.clear_marker()

    def _loop(self) -> None:
        watchdog = sdnotify.watchdog_interval()
        next_tel = time.monotonic() + self.cfg.telemetry_interval_s
        next_wd = time.monotonic()
        while not self._stop:
            now = time.monotonic()
            if self._reload:
                self._reload = False
                self._reload_config()
                next_tel = min(next_tel, now + self.cfg.telemetry_interval_s)
            if now >= next_tel:
                self._telemetry()
                interval = min(self.cfg.telemetry_interval_s, DISK_RETRY_S) if self.paused else \
                    self.cfg.telemetry_interval_s
                next_tel = max(next_tel + interval, now)
            if watchdog and now >= next_wd:
                if self._healthy():
                    sdnotify.notify(WATCHDOG=1)
                next_wd = now + watchdog
            wait = min(next_tel, next_wd if watchdog else next_tel) - time.monotonic()
            self._wake.wait(max(0.0, wait))
            self._wake.clear()

    def _telemetry(self) -> None:
        """One sample; on a full disk it is lost (a gap in seq the fleet counts) and the daemon pauses; the next
        sample that is stored resumes it."""
        try:
            self.publisher.telemetry(self.telemetry.sample(self.state))
        except DBFull as e:
            self._pause(str(e))
            return
        self._resume()
        sdnotify.notify(STATUS=self._status_line())

    def _healthy(self) -> bool:
        """No watchdog ping if a worker thread died: systemd then restarts a daemon that stopped working."""
        dead = [n for n, t in (("tuner", self.scheduler), ("mqtt", self.link), ("control", self.control),
                               ("model", self.updater))
                if t is not None and not t.alive()]
        if dead:
            log.error("thread(s) died: %s; withholding the watchdog ping", ", ".join(dead))
        return not dead

    def _shutdown(self) -> None:
        """Commands first: one that arrives from here on is rejected (`stopping`), never accepted into an executor
        that is going away; then the tuner, the ops, the model updater and the broker link."""
        self._stop = True
        self._halt.set()
        sdnotify.notify(STOPPING=1, STATUS="stopping")
        if self.commands:
            self.commands.close()
        if self.scheduler:
            for job in self.scheduler.stop():
                self._update_all(job.command_ids, "failed", reason="interrupted")
        if self.ops:
            self.ops.shutdown(wait=True)
        if self.updater:
            self.updater.stop()  # a download or health check in progress resumes at the next start
        if self.publisher:
            try:
                self.publisher.status("offline", self.session)
            except DBError as e:  # e.g. still no space: the will (`lost`) then speaks for us
                log.warning("could not queue status offline: %s", e)
        if self.link:
            if not self.link.flush(FLUSH_TIMEOUT_S):
                log.warning("stopping with %d message(s) still queued; they go out after the next start",
                            self.outbox.depth()[0])
            self.link.stop()
        if self.control:
            self.control.stop()
        log.info("stopped")

    @property
    def state(self) -> str:
        if self._stop:
            return "stopping"
        if self.paused:
            return PAUSED
        if not self._ready:
            return "starting"
        return self.scheduler.state

    def _status_line(self) -> str:
        snap = self.scheduler.snapshot() if self.scheduler else {"state": self.state, "job": None}
        job = snap["job"]
        broker = "no broker" if not self.link else ("connected" if self.link.connected else "disconnected")
        if job and snap["state"] == "waiting-idle":
            doing = (f"waiting for idle before tuning: load1 per core {load_per_core():.2f}, under "
                     f"{self.scheduler.idle_threshold:g} needed (idle_load_threshold)")
        else:
            doing = f"{job['message'] or 'tuning'} ({job['progress']:.0%})" if job else self.state
        return f"{doing}; broker {broker}; outbox {self.outbox.depth()[0]}"

    # ---- config reload (SIGHUP) ----------------------------------------------------------------------------

    def _reload_config(self) -> None:
        loaded = config_mod.load(self.config_path)
        if loaded.problems:
            for p in loaded.problems:
                log.error("config reload: %s", p)
            log.error("config reload refused: keeping the running config")
            return
        old, new = self.cfg, loaded.config
        self.cfg = new
        self.outbox.max_bytes, self.outbox.max_age_s = new.outbox.max_bytes, new.outbox.max_age_s
        self.outbox.resend_s, self.publisher.fleet_ack = new.outbox.resend_s, new.outbox.fleet_ack
        self.scheduler.idle_threshold = new.idle_load_threshold
        if self.updater:
            self.updater.cfg = new.model_update
        self.pairs = self._configured()
        if new.mqtt != old.mqtt or new.device_id != old.device_id:
            log.info("config reload: broker settings changed, reconnecting")
            if self.link:
                self.publisher.status("offline", self.session)
                self.link.flush(FLUSH_TIMEOUT_S)
                self.link.stop()
                self.link = None
            self.publisher.topics = Topics(new.device_id)
            self.publisher.broker = bool(new.mqtt.host)
            self._start_link()
        else:
            self.publisher.info(self._info())
        log.info("config reloaded from %s", ", ".join(loaded.files) or "defaults")
        self._plan()

    # ---- commands ------------------------------------------------------------------------------------------

    def _check(self, cmd: Command) -> None:
        if cmd.op == "retune":
            pairs = targets.select(self.pairs, cmd.args.get("kernels"), cmd.args.get("workloads"))
            if cmd.origin == ORIGIN_FLEET:
                for spec, wl in pairs:
                    mb = spec.bytes_moved(wl.shape) / 1e6
                    if wl.source == "custom shape" and mb > COMMAND_MAX_INPUT_MB:
                        raise BadInput(f"{spec.name}/{wl.name} needs about {mb:,.0f} MB of buffers; a fleet "
                                       f"command may ask for custom shapes up to {COMMAND_MAX_INPUT_MB:.0f} MB")

    def _execute(self, cmd: Command) -> None:
        if cmd.op != "retune":
            self.ops.submit(self._run_op, cmd)
            return
        a = cmd.args
        pairs = targets.select(self.pairs, a.get("kernels"), a.get("workloads"))
        ts = [targets.Target(s, w, force=bool(a.get("force"))) for s, w in pairs]
        firmware_hook = cmd.origin == ORIGIN_FIRMWARE_HOOK
        self.scheduler.submit(Job({t.name: t for t in ts}, a.get("strategy", self.cfg.tuning.strategy),
                                  a.get("budget", self.cfg.tuning.budget),
                                  SESSION_FIRMWARE_HOOK if firmware_hook else SESSION_COMMAND,
                                  [cmd.id], wait_idle=firmware_hook, objective=self.cfg.tuning.objective,
                                  power=self.cfg.power, max_s=COMMAND_MAX_S if cmd.origin == ORIGIN_FLEET else None))

    def _run_op(self, cmd: Command) -> None:
        try:
            if cmd.op == "ping":
                result = {"pong": True, "version": __version__, "session": self.session, "state": self.state}
            elif cmd.op == "probe":
                result = self._reprobe()
            else:  # report
                self.active_doc = self.db().active_document()
                self.publisher.config_active(self.active_doc)
                result = {"config_active": self.active_doc, "last_tune": self._last_tune()}
        except Exception as e:
            log.exception("command %s (%s) failed", cmd.id, cmd.op)
            self.commands.update(cmd.id, "failed", reason=f"{type(e).__name__}: {e}")
            return
        self.commands.update(cmd.id, "succeeded", result=result)

    def _reprobe(self) -> dict:
        """Probe again and republish info; a new fw_fingerprint is a firmware change."""
        hw = probe(isa_cap=self.cfg.isa or None, measure_bandwidth=True)
        old_fw, self.hw = self.hw.fw_fingerprint, hw
        self.scheduler.hw = hw
        self.publisher.info(self._info())
        changed = hw.fw_fingerprint != old_fw
        if changed:
            self.store.set("fw_fingerprint", hw.fw_fingerprint)
            self._firmware_changed("probe")
        return {"hw_fingerprint": hw.hw_fingerprint, "fw_fingerprint": hw.fw_fingerprint, "fw_changed": changed}

    # ---- scheduler events (tuner thread) -------------------------------------------------------------------

    def job_started(self, job: Job) -> None:
        log.info("tuning %d workload(s) (%s)", len(job.targets), job.origin)
        self._tuner_step(lambda: self._update_all(job.command_ids, "in_progress", progress=0.0,
                                                  message=f"tuning {len(job.targets)} workload(s)"))
        sdnotify.notify(STATUS=self._status_line())

    def waiting_idle(self, job: Job) -> None:
        sdnotify.notify(STATUS=self._status_line())  # `systemctl status` says why nothing runs yet

    def job_progress(self, job: Job, fraction: float, message: str) -> None:
        now = time.monotonic()
        if now - self._progress_at < PROGRESS_EVERY_S:
            return
        self._progress_at = now
        self._tuner_step(lambda: self._update_all(job.command_ids, "in_progress", progress=round(fraction, 4),
                                                  message=message))

    def tuned(self, db: ResultsDB, target: targets.Target, result: dict | None) -> None:
        def publish() -> None:
            self.active_doc = db.active_document()
            self.publisher.config_active(self.active_doc)
            records.sweep(db, self.store, self.publisher, self.cfg.device_id, self.hw, self.model)

        self._tuner_step(publish)

    def job_finished(self, job: Job, outcome: Outcome) -> None:
        if outcome.interrupted:
            final = {"status": "failed", "reason": "interrupted", "result": {"tuned": outcome.tuned}}
        elif outcome.failed:
            final = {"status": "failed", "reason": f"{len(outcome.failed)} of {len(job.targets)} workload(s) "
                     f"failed: {outcome.failed[0]['reason']}", "result": {"tuned": outcome.tuned,
                                                                           "failed": outcome.failed}}
        else:
            final = {"status": "succeeded", "result": {"tuned": outcome.tuned}}
        if self._tuner_step(lambda: self._update_all(job.command_ids, **final)) and not outcome.interrupted:
            self._firmware_settled(job.command_ids)
        sdnotify.notify(STATUS=self._status_line())

    def _update_all(self, command_ids: list[str], status: str, **kw: Any) -> None:
        """The same new state for each command of a job (repeatable: a terminal status is never overwritten)."""
        for cid in command_ids:
            self.commands.update(cid, status, **kw)

    # ---- local control -------------------------------------------------------------------------------------

    def _last_tune(self) -> dict | None:
        kernels = self.active_doc.get("kernels", {})
        if not kernels:
            return None
        name, e = max(kernels.items(), key=lambda kv: kv[1].get("tuned_at") or 0)
        return {"target": name, **{k: e.get(k) for k in ("tuned_at", "ms", "default_ms", "speedup", "evals",
                                                           "strategy", "session_id")}}

    def status(self) -> dict:
        sched = self.scheduler.snapshot() if self.scheduler else {"job": None, "queue": None}
        out: dict[str, Any] = {"ok": True, "pid": os.getpid(), "version": __version__,
                               "device_id": self.cfg.device_id, "state": self.state, "paused": self.paused,
                               "uptime_s": round(time.monotonic() - self._t0, 1)}
        if self._ready:
            count, size = self.outbox.depth()
            out |= {"session": self.session, "job": sched["job"], "queue": sched["queue"],
                    "broker": self.link.snapshot() if self.link else {"configured": False},
                    "outbox": {"messages": count, "bytes": size, "dropped": self.outbox.dropped,
                               "awaiting_fleet_ack": self.outbox.awaiting_fleet(),
                               "coalesced": self.outbox.coalesced},
                    "last_tune": self._last_tune(), "workloads": len(self.pairs),
                    "model": self.model, "model_update": self._model_update()}
        return out

    def _control(self, req: dict, send: Any) -> None:
        op = req.get("op")
        if op == "ping":
            send({"ok": True, "pong": True, "version": __version__, "state": self.state})
        elif op == "status":
            send(self.status())
        elif not self._ready or self._stop:
            send({"ok": False, "error": f"the daemon is {self.state}; try again in a moment", "exit": 1})
        elif op == "retune":
            self._control_retune(req, send)
        elif op == "notify" and req.get("event") == "firmware-changed":
            cmd = self._firmware_changed(str(req.get("source", "unknown")))
            send({"ok": True, "id": cmd.id if cmd else None})
        else:
            send({"ok": False, "error": f"unknown request {str(op)[:40]!r}", "exit": 2})

    def _control_retune(self, req: dict, send: Any) -> None:
        # `is not`: a budget of 0 must reach the command's validation (0 == False would drop it unchecked)
        args = {k: req[k] for k in ("kernels", "workloads", "strategy", "budget", "force")
                if req.get(k) is not None and req.get(k) is not False}
        try:
            cmd = self.commands.local("retune", args, ORIGIN_LOCAL)
        except EdgetuneError as e:  # bad input, or the daemon is stopping
            send({"ok": False, "error": str(e), "exit": e.exit_code})
            return
        if not req.get("wait"):
            send({"ok": True, **self.journal.response(cmd.id)})
            return
        updates: queue.Queue[dict] = queue.Queue()
        unwatch = self.commands.watch(cmd.id, updates.put)
        try:
            doc = self.journal.response(cmd.id)
            while True:
                send({"ok": True, **doc})
                if doc["status"] in TERMINAL_STATES:
                    return
                doc = updates.get()
        finally:
            unwatch()
