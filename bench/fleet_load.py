"""Fleet load: a simulated fleet against real receivers, a real mosquitto on loopback and a throwaway PostgreSQL.

    PYTHONPATH=. .venv/bin/python bench/fleet_load.py [--devices 1000] [--minutes 10] [--burst 20000]

One process simulates N devices speaking the device contract (DESIGN.md "daemon and MQTT"): retained status,
info and config/active, one tuning record each, then telemetry at 1 Hz for T minutes, all QoS 1. It publishes
over a few broker connections, each carrying many devices' topics (N client connections from one process would
measure the simulator, not the fleet side). Receivers are real `edgetune fleet listen` processes.

Reported, side by side:
1. ingest rate: a burst of queued telemetry drained by 1 or 2 receivers (shared subscription) into SQLite and
   into PostgreSQL, messages/s; then a burst published live to one PostgreSQL receiver, with its Receive Maximum
   and without one (mosquitto then keeps its max_inflight_messages window, 20 by default: what the receiver had
   before it asked), ratio to the first;
2. sustained: N devices at 1 Hz for T minutes into PostgreSQL (or --backend sqlite) with 2 receivers sharing
   the subscription (or --receivers 1), one SIGKILLed half-way and restarted after the fleet unit's RestartSec
   (systemd/edgetune-fleet.service), as systemd would: lost and duplicated rows; receiver lag per sample (its
   stored time, received_at, minus the device's ts) p50/p99/max overall, in steady state (without the
   KILL_WINDOW_S after the kill) and in that window, and per minute; how many samples sent while the receiver
   was down waited for its restart (mosquitto keeps dealing a share to a member that is away); the receivers'
   batches and transaction times. The telemetry clock starts once the receivers run and have stored the fleet's
   announcements (start-up, timed apart);
3. dashboard: `fleet serve` on that DB, p50/p95 latency of the overview, the device list and a device page.
The machine's load average is printed before and after each phase: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from edgetune.broker import BrokerSettings  # noqa: E402
from fleet.listener import Listener  # noqa: E402
from fleet.store import open_fleet_store  # noqa: E402
from tests.broker import Mosquitto, free_port  # noqa: E402
from tests.pg import PgCluster, missing_reason  # noqa: E402

PUBLISHERS = 4  # broker connections the simulated fleet publishes over
OTHER_KINDS = ("status", "info", "active", "record")  # what the fleet announces (retained state and a record)
KILL_WINDOW_S = 30  # samples sent this long after the SIGKILL count as the kill window
UNIT = REPO / "systemd" / "edgetune-fleet.service"
HW = {"arch": "x86_64", "cpu_model": "Sim CPU", "isa": "x86-64-v3", "vector_bits": 256, "cores": 4,
      "hw_fingerprint": "hw-sim", "fw_fingerprint": "fw-sim"}


def load() -> str:
    return "load %.2f %.2f %.2f on %d cores" % (*os.getloadavg(), os.cpu_count())


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_s(pid: int) -> float:
    """CPU seconds of a process, with its children reaped or alive (PostgreSQL's backends are the postmaster's)."""
    tick = os.sysconf("SC_CLK_TCK")
    own = _stat(pid)
    total = sum(int(x) for x in own[11:15])  # utime stime cutime cstime
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                st = _stat(int(d.name))
            except OSError:
                continue
            if int(st[1]) == pid:
                total += int(st[11]) + int(st[12])
    return total / tick


class Cpu:
    """CPU seconds spent by each part during a phase: the receivers (this process's reaped children), the broker,
    PostgreSQL, and the simulator (this process)."""

    def __init__(self, broker: Mosquitto, pg: PgCluster | None):
        self.pids = {"broker": broker.proc.pid}
        if pg is not None:
            self.pids["postgresql"] = int((pg.dir / "data" / "postmaster.pid").read_text().split()[0])
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        t = os.times()
        return {"receivers": t.children_user + t.children_system, "simulator": t.user + t.system,
                **{k: cpu_s(pid) for k, pid in self.pids.items()}}

    def per_1000(self, messages: int) -> str:
        """CPU ms per 1000 messages, by part (the receivers only once they were all stopped)."""
        end = self._now()
        return ", ".join(f"{k} {1000 * 1000 * (end[k] - self.start[k]) / messages:.0f}" for k in end)


def restart_sec() -> float:
    """The fleet unit's RestartSec, in seconds: how long systemd leaves a crashed receiver down."""
    for line in UNIT.read_text().splitlines():
        if line.startswith("RestartSec="):
            v = line.split("=", 1)[1].strip()
            return float(v[:-2]) / 1000 if v.endswith("ms") else float(v.rstrip("s"))
    return 0.1  # systemd's default


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


class Fleet:
    """N simulated devices over PUBLISHERS connections; `pub` waits for nothing, `flush` for every PUBACK."""

    def __init__(self, broker: Mosquitto, n: int, tag: str):
        self.devices = [f"sim-{tag}-{i:04d}" for i in range(n)]
        self.boot = uuid.uuid4().hex[:8]
        self.clients = []
        self.pending: list[mqtt.MQTTMessageInfo] = []
        for i in range(PUBLISHERS):
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fleet-sim-{tag}-{i}", protocol=mqtt.MQTTv5)
            c.max_inflight_messages_set(1000)
            c.max_queued_messages_set(0)
            c.connect(broker.host, broker.port)
            c.loop_start()
            self.clients.append(c)

    def pub(self, i: int, sub: str, payload: dict, retain: bool = False) -> None:
        c = self.clients[i % PUBLISHERS]
        self.pending.append(c.publish(f"edgetune/v1/{self.devices[i]}/{sub}", json.dumps(payload), qos=1,
                                      retain=retain))

    def flush(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for info in self.pending:
            info.wait_for_publish(max(0.1, deadline - time.monotonic()))
            if not info.is_published():
                raise RuntimeError("the broker did not acknowledge a publish")
        self.pending.clear()

    def announce(self) -> int:
        """Retained status, info and config/active, and one tuning record per device."""
        now = time.time()
        for i, d in enumerate(self.devices):
            self.pub(i, "status", {"state": "online", "session": 1, "version": "0.1.0", "ts": now}, retain=True)
            self.pub(i, "info", {"device_id": d, "hw": HW, "hw_fingerprint": "hw-sim", "fw_fingerprint": "fw-sim",
                                 "model": {"version": "m1"}}, retain=True)
            self.pub(i, "config/active", {"model_version": "m1", "kernels": {
                "gemm/pw1": {"config": {"tile": 32}, "ms": 0.5, "default_ms": 1.0 + i % 7 / 10, "evals": 12,
                             "strategy": "anneal", "tuned_at": now},
                "conv1d/ds1": {"config": {"tile": 8}, "ms": 2.0, "default_ms": 3.0, "evals": 9,
                               "strategy": "anneal", "tuned_at": now}}}, retain=True)
            self.pub(i, "tuning/record", {"id": 1, "kernel": "gemm", "workload": "pw1", "state": "done",
                                          "started_at": now - 60, "hw_fingerprint": "hw-sim",
                                          "measurements": [{"seq": k, "ms": 1.0 / (k + 1)} for k in range(5)]})
        self.flush()
        return 4 * len(self.devices)

    def telemetry(self, i: int, seq: int) -> None:
        self.pub(i, "telemetry", {"boot_id": self.boot, "seq": seq, "ts": time.time(), "cpu_percent": 20.0 + i % 50,
                                  "load1": 0.5, "temp_c": 50.0 + seq % 10, "freq_mhz": 1800.0, "mem_used": 0.4,
                                  "rss": 4.0e7, "state": "idle"})

    def close(self) -> None:
        for c in self.clients:
            c.disconnect()
            c.loop_stop()


class Receiver:
    """One `edgetune fleet listen` process."""

    def __init__(self, broker: Mosquitto, db: str, client_id: str, share: str | None, log: Path,
                 receive_maximum: int | None = None):
        verb = ["fleet", "listen", "--broker", f"{broker.host}:{broker.port}", "--db", db, "--client-id", client_id,
                "--json", *(["--share", share] if share else [])]
        # receive_maximum 0: ask for none (mosquitto then allows its max_inflight_messages, 20 by default)
        patch = [] if receive_maximum is None else [
            "-c", "import sys, fleet.listener as l; l.RECEIVE_MAXIMUM = int(sys.argv[1]); "
                  "from edgetune.main import main; sys.exit(main(sys.argv[2:]))", str(receive_maximum)]
        self.argv = [sys.executable, *(patch or ["-m", "edgetune.main"]), *verb]
        self.log = log
        self.proc: subprocess.Popen | None = None
        # the persistent session and its subscription exist before anything is published: the process started
        # later resumes it, so nothing published meanwhile can miss it
        lst = Listener(BrokerSettings(host=broker.host, port=broker.port), db, client_id=client_id,
                       share=share).start()
        if not lst.subscribed.wait(60):
            raise RuntimeError("receiver session did not subscribe")
        lst.stop()

    def start(self) -> "Receiver":
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=subprocess.PIPE, stderr=err,
                                         env=os.environ | {"PYTHONPATH": str(REPO)})
        return self


    def stop(self) -> dict:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        return json.loads(out) if out.strip() else {}

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def wait_rows(db: str, table: str, want: int, timeout: float) -> tuple[int, float]:
    """Poll the DB until `table` holds `want` rows; returns (rows, when the last poll saw them)."""
    deadline = time.monotonic() + timeout
    with open_fleet_store(db) as s:
        while True:
            n = s.query_one(f"SELECT count(*) FROM {table}")[0]
            if n >= want or time.monotonic() > deadline:
                return n, time.monotonic()
            time.sleep(0.2)


def burst(broker: Mosquitto, db: str, receivers: int, messages: int, work: Path,
          receive_maximum: int | None = None, live: bool = False) -> dict:
    """Queue `messages` telemetry samples while the receivers are away, then time their drain; or (`live`) start
    the receivers, then publish them as fast as the simulator can. (mosquitto 2.0.11 holds a receiver that asks
    for no Receive Maximum to max_inflight_messages, 20, only while nothing is acknowledged: once PUBACKs flow,
    batches of hundreds reach it, and a resumed session's backlog comes in batches of up to BATCH_MAX.)"""
    group = f"b{uuid.uuid4().hex[:6]}" if receivers > 1 else None
    recv = [Receiver(broker, db, f"burst-{group or 'solo'}-{i}-{uuid.uuid4().hex[:4]}", group, work / f"r{i}.log",
                     receive_maximum) for i in range(receivers)]
    fleet = Fleet(broker, 500, uuid.uuid4().hex[:4])
    if live:
        for r in recv:
            r.start()
        fleet.pub(0, "status", {"state": "online", "session": 1, "ts": time.time()})  # stored once they run
        wait_rows(db, "devices", 1, timeout=120)
    for seq in range(messages // 500):
        for i in range(500):
            fleet.telemetry(i, seq)
    fleet.flush()
    fleet.close()
    if not live:
        for r in recv:
            r.start()
    n, _ = wait_rows(db, "telemetry", messages, timeout=900)
    stats = [r.stop() for r in recv]
    split = [s.get("messages", {}).get("telemetry", 0) for s in stats]
    with open_fleet_store(db) as s:  # the receivers' own clock: process start-up is not ingest time
        first, last = s.query_one("SELECT min(received_at), max(received_at) FROM telemetry")
    return {"stored": n, "s": last - first, "rate": n / (last - first), "split": split,
            "batch": [s.get("batches", {}).get("messages_per_batch") for s in stats], "load": load()}


def sustained(broker: Mosquitto, db: str, n: int, seconds: int, receivers: int, work: Path,
              pg: PgCluster | None, down: float) -> dict:
    group = f"s{uuid.uuid4().hex[:6]}"
    recv = [Receiver(broker, db, f"sustained-{group}-{i}", group if receivers > 1 else None, work / f"s{i}.log")
            for i in range(receivers)]
    load_before = load()
    cpu = Cpu(broker, pg)
    t_start = time.monotonic()
    for r in recv:
        r.start()
    fleet = Fleet(broker, n, "load")
    fleet.announce()
    wait_rows(db, "records", n, timeout=600)  # start-up: the receivers run and stored the announcements
    startup_s = time.monotonic() - t_start
    kill_at = restart_at = None
    t0 = time.monotonic()
    behind = 0.0
    for seq in range(seconds):
        tick = t0 + seq
        time.sleep(max(0.0, tick - time.monotonic()))
        behind = max(behind, time.monotonic() - tick)
        for i in range(n):
            fleet.telemetry(i, seq)
        if seq == seconds // 2:
            recv[0].kill()
            kill_at = time.time()
        if kill_at is not None and restart_at is None and time.time() >= kill_at + down:
            recv[0].start()
            restart_at = time.time()
        if seq % 10 == 0:
            fleet.flush()  # bounded memory: PUBACKs of the last ten seconds
    fleet.flush()
    fleet.close()
    n_rows, _ = wait_rows(db, "telemetry", n * seconds, timeout=600)
    stats = [r.stop() for r in recv]
    with open_fleet_store(db) as s:
        rows = s.query("SELECT ts, received_at FROM telemetry")
        dup = s.query_one("SELECT count(*) - (SELECT count(*) FROM (SELECT DISTINCT device_id, boot_id, seq"
                          " FROM telemetry) x) FROM telemetry")[0]
        recs = s.query_one("SELECT count(*), sum(copies) FROM records")
    return {"devices": n, "seconds": seconds, "expected": n * seconds, "stored": n_rows,
            "lost": n * seconds - n_rows, "duplicated_rows": dup, "records": recs[0], "record_copies": recs[1],
            "redelivered_deduped": sum(s.get("messages", {}).get("telemetry:duplicate", 0) for s in stats),
            "startup_s": startup_s, "restart_after_s": down, **lag_report(rows, kill_at, restart_at),
            "receivers": [s.get("batches") for s in stats], "publisher_behind_max_s": behind,
            "receivers_other_messages": [sum(v for k, v in s.get("messages", {}).items() if k in OTHER_KINDS)
                                         for s in stats],
            "cpu_ms_per_1000_messages": cpu.per_1000(n * seconds + 4 * n),
            "load_before": load_before, "load_after": load()}


def lag_report(rows: list, kill_at: float, restart_at: float) -> dict:
    """Lag = stored time − the device's ts, per sample: overall, steady state, the kill window, per minute; and
    of the samples sent while a receiver was down, how many waited for its restart."""
    lag = [(ts, got - ts) for ts, got in rows]
    first = min(ts for ts, _ in lag)
    window = [x for ts, x in lag if kill_at <= ts < kill_at + KILL_WINDOW_S]
    steady = [x for ts, x in lag if not kill_at <= ts < kill_at + KILL_WINDOW_S]
    outage = [(ts, ts + x) for ts, x in lag if kill_at <= ts < restart_at]
    minutes: dict[int, list[float]] = {}
    for ts, x in lag:
        minutes.setdefault(int((ts - first) // 60), []).append(x)
    every = [x for _, x in lag]
    return {
        "lag_p50_s": pct(every, 50), "lag_p99_s": pct(every, 99), "lag_max_s": max(every),
        "steady_lag_p50_s": pct(steady, 50), "steady_lag_p99_s": pct(steady, 99), "steady_lag_max_s": max(steady),
        f"kill_window_{KILL_WINDOW_S}s_lag_p50_s": pct(window, 50), f"kill_window_{KILL_WINDOW_S}s_lag_p99_s":
            pct(window, 99), f"kill_window_{KILL_WINDOW_S}s_lag_max_s": max(window, default=float("nan")),
        "sent_while_down": len(outage), "of_which_stored_after_restart": sum(got >= restart_at for _, got in outage),
        "per_minute_p50/p99/max_s": " | ".join(f"{m}: {pct(xs, 50):.2f}/{pct(xs, 99):.2f}/{max(xs):.1f}"
                                                for m, xs in sorted(minutes.items())),
    }


def dashboard(broker: Mosquitto, db: str, device: str, work: Path, n: int = 40) -> dict:
    cfg = work / "fleet.toml"
    port = free_port()
    cfg.write_text(f'[fleet]\ndatabase = "{db}"\nauth_database = "{work / "auth.db"}"\nport = {port}\n'
                   'anonymous_read = true\nshare_group = "dash"\n')
    with open(work / "serve.log", "ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "edgetune.main", "fleet", "serve", "--config", str(cfg),
                                 "--broker", f"{broker.host}:{broker.port}", "--client-id", "bench-serve"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                env=os.environ | {"PYTHONPATH": str(REPO)})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "/healthz", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((work / "serve.log").read_text()[-2000:])
                time.sleep(0.2)
        out = {"load_before": load()}
        for name, path in (("overview", "/"), ("device", f"/devices/{device}"), ("device list", "/devices")):
            times = []
            for _ in range(n):
                t = time.perf_counter()
                with urllib.request.urlopen(base + path, timeout=30) as r:
                    assert r.status == 200
                    r.read()
                times.append(time.perf_counter() - t)
            out[name] = {"p50_ms": 1000 * pct(times, 50), "p95_ms": 1000 * pct(times, 95)}
        out["load_after"] = load()
        return out
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=10.0, help="of the sustained run (0: only the ingest rates)")
    ap.add_argument("--burst", type=int, default=20000, help="telemetry messages per ingest-rate run (0: skip)")
    ap.add_argument("--backend", choices=("postgresql", "sqlite"), default="postgresql",
                    help="fleet DB of the sustained run and the dashboard")
    ap.add_argument("--receivers", type=int, choices=(1, 2), default=2, help="receivers in the sustained run")
    ap.add_argument("--restart-after", type=float, metavar="S",
                    help="seconds the killed receiver stays down (default: the fleet unit's RestartSec)")
    args = ap.parse_args()
    if missing_reason():
        print(missing_reason(), file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="fleet-load-"))
    broker = Mosquitto(work / "broker", extra_conf=["max_queued_messages 0"]).start()
    pg = PgCluster().init()
    print(f"fleet_load: {args.devices} devices, {args.minutes:g} min, burst {args.burst}; {load()}; work {work}",
          flush=True)
    try:
        print("\n1. ingest rate (queued telemetry drained by the receivers)")
        runs = [("sqlite", 1, None, False), ("sqlite", 2, None, False), ("postgresql", 1, None, False),
                ("postgresql", 2, None, False), ("postgresql", 1, None, True), ("postgresql", 1, 0, True)]
        base = {}
        for backend, n, window, live in runs if args.burst else ():
            db = str(work / f"burst-{n}-{window}-{live}.db") if backend == "sqlite" else pg.create_db()
            r = burst(broker, db, n, args.burst, work, window, live)
            ref = base.setdefault((backend, live), r["rate"])
            label = (f"{backend} x{n} receiver{'s' if n > 1 else ' '}" + (", live" if live else "")
                     + (", window 20" if window == 0 else ""))
            print(f"   {label:40s}: {r['rate']:7.0f} msg/s ({r['rate'] / ref:.2f}x; {r['stored']} in {r['s']:.1f} s, "
                  f"split {r['split']}, messages per batch {r['batch']}); {r['load']}", flush=True)
        if not args.minutes:
            return 0
        down = restart_sec() if args.restart_after is None else args.restart_after
        print(f"\n2. sustained: {args.devices} devices at 1 Hz for {args.minutes:g} min, {args.backend}, "
              f"{args.receivers} receiver(s) (2: sharing the subscription), one SIGKILLed half-way and restarted "
              f"{down:g} s later" + (" (the unit's RestartSec)" if args.restart_after is None else ""))
        db = pg.create_db() if args.backend == "postgresql" else str(work / "sustained.db")
        r = sustained(broker, db, args.devices, int(args.minutes * 60), args.receivers, work,
                      pg if args.backend == "postgresql" else None, down)
        for k, v in r.items():
            print(f"   {k}: {v:.3f}" if isinstance(v, float) else f"   {k}: {v}", flush=True)
        print(f"\n3. dashboard pages with that fleet in the DB (fleet serve, {args.backend}; target p95 < 300 ms)")
        d = dashboard(broker, db, "sim-load-0001", work)
        for k, v in d.items():
            print(f"   {k}: {v}", flush=True)
    finally:
        broker.stop()
        pg.destroy()
        print(f"\nfleet_load done; {load()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
