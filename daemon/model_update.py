"""Follow the fleet's signed tuner-model releases: verify, download, stage A/B, health-check, commit or roll back.

The broker thread hands over each `model/release` payload (`offer`); this module's own thread (`model`) works
through the newest one:

1. verify (edgetune.release: signature by a trusted key, size cap, prompt format, expiry, ISA, edgetune version,
   no downgrade unless a signed rollback) -> `rejected` with the reason code;
2. download (daemon.model_fetch: `.part` file; over HTTP with Range resume when `fleet_url` is set and answers,
   else in MQTT chunks when the manifest offers them, resuming by chunk) -> `downloading`, then `failed`
   (disk_full, download_failed) or on to
3. verify the file (size + sha256) -> `verifying` or `rejected`, and stage it in the slot the pointer does not
   name (tuner.model.slots);
4. health check in a child process (daemon.model_check) -> `evaluating`, then `committed` (the pointer names the
   new slot, the old one stays as `previous`) or `rolled_back` with the reason. A signed rollback whose model is
   the previous slot's (or the bundled one) needs no download and only has to load.

Every step is reported retained on `model/state` through the outbox (nothing lost while offline) and kept in
daemon.db, with the release being worked on, so a restart or kill -9 at any point resumes: a download continues
from its `.part`, a health check runs again (at most MAX_ATTEMPTS times, then `failed`/interrupted), and the
pointer only ever names a checked model, so the device always runs a working one. A release that reached a final
state is not worked on again when its retained message comes back on reconnect.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from daemon.config import ModelUpdateConfig
from daemon.model_check import request as check_request
from daemon.model_fetch import FetchFailed, Stopped, fetch, fetch_chunks, held_bytes
from daemon.store import DaemonStore
from edgetune import __version__
from edgetune import release as rel
from edgetune.atomic import fsync_dir, write_atomic
from edgetune.errors import BadInput
from edgetune.protocol import MODEL_FINAL_STATES, MODEL_RELEASE, ProtocolError, decode
from edgetune.release import Manifest, ReleaseRejected
from edgetune.sqlite import DBError
from tuner.model import slots
from tuner.model.inference import PROMPT_FORMAT, ModelError, bundled_model_path, check_gguf

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 2  # health checks of one release started before a restart counts as `interrupted`
HEALTH_BASE_S, HEALTH_PER_WORKLOAD_S = 300.0, 300.0  # a health check that takes longer has hung
MAX_RELEASE_BYTES = 64 * 1024  # a model/release payload: a manifest and a signature
CHUNK_INBOX_MAX = 64  # model/chunk payloads waiting for the model thread; more are dropped (and asked for again)
ROOT = str(Path(__file__).resolve().parent.parent)
JOB, DONE, STATE = "model_job", "model_done", "model_state"  # daemon.db keys


@dataclass(frozen=True)
class Release:
    """One model/release message."""

    manifest: Any
    signature: Any
    rollout_id: str | None
    phase: str | None

    @classmethod
    def parse(cls, payload: bytes) -> "Release":
        doc = decode(payload, MODEL_RELEASE.sub, limit=MAX_RELEASE_BYTES)
        rid, phase = doc.get("rollout_id"), doc.get("phase")
        if not (rid is None or isinstance(rid, str)) or not (phase is None or isinstance(phase, str)):
            raise ProtocolError("model/release: rollout_id and phase must be strings")
        return cls(doc.get("manifest"), doc.get("signature"), rid, phase)

    def doc(self) -> dict:
        return {"manifest": self.manifest, "signature": self.signature, "rollout_id": self.rollout_id,
                "phase": self.phase}

    @property
    def key(self) -> str:
        """What makes two messages the same release for this device."""
        m = self.manifest if isinstance(self.manifest, dict) else {}
        return json.dumps([m.get("sha256"), m.get("version"), bool(m.get("rollback")), self.rollout_id,
                           self.signature if isinstance(self.signature, str) else None])


class Final(Exception):
    """A release reached a final state; raised out of the steps to end its handling."""

    def __init__(self, state: str, reason: str | None, detail: str):
        super().__init__(detail)
        self.state, self.reason, self.detail = state, reason, detail


def entry(m: Manifest, slot: str | None, model_version: str, rollout_id: str | None) -> dict:
    return {"slot": slot, "name": m.name, "version": m.version, "model_version": model_version,
            "sha256": m.sha256, "rollout_id": rollout_id}


def bundled_entry() -> dict | None:
    try:
        info = check_gguf(bundled_model_path())
    except ModelError:
        return None
    return {"slot": None, "name": str(info.meta.get("general.name") or "edgetune-tuner"), "version": None,
            "model_version": info.model_version, "sha256": info.sha256, "rollout_id": None}


class Updater:
    def __init__(self, cfg: ModelUpdateConfig, store: DaemonStore, publish: Callable[[dict], None], hw: Any,
                 pairs: Callable[[], list], committed: Callable[[list[str]], None],
                 request_chunks: Callable[[bytes], None]):
        self.cfg, self.store, self.publish, self.hw = cfg, store, publish, hw
        self._pairs, self._committed, self._request_chunks = pairs, committed, request_chunks
        self._cond = threading.Condition()
        self._inbox: bytes | None = None  # the newest model/release payload not yet looked at
        self._chunks: deque[bytes] | None = None  # model/chunk payloads, while an MQTT download runs
        self._stopping = False
        self._child: subprocess.Popen | None = None
        self._bundled = bundled_entry()
        self._thread = threading.Thread(target=self._run, name="model", daemon=True)

    # ---- any thread ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def offer(self, payload: bytes) -> None:
        """A model/release message (the broker thread): only the newest one matters."""
        with self._cond:
            self._inbox = payload
            self._cond.notify_all()

    def chunk(self, payload: bytes) -> None:
        """A model/chunk message (the broker thread); kept only while a download over MQTT runs."""
        with self._cond:
            if self._chunks is None or len(self._chunks) >= CHUNK_INBOX_MAX:
                return
            self._chunks.append(payload)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            if self._child:
                self._child.terminate()
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join()

    def state(self) -> dict | None:
        """The last model/state document (for `info`, `edgetune status` and every reconnect)."""
        return self.store.get(STATE)

    def pointer(self) -> dict:
        """Current and previous model entries; a null current is the bundled model."""
        p = slots.read_pointer()
        return {"current": p["current"] or self._bundled, "previous": p["previous"]}

    # ---- the model thread ----------------------------------------------------------------------------------

    def _wait(self, seconds: float) -> bool:
        """Wait up to `seconds`; True when the daemon stops or a newer release message arrived."""
        with self._cond:
            if seconds > 0 and not (self._stopping or self._inbox is not None):
                self._cond.wait(seconds)
            return self._stopping or self._inbox is not None

    def _run(self) -> None:
        job = self.store.get(JOB)
        if job:
            log.info("model update: resuming release v%s after a restart (%s)",
                     (job["release"].get("manifest") or {}).get("version"), job["stage"])
            self._guarded(lambda: self._work(Release(**job["release"]), job))
        while True:
            with self._cond:
                while self._inbox is None and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                payload, self._inbox = self._inbox, None
            self._guarded(lambda: self._message(payload))

    def _guarded(self, step: Callable[[], None]) -> None:
        """A DB error (a full disk) or a bug must not end the thread: logged; the release is tried again next
        start (its job stays in daemon.db)."""
        try:
            step()
        except DBError as e:
            log.error("model update: %s; the release is taken up again after a restart", e)
        except Exception:
            log.exception("model update failed")

    def _message(self, payload: bytes) -> None:
        if not payload:  # withdrawn: anything not yet committed stops (handled in the steps); nothing to do here
            log.info("model update: the fleet withdrew its release")
            return
        if len(payload) > MAX_RELEASE_BYTES:
            self._report("rejected", None, rel.TOO_LARGE, f"model/release of {len(payload)} bytes: a manifest and "
                                                          f"its signature fit in {MAX_RELEASE_BYTES}")
            return
        try:
            release = Release.parse(payload)
        except ProtocolError as e:
            self._report("rejected", None, rel.MALFORMED, str(e))
            return
        if release.key == self.store.get(DONE):
            log.info("model update: release v%s of rollout %s was handled already",
                     (release.manifest or {}).get("version") if isinstance(release.manifest, dict) else "?",
                     release.rollout_id)
            return
        self._work(release, None)

    def _work(self, release: Release, job: dict | None) -> None:
        try:
            m = self._verify(release)
            job = job or {"release": release.doc(), "stage": "downloading", "attempts": 0}
            if job["stage"] == "downloading":
                job = self._stage(release, m, job)
            self._evaluate(release, m, job)
        except Final as f:
            self._finish(release, f.state, f.reason, f.detail)
        except Stopped:
            log.info("model update: stopped; resumes at the next start")

    def _verify(self, release: Release) -> Manifest:
        try:
            if not self.cfg.trusted_keys:
                raise ReleaseRejected(rel.UNKNOWN_KEY, "this device trusts no key ([model_update] trusted_keys)")
            try:
                trusted = rel.load_trusted_keys([Path(p) for p in self.cfg.trusted_keys])
            except BadInput as e:
                raise ReleaseRejected(rel.UNKNOWN_KEY, str(e)) from None
            m = rel.verify(release.manifest, release.signature, trusted)
            if m.size > self.cfg.max_bytes:
                raise ReleaseRejected(rel.TOO_LARGE, f"model of {m.size} bytes is over this device's "
                                                     f"[model_update] max_bytes = {self.cfg.max_bytes}")
            if m.prompt_format != PROMPT_FORMAT:
                raise ReleaseRejected(rel.WRONG_PROMPT_FORMAT, f"release speaks {m.prompt_format!r}, this device's "
                                                               f"tuner {PROMPT_FORMAT!r}")
            cur = self.pointer()["current"] or {}
            if cur.get("sha256") == m.sha256 and cur.get("version") == m.version:  # committed before a restart
                raise Final("committed", None, "this release is already the current model")
            rel.check_applicable(m, now=time.time(), isa=self.hw.isa, edgetune_version=__version__,
                                 current_version=cur.get("version"))
        except ReleaseRejected as e:
            raise Final("rejected", e.reason, str(e)) from None
        return m

    # ---- download and staging ------------------------------------------------------------------------------

    def _stage(self, release: Release, m: Manifest, job: dict) -> dict:
        """Bring the release's file into the free slot (or find it on the device); returns the job at its next
        stage, persisted."""
        ptr = slots.read_pointer()
        cur = ptr["current"]
        free = "b" if cur and cur.get("slot") == "a" else "a"
        prev = ptr["previous"]
        if m.rollback and self._bundled and m.sha256 == self._bundled["sha256"]:
            job = {**job, "stage": "evaluating", "slot": None}
        elif m.rollback and prev and prev.get("sha256") == m.sha256 and prev.get("slot"):
            job = {**job, "stage": "evaluating", "slot": prev["slot"]}
        else:
            part = slots.models_dir() / "staging" / f"{m.sha256}.part"
            self._download(release, m, job, part)
            self._report("verifying", release, None, f"checking {m.size} bytes")
            try:
                rel.check_file(m, part)
            except ReleaseRejected as e:
                part.unlink(missing_ok=True)
                raise Final("rejected", e.reason, str(e)) from None
            if prev and prev.get("slot") == free:  # the previous model's slot is about to be overwritten
                slots.write_pointer(cur, None)
            d = slots.slot_dir(free)
            d.mkdir(parents=True, exist_ok=True)
            write_atomic(d / slots.RELEASE_FILE, json.dumps(release.doc()).encode())
            os.replace(part, d / slots.MODEL_FILE)
            fsync_dir(d)
            job = {**job, "stage": "evaluating", "slot": free}
        self.store.set(JOB, job)
        return job

    def _download(self, release: Release, m: Manifest, job: dict, part: Path) -> None:
        self.store.set(JOB, job)
        for stale in part.parent.glob("*.part*") if part.parent.exists() else ():
            if not stale.name.startswith(part.name):
                stale.unlink()
        have = held_bytes(part, m.size)
        self._report("downloading", release, None, f"resuming at byte {have} of {m.size}" if have else
                     f"{m.size} bytes")
        try:
            source = self._transfer(release, m, part)
        except FetchFailed as e:
            if e.reason != rel.DOWNLOAD_FAILED:  # a full disk gets its space back; an oversized file is not ours
                part.unlink(missing_ok=True)
                part.with_name(part.name + ".chunks").unlink(missing_ok=True)
            raise Final("failed" if e.reason != rel.TOO_LARGE else "rejected", e.reason, e.message) from None
        log.info("model update: downloaded v%d (%d bytes) from %s", m.version, m.size, source)

    def _transfer(self, release: Release, m: Manifest, part: Path) -> str:
        """Fill the part over HTTP when fleet_url is set and answers, else in MQTT chunks if the release offers
        them; where it came from."""
        stopping = self._download_stops(release)
        if self.cfg.fleet_url:
            url = self.cfg.fleet_url.rstrip("/") + m.url
            try:
                fetch(url, part, m.size, timeout=self.cfg.http_timeout_s, stopping=stopping)
                return url
            except FetchFailed as e:
                if not (e.unreachable and m.mqtt_chunk_size):
                    raise
                log.warning("model update: %s; fetching the file over MQTT instead", e)
        if not m.mqtt_chunk_size:
            raise FetchFailed(rel.DOWNLOAD_FAILED, "no [model_update] fleet_url to download the model from, and "
                                                   "the release offers no MQTT transfer")
        with self._cond:
            self._chunks = deque()
        try:
            fetch_chunks(part, m.size, m.sha256, m.mqtt_chunk_size, timeout=self.cfg.mqtt_timeout_s,
                         request=self._request_chunks, receive=self._next_chunk, stopping=stopping)
        finally:
            with self._cond:
                self._chunks = None
        return "MQTT chunks"

    def _next_chunk(self, wait_s: float) -> bytes | None:
        """The next model/chunk payload, waiting up to wait_s (less when the daemon stops or a release comes)."""
        with self._cond:
            if not self._chunks and wait_s > 0 and not (self._stopping or self._inbox is not None):
                self._cond.wait(wait_s)
            return self._chunks.popleft() if self._chunks else None

    def _download_stops(self, release: Release) -> Callable[[float], bool]:
        def stopping(wait_s: float) -> bool:
            if not self._wait(wait_s):
                return False
            if self._stopping:
                return True
            with self._cond:
                payload = self._inbox
            if payload is not None and payload and _same(payload, release):
                with self._cond:
                    self._inbox = None  # the same release again (a reconnect): keep going
                return False
            raise Final("failed", rel.WITHDRAWN, "the fleet withdrew or replaced this release during the download")
        return stopping

    # ---- health check and commit ---------------------------------------------------------------------------

    def _evaluate(self, release: Release, m: Manifest, job: dict) -> None:
        slot = job.get("slot")
        path = slots.slot_model(slot) if slot else bundled_model_path()
        if job["attempts"] >= MAX_ATTEMPTS:
            raise Final("failed", rel.INTERRUPTED, f"the device restarted during {job['attempts']} health checks "
                                                   "of this release")
        try:
            rel.check_file(m, path)  # the staged file, again: a restart may have come between any two steps
        except (ReleaseRejected, OSError) as e:
            raise Final("failed", rel.INTERRUPTED, f"the staged model is gone or damaged: {e}") from None
        self.store.set(JOB, {**job, "attempts": job["attempts"] + 1})
        compare = not m.rollback
        self._report("evaluating", release, None, "load check (signed rollback)" if not compare else
                     f"top-{self.cfg.top_k} side by side with the current model on {len(self._pairs())} "
                     "workload(s)")
        current = slots.committed_model() or bundled_model_path()
        try:
            verdict = self._health(check_request(str(path), str(current), self._pairs(), self.hw, compare=compare,
                                                 top_k=self.cfg.top_k, rounds=self.cfg.rounds,
                                                 latency_budget_ms=self.cfg.latency_budget_ms,
                                                 tolerance=self.cfg.tolerance))
        except Stopped:  # a clean stop is not a failed attempt
            self.store.set(JOB, job)
            raise
        if not verdict["ok"]:
            raise Final("rolled_back", verdict["reason"], verdict["detail"])
        ptr = slots.read_pointer()
        info = check_gguf(path)
        new = entry(m, slot, info.model_version, release.rollout_id)
        old = ptr["current"] or self._bundled
        slots.write_pointer(new if slot else None, old if old and old.get("sha256") != m.sha256 else ptr["previous"])
        better = verdict.get("better", [])
        detail = (f"retuning {len(better)} workload(s) it measured better on: {', '.join(better)}" if better else
                  "not retuning: it measured better on no workload" if compare else "rolled back to this model")
        self._committed(better)  # the daemon names the new model (results, info) before the fleet hears of it
        self._finish(release, "committed", None, detail)

    def _health(self, req: dict) -> dict:
        """The child's verdict; a child that crashed (a model can crash llama.cpp) or hung is a failed check."""
        env = dict(os.environ, EDGETUNE_DAEMON_PID=str(os.getpid()))
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        limit = HEALTH_BASE_S + HEALTH_PER_WORKLOAD_S * len(req["workloads"])
        with subprocess.Popen([sys.executable, "-m", "daemon.model_check"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env, text=True, start_new_session=True) as child:
            with self._cond:
                self._child = child
                if self._stopping:
                    child.terminate()
            try:
                out, _ = child.communicate(json.dumps(req) + "\n", timeout=limit)
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                return {"ok": False, "reason": rel.TOO_SLOW, "detail": f"the health check took over {limit:.0f} s"}
            finally:
                with self._cond:
                    self._child = None
            if self._stopping:
                raise Stopped
        try:
            verdict = json.loads(out.splitlines()[-1])
        except (IndexError, ValueError):
            return {"ok": False, "reason": rel.LOAD_FAILED, "detail": f"the health check process exited with code "
                                                                      f"{child.returncode} (the model crashed it?)"}
        for w in verdict.get("workloads", []):
            log.info("model health check: %s", json.dumps(w))
        return verdict

    # ---- reporting -----------------------------------------------------------------------------------------

    def _finish(self, release: Release, state: str, reason: str | None, detail: str) -> None:
        log.log(logging.INFO if state == "committed" else logging.WARNING, "model update: %s%s: %s", state,
                f" ({reason})" if reason else "", detail)
        self._report(state, release, reason, detail)
        self.store.set(DONE, release.key)
        self.store.set(JOB, None)

    def _report(self, state: str, release: Release | None, reason: str | None, detail: str) -> None:
        ptr = self.pointer()
        summary = lambda e: {k: e.get(k) for k in ("name", "version", "sha256")} if e else None  # noqa: E731
        m = release.manifest if release and isinstance(release.manifest, dict) else {}
        doc = {"state": state, "current": summary(ptr["current"]), "previous": summary(ptr["previous"]),
               "rollout_id": release.rollout_id if release else None, "phase": release.phase if release else None,
               "version": m.get("version"), "reason": reason, "detail": detail, "ts": time.time()}
        if state not in MODEL_FINAL_STATES:
            log.info("model update: %s v%s: %s", state, m.get("version"), detail)
        self.store.set(STATE, doc)
        self.publish(doc)


def _same(payload: bytes, release: Release) -> bool:
    try:
        return Release.parse(payload).key == release.key
    except ProtocolError:
        return False
