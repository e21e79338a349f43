"""Which C compiler builds will use, and its exact version: results are only comparable per compiler."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from edgetune.errors import EdgetuneError
from hwprobe.descriptor import Compiler

NONE = Compiler(path=None, id="none", version="")
DEFAULTS = ("cc", "gcc", "clang")


class CompilerMissing(EdgetuneError):
    """No C compiler: nothing can be built until one is installed."""


def compiler_path(cc: str | None = None, *, fallback: str | None = None) -> str:
    """The C compiler to run: `cc`, else $CC, else `fallback` (the probed compiler's path), else the first of
    cc, gcc, clang on PATH. A named compiler that is missing is an error naming it, never a silent substitute."""
    for named, source in ((cc, "asked for"), (os.environ.get("CC"), "$CC"), (fallback, "probed")):
        if not named:
            continue
        path = shutil.which(named)
        if path is None:
            flags = " (it names one program: flags such as -O2 do not belong in it)" if " " in named.strip() else ""
            raise CompilerMissing(f"C compiler {named!r} ({source}) not found{flags}; install one "
                                  "(e.g. `apt-get install gcc`) or point CC at it")
        return path
    path = next((p for p in map(shutil.which, DEFAULTS) if p), None)
    if path is None:
        raise CompilerMissing(f"no C compiler found (looked at $CC, {', '.join(DEFAULTS)}); install one "
                              "(e.g. `apt-get install gcc`) or point CC at it")
    return path


def _run(path: str, flag: str) -> str:
    try:
        return subprocess.run([path, flag], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def describe_compiler(cc: str | None = None) -> Compiler:
    """The compiler builds will use (see compiler_path) and its id. A named compiler that is missing gives NONE:
    probing never fails for it, builds report it."""
    try:
        path = compiler_path(cc)
    except CompilerMissing:
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
