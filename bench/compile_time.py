"""Compile time with and without the precompiled <immintrin.h> (kernels.pch), side by side in one run.

`PYTHONPATH=. .venv/bin/python bench/compile_time.py [--configs 8] [--isa x86-64-v4]`

For every kernel, `--configs` random valid configs of its first workload are compiled both ways, in batches of
one job per core as a session's `build_many` does, the two ways alternating batch by batch (so load drifts hit
both alike). Printed per kernel: median seconds per compile each way and their ratio, and whether the two builds
of each config disassemble the same. Kernels that do not take the precompiled header compile once each way
without it, which shows the run's noise floor.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.cli_args import at_least  # noqa: E402
from hwprobe.target import describe  # noqa: E402
from kernels import pch  # noqa: E402
from kernels.build import code_flags, compile_command, precompiled, target_compiler  # noqa: E402
from kernels.registry import all_specs  # noqa: E402


def code(so: Path) -> str:
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True)
    return out.stdout.split("\n", 2)[-1]


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--configs", type=at_least(1), default=8, help="configs per kernel (default 8)")
    ap.add_argument("--isa", help="the ISA cap to build for (default: this machine's)")
    ap.add_argument("--seed", type=int, default=0)


def run(a: argparse.Namespace) -> int:
    hw = describe(a.isa)  # an --isa this machine cannot build for is a usage error listing the levels
    cc, cc_id = target_compiler(hw)
    jobs = max(1, hw.cores)
    rng = random.Random(a.seed)
    print(f"{hw.cpu_model}, {hw.isa}, {jobs} parallel jobs, {cc_id}; load {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="et-cc-") as td, ThreadPoolExecutor(jobs) as pool:
        os.environ["CACHE_DIRECTORY"] = td
        t0 = time.perf_counter()
        header = pch.ensure(cc, cc_id, code_flags(hw))
        print(f"making the precompiled header: {time.perf_counter() - t0:.2f} s (once per compiler and target)")
        print(f"{'kernel':12s} {'plain s':>8s} {'pch s':>8s} {'ratio':>6s}  same code")
        for spec in all_specs().values():
            wl = spec.workloads[0]
            space = spec.space(wl.shape, hw)
            cfgs = space.sample(a.configs, rng)
            include = precompiled(spec, hw, cc, cc_id) and header
            times: dict[str, list[float]] = {"plain": [], "pch": []}
            same = True
            for b in range(0, len(cfgs), jobs):
                batch = list(enumerate(cfgs[b:b + jobs], start=b))
                for way in (("plain", "pch") if b // jobs % 2 == 0 else ("pch", "plain")):
                    cmds = [compile_command(spec, c, hw, Path(td) / f"{spec.name}-{i}-{way}.so", cc, wl.shape,
                                            include if way == "pch" else None) for i, c in batch]
                    times[way] += pool.map(timed, cmds)
                same &= all(code(Path(td) / f"{spec.name}-{i}-plain.so") == code(Path(td) / f"{spec.name}-{i}-pch.so")
                            for i, _ in batch)
            p, q = statistics.median(times["plain"]), statistics.median(times["pch"])
            print(f"{spec.name:12s} {p:8.3f} {q:8.3f} {q / p:6.2f}  {'yes' if same else 'NO'}"
                  f"{'' if include else '  (takes no precompiled header: both plain)'}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from edgetune.main import run_module

    return run_module("python bench/compile_time.py", __doc__.split("\n\n")[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
