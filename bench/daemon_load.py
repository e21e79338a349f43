"""Daemon load figures: idle RSS and CPU over 60 s, outbox throughput to a local broker, drain time after a restart.

    python bench/daemon_load.py [--idle-s 60] [--messages 10000]

Starts its own mosquitto on a free port and uses throw-away state/runtime dirs. The idle figures are of the real
daemon process (`edgetune daemon`) after its start-up tune of one small workload; the outbox figures drive the
daemon's own Outbox + Link in this process, so they measure that path alone (SQLite commit per enqueue, delete
on PUBACK, 64 messages in flight).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from daemon import control  # noqa: E402
from daemon.mqtt import Link  # noqa: E402
from daemon.outbox import Outbox  # noqa: E402
from edgetune.broker import BrokerSettings  # noqa: E402
from edgetune.protocol import Topics  # noqa: E402
from tests.broker import Mosquitto  # noqa: E402

WORKLOAD = '[[workload]]\nkernel = "gemm"\nname = "kws_dscnn.fc"\nshape = { M = 1, N = 12, K = 64 }\n'


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def unsent(outbox: dict) -> int:
    """Messages the broker has not taken yet. A tuning record stays in the outbox after the broker's PUBACK until
    a fleet receiver acknowledges it (end-to-end delivery), and this bench runs no fleet: such rows are sent."""
    return outbox["messages"] - outbox.get("awaiting_fleet_ack", 0)


def idle_figures(tmp: Path, broker: Mosquitto, idle_s: float) -> dict:
    env = dict(os.environ)
    for name in ("STATE_DIRECTORY", "RUNTIME_DIRECTORY", "CACHE_DIRECTORY"):
        env[name] = str(tmp / name.lower())
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "workloads.toml").write_text(WORKLOAD)
    cfg = tmp / "edgetune.toml"
    # no idle gating: on a shared machine the start-up tune would otherwise wait for a quiet moment
    cfg.write_text(f'device_id = "bench"\nidle_load_threshold = 1000\n'
                   f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'
                   f'[tuning]\nbudget = 3\nworkloads = ["{tmp / "workloads.toml"}"]\n')
    with open(tmp / "daemon.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "edgetune.main", "daemon", "--config", str(cfg)], cwd=REPO,
                                env=env, stdout=subprocess.DEVNULL, stderr=log)
    sock = Path(env["RUNTIME_DIRECTORY"]) / "control.sock"

    def settled() -> dict | None:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited:\n{(tmp / 'daemon.log').read_text()[-2000:]}")
        try:
            st = next(control.request({"op": "status"}, path=sock))
        except (control.DaemonDown, OSError, StopIteration):
            return None
        ok = (st["state"] == "idle" and st.get("last_tune") and st["broker"]["connected"]
              and unsent(st["outbox"]) == 0)
        return st if ok else None

    try:
        wait_for(settled, 300, "the daemon to finish its start-up tune and go idle")
        p = psutil.Process(proc.pid)
        cpu0, t0 = p.cpu_times(), time.monotonic()
        rss_max = 0
        while time.monotonic() - t0 < idle_s:
            rss_max = max(rss_max, p.memory_info().rss)
            time.sleep(1.0)
        cpu1, dt = p.cpu_times(), time.monotonic() - t0
        busy = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        return {"idle_s": round(dt, 1), "rss_mb": round(p.memory_info().rss / 2**20, 1),
                "rss_max_mb": round(rss_max / 2**20, 1), "cpu_percent": round(100 * busy / dt, 3),
                "threads": p.num_threads()}
    finally:
        proc.terminate()
        proc.wait(30)


def fill(ob: Outbox, topics: Topics, n: int) -> float:
    """Queue n telemetry-sized messages (kind record, so none is dropped); returns the enqueue rate."""
    t = time.perf_counter()
    for i in range(n):
        ob.enqueue(topics.record, json.dumps({"seq": i, "pad": "x" * 200}).encode(), kind="record")
    return n / (time.perf_counter() - t)


def outbox_figures(tmp: Path, broker: Mosquitto, n: int) -> dict:
    topics = Topics("bench-outbox")
    ob = Outbox(tmp / "outbox.db", max_bytes=1 << 30)
    link = Link(BrokerSettings(host=broker.host, port=broker.port), topics, ob, will=lambda: b'{"state":"lost"}',
                on_connected=lambda: None, on_command=lambda p: None)
    out: dict = {"messages": n}
    out["enqueue_per_s"] = round(fill(ob, topics, n))
    t = time.perf_counter()
    link.start()
    wait_for(lambda: link.connected, 30, "the link to connect")
    assert link.flush(600)
    out["throughput_per_s"] = round(n / (time.perf_counter() - t))

    broker.stop()
    wait_for(lambda: not link.connected, 30, "the link to notice the broker is gone")
    fill(ob, topics, n)
    t = time.perf_counter()
    broker.start()
    wait_for(lambda: link.connected, 120, "the link to reconnect")
    reconnect = time.perf_counter() - t
    assert link.flush(600) and ob.depth()[0] == 0
    total = time.perf_counter() - t
    out |= {"restart_reconnect_s": round(reconnect, 2), "restart_drain_s": round(total - reconnect, 2),
            "restart_total_s": round(total, 2)}
    link.stop()
    ob.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--messages", type=int, default=10_000)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the link's "connection lost" during the restart is expected
    with tempfile.TemporaryDirectory(prefix="edgetune-bench-") as d:
        tmp = Path(d)
        broker = Mosquitto(tmp / "broker").start()
        try:
            idle = idle_figures(tmp / "daemon", broker, args.idle_s)
            ob = outbox_figures(tmp, broker, args.messages)
        finally:
            broker.stop()
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cpus, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"daemon idle over {idle['idle_s']} s: RSS {idle['rss_mb']} MiB (max {idle['rss_max_mb']} MiB), "
          f"CPU {idle['cpu_percent']}% of one core, {idle['threads']} threads")
    print(f"outbox enqueue: {ob['enqueue_per_s']} msgs/s (one SQLite commit each)")
    print(f"outbox throughput to a local broker: {ob['throughput_per_s']} msgs/s ({ob['messages']} messages, "
          "QoS 1, deleted on PUBACK)")
    print(f"drain of {ob['messages']} queued messages after a broker restart: {ob['restart_total_s']} s "
          f"(reconnect {ob['restart_reconnect_s']} s + drain {ob['restart_drain_s']} s)")
    print(json.dumps({"idle": idle, "outbox": ob}))


if __name__ == "__main__":
    main()
