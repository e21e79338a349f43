"""`GET /releases/{sha256}`: the model file a signed release names, for devices to download.

No credentials: a device has none, and what it downloads is worth nothing without the signed manifest, which names
the file's sha256 and size (the device checks both). Range requests let a device resume (Starlette's FileResponse
answers `Range: bytes=N-` with 206 and Content-Range); the response carries the file's sha256 as ETag and
Repr-Digest. The bytes live in the fleet DB; each is written once to a cache file (atomically, checked against
the registered sha256), and checked again whenever that file changed on disk, so a damaged or replaced cache file
is rewritten from the DB rather than served.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, MalformedRangeHeader, Response
from starlette.routing import Route

from edgetune import paths
from edgetune.atomic import write_atomic
from edgetune.release import SHA256_RE
from edgetune.sqlite import DBError
from fleet import rollout_store as rs
from fleet.store import FleetStore
from fleet.web.app import RETRY_AFTER_S, fleet_of

_checked: dict[str, tuple[int, int]] = {}  # sha256 -> (size, mtime_ns) of the cache file when it last matched
_lock = threading.Lock()


def cache_dir() -> Path:
    d = paths.cache_dir() / "fleet-releases"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _sha_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cached_file(store: FleetStore, sha: str) -> Path | None:
    """The cache file holding the registered model `sha`, (re)written from the DB when missing or changed; None
    when no registered model has that sha256."""
    path = cache_dir() / f"{sha}.gguf"
    with _lock:
        try:
            st = path.stat()
            if _checked.get(sha) == (st.st_size, st.st_mtime_ns) or _sha_of(path) == sha:
                _checked[sha] = (st.st_size, st.st_mtime_ns)
                return path
        except FileNotFoundError:
            pass
        data = rs.model_data(store, sha)
        if data is None:
            return None
        if hashlib.sha256(data).hexdigest() != sha:  # the DB row itself is damaged: serve nothing rather than it
            raise RuntimeError(f"model {sha[:16]}… in the fleet DB does not match its sha256")
        write_atomic(path, data, mode=0o644)
        st = path.stat()
        _checked[sha] = (st.st_size, st.st_mtime_ns)
        return path


async def release_file(request: Request) -> Response:
    sha = request.path_params["sha256"]
    if not SHA256_RE.fullmatch(sha):
        return Response("not a sha256: /releases/<64 lowercase hex digits>\n", 404, media_type="text/plain")
    fleet = fleet_of(request)
    try:
        path = await run_in_threadpool(lambda: cached_file(fleet.stores(), sha))
    except RuntimeError as e:
        return Response(f"{e}\n", 500, media_type="text/plain")
    except DBError as e:  # passing (PostgreSQL restarting): the device's download tries again
        return Response(f"{e}; try again in a moment\n", 503, media_type="text/plain",
                        headers={"Retry-After": RETRY_AFTER_S})
    if path is None:
        return Response(f"no model with sha256 {sha} is registered\n", 404, media_type="text/plain")
    etag = f'"{sha}"'
    cache = {"etag": etag, "cache-control": "public, max-age=31536000, immutable"}
    if _matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=cache)
    digest = base64.b64encode(bytes.fromhex(sha)).decode()
    return _ReleaseFile(path, media_type="application/octet-stream",
                        headers={**cache, "repr-digest": f"sha-256=:{digest}:"})


def _matches(if_none_match: str | None, etag: str) -> bool:
    """If-None-Match against our ETag, by the weak comparison RFC 9110 §13.1.2 prescribes for it."""
    if if_none_match is None:
        return False
    tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in tags or etag in tags


class _ReleaseFile(FileResponse):
    """A FileResponse that ignores a Range header it cannot use (RFC 9110 §14.2: unparseable, or a range ending
    before it starts) and sends the whole file with 200, as Starlette's 400 would leave a device's download stuck;
    a range starting past the end stays a 416."""

    @classmethod
    def _parse_range_header(cls, http_range: str, file_size: int) -> list[tuple[int, int]]:
        try:
            return super()._parse_range_header(http_range, file_size)
        except MalformedRangeHeader:
            return []  # no ranges: the whole file


def routes() -> list[Route]:
    return [Route("/releases/{sha256}", release_file, methods=["GET", "HEAD"])]
