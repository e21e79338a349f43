"""Energy objective: a tune ranked by joules per call from a serial power meter, emulated by a peer process on a
pty that reports real CPU activity as watts (idle + per busy core), in an INA219 sketch's CSV.

The emulated board's CPUs are the test's own process tree (the worker running the kernels): this machine is
shared, so whole-machine activity would drown the signal a real board's meter sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tty

import pytest

from hwprobe.power import meter_from_config
from kernels.registry import get_spec
from kernels.worker import Runner
from tests.polling import wait_until
from tuner.db import ResultsDB
from tuner.objective import Objective
from tuner.session import Budget, Session

# A USB meter on a board whose draw follows its CPUs: watts = 2.0 + 1.5 per busy core of the board's processes.
METER = r'''
import os, sys, time
import psutil
fd, root = int(sys.argv[1]), psutil.Process(int(sys.argv[2]))
def cpu_s():
    total = 0.0
    for p in [root] + root.children(recursive=True):
        if p.pid == os.getpid():
            continue
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total
c0, t0 = cpu_s(), time.monotonic()
while True:
    time.sleep(0.02)
    c1, t1 = cpu_s(), time.monotonic()
    cores = max(0.0, (c1 - c0) / (t1 - t0))
    c0, t0 = c1, t1
    w = 2.0 + 1.5 * cores
    try:
        os.write(fd, f"5.000,{w / 5 * 100:.3f},{w / 5 * 1000:.2f},{w * 1000:.2f}\r\n".encode())
    except OSError:
        pass
'''
CSV = {"meter": "text", "format": "csv", "columns": ["bus_V", "shunt_mV", "current_mA", "power_mW"],
       "power": "power_mW", "max_gap_s": 0.3, "retry_s": 0.05, "idle_s": 0.5}
WL = get_spec("gemm").workload("kws_dscnn.pw4")


@pytest.fixture
def meter_peer(tmp_path):
    master, slave = os.openpty()
    tty.setraw(slave)
    link = tmp_path / "ttyUSB0"
    link.symlink_to(os.ttyname(slave))
    peer = subprocess.Popen([sys.executable, "-c", METER, str(master), str(os.getpid())], pass_fds=(master,))
    yield link, peer, (master, slave)
    peer.kill()
    peer.wait()
    for fd in (master, slave):
        try:
            os.close(fd)
        except OSError:
            pass


def _meter(link):
    m = meter_from_config({**CSV, "port": str(link)})
    m.start()
    wait_until(lambda: m.connected, lambda: f"the meter to connect ({m.status})", 10, interval=0.02)
    return m


def test_energy_objective_tune(meter_peer, hw):
    link, _, _ = meter_peer
    meter = _meter(link)
    try:
        obj = Objective.create("energy", meter)
        assert obj.idle_w is not None and obj.idle_w >= 2.0
        db = ResultsDB()
        with Runner() as r:
            res = Session(db, r, hw).tune(get_spec("gemm"), WL, strategy="random", budget=Budget(evals=4),
                                          objective=obj)
    finally:
        meter.stop()
    assert res.objective == "energy", res.objective_note
    assert res.energy_j and res.energy_j > 0 and res.default_energy_j
    rows = [r for r in db.measurements(res.session_id, "search") if r["ok"]]  # a variant may fail on a loaded host
    assert rows and all(r["stats"]["energy_j"] > 0 and r["stats"]["score"] == r["stats"]["energy_j"] for r in rows)
    assert db.active()[f"gemm/{WL.name}"]["energy_j"] == res.energy_j
    print(f"\nenergy tune gemm/{WL.name}: winner {res.config} {res.ms:.4f} ms {res.energy_j * 1e6:.2f} uJ/call "
          f"(default {res.default_ms:.4f} ms {res.default_energy_j * 1e6:.2f} uJ/call), idle {obj.idle_w:.2f} W")


def test_unplug_mid_run_falls_back_to_latency(meter_peer, hw):
    link, peer, _ = meter_peer
    meter = _meter(link)
    try:
        obj = Objective.create("edp", meter)
        calls = {"n": 0}

        def unplug_after_two(done, total, msg):
            calls["n"] = done
            if done >= 2 and peer.poll() is None:
                peer.kill()  # the meter goes silent mid-run, as when its USB cable is pulled
                peer.wait()

        with Runner() as r:
            res = Session(ResultsDB(), r, hw).tune(get_spec("gemm"), WL, strategy="anneal", budget=Budget(evals=6),
                                                   objective=obj, progress=unplug_after_two)
    finally:
        meter.stop()
    assert res.objective == "latency" and res.objective_note  # fell back, with the reason kept
    assert res.evals == 6 and res.ms > 0


def test_energy_without_meter_is_bad_input():
    from edgetune.errors import BadInput

    with pytest.raises(BadInput, match="needs a power meter"):
        Objective.create("energy", None)
    with pytest.raises(BadInput, match="objectives: latency, energy, edp"):
        Objective.create("joules", None)
