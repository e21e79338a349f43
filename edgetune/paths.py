"""Where state, cache and the control socket live.

systemd hands a service $STATE_DIRECTORY, $CACHE_DIRECTORY and $RUNTIME_DIRECTORY; an installed copy run
as root uses the FHS dirs; a user (or a checkout) falls back to per-user XDG dirs.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from edgetune.errors import EdgetuneError

_CHECKOUT = (Path(__file__).resolve().parent.parent / "pyproject.toml").exists()


def _system_wide() -> bool:
    return os.geteuid() == 0 and not _CHECKOUT


def _pick(env: str, system: str, xdg_env: str, xdg_default: Path) -> Path:
    # systemd may pass several dirs separated by ':'; the first is ours.
    if os.environ.get(env):
        return Path(os.environ[env].split(":")[0])
    if _system_wide():
        return Path(system)
    return Path(os.environ.get(xdg_env) or xdg_default) / "edgetune"


def _ensure(p: Path, env: str) -> Path:
    """`p`, created if missing; a path that cannot be a directory is a clear error naming the variable to set."""
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "not a directory" if p.exists() else e.strerror
        raise EdgetuneError(f"cannot use {p} as edgetune's {_ROLE[env]} dir: {why}; set {env} to a "
                            "writable directory") from None
    return p


_ROLE = {"STATE_DIRECTORY": "state", "CACHE_DIRECTORY": "cache", "RUNTIME_DIRECTORY": "runtime"}


def state_dir() -> Path:
    return _ensure(_pick("STATE_DIRECTORY", "/var/lib/edgetune", "XDG_STATE_HOME", Path.home() / ".local/state"),
                   "STATE_DIRECTORY")


def cache_dir() -> Path:
    return _ensure(_pick("CACHE_DIRECTORY", "/var/cache/edgetune", "XDG_CACHE_HOME", Path.home() / ".cache"),
                   "CACHE_DIRECTORY")


def runtime_dir() -> Path:
    if os.environ.get("RUNTIME_DIRECTORY"):
        return _ensure(Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0]), "RUNTIME_DIRECTORY")
    if _system_wide():
        return _ensure(Path("/run/edgetune"), "RUNTIME_DIRECTORY")
    if os.environ.get("XDG_RUNTIME_DIR"):
        return _ensure(Path(os.environ["XDG_RUNTIME_DIR"]) / "edgetune", "RUNTIME_DIRECTORY")
    return _private(Path(f"/tmp/edgetune-{os.getuid()}"))


def _private(p: Path) -> Path:
    """A per-user dir in the shared /tmp: another user may have created it first, to read or replace the control
    socket, so it must be ours, a real directory, and closed to others."""
    try:
        p.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
        raise EdgetuneError(f"runtime dir {p} is not private to uid {os.getuid()} ({kind}, owner uid {st.st_uid}, "
                            f"mode {stat.S_IMODE(st.st_mode):o}); remove it, or set RUNTIME_DIRECTORY or "
                            "XDG_RUNTIME_DIR to a directory of your own")
    return p


def config_dir() -> Path:
    """Not created: a missing config dir just means defaults."""
    if os.environ.get("CONFIGURATION_DIRECTORY"):
        return Path(os.environ["CONFIGURATION_DIRECTORY"].split(":")[0])
    return Path("/etc/edgetune")
