"""The local control socket: <runtime_dir>/control.sock, mode 0660, one JSON object per line.

A client sends one request line ({"op": ..., ...}) and reads reply lines until the daemon closes the connection;
`retune --wait` is the one request answered with several lines (every state of the command). Who may talk to
the daemon is decided by the socket's owner, group and mode, as for any Unix service.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

from edgetune import paths
from edgetune.errors import EdgetuneError

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024
SOCKET_MODE = 0o660

Send = Callable[[dict], None]
Handler = Callable[[dict, Send], None]


class DaemonDown(EdgetuneError):
    """The daemon is not running (exit 1)."""


class NotListening(DaemonDown):
    """Nothing listens on the control socket: `reason` says why (the socket file is missing, or a stale one
    refuses the connection), so `status --json` can report it as data, not only as a message."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"the edgetune daemon is not running ({reason} at {path}); "
                         "start it with `systemctl start edgetune` or `edgetune daemon`")
        self.path, self.reason = path, reason


class NoReply(EdgetuneError):
    """Something holds the control socket but gave no usable answer (exit 1): it timed out, closed the connection
    early or sent what is not JSON. `reason` says which, for `--json` output as for DaemonDown."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{reason} (control socket {path}); its log says why: `journalctl -u edgetune`")
        self.path, self.reason = path, reason


class AlreadyRunning(EdgetuneError):
    pass


def socket_path() -> Path:
    return paths.runtime_dir() / "control.sock"


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    handler: Handler


class _Conn(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        send = lambda doc: self.wfile.write(json.dumps(doc, default=str).encode() + b"\n")  # noqa: E731
        try:
            line = self.rfile.readline(MAX_REQUEST + 1)
            try:
                req = json.loads(line)
                if not isinstance(req, dict) or len(line) > MAX_REQUEST:
                    raise ValueError
            except ValueError:
                send({"ok": False, "error": "bad request: one JSON object per line expected"})
                return
            self._serve(req, send)
        except (BrokenPipeError, ConnectionResetError):  # the client went away (e.g. ^C on --wait)
            pass

    def _serve(self, req: dict, send: Send) -> None:
        """The handler's answer; a bug in it is an error reply, not a dropped connection the client cannot read."""
        try:
            self.server.handler(req, send)  # type: ignore[attr-defined]
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as e:
            log.exception("control request %.100s failed", json.dumps(req, default=str))
            send({"ok": False, "error": f"internal error: {type(e).__name__}: {str(e)[:200]}", "exit": 1})


class ControlServer:
    def __init__(self, handler: Handler, path: Path | None = None):
        self.path = path or socket_path()
        if self.path.exists():
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(str(self.path))
                raise AlreadyRunning(f"an edgetune daemon is already running (control socket {self.path})")
            except (ConnectionRefusedError, FileNotFoundError):
                self.path.unlink(missing_ok=True)  # left by a daemon that was killed
        old = os.umask(0o117)  # created 0660 from the start, no window with a wider mode
        try:
            self._server = _Server(str(self.path), _Conn)
        finally:
            os.umask(old)
        os.chmod(self.path, SOCKET_MODE)
        self._server.handler = handler
        self._thread = threading.Thread(target=self._server.serve_forever, name="control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)


def request(req: dict[str, Any], timeout: float | None = 10.0, path: Path | None = None) -> Iterator[dict]:
    """Send one request; yield the reply lines (at least one). Raises DaemonDown when nothing listens on the
    socket, NoReply when what listens does not answer within `timeout` s per line, closes without a reply or
    sends a line that is not a JSON object."""
    path = path or socket_path()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
    except FileNotFoundError:
        s.close()
        raise NotListening(path, "no control socket") from None
    except ConnectionRefusedError:
        s.close()
        raise NotListening(path, "connection refused by the control socket") from None
    except PermissionError:
        s.close()
        raise EdgetuneError(f"no permission to talk to the daemon at {path}: join the socket's group") from None
    with s, s.makefile("rwb") as f:
        f.write(json.dumps(req).encode() + b"\n")
        f.flush()
        replies = 0
        for line in _lines(f, path, timeout):
            yield _reply(line, path)
            replies += 1
        if not replies:
            raise NoReply(path, "daemon closed the connection without a reply")


def _lines(f: Any, path: Path, timeout: float | None) -> Iterator[bytes]:
    """The reply lines as they come; a silence longer than `timeout` is NoReply."""
    while True:
        try:
            line = f.readline()
        except TimeoutError:
            raise NoReply(path, f"daemon not answering within {timeout:g} s") from None
        if not line:
            return
        yield line


def _reply(line: bytes, path: Path) -> dict:
    try:
        doc = json.loads(line)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise NoReply(path, f"daemon sent an unreadable reply: {line[:80]!r}")
    return doc
