"""A broker outage with default-sized queues: does anything the fleet needs get lost? (Not a test.)

    python bench/outage.py [--devices 4] [--outage-s 600] [--telemetry-s 0.5] [--retune-every-s 30]

Starts its own mosquitto (persistence on, every queue setting at mosquitto's default, e.g. 1000 queued messages
per client), N real daemons (`edgetune daemon`) sending telemetry and doing forced retunes (tuning records and
command results), and the real receiver (`edgetune fleet listen`). Then: warm up, stop the broker for the outage,
stop and restart the receiver in the middle of it, restart the broker, and wait until every device outbox is
empty (the fleet acknowledged every record and result). Reports produced vs stored per kind, duplicates, order,
drain time and the machine's load. Target: 0 tuning records and 0 command results lost; lost telemetry shows up
as gaps in (boot_id, seq).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from edgetune.protocol import TERMINAL_STATES  # noqa: E402
from fleet.store import FleetStore  # noqa: E402
from tests.broker import Mosquitto  # noqa: E402
from tests.test_daemon_support import DaemonProc, daemon_config, env_for  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def listen(broker: Mosquitto, db: Path, out: Path) -> subprocess.Popen:
    with open(out, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "edgetune.main", "fleet", "listen", "--broker",
                                 f"{broker.host}:{broker.port}", "--db", str(db), "--client-id", "fleet-outage",
                                 "--json"], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)


def stop_listener(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    p.wait(60)


def produced(d: DaemonProc) -> dict:
    """What one daemon produced, from its own DBs."""
    with sqlite3.connect(d.state_dir / "results.db") as r:
        records = r.execute("SELECT count(*) FROM sessions WHERE state != 'running'").fetchone()[0]
    with sqlite3.connect(d.state_dir / "daemon.db") as s:
        marks = ",".join("?" * len(TERMINAL_STATES))
        results = s.execute(f"SELECT count(*) FROM commands WHERE status IN ({marks})", TERMINAL_STATES).fetchone()[0]
        tel = json.loads(s.execute("SELECT value FROM kv WHERE key='telemetry'").fetchone()[0])
    return {"records": records, "results": results, "telemetry": tel["seq"] + 1}


def outbox_left(d: DaemonProc) -> int:
    with sqlite3.connect(d.state_dir / "outbox.db") as o:
        return o.execute("SELECT count(*) FROM outbox WHERE kind IN ('record', 'response')").fetchone()[0]


def stored(db: Path, device: str) -> dict:
    with FleetStore(db) as s:
        recs = s.records(device)
        cmds = [c for c in s.commands(device) if c["status"] in TERMINAL_STATES]
        tel = s.telemetry(device)
        gaps = s.telemetry_gaps().get(device, {"missing": 0})
    seqs = [t["seq"] for t in tel]
    return {"records": len(recs), "record_copies": sum(r["copies"] for r in recs), "results": len(cmds),
            "telemetry": len(tel), "telemetry_missing": gaps["missing"],
            "telemetry_out_of_order": sum(1 for a, b in zip(seqs, seqs[1:]) if b < a)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--outage-s", type=float, default=600.0)
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--telemetry-s", type=float, default=0.5)
    ap.add_argument("--retune-every-s", type=float, default=30.0, help="a forced retune per device this often")
    ap.add_argument("--resend-s", type=float, default=60.0, help="the daemons' [outbox] resend_s")
    ap.add_argument("--drain-timeout-s", type=float, default=900.0)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="edgetune-outage-"))
    load0 = os.getloadavg()
    broker = Mosquitto(tmp / "broker").start()  # mosquitto's default queue limits
    db = tmp / "fleet.db"
    lst = listen(broker, db, tmp / "listener.log")
    daemons = []
    for i in range(a.devices):
        home = tmp / f"dev{i}"
        home.mkdir()
        cfg = daemon_config(home, broker, device_id=f"bench-{i}", telemetry_interval_s=a.telemetry_s,
                            tuning={"budget": 2}, outbox={"resend_s": a.resend_s})
        daemons.append(DaemonProc(cfg, env=env_for(home, tmp / "cache")).start())
    for d in daemons:
        d.wait_status(lambda s: s["state"] == "idle" and s["last_tune"] is not None, 300)
    log(f"{a.devices} daemons up; warm-up {a.warmup_s:.0f} s")

    def run_for(seconds: float) -> None:
        end, next_retune = time.monotonic() + seconds, time.monotonic()
        while time.monotonic() < end:
            if time.monotonic() >= next_retune:
                for d in daemons:
                    d.request({"op": "retune", "force": True, "budget": 2})
                next_retune += a.retune_every_s
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))

    run_for(a.warmup_s)
    log(f"broker down for {a.outage_s:.0f} s")
    broker.stop()
    run_for(a.outage_s / 2)
    log("fleet listener restarted mid-outage")
    stop_listener(lst)
    lst = listen(broker, db, tmp / "listener.log")
    run_for(a.outage_s / 2)
    broker.start()
    t_up = time.monotonic()
    log("broker back; waiting for every record and result to be acknowledged by the fleet")
    deadline = t_up + a.drain_timeout_s
    while any(outbox_left(d) for d in daemons) and time.monotonic() < deadline:
        time.sleep(0.5)
    drain_s = time.monotonic() - t_up
    for d in daemons:
        d.signal(signal.SIGTERM)
    stop_listener(lst)
    load1 = os.getloadavg()

    rows, total = [], {"produced": {}, "stored": {}}
    for i, d in enumerate(daemons):
        p, s = produced(d), stored(db, f"bench-{i}")
        rows.append({"device": f"bench-{i}", "produced": p, "stored": s})
        for k, v in p.items():
            total["produced"][k] = total["produced"].get(k, 0) + v
        for k, v in s.items():
            total["stored"][k] = total["stored"].get(k, 0) + v
    dropped = "Outgoing messages are being dropped" in (broker.workdir / "mosquitto.log").read_text()
    report = {
        "devices": a.devices, "outage_s": a.outage_s, "telemetry_s": a.telemetry_s,
        "retune_every_s": a.retune_every_s, "resend_s": a.resend_s, "broker_dropped_messages": dropped,
        "drain_s": round(drain_s, 1), "drained": drain_s < a.drain_timeout_s,
        "lost": {"records": total["produced"]["records"] - total["stored"]["records"],
                 "results": total["produced"]["results"] - total["stored"]["results"],
                 "telemetry": total["produced"]["telemetry"] - total["stored"]["telemetry"]},
        "telemetry_gaps_reported": total["stored"]["telemetry_missing"],
        "record_duplicates_received": total["stored"]["record_copies"] - total["stored"]["records"],
        "telemetry_out_of_order": total["stored"]["telemetry_out_of_order"],
        "total": total, "per_device": rows,
        "machine": {"cpus": os.cpu_count(), "load_before": [round(x, 2) for x in load0],
                    "load_after": [round(x, 2) for x in load1]},
        "dir": str(tmp),
    }
    print(json.dumps(report, indent=2))
    broker.stop()
    if not a.keep:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return 0 if report["lost"]["records"] == 0 and report["lost"]["results"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
