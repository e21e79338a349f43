"""edgetune.wakeup: the wake-up flag the daemon's and `fleet listen`'s signal handlers set (a signal storm on the
real daemon: tests/test_daemon_resilience.py)."""

from __future__ import annotations

import threading

from edgetune.wakeup import Wakeup


def test_it_behaves_as_an_event():
    w = Wakeup()
    assert not w.is_set() and w.wait(0.01) is False
    w.set()
    w.set()  # setting twice is still one "set"
    assert w.is_set() and w.wait(0) and w.wait(None)
    w.clear()
    assert not w.is_set()
    woke = threading.Event()
    t = threading.Thread(target=lambda: w.wait(30) and woke.set())
    t.start()
    w.set()  # from another thread
    t.join(30)
    assert woke.is_set()
