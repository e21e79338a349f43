"""The software image a device runs: what fw_fingerprint hashes, so an OS or kernel update is noticed."""

from __future__ import annotations

import os
from pathlib import Path

from edgetune import __version__
from hwprobe.sysfs import read

_OS_RELEASE_KEYS = {"IMAGE_VERSION": "image_version", "BUILD_ID": "build_id", "VERSION_ID": "version_id"}
_MODEL_PATHS = ("proc/device-tree/model", "sys/firmware/devicetree/base/model")


def _os_release(root: Path) -> dict[str, str]:
    text = read(root, "etc/os-release") or read(root, "usr/lib/os-release") or ""
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in _OS_RELEASE_KEYS:
            values[_OS_RELEASE_KEYS[key]] = value.strip().strip("\"'")
    return values


def firmware_info(root: Path, live: bool) -> dict[str, str]:
    """os-release IMAGE_VERSION/BUILD_ID/VERSION_ID, kernel release, device-tree model and edgetune version;
    "" for what is absent."""
    info = dict.fromkeys(_OS_RELEASE_KEYS.values(), "") | _os_release(root)
    info["kernel"] = os.uname().release if live else read(root, "proc/sys/kernel/osrelease") or ""
    info["model"] = next((m for m in (read(root, p) for p in _MODEL_PATHS) if m), "")
    info["edgetune"] = __version__
    return info
