"""Download a release's model file over HTTP into a `.part` file, resuming from what it already holds.

A restart, a dropped connection or a server that stops half-way costs only the missing bytes: every request
after the first asks for `Range: bytes=<have>-` and accepts only a 206 whose Content-Range starts exactly there
and names the manifest's size (a 200 means the server ignored the range: the part starts over). Nothing past the
manifest's size is ever written, so a server (or an attacker in between) cannot fill the disk; the caller checks
size and sha256 (edgetune.release.check_file) before the file goes anywhere near a slot. Stdlib urllib only.
"""

from __future__ import annotations

import errno
import http.client
import logging
import os
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from edgetune.release import DISK_FULL, DOWNLOAD_FAILED, TOO_LARGE

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
RETRIES = 5  # consecutive attempts without a byte of progress before the download fails for good
BACKOFF_S = 0.5  # doubled after each attempt that made no progress
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class FetchFailed(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


class Stopped(Exception):
    """The caller asked to stop (daemon shutdown, a newer release); the part file stays for a resume."""


def fetch(url: str, part: Path, size: int, *, timeout: float, stopping: Callable[[float], bool],
          progress: Callable[[int], None] = lambda n: None) -> None:
    """Fill `part` up to `size` bytes from `url`. `stopping(wait_s)` waits up to wait_s and says whether to stop
    (it is also asked, with 0, between chunks). FetchFailed(reason) when it cannot finish."""
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if have > size:  # not this release's bytes: start over
        part.unlink()
        have = 0
    failures, wait, best = 0, BACKOFF_S, have
    while have < size:
        try:
            have = _get(url, part, have, size, timeout, stopping, progress)
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError) as e:
            have = part.stat().st_size if part.exists() else 0
            # progress is a byte never held before: a server that always stops at the same place fails for good
            failures = 0 if have > best else failures + 1
            best = max(best, have)
            log.warning("model download from %s stopped at %d of %d bytes (%s); attempt %d of %d without progress",
                        url, have, size, e, failures, RETRIES)
            if failures >= RETRIES:
                raise FetchFailed(DOWNLOAD_FAILED, f"{url}: {e} ({RETRIES} attempts without progress, {have} of "
                                                   f"{size} bytes kept for the next try)") from None
            if stopping(wait):
                raise Stopped from None
            wait = BACKOFF_S if failures == 0 else min(wait * 2, 30.0)


def _get(url: str, part: Path, have: int, size: int, timeout: float, stopping: Callable[[float], bool],
         progress: Callable[[int], None]) -> int:
    """One request; returns how many bytes the part holds afterwards."""
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the server's file is shorter than our part: not ours, start over
            part.unlink()
            raise urllib.error.URLError(f"range {have}- not satisfiable; starting over") from None
        if 500 <= e.code < 600:
            raise urllib.error.URLError(f"HTTP {e.code}") from None
        raise FetchFailed(DOWNLOAD_FAILED, f"{url}: HTTP {e.code} {e.reason}") from None
    with resp:
        if have and resp.status == 206:
            m = CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "").strip())
            if not m or int(m[1]) != have or m[3] not in ("*", str(size)):
                raise FetchFailed(DOWNLOAD_FAILED, f"{url}: Content-Range {resp.headers.get('Content-Range')!r} "
                                                   f"does not continue at byte {have} of {size}")
        elif resp.status == 200:
            have = 0  # a whole file: the server ignored the range (or this is the first request)
        else:
            raise FetchFailed(DOWNLOAD_FAILED, f"{url}: unexpected HTTP {resp.status}")
        length = resp.headers.get("Content-Length")
        if length and length.isdigit() and have + int(length) > size:
            raise FetchFailed(TOO_LARGE, f"{url}: the server offers {have + int(length)} bytes, the manifest says "
                                         f"{size}")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, have)
            os.lseek(fd, have, os.SEEK_SET)
            while have < size:
                if stopping(0):
                    raise Stopped
                chunk = resp.read(min(CHUNK, size - have + 1))
                if not chunk:
                    break
                if have + len(chunk) > size:
                    raise FetchFailed(TOO_LARGE, f"{url}: the server sent more than the manifest's {size} bytes")
                _write(fd, chunk, part)
                have += len(chunk)
                progress(have)
            if have == size and resp.read(1):
                raise FetchFailed(TOO_LARGE, f"{url}: the server sent more than the manifest's {size} bytes")
            os.fsync(fd)
        finally:
            os.close(fd)
        if have < size:
            raise http.client.IncompleteRead(b"", size - have)
    return have


def _write(fd: int, chunk: bytes, part: Path) -> None:
    view = memoryview(chunk)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise FetchFailed(DISK_FULL, f"no space left for the model download in {part.parent}") from None
        raise
