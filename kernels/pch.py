"""A precompiled <immintrin.h> for the kernel builds that include it, where it pays.

On AVX-512 targets et_gemm.h includes <immintrin.h> (for masked tail loads and stores), and parsing that header
is most of the front end of a gemm, conv2d_3x3 or conv1d compile. Precompiled once per compiler and target flags
(~0.5 s, a 26 MB file in the cache) and forced in with `-include`, it took a third off each compile on an AMD
EPYC Zen 4 in bench/compile_time.py (10 random configs, 2 jobs: gemm 0.375 -> 0.224 s, conv2d_3x3 0.371 ->
0.221 s, conv1d 0.401 -> 0.268 s; the same machine code by objdump). The other kernels, and every target without
AVX-512, never include it: there, loading the precompiled file cost more than it saved (serial, default
configs: dwconv_3x3 +3%, gru +13%), so they build as before.

GCC takes the `.gch` beside the header only when the compile's flags match those it was made with; otherwise it
reads the header itself, which includes <immintrin.h> as the source would. So a stale, foreign or damaged `.gch`
makes a build slower, never different, and a compiler that cannot make one leaves builds as they were.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
from functools import cache
from pathlib import Path

from edgetune import paths
from edgetune.atomic import write_atomic

log = logging.getLogger(__name__)

HEADER = b"#include <immintrin.h>\n"
PCH_TIMEOUT_S = 60.0
_lock = threading.Lock()  # build_many's threads: one of them makes the .gch, the others wait for it
_failed: set[Path] = set()  # headers this process could not precompile: not tried again on every build


@cache
def defines_avx512(cc: str, target: tuple[str, ...]) -> bool:
    """Whether `cc` with these target flags defines __AVX512F__, the condition under which et_gemm.h includes
    <immintrin.h> (asked of the compiler: an ISA cap or an -march alias decides it, not the host's CPU flags)."""
    try:
        out = subprocess.run([cc, *target, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True,
                             timeout=PCH_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "#define __AVX512F__ 1" in out


def header(cc_id: str, flags: list[str]) -> Path:
    """Where the header compiled with `flags` (the build's own, minus its knobs, shape, input and output) lives."""
    key = hashlib.sha256("\0".join([cc_id, *flags, HEADER.decode()]).encode()).hexdigest()[:16]
    return paths.cache_dir() / "pch" / key / "et_immintrin.h"


def ensure(cc: str, cc_id: str, flags: list[str]) -> Path | None:
    """The header to `-include`, its `.gch` made first if missing (a failure is logged; the header still works);
    None when not even the header can be written (a full or read-only cache): build without it."""
    h = header(cc_id, flags)
    gch = h.with_name(h.name + ".gch")
    with _lock:
        try:
            h.parent.mkdir(parents=True, exist_ok=True)
            if not h.exists():
                write_atomic(h, HEADER, mode=0o644)
        except OSError as e:
            log.warning("no precompiled <immintrin.h>, builds parse it (slower, same code): %s", e)
            return None
        if not gch.exists() and h not in _failed:
            _precompile(cc, flags, h, gch)
    return h


def unreadable(h: Path, stderr: str) -> bool:
    """Whether a failed compile blamed the `.gch` of `h` (a damaged one is fatal where a mismatched one is
    skipped); if so it is removed and not made again by this process, so the compile can be run again."""
    if "PCH file" not in stderr:
        return False
    h.with_name(h.name + ".gch").unlink(missing_ok=True)
    _failed.add(h)
    log.warning("removed the unreadable precompiled header %s.gch: %s", h, stderr.strip()[:300])
    return True


def _precompile(cc: str, flags: list[str], h: Path, gch: Path) -> None:
    tmp = gch.with_name(f"{gch.name}.{os.getpid()}.tmp")  # another process may be making the same one
    try:
        proc = subprocess.run([cc, *flags, "-x", "c-header", str(h), "-o", str(tmp)], capture_output=True, text=True,
                              timeout=PCH_TIMEOUT_S)
        if proc.returncode == 0:
            tmp.replace(gch)
            return
        why = proc.stderr.strip()[:300] or f"{cc} exited with status {proc.returncode}"
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    finally:
        tmp.unlink(missing_ok=True)
    _failed.add(h)
    log.warning("no precompiled <immintrin.h>, builds parse it (slower, same code): %s", why)
