"""Download a release's model file into a `.part` file, over HTTP or in MQTT chunks, resuming from what it already
holds. The caller checks size and sha256 (edgetune.release.check_file) of the finished part, whichever way it came.

HTTP: a restart, a dropped connection or a server that stops half-way costs only the missing bytes: every request
after the first asks for `Range: bytes=<have>-` and accepts only a 206 whose Content-Range starts exactly there
and names the manifest's size (a 200 means the server ignored the range: the part starts over). Nothing past the
manifest's size is ever written, so a server (or an attacker in between) cannot fill the disk. Stdlib urllib only.

MQTT (edgetune.protocol model/chunk, for devices that cannot reach the fleet's HTTP server): the device asks
(model/chunk/req) for a window of the chunks it misses, at most CHUNKS_PER_REQUEST, and asks again when no chunk
came for `timeout` s; RETRIES such silences in a row fail the download. Each chunk is written at its offset and
fsynced, and only then is its index appended to `<part>.chunks` (first line: the chunk size), so after a restart
or kill -9 the chunks listed there are not asked for again (a torn last line is ignored). A chunk that is
malformed, oversized, of another file, past the end or of the wrong length for its index is refused with the
reason in the log, and asked for again: nothing written is touched. The fleet's `error` answer (e.g. a file it
does not have) fails the download with that reason. A part begun over HTTP counts its whole chunks as held, and
an HTTP download after chunks keeps only the chunks in one run from the start (the rest of a sparse part would
read as zeros).
"""

from __future__ import annotations

import errno
import http.client
import logging
import os
import re
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from edgetune.atomic import write_atomic
from edgetune.protocol import CHUNKS_PER_REQUEST, ChunkRequest, ProtocolError, chunk_count, parse_chunk
from edgetune.release import DISK_FULL, DOWNLOAD_FAILED, TOO_LARGE

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
RETRIES = 5  # consecutive attempts without a byte of progress before the download fails for good
BACKOFF_S = 0.5  # doubled after each attempt that made no progress
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class FetchFailed(Exception):
    """`unreachable`: the fleet's HTTP server never answered (a device may then fetch over MQTT)."""

    def __init__(self, reason: str, message: str, unreachable: bool = False):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message, self.unreachable = reason, message, unreachable


class Stopped(Exception):
    """The caller asked to stop (daemon shutdown, a newer release); the part file stays for a resume."""


def fetch(url: str, part: Path, size: int, *, timeout: float, stopping: Callable[[float], bool],
          progress: Callable[[int], None] = lambda n: None) -> None:
    """Fill `part` up to `size` bytes from `url`. `stopping(wait_s)` waits up to wait_s and says whether to stop
    (it is also asked, with 0, between chunks). FetchFailed(reason) when it cannot finish."""
    part.parent.mkdir(parents=True, exist_ok=True)
    have = _contiguous(part, size)
    failures, wait, best = 0, BACKOFF_S, have
    while have < size:
        try:
            have = _get(url, part, have, size, timeout, stopping, progress)
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError) as e:
            have = _contiguous(part, size)
            # progress is a byte never held before: a server that always stops at the same place fails for good
            failures = 0 if have > best else failures + 1
            best = max(best, have)
            log.warning("model download from %s stopped at %d of %d bytes (%s); attempt %d of %d without progress",
                        url, have, size, e, failures, RETRIES)
            if failures >= RETRIES:
                unreachable = not isinstance(e, http.client.HTTPException) and not (
                    isinstance(e, urllib.error.URLError) and not isinstance(e.reason, OSError))
                raise FetchFailed(DOWNLOAD_FAILED, f"{url}: {e} ({RETRIES} attempts without progress, {have} of "
                                                   f"{size} bytes kept for the next try)", unreachable) from None
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
            _index(part).unlink(missing_ok=True)
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
            _index(part).unlink(missing_ok=True)  # from here on the part is one run from the start
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


def _index(part: Path) -> Path:
    return part.with_name(part.name + ".chunks")


def _read_index(part: Path) -> tuple[int, list[int]] | None:
    """The chunk size and the chunks `part`'s index lists (size 0: its first line is damaged); None without one.
    A torn last line (no newline after it) is left out."""
    index = _index(part)
    if not index.exists():
        return None
    lines = index.read_text().split("\n")
    if not lines[0].isdigit():
        return 0, []
    return int(lines[0]), [int(x) for x in lines[1:-1] if x.isdigit()]


def _held(part: Path, size: int, chunk_size: int, listing: tuple[int, list[int]] | None) -> set[int]:
    """The chunks of `part` on disk: those its index `listing` names (for this chunk size), else the whole chunks
    of an HTTP prefix."""
    n = chunk_count(size, chunk_size)
    if listing is not None and listing[0] == chunk_size:
        return {i for i in listing[1] if i < n}
    have = min(part.stat().st_size if part.exists() else 0, size)
    return set(range(n if have == size else have // chunk_size))


def _contiguous(part: Path, size: int) -> int:
    """The bytes from the start of `part` that an HTTP download may continue from (see the module doc); the part
    is cut there only when the server answers (`_get`), so chunks stay usable while HTTP is unreachable."""
    have = part.stat().st_size if part.exists() else 0
    listing = _read_index(part)
    if listing is not None:
        cs = listing[0]
        held = _held(part, size, cs, listing) if cs else set()
        have = min(have, next(i for i in range(len(held) + 1) if i not in held) * cs)  # up to the first gap
    return have if have <= size else 0  # longer: not this release's bytes, start over


def held_bytes(part: Path, size: int) -> int:
    """How much of the file `part` holds, whichever way it came (for the `downloading` report)."""
    listing = _read_index(part)
    if not listing or not listing[0]:
        return min(part.stat().st_size if part.exists() else 0, size)
    cs = listing[0]
    return sum(min(cs, size - i * cs) for i in _held(part, size, cs, listing))


@dataclass
class _Assembly:
    """The chunks of one file being written into its part: `take` writes a received chunk if it fits."""

    part: Path
    size: int
    sha256: str
    chunk_size: int
    held: set[int]
    fd: int
    listed: TextIO  # the index, open for appending

    def take(self, payload: bytes) -> bool:
        """Whether `payload` was a new chunk of this file, now on disk; FetchFailed for the fleet's error."""
        try:
            c = parse_chunk(payload, self.chunk_size)
        except ProtocolError as e:
            log.warning("model download: refused a chunk: %s", e)
            return False
        if c.sha256 != self.sha256:
            log.info("model download: ignoring a chunk of another file (%s…)", c.sha256[:16])
            return False
        if c.error is not None:
            raise FetchFailed(DOWNLOAD_FAILED, f"the fleet cannot send {self.sha256[:16]}… over MQTT: {c.error}")
        n = chunk_count(self.size, self.chunk_size)
        expected = min(self.chunk_size, self.size - c.index * self.chunk_size)
        if c.index >= n or len(c.data) != expected:
            log.warning("model download: refused chunk %d: %s", c.index, f"past the file's {n} chunks" if c.index >= n
                        else f"{len(c.data)} bytes, that chunk has {expected}")
            return False
        if c.index in self.held:
            return False
        os.lseek(self.fd, c.index * self.chunk_size, os.SEEK_SET)
        _write(self.fd, c.data, self.part)
        os.fsync(self.fd)  # the bytes are on disk before the index says so
        self.listed.write(f"{c.index}\n")
        self.listed.flush()
        self.held.add(c.index)
        return True

    def window(self) -> ChunkRequest:
        """A request for the first run of missing chunks, at most CHUNKS_PER_REQUEST long."""
        n = chunk_count(self.size, self.chunk_size)
        first = min(i for i in range(n) if i not in self.held)
        count = next((k for k in range(1, CHUNKS_PER_REQUEST) if first + k >= n or first + k in self.held),
                     CHUNKS_PER_REQUEST)
        return ChunkRequest(self.sha256, self.chunk_size, first, count)


def fetch_chunks(part: Path, size: int, sha256: str, chunk_size: int, *, timeout: float,
                 request: Callable[[bytes], None], receive: Callable[[float], bytes | None],
                 stopping: Callable[[float], bool]) -> None:
    """Fill `part` with the `size` bytes of file `sha256` from MQTT chunks (see the module doc): `request` sends a
    model/chunk/req payload, `receive(wait_s)` returns the next model/chunk payload or None after wait_s."""
    part.parent.mkdir(parents=True, exist_ok=True)
    index, listing = _index(part), _read_index(part)
    if listing is None or listing[0] != chunk_size:  # none (an HTTP prefix, if anything), another size, damaged:
        if part.exists():  # keep the run from the start
            os.truncate(part, _contiguous(part, size))
        index.unlink(missing_ok=True)
        listing = None
    n, held = chunk_count(size, chunk_size), _held(part, size, chunk_size, listing)
    if not index.exists():
        write_atomic(index, "".join(f"{i}\n" for i in [chunk_size, *sorted(held)]).encode())
    if held:
        log.info("model download over MQTT: resuming with %d of %d chunks on disk", len(held), n)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with index.open("a") as listed:
            a, silences = _Assembly(part, size, sha256, chunk_size, held, fd, listed), 0
            while len(held) < n:
                want = a.window()
                request(want.encode())
                got, deadline = False, time.monotonic() + timeout
                while not all(i in held for i in range(want.first, want.first + want.count)) and \
                        time.monotonic() < deadline:
                    if stopping(0):
                        raise Stopped
                    payload = receive(deadline - time.monotonic())
                    if payload is not None and a.take(payload):
                        got, deadline = True, time.monotonic() + timeout
                silences = 0 if got else silences + 1
                if silences >= RETRIES:
                    raise FetchFailed(DOWNLOAD_FAILED, f"no chunk of {sha256[:16]}… came over MQTT in {RETRIES} "
                                                       f"requests of {timeout:g} s each ({len(held)} of {n} chunks "
                                                       "kept for the next try)")
        os.fsync(fd)
    finally:
        os.close(fd)
    index.unlink()


def _write(fd: int, chunk: bytes, part: Path) -> None:
    view = memoryview(chunk)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise FetchFailed(DISK_FULL, f"no space left for the model download in {part.parent}") from None
        raise
