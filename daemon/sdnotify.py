"""The sd_notify protocol without libsystemd, so Type=notify and WatchdogSec work on minimal images.

systemd passes `$NOTIFY_SOCKET` (a filesystem path, or `@name` for an abstract socket) and, with WatchdogSec,
`$WATCHDOG_USEC` (plus `$WATCHDOG_PID` naming the process that must ping). A message is one datagram of
newline-separated `KEY=VALUE` lines. Outside systemd every call is a cheap no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def _address(raw: str) -> str | bytes:
    # '@' marks Linux's abstract namespace, whose address starts with a NUL byte.
    return b"\0" + raw[1:].encode() if raw.startswith("@") else raw


def notify(**fields: object) -> bool:
    """Send one datagram `K=V\\n...` to $NOTIFY_SOCKET, e.g. notify(READY=1, STATUS="idle").

    Returns False when not under systemd or when sending failed: the service keeps running either way, and a
    lost READY/WATCHDOG shows up in systemd, not as an exception here.
    """
    raw = os.environ.get("NOTIFY_SOCKET")
    if not raw or not fields:
        return False
    # systemd splits on newlines, so a value must not contain one (STATUS is free text).
    msg = "".join(f"{k}={str(v).replace(chr(10), ' ')}\n" for k, v in fields.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(msg, _address(raw))
        return True
    except OSError as e:
        log.debug("sd_notify to %s failed: %s", raw, e)
        return False


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC, as sd_watchdog_enabled advises), or None when
    no watchdog is asked of this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec:
        return None
    try:
        if pid and int(pid) != os.getpid():  # meant for a parent/child, not us
            return None
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None
