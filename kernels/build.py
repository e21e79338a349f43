"""Compile one kernel config into a content-hashed shared object (the backend half of the runner/backend split)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Iterable

from edgetune import paths
from edgetune.errors import BadInput, EdgetuneError
from hwprobe.compiler import CompilerMissing, compiler_path, describe_compiler
from hwprobe.target import is_foreign, toolchain
from kernels import pch
from kernels.space import Config, Shape
from kernels.spec import C_DIR, KernelSpec

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 60.0
ORPHAN_AGE_S = 10 * COMPILE_TIMEOUT_S  # a temporary build output this old belongs to a killed compile
# builds kept (~8000 of ~32 KB): beyond it the least recently used go, so retunes over a device's life cannot fill
# its disk; a removed build is compiled again when next asked for
CACHE_MAX_BYTES = 256 << 20


class CompileError(EdgetuneError):
    """The compiler rejected a variant or timed out; the message carries its trimmed stderr."""


@dataclass(frozen=True)
class Build:
    path: Path
    key: str
    seconds: float
    cached: bool


def knob_flags(cfg: Config) -> list[str]:
    """Knob `name=v` becomes -DET_NAME=v; a string value becomes the flag -DET_NAME_VALUE."""
    flags = []
    for name, v in sorted(cfg.items()):
        macro = "ET_" + name.upper()
        flags.append(f"-D{macro}_{str(v).upper()}" if isinstance(v, str) else f"-D{macro}={v}")
    return flags


@cache
def _compiler_id(path: str) -> str:
    return describe_compiler(path).id


def target_compiler(hw: Any) -> tuple[str, str]:
    """(path, id) of the compiler for `hw`: this host's, or the cross compiler of a foreign arch (builds for another
    device never pick up $CC, which names a compiler for this host)."""
    if not is_foreign(hw):
        return compiler_path(fallback=hw.compiler.path), hw.compiler.id
    tc = toolchain(hw.arch)
    cc = tc.which_cc()
    if not cc:
        raise CompilerMissing(f"no cross compiler for {hw.arch} ({tc.cc}); install it with "
                              f"`apt-get install {tc.apt}` (or `make test`, which does)")
    return cc, _compiler_id(cc)


# 32-bit Arm: -mfpu=auto, or a toolchain configured --with-fpu (Raspberry Pi OS's armhf gcc: vfp) overrides the
# +neon of -march; and -funsafe-math-optimizations, without which GCC lowers every vector-extension
# float op to scalar VFP (ARMv7 NEON flushes denormals to zero, so it is not IEEE): gemm had 253 scalar and 0
# quad-register multiply-adds without it, 1 and 56 with it. Reassociation and reciprocals stay off: reassociating
# folds gru's round-to-integer trick, (x + 1.5 * 2^23) - 1.5 * 2^23, to x (max_abs_err 0.41 under emulation).
_ARMV7_FLAGS = ["-mfpu=auto", "-funsafe-math-optimizations", "-fno-associative-math", "-fno-reciprocal-math"]


def target_flags(hw: Any) -> list[str]:
    """-march for the probed level, plus what 32-bit Arm needs for its NEON code to be NEON."""
    if not hw.march:
        return []
    return [f"-march={hw.march}", *(_ARMV7_FLAGS if hw.arch == "armv7l" else [])]


def shape_flags(spec: KernelSpec, shape: Shape | None) -> list[str]:
    """The spec's baked dims of `shape` as -DET_SHAPE_<DIM>=v (none without a shape: the build serves any shape)."""
    return [f"-DET_SHAPE_{d.upper()}={int(shape[d])}" for d in spec.baked_dims] if shape else []


def code_flags(hw: Any) -> list[str]:
    """The flags that shape the code (a precompiled header is made with the same). -pthread for the header's
    thread pool (every build: a firmware build of the same source needs the same)."""
    return ["-O3", *target_flags(hw), "-fPIC", "-pthread"]


def compile_command(spec: KernelSpec, cfg: Config, hw: Any, out: Path, cc: str, shape: Shape | None = None,
                    include: Path | None = None) -> list[str]:
    """`include`: a header forced in first (the precompiled <immintrin.h>, see kernels.pch)."""
    return [
        cc, *code_flags(hw), "-shared", *(["-include", str(include)] if include else []),
        f"-I{C_DIR}", *knob_flags(cfg), *shape_flags(spec, shape), str(spec.source), "-o", str(out), "-lm",
    ]


def precompiled(spec: KernelSpec, hw: Any, cc: str, cc_id: str) -> Path | None:
    """The precompiled header for `spec`'s builds, for the kernels on the packed GEMM core when the target has
    AVX-512 (where et_gemm.h includes <immintrin.h>); None for the rest, where it would not pay (kernels.pch)."""
    if C_DIR / "et_gemm.h" not in spec.extra_headers or not pch.defines_avx512(cc, tuple(target_flags(hw))):
        return None
    return pch.header(cc_id, code_flags(hw))


def build(spec: KernelSpec, cfg: Config, hw: Any, *, shape: Shape | None = None,
          timeout_s: float = COMPILE_TIMEOUT_S) -> Build:
    """Build (or reuse) the .so for `cfg`, specialised to `shape`'s baked dims when given (it then runs only
    shapes that agree on them). The key covers source, headers, flags, knobs, the target arch and compiler id.
    A foreign `hw` (another arch, see hwprobe.target) is cross-compiled; run such a build with kernels.emulate."""
    unknown = sorted(set(cfg) - {p.name for p in spec.params})
    if unknown:  # a stale knob name would otherwise build the default silently
        raise BadInput(f"{spec.name} has no knob(s) {', '.join(unknown)}; its knobs: "
                       f"{', '.join(p.name for p in spec.params)}")
    cc, cc_id = target_compiler(hw)
    include = precompiled(spec, hw, cc, cc_id)
    probe_cmd = compile_command(spec, cfg, hw, Path("OUT"), cc, shape, include)
    h = hashlib.sha256(spec.source_hash().encode())
    h.update("\0".join(probe_cmd[1:]).encode())
    h.update(f"{hw.arch}\0{cc_id}".encode())
    key = h.hexdigest()[:20]
    out_dir = paths.cache_dir() / "builds"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{spec.name}-{key}.so"
    if out.exists():
        _touch(out)
        return Build(out, key, 0.0, True)
    if include:
        include = pch.ensure(cc, cc_id, code_flags(hw))  # None: the cache cannot hold it, build without
    # unique per process and thread: build_many's threads may get the same config twice in one batch
    tmp = out.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp.so")
    cmd = compile_command(spec, cfg, hw, tmp, cc, shape, include)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 and include and pch.unreadable(include, proc.stderr):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)  # now parses the header
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise CompileError(f"{spec.name} {cfg}: compile timed out after {timeout_s:.0f}s")
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        lines = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines()
        why = "\n".join(lines[:8]) or f"{cc} exited with status {proc.returncode} and printed nothing"
        raise CompileError(f"{spec.name} {cfg}: compiler failed: {why}")
    if not tmp.exists():
        raise CompileError(f"{spec.name} {cfg}: {cc} exited 0 but wrote no shared object: is it a C compiler? "
                           "set CC to gcc or clang")
    os.replace(tmp, out)  # atomic: a concurrent builder of the same key is harmless
    return Build(out, key, time.perf_counter() - t0, False)


def _touch(path: Path) -> None:
    """Mark a build used now: prune_builds keeps the recently used."""
    try:
        os.utime(path)
    except OSError:  # a read-only cache still serves its builds
        pass


def _remove_orphans(builds: Path) -> None:
    """Remove the temporary outputs of compiles killed with their process (kill -9 mid-tune): a live compile's is
    younger than its timeout, so one older than ORPHAN_AGE_S has no writer left."""
    cutoff = time.time() - ORPHAN_AGE_S
    for p in builds.glob("*.tmp.so"):
        try:
            if p.stat().st_mtime < cutoff:
                p.unlink()
        except OSError:  # pruned by another process, or a read-only cache
            continue


def prune_builds(max_bytes: int | None = None) -> int:
    """Once the builds take more than `max_bytes`, remove the least recently used (built or reused) until they take
    3/4 of it, so that pruning is rare (default: CACHE_MAX_BYTES). Returns the bytes freed."""
    max_bytes = CACHE_MAX_BYTES if max_bytes is None else max_bytes
    _remove_orphans(paths.cache_dir() / "builds")
    entries = []
    for p in (paths.cache_dir() / "builds").glob("*.so"):
        try:
            st = p.stat()
        except FileNotFoundError:  # another process pruned it
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return 0
    freed = 0
    for _, size, p in sorted(entries, key=lambda e: e[0]):
        if total - freed <= max_bytes * 3 // 4:
            break
        try:
            p.unlink(missing_ok=True)
        except OSError as e:  # a read-only cache: it keeps what it has, the tune's result stands
            log.warning("build cache: cannot remove %s: %s", p, e)
            break
        freed += size
    log.info("build cache: removed %.1f MB of least recently used builds (kept %.1f MB)", freed / 2**20,
             (total - freed) / 2**20)
    return freed


def build_many(spec: KernelSpec, cfgs: Iterable[Config], hw: Any, jobs: int | None = None, *,
               shape: Shape | None = None) -> list[Build | CompileError]:
    """Compile a batch in parallel (one job per usable core); failures come back in place, not raised."""

    def one(cfg: Config) -> Build | CompileError:
        try:
            return build(spec, cfg, hw, shape=shape)
        except CompileError as e:
            return e

    cfgs = list(cfgs)
    with ThreadPoolExecutor(max_workers=jobs or max(1, getattr(hw, "cores", 1))) as pool:
        return list(pool.map(one, cfgs))
