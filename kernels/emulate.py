"""Check a cross-built variant's values under qemu-user: the host makes the inputs and the numpy reference, the
emulated target computes, the host compares with the spec's tolerance (the worker's verdict).

The variant is the same shared object a device would load (`build` for a foreign `hw`, see hwprobe.target), run
once by a small C harness (c/et_harness.c) that dlopens it inside the emulator. Emulated time says nothing about
the device, so nothing here times.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import struct
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgetune import paths
from edgetune.errors import EdgetuneError
from hwprobe.target import toolchain
from kernels.abi import abi_version
from kernels.build import COMPILE_TIMEOUT_S, CompileError, build, target_compiler, target_flags
from kernels.space import Config, Shape
from kernels.spec import C_DIR, KernelSpec, act_code
from kernels.worker import compare

HARNESS = C_DIR / "et_harness.c"
RUN_TIMEOUT_S = 300.0  # emulation runs 10-50x slower than the device
_HARNESS_ERRORS = {-1: "harness protocol error", -2: "the variant did not load", -3: "ABI version mismatch"}


class EmulatorMissing(EdgetuneError):
    """qemu-user (or the cross sysroot) is not installed: emulated checks cannot run."""


@dataclass(frozen=True)
class Check:
    ok: bool
    reason: str = ""
    max_abs_err: float | None = None


def emulator(hw: Any) -> list[str]:
    """The qemu-user command line that runs `hw`'s binaries against its cross sysroot."""
    tc = toolchain(hw.arch)
    qemu = shutil.which(tc.qemu)
    if not qemu or not Path(tc.sysroot).is_dir():
        raise EmulatorMissing(f"emulating {hw.arch} needs {tc.qemu} and the {tc.sysroot} sysroot; install them "
                              f"with `apt-get install qemu-user {tc.apt}` (or `make test`, which does)")
    return [qemu, "-L", tc.sysroot]


def harness(hw: Any) -> Path:
    """The harness executable for `hw`'s arch, built once per harness source, ABI, flags and compiler."""
    cc, cc_id = target_compiler(hw)
    flags = ["-O2", *target_flags(hw), f"-DET_ABI_EXPECTED={abi_version()}"]
    key = hashlib.sha256("\0".join([HARNESS.read_text(), hw.arch, cc_id, *flags]).encode()).hexdigest()[:20]
    out = paths.cache_dir() / "builds" / f"et_harness-{hw.arch}-{key}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    proc = subprocess.run([cc, *flags, str(HARNESS), "-o", str(tmp), "-ldl"], capture_output=True, text=True,
                          timeout=COMPILE_TIMEOUT_S)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise CompileError(f"the emulation harness for {hw.arch} did not build: {proc.stderr.strip()[:800]}")
    os.replace(tmp, out)
    return out


def _request(spec: KernelSpec, shape: Shape, bufs: list[np.ndarray], n_inputs: int, act: str) -> bytes:
    head = struct.pack("<4i", len(spec.dims), n_inputs, len(bufs) - n_inputs, act_code(act))
    dims = struct.pack(f"<{len(spec.dims)}q", *spec.dims_vector(shape))
    sizes = struct.pack(f"<{len(bufs)}q", *(b.size for b in bufs))
    return head + dims + sizes + b"".join(b.astype("<f4").tobytes() for b in bufs)


def run(spec: KernelSpec, shape: Shape, so: Path, hw: Any, inputs: list[np.ndarray], act: str = "none",
        timeout_s: float = RUN_TIMEOUT_S) -> list[np.ndarray] | str:
    """The variant's outputs for `inputs` with fused activation `act`, computed under emulation (packed, then run,
    as an application runs it); or why there are none."""
    outputs = [np.full(s, np.nan, dtype=np.float32) for s in spec.output_shapes(shape)]
    cmd = [*emulator(hw), str(harness(hw)), str(so)]
    try:
        proc = subprocess.run(cmd, input=_request(spec, shape, inputs + outputs, len(inputs), act),
                              capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"hung: no result within {timeout_s:.0f}s under emulation"
    if len(proc.stdout) < 4:
        rc = proc.returncode
        what = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        return f"crashed: {what} under emulation; {proc.stderr.decode(errors='replace').strip()[:300]}"
    (status,) = struct.unpack("<i", proc.stdout[:4])
    if status != 0:
        return _HARNESS_ERRORS.get(status, f"kernel returned error code {status}")
    data = np.frombuffer(proc.stdout[4:], dtype="<f4")
    if data.size != sum(o.size for o in outputs):
        return f"crashed: {data.size} output floats of {sum(o.size for o in outputs)} came back (exit {proc.returncode})"
    offsets = np.cumsum([0] + [o.size for o in outputs])
    return [data[a:b].reshape(o.shape) for o, a, b in zip(outputs, offsets[:-1], offsets[1:])]


def check(spec: KernelSpec, shape: Shape, cfg: Config, hw: Any, *, seed: int = 0, act: str = "none") -> Check:
    """Cross-build `cfg` for `hw`, run it under qemu-user on seeded inputs and compare with the numpy reference
    (with fused activation `act`)."""
    try:
        so = build(spec, cfg, hw, shape=shape).path
    except CompileError as e:
        return Check(False, str(e))
    inputs = [np.ascontiguousarray(a, dtype=np.float32) for a in spec.make_inputs(shape, np.random.default_rng(seed))]
    got = run(spec, shape, so, hw, inputs, act)
    if isinstance(got, str):
        return Check(False, got)
    verdict = compare(spec, got, spec.activated(spec.reference(shape, inputs), act))
    return Check(verdict["ok"], verdict.get("reason", ""), verdict.get("max_abs_err"))


def check_all(spec: KernelSpec, cases: list[tuple[Shape, Config]], hw: Any, *, seed: int = 0,
              jobs: int | None = None, act: str = "none") -> list[Check]:
    """check() of each (shape, config), in parallel: compiling and emulating are both single-threaded."""
    harness(hw)  # once, before the threads race to build it
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda case: check(spec, case[0], case[1], hw, seed=seed, act=act), cases))


def covering_cases(spec: KernelSpec, hw: Any) -> tuple[list[tuple[str, Config]], list[tuple[str, Any]]]:
    """Every bundled workload's valid default, then, for each knob value they leave out, the valid config nearest
    the default that has it, on the cheapest workload whose space holds one. Returns the (workload, config) cases
    and the (knob, value) pairs that no workload's space holds on `hw` (e.g. vectors wider than its registers)."""
    spaces = {w.name: spec.space(w.shape, hw) for w in sorted(spec.workloads, key=lambda w: spec.flops(w.shape))}
    defaults = {name: space.valid_default() for name, space in spaces.items()}
    cases = list(defaults.items())
    covered = {(k, v) for _, cfg in cases for k, v in cfg.items()}
    absent = []
    valid = {name: list(space.enumerate()) for name, space in spaces.items()}
    for p in spec.params:
        for v in p.values:
            if (p.name, v) in covered:
                continue
            for name, space in spaces.items():
                holders = [c for c in valid[name] if c[p.name] == v]
                if holders:
                    cfg = min(holders, key=lambda c: space.distance(c, defaults[name]))
                    cases.append((name, cfg))
                    covered |= set(cfg.items())
                    break
            else:
                absent.append((p.name, v))
    return cases, absent
