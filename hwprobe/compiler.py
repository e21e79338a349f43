"""Which C compiler builds will use, and its exact version: results are only comparable per compiler."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from hwprobe.descriptor import Compiler

NONE = Compiler(path=None, id="none", version="")


def _run(path: str, flag: str) -> str:
    try:
        return subprocess.run([path, flag], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def find_compiler(cc: str | None = None) -> Compiler:
    """`cc`, else $CC, else cc/gcc/clang on PATH. A named compiler that is missing gives NONE rather than a
    silent substitute; probing never fails for it, builds report it."""
    named = cc or os.environ.get("CC")
    candidates = [named] if named else ["cc", "gcc", "clang"]
    path = next((p for p in map(shutil.which, candidates) if p), None)
    if path is None:
        return NONE
    banner = _run(path, "--version")
    first_line = banner.partition("\n")[0]
    if "clang" in first_line:
        family, match = "clang", re.search(r"version (\d+(?:\.\d+)+)", first_line)
        version = match.group(1) if match else ""
    elif "gcc" in first_line.lower() or "Free Software Foundation" in banner:
        family, version = "gcc", _run(path, "-dumpfullversion").strip()
    else:
        family, version = "", ""
    if not (family and re.fullmatch(r"\d+(?:\.\d+)*", version)):
        return Compiler(path=path, id="unknown", version="")
    return Compiler(path=path, id=f"{family}-{version}", version=version)
