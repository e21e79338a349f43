"""The tuning thread: one job at a time; later requests queue, coalesced into one pending job per settings
(strategy, budget, objective, power meter, time cap), so each request is tuned with its own.

Each workload is tuned in a child process (daemon.tunejob) so the daemon itself stays small. Background work (the
start-up plan, firmware retunes) waits until the machine is idle enough (load1 per core under the threshold),
also between workloads; commanded work runs at once, since someone asked for it. A stop sends the child SIGTERM:
it ends right after its in-flight measurement has been journaled, so the session stays `running` in the results
DB and resumes from its journal next time.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from daemon import tunejob
from daemon.store import results_db
from daemon.targets import Target
from edgetune.protocol import SESSION_COMMAND, SESSION_DAEMON, SESSION_FIRMWARE_HOOK
from hwprobe.power.config import PowerConfig
from tuner.db import ResultsDB

log = logging.getLogger(__name__)

IDLE_POLL_S = 30.0
ROOT = str(Path(__file__).resolve().parent.parent)
ORIGIN_RANK = (SESSION_DAEMON, SESSION_COMMAND, SESSION_FIRMWARE_HOOK)  # a merged job carries the weightiest origin


@dataclass
class Job:
    targets: dict[str, Target]  # by "kernel/workload", in order
    strategy: str
    budget: int
    origin: str  # one of ORIGIN_RANK: the session origin in the results DB
    command_ids: list[str] = field(default_factory=list)
    wait_idle: bool = False
    objective: str = "latency"
    power: PowerConfig = field(default_factory=PowerConfig)  # the [power] meter, for energy/edp objectives
    max_s: float | None = None  # a time cap per workload (fleet commands), on top of the evals budget

    def settings(self) -> tuple:
        """What a tune of this job is run with: only jobs with equal settings are merged, so a request never
        runs with another's budget, strategy or time cap."""
        return self.strategy, self.budget, self.objective, self.power, self.max_s

    def merge(self, later: "Job") -> None:
        """Coalesce a later request with the same settings: union of targets (force if either forces)."""
        for name, t in later.targets.items():
            old = self.targets.get(name)
            self.targets[name] = Target(t.spec, t.workload, force=t.force or bool(old and old.force))
        self.origin = max(self.origin, later.origin, key=ORIGIN_RANK.index)
        self.command_ids += later.command_ids
        self.wait_idle = self.wait_idle and later.wait_idle

    def describe(self) -> dict:
        return {"targets": list(self.targets), "origin": self.origin, "commands": self.command_ids,
                "strategy": self.strategy, "budget": self.budget}


@dataclass
class Outcome:
    tuned: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    interrupted: bool = False


class Events(Protocol):
    def job_started(self, job: Job) -> None: ...
    def job_progress(self, job: Job, fraction: float, message: str) -> None: ...
    def waiting_idle(self, job: Job) -> None: ...
    def tuned(self, db: ResultsDB, target: Target, result: dict | None) -> None: ...
    def job_finished(self, job: Job, outcome: Outcome) -> None: ...


def load_per_core() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


class Scheduler:
    def __init__(self, hw: Any, events: Events, idle_threshold: float):
        self.hw, self.events, self.idle_threshold = hw, events, idle_threshold
        self.state = "idle"  # idle | waiting-idle | tuning
        self._cond = threading.Condition()
        self._pending: list[Job] = []  # in order; at most one per settings
        self._current: Job | None = None
        self._progress: tuple[float, str] = (0.0, "")
        self._stopping = False
        self._paused = False
        self._child: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._run, name="tuner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        with self._cond:
            same = next((p for p in self._pending if p.settings() == job.settings()), None)
            if same:
                same.merge(job)
            else:
                self._pending.append(job)
            self._cond.notify_all()

    def stop(self) -> list[Job]:
        """Stop after the measurement in flight; returns the pending jobs that never started."""
        with self._cond:
            self._stopping = True
            if self._child:
                self._child.terminate()  # the child checkpoints after its measurement in flight
            self._cond.notify_all()
        if self._thread.ident is not None:  # never started (the start-up failed): nothing to join
            self._thread.join()
        with self._cond:
            left, self._pending = self._pending, []
        return left

    def pause(self, paused: bool) -> None:
        """Hold back the next workload (a full disk) until resumed; the one in flight finishes or fails."""
        with self._cond:
            self._paused = paused
            self._cond.notify_all()

    def snapshot(self) -> dict:
        with self._cond:
            cur, pend = self._current, self._pending
            return {"state": self.state,
                    "job": cur.describe() | {"progress": self._progress[0], "message": self._progress[1]}
                    if cur else None,
                    "queue": {"jobs": len(pend), "targets": sum(len(p.targets) for p in pend)}}

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._pending.pop(0)
                self._current, self._progress = job, (0.0, "")
            try:
                self._run_job(job)
            except Exception:  # an event handler's bug: this job's commands stay open, the thread lives on
                log.exception("tuning job %s: reporting it failed", ", ".join(job.targets))

    def _run_job(self, job: Job) -> None:
        """One job, start to finish. An unexpected error fails it with the reason, rather than ending the tuner
        thread with its commands left open for good."""
        self.events.job_started(job)
        try:
            outcome = self._tune(job)
        except Exception as e:
            log.exception("tuning job %s failed", ", ".join(job.targets))
            outcome = Outcome(failed=[{"target": ", ".join(job.targets),
                                       "reason": f"internal error: {type(e).__name__}: {e}"}])
        finally:
            with self._cond:
                self._current = None
                self.state = "idle"
        self.events.job_finished(job, outcome)

    def _idle(self, job: Job) -> bool:
        """Wait (if the job is background work) until load1 per core is under the threshold; False on stop."""
        with self._cond:
            while self._paused and not self._stopping:
                self.state = "paused"
                self._cond.wait()
            while job.wait_idle and not self._stopping and load_per_core() >= self.idle_threshold:
                if self.state != "waiting-idle":
                    log.info("waiting for idle: load1 per core %.2f >= %.2f", load_per_core(), self.idle_threshold)
                    self.state = "waiting-idle"
                    self.events.waiting_idle(job)  # under the (re-entrant) lock: it may read snapshot()
                self._cond.wait(IDLE_POLL_S)
            self.state = "tuning"
            return not self._stopping

    def _tune(self, job: Job) -> Outcome:
        out = Outcome()
        db = results_db()  # this thread's own connection, for what the events publish
        targets = list(job.targets.values())
        try:
            for i, t in enumerate(targets):
                if not self._idle(job):
                    out.interrupted = True
                    break
                self.events.job_progress(job, i / len(targets), f"tuning {t.name}")
                t0 = time.monotonic()
                reply = self._run_child(t, job, lambda f, msg, i=i: self._on_progress(job, (i + f) / len(targets), msg))
                if "stopped" in reply:
                    out.interrupted = True
                    break
                if "error" in reply:
                    log.error("tuning %s failed: %s", t.name, reply["error"])
                    out.failed.append({"target": t.name, "reason": reply["error"]})
                    self.events.tuned(db, t, None)
                    continue
                res = reply["result"]
                log.info("tuned %s: %.4f ms, speedup %s, %d evals in %.1f s%s", t.name, res["ms"],
                         f"{res['speedup']:.2f}x" if res["speedup"] else "?", res["evals"], time.monotonic() - t0,
                         " (cached)" if res["cached"] else "")
                out.tuned.append({"target": t.name, **{k: res[k] for k in (
                    "ms", "default_ms", "speedup", "evals", "cached", "session_id", "config")}})
                self.events.tuned(db, t, res)
        finally:
            db.close()
        return out

    def _on_progress(self, job: Job, fraction: float, message: str) -> None:
        self._progress = (fraction, message)
        self.events.job_progress(job, fraction, message)

    def _run_child(self, t: Target, job: Job, progress: Callable[[float, str], None]) -> dict:
        """Tune one workload in a child process (daemon.tunejob); returns its final line."""
        env = dict(os.environ, EDGETUNE_DAEMON_PID=str(os.getpid()))
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        req = tunejob.request(t.spec, t.workload, force=t.force, strategy=job.strategy, budget=job.budget,
                              origin=job.origin, hw=self.hw, objective=job.objective, power=job.power,
                              max_s=job.max_s)
        # its own session: a terminal's ^C must not reach the child and its measuring worker mid-measurement;
        # the daemon decides, and stops it with SIGTERM
        with subprocess.Popen([sys.executable, "-m", "daemon.tunejob"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=env, text=True, start_new_session=True) as child:
            with self._cond:
                self._child = child
                if self._stopping:  # stop() came between the idle check and the spawn
                    child.terminate()
            try:
                child.stdin.write(json.dumps(req) + "\n")
                child.stdin.close()
            except BrokenPipeError:  # stopped (or dead) before it read the request: the exit code says which
                pass
            reply: dict = {}
            for line in child.stdout:
                reply = json.loads(line)
                if "progress" in reply:
                    done, total, msg = reply["progress"]
                    progress(done / max(total, 1), msg)
            code = child.wait()
            with self._cond:
                self._child = None
                stopping = self._stopping
        if "progress" in reply or not reply:  # no final line: killed, or it crashed
            # a stop while it was starting (before its SIGTERM handler) ends it with -15: that is an interruption
            return {"stopped": True} if stopping else {"error": f"the tune process exited with code {code}"}
        return reply
