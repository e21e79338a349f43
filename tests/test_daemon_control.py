"""The CLI against a control socket that misbehaves (never replies, closes without a reply, sends garbage) and
against a daemon that dies while `retune --wait` follows it: always a clear error and exit 1, never a traceback."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.polling import wait_until
from tests.test_daemon_support import REPO, WORKLOAD_PW4, DaemonProc, daemon_config


class FakeDaemon:
    """A control socket that accepts and reads each request, then does `answer(conn)`."""

    def __init__(self, path: Path, answer):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen()
        self.answer, self.conns = answer, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.conns.append(conn)
            conn.recv(65536)
            self.answer(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


ANSWERS = {
    "not answering within 10 s": lambda conn: None,  # keeps the connection open, says nothing
    "closed the connection without a reply": lambda conn: conn.close(),
    "sent an unreadable reply": lambda conn: (conn.sendall(b"<html>nope</html>\n"), conn.close()),
}


@pytest.mark.parametrize("why", ANSWERS)
def test_a_control_socket_that_does_not_answer_is_a_clear_error(tmp_path, why):
    """`ping`/`status` crashed with a TimeoutError, StopIteration or JSONDecodeError traceback."""
    d = DaemonProc(daemon_config(tmp_path, None))
    sock = Path(d.env["RUNTIME_DIRECTORY"]) / "control.sock"
    fake = FakeDaemon(sock, ANSWERS[why])
    # each call of the silent one waits out the CLI's 10 s: ping for a person, status for a script
    calls = [("ping",), ("status", "--json")] if why.startswith("not answering") else \
        [(v, *j) for v in ("ping", "status") for j in ((), ("--json",))]
    try:
        for call in calls:
            r = d.cli(*call)
            assert r.returncode == 1 and "Traceback" not in r.stderr, (call, r.stderr)
            if "--json" not in call:
                assert f"daemon {why}" in r.stderr, r.stderr
                continue
            doc = json.loads(r.stdout)
            assert f"daemon {why}" in doc["error"] and (doc["running"], doc["socket"]) == (None, str(sock)), doc
    finally:
        fake.close()


def test_retune_wait_fails_when_the_daemon_dies_before_a_final_status(tmp_path):
    """`retune --wait` printed `in_progress` and exited 0 when the daemon died mid-retune."""
    d = DaemonProc(daemon_config(tmp_path, None, WORKLOAD_PW4)).start()
    try:
        d.wait_status(lambda s: s["state"] == "idle" and s.get("last_tune"), 120)
        cli = subprocess.Popen([sys.executable, "-m", "edgetune.main", "retune", "--wait", "--force", "--budget",
                                "40", "--strategy", "random", "--json"], cwd=REPO, env=d.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        d.wait_status(lambda s: s["job"] and s["job"]["progress"] > 0, 120)
        d.kill9()
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 1, (out, err)
        doc = json.loads(out)
        assert "connection closed before a final status" in doc["error"] and "in_progress" in doc["error"], doc
    finally:
        d.stop()


def test_a_request_the_daemon_fails_on_gets_an_error_reply(tmp_path):
    """A handler that raised closed the connection without a word (the CLI then printed `{}` and exited 0)."""
    d = DaemonProc(daemon_config(tmp_path, None)).start()
    try:
        d.wait_status(lambda s: "session" in s, 120)
        reply = d.request({"op": "retune", "workloads": ["gemm/custom.M1-N1-K" + "9" * 400]})
        assert reply["ok"] is False and reply["exit"] == 2 and "far too large" in reply["error"], reply
        wait_until(lambda: d.request({"op": "ping"})["ok"], "the daemon to answer after it")
        assert "Exception occurred during processing of request" not in d.log
        assert d.signal(signal.SIGTERM) == 0
    finally:
        d.stop()
