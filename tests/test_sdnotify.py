"""sd_notify over a real datagram socket: filesystem and abstract addresses, the watchdog interval, and the
daemon itself announcing READY, WATCHDOG and STATUS as systemd would see them."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from daemon import sdnotify

EDGETUNE = Path(sys.executable).parent / "edgetune"


@pytest.fixture
def listener(tmp_path, monkeypatch, request):
    """A bound SOCK_DGRAM socket standing in for systemd; NOTIFY_SOCKET points at it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if getattr(request, "param", "path") == "abstract":
        name = f"edgetune-test-{uuid.uuid4().hex}"
        s.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    else:
        path = tmp_path / "notify.sock"
        s.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    s.settimeout(5)
    yield s
    s.close()


@pytest.mark.parametrize("listener", ["path", "abstract"], indirect=True)
def test_ready_status_watchdog_arrive(listener) -> None:
    assert sdnotify.notify(READY=1, STATUS="tuning gemm/kws_dscnn.fc (40%)")
    assert listener.recv(4096) == b"READY=1\nSTATUS=tuning gemm/kws_dscnn.fc (40%)\n"
    assert sdnotify.notify(WATCHDOG=1)
    assert listener.recv(4096) == b"WATCHDOG=1\n"
    assert sdnotify.notify(STOPPING=1)
    assert listener.recv(4096) == b"STOPPING=1\n"


def test_status_newlines_cannot_forge_fields(listener) -> None:
    sdnotify.notify(STATUS="line one\nREADY=1")
    assert listener.recv(4096) == b"STATUS=line one READY=1\n"


def test_outside_systemd_is_a_noop(monkeypatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify(READY=1) is False


def test_nobody_listening_is_not_an_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert sdnotify.notify(WATCHDOG=1) is False


@pytest.mark.parametrize("usec,pid,expected", [
    ("20000000", None, 10.0),
    ("20000000", "self", 10.0),
    ("20000000", "1", None),  # meant for another process
    (None, None, None),
    ("0", None, None),
    ("soon", None, None),
])
def test_watchdog_interval(monkeypatch, usec, pid, expected) -> None:
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", str(os.getpid()) if pid == "self" else pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert sdnotify.watchdog_interval() == expected


WAITING = "STATUS=waiting for idle before tuning: load1 per core "


def _daemon_verb() -> bool:
    if not (Path(sdnotify.__file__).parent / "service.py").exists():
        return False
    r = subprocess.run([str(EDGETUNE), "daemon", "--help"], capture_output=True, text=True)
    return r.returncode == 0


@pytest.mark.skipif(not _daemon_verb(), reason="the `edgetune daemon` verb (daemon/service.py) is not there yet")
def test_daemon_speaks_sd_notify(tmp_path, listener) -> None:
    """The real daemon, started as systemd would: NOTIFY_SOCKET and WATCHDOG_USEC set, no broker configured."""
    from tests.test_daemon_support import DaemonProc, daemon_config

    d = DaemonProc(daemon_config(tmp_path, None, idle_load_threshold=1e-9))  # its first tune waits for idle
    d.env |= {"WATCHDOG_USEC": "1000000"}  # pings expected every 0.5 s
    d.env.pop("WATCHDOG_PID", None)
    d.start()
    got: list[tuple[float, str]] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            fields = [f for t, m in got for f in m.splitlines()]
            if "READY=1" in fields and fields.count("WATCHDOG=1") >= 4 and any(f.startswith(WAITING) for f in fields):
                break
            assert d.proc.poll() is None, f"daemon exited:\n{d.log[-3000:]}"
            try:
                got.append((time.monotonic(), listener.recv(4096).decode()))
            except TimeoutError:
                pass
        assert d.signal(signal.SIGTERM) == 0
        while True:  # drain what it said on the way out
            listener.settimeout(0.5)
            try:
                got.append((time.monotonic(), listener.recv(4096).decode()))
            except TimeoutError:
                break
    finally:
        d.stop()
    t0 = got[0][0] if got else 0.0
    for t, m in got:
        print(f"+{t - t0:6.2f}s  {m.strip()!r}")
    fields = [f for _, m in got for f in m.splitlines()]
    assert "READY=1" in fields, d.log[-3000:]
    waiting = next(f for f in fields if f.startswith(WAITING))  # not "tuning ... (0%)" while nothing runs
    assert "under 1e-09 needed (idle_load_threshold); broker no broker" in waiting, waiting
    assert "STOPPING=1" in fields
    pings = [t for t, m in got if "WATCHDOG=1" in m.splitlines()]
    ready_at = next(t for t, m in got if "READY=1" in m.splitlines())
    assert len(pings) >= 4 and pings[-1] > ready_at
    gap = statistics.median(b - a for a, b in zip(pings, pings[1:]))
    print(f"watchdog: {len(pings)} pings, median gap {gap:.2f} s for WATCHDOG_USEC=1 s")
    assert 0.3 <= gap <= 0.8  # half of WATCHDOG_USEC


def _fields_until(listener, d, done, timeout: float = 120.0) -> list[str]:
    """The daemon's sd_notify fields, in order, until `done(fields)` holds (it must not exit meanwhile)."""
    fields: list[str] = []
    deadline = time.monotonic() + timeout
    while not done(fields):
        assert time.monotonic() < deadline, f"no such notification in {timeout:g} s: {fields}\n{d.log[-3000:]}"
        assert d.proc.poll() is None, f"daemon exited:\n{d.log[-3000:]}"
        try:
            fields += listener.recv(4096).decode().splitlines()
        except TimeoutError:
            pass
    return fields


@pytest.mark.skipif(not _daemon_verb(), reason="the `edgetune daemon` verb (daemon/service.py) is not there yet")
def test_a_daemon_starting_on_a_full_disk_extends_its_start_timeout_until_ready(tmp_path, listener) -> None:
    """Paused on a full disk before READY, the daemon asks systemd for more start time on every retry (else
    TimeoutStartSec kills it and Restart=on-failure loops), and sends READY once there is space."""
    from tests.test_daemon_support import DaemonProc, daemon_config
    from tests.test_delivery import fill, tmpfs

    with tmpfs(tmp_path / "fs") as fs:
        filler = fill(fs)
        d = DaemonProc(daemon_config(tmp_path, None, idle_load_threshold=1e-9),
                       env={**os.environ, "STATE_DIRECTORY": str(fs)})
        d.env |= {"WATCHDOG_USEC": "60000000"}
        d.env.pop("WATCHDOG_PID", None)
        d.start()
        try:
            fields = _fields_until(listener, d, lambda f: sum(x.startswith("EXTEND_TIMEOUT_USEC=") for x in f) >= 2)
            assert "READY=1" not in fields
            assert any(x.startswith("STATUS=paused: disk full") for x in fields), fields
            assert "EXTEND_TIMEOUT_USEC=15000000" in fields and "WATCHDOG=1" in fields
            filler.unlink()
            _fields_until(listener, d, lambda f: "READY=1" in f)
            assert d.signal(signal.SIGTERM) == 0
        finally:
            d.stop()
