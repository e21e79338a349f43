"""Compile one kernel config into a content-hashed shared object (the backend half of the runner/backend split)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from edgetune import paths
from edgetune.errors import EdgetuneError
from hwprobe.compiler import compiler_path
from kernels.space import Config, Shape
from kernels.spec import C_DIR, KernelSpec

COMPILE_TIMEOUT_S = 60.0


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


def shape_flags(spec: KernelSpec, shape: Shape | None) -> list[str]:
    """The spec's baked dims of `shape` as -DET_SHAPE_<DIM>=v (none without a shape: the build serves any shape)."""
    return [f"-DET_SHAPE_{d.upper()}={int(shape[d])}" for d in spec.baked_dims] if shape else []


def compile_command(spec: KernelSpec, cfg: Config, hw: Any, out: Path, cc: str, shape: Shape | None = None) -> list[str]:
    threaded = int(cfg.get("threads", 1)) > 1
    return [
        cc, "-O3", *([f"-march={hw.march}"] if hw.march else []), "-fPIC", "-shared", *(["-fopenmp"] if threaded else []),
        f"-I{C_DIR}", *knob_flags(cfg), *shape_flags(spec, shape), str(spec.source), "-o", str(out), "-lm",
    ]


def build(spec: KernelSpec, cfg: Config, hw: Any, *, shape: Shape | None = None,
          timeout_s: float = COMPILE_TIMEOUT_S) -> Build:
    """Build (or reuse) the .so for `cfg`, specialised to `shape`'s baked dims when given (it then runs only
    shapes that agree on them). The key covers source, headers, flags, knobs and compiler id."""
    cc = compiler_path(fallback=hw.compiler.path)
    probe_cmd = compile_command(spec, cfg, hw, Path("OUT"), cc, shape)
    h = hashlib.sha256(spec.source_hash().encode())
    h.update("\0".join(probe_cmd[1:]).encode())
    h.update(hw.compiler.id.encode())
    key = h.hexdigest()[:20]
    out_dir = paths.cache_dir() / "builds"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{spec.name}-{key}.so"
    if out.exists():
        return Build(out, key, 0.0, True)
    # unique per process and thread: build_many's threads may get the same config twice in one batch
    tmp = out.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp.so")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            compile_command(spec, cfg, hw, tmp, cc, shape), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise CompileError(f"{spec.name} {cfg}: compile timed out after {timeout_s:.0f}s")
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        lines = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines()
        why = "\n".join(lines[:8]) or f"{cc} exited with status {proc.returncode} and printed nothing"
        raise CompileError(f"{spec.name} {cfg}: compiler failed: {why}")
    os.replace(tmp, out)  # atomic: a concurrent builder of the same key is harmless
    return Build(out, key, time.perf_counter() - t0, False)


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
