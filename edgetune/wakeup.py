"""A wake-up flag that a signal handler may set: the daemon's SIGHUP/SIGTERM and `fleet listen`'s SIGINT/SIGTERM.

`threading.Event.set()` takes the Event's lock. A handler runs in the main thread between two bytecodes, so when
the main thread is itself inside `wait()` or `clear()` with that lock held, the handler's `set()` waits for a lock
its own thread holds: the process hangs (a SIGTERM then never stops it), and further signals nest handlers until
a RecursionError kills it. A self-pipe takes no lock: `set()` is one non-blocking `os.write`, safe from a handler
and from any thread, and `wait()` is a `poll` that the signal interrupts and Python retries (PEP 475).
"""

from __future__ import annotations

import os
import select
import weakref


class Wakeup:
    """`set` / `is_set` / `wait` / `clear`, as `threading.Event`, minus the lock."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        weakref.finalize(self, _close_fds, self._r, self._w)

    def set(self) -> None:
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:  # the pipe is full: it is set already
            pass

    def is_set(self) -> bool:
        return self.wait(0)

    def wait(self, timeout: float | None = None) -> bool:
        """True once set (until `clear`), else False after `timeout` seconds."""
        p = select.poll()  # one per call: a poll object refuses concurrent use, and select() stops at fd 1024
        p.register(self._r, select.POLLIN)
        return bool(p.poll(None if timeout is None else max(0.0, timeout) * 1000))

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:  # drained
            pass


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)
