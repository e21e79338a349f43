"""Waiting in tests for state another process makes: poll a predicate until it holds or a deadline passes."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], what: str | Callable[[], str], timeout: float = 30.0, *,
               interval: float = 0.05, poll: Callable[[], object] | None = None) -> T:
    """Return the first truthy value of `pred()`; fail the test naming `what` if none comes within `timeout` s.

    For state the test can only observe by polling: files, logs, a database or HTTP answers written by another
    process (a daemon, a broker, a server), which give no event to wait on. `pred` is checked first, and once more
    after the deadline passes; between checks `poll` is called when given (so a caller that does have an event can
    wait on it instead of sleeping), else the test sleeps `interval` s. `what` may be a callable, called only on
    timeout, so the failure can show state as it was then (a log's tail, the last HTTP answer).
    """
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        if poll is not None:
            poll()
        else:
            time.sleep(interval)
    return value
