"""One tune in a child process (`python -m daemon.tunejob`), so the long-lived daemon stays small and safe.

Tuning loads the tuner model, grows numpy buffers and drives compilers and a measuring worker (which also runs
the ORT twin); none of that can be unloaded from a process afterwards, and a crash in it must not take the daemon
down. So the daemon runs each workload's tune here and keeps only what it reports.

Protocol: the daemon writes one JSON request line to stdin; the child writes JSON lines to stdout:
{"progress": [done, total, message]} per measurement, then one of {"result": TuneResult}, {"error": reason} or
{"stopped": true}. SIGTERM (also sent if the daemon dies, via PR_SET_PDEATHSIG) ends the tune right after the
measurement in flight has been journaled, so the session resumes from its journal next time.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import signal
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hwprobe.power import PowerConfig

PR_SET_PDEATHSIG = 1


class Stopping(BaseException):
    """The daemon asked the tune to stop (SIGTERM). A BaseException, as KeyboardInterrupt: the session records
    an Exception as `failed`, while a stop leaves it `running`, to be resumed from its journal."""


def request(spec: Any, wl: Any, *, force: bool, strategy: str, budget: int, origin: str, hw: Any,
            objective: str = "latency", power: PowerConfig | None = None, max_s: float | None = None) -> dict:
    return {"kernel": spec.name, "workload": {"name": wl.name, "shape": wl.shape, "source": wl.source},
            "force": force, "strategy": strategy, "budget": budget, "origin": origin, "hw": hw.to_dict(),
            "objective": objective, "power": asdict(power) if power else {}, "max_s": max_s}


def die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: a dead parent shows up as a broken stdout pipe instead
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    out = os.fdopen(os.dup(1), "w")  # the protocol channel; anything else printed, by C libraries too, goes
    os.dup2(2, 1)  # to stderr (the daemon's log) instead of corrupting it
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    die_with_parent(int(os.environ.get("EDGETUNE_DAEMON_PID", os.getppid())))

    from edgetune import paths
    from edgetune.errors import EdgetuneError
    from hwprobe.descriptor import HwDescriptor
    from kernels.registry import get_spec
    from kernels.spec import Workload
    from kernels.worker import Runner
    from daemon.store import results_db
    from hwprobe.power import meter_from_config
    from tuner.objective import Objective
    from tuner.session import Budget, Session

    def send(doc: dict) -> None:
        try:
            out.write(json.dumps(doc, default=str) + "\n")
            out.flush()
        except BrokenPipeError:  # the daemon died (kill -9): the journal holds the work, nobody reads this
            stop["now"] = True
            sys.stderr = open(os.devnull, "w")  # nor the interpreter's complaint about the pipe at exit

    req = json.loads(sys.stdin.readline())
    spec = get_spec(req["kernel"])
    w = req["workload"]
    wl = Workload(w["name"], w["shape"], w["source"])

    def progress(done: int, total: int, msg: str) -> None:
        if stop["now"]:
            raise Stopping
        send({"progress": [done, total, msg]})

    # one tune at a time per state dir: after a kill -9 of the daemon, the orphaned child may still be finishing
    # its last measurement when the restarted daemon starts the same (resumable) session
    lock = open(paths.state_dir() / "tune.lock", "w")  # held until this process exits
    fcntl.flock(lock, fcntl.LOCK_EX)
    db = results_db()
    meter = meter_from_config(req["power"]) if req["objective"] != "latency" else None
    try:
        if meter:
            meter.start()
        with Runner() as runner:
            res = Session(db, runner, HwDescriptor.from_dict(req["hw"])).tune(
                spec, wl, strategy=req["strategy"], budget=Budget(evals=req["budget"], seconds=req.get("max_s")),
                force=req["force"], origin=req["origin"], progress=progress,
                objective=Objective.create(req["objective"], meter))
        send({"result": res.to_dict()})
    except Stopping:
        logging.getLogger(__name__).info("%s/%s checkpointed after its last measurement", spec.name, wl.name)
        send({"stopped": True})
    except EdgetuneError as e:
        send({"error": str(e)})
    finally:
        if meter:
            meter.stop()
        db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
