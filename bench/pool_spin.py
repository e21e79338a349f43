"""How long an idle pool worker should spin before it sleeps (ET_SPIN_US in kernels/c/edgetune_kernel.h).

    python bench/pool_spin.py [--kernel gemm --workload kws_dscnn.pw4] [--spins 0,50,200,1000,5000]
                              [--gaps 0,20,100,500,2000] [--rounds 5] [--calls 300] [--json FILE]

An application calls layer after layer with its own work in between. For each spin window and each gap of
application work between calls (a busy wait, as other layers would be), this times one 2-thread call of a small
layer, and the process CPU time per call (the spinning a window costs while the application works), in the same
interleaved rounds as the 1-thread build. Short windows let workers fall asleep between calls, so the next call
pays a futex wake-up; long windows burn a core during the gaps. Prints ms per call, 2T/1T and CPU ms per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgetune.output import console, fmt, table  # noqa: E402
from kernels.abi import KernelLibrary  # noqa: E402
from kernels.build import build  # noqa: E402
from kernels.registry import get_spec  # noqa: E402
from tuner.evaluate import interleave_plan  # noqa: E402


def _variant(spec, spin_us: int, tmp: Path):
    """The spec around a source that sets ET_SPIN_US before including the kernel (the build key covers it)."""
    src = tmp / f"{spec.name}_spin{spin_us}.c"
    src.write_text(f"#define ET_SPIN_US {spin_us}\n#include \"{spec.source}\"\n")
    return dataclasses.replace(spec, source=src)


def _time_calls(lib: KernelLibrary, spec, shape, inputs, packed, calls: int, gap_s: float) -> tuple[float, float]:
    """Median wall ms of one call, and process CPU ms per call (gap work included, the same for every build)."""
    outs = [np.empty(s, np.float32) for s in spec.output_shapes(shape)]
    dims, ptrs = lib.dims(shape), lib.pointers(inputs + outs)
    walls = []
    cpu0 = time.process_time()
    for _ in range(calls):
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:  # the application's own work between layers
            pass
        t0 = time.perf_counter()
        lib.run(dims, ptrs, packed)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls) * 1e3, (time.process_time() - cpu0) * 1e3 / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="gemm")
    ap.add_argument("--workload", default="kws_dscnn.pw4")
    ap.add_argument("--spins", default="0,50,200,1000,5000", help="spin windows to compare, microseconds")
    ap.add_argument("--gaps", default="0,20,100,500,2000", help="application work between calls, microseconds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=300, help="calls per contender per round and gap")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    from hwprobe import probe

    spins = [int(x) for x in args.spins.split(",")]
    gaps = [int(x) for x in args.gaps.split(",")]
    spec = get_spec(args.kernel)
    shape = spec.workload(args.workload).shape
    hw = probe(measure_bandwidth=False)
    base = spec.space(shape, hw).valid_default()
    inputs = [np.ascontiguousarray(a) for a in spec.make_inputs(shape, np.random.default_rng(0))]
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        names = ["1 thread"] + [f"2T spin {s} us" for s in spins]
        libs = [KernelLibrary(build(spec, dict(base, threads=1), hw, shape=shape).path, spec)]
        for s in spins:
            variant = _variant(spec, s, Path(tmp))
            libs.append(KernelLibrary(build(variant, dict(base, threads=2), hw, shape=shape).path, variant))
        packed = [lib.pack(lib.dims(shape), lib.pointers(inputs + [None])) for lib in libs]
        wall = {(n, g): [] for n in names for g in gaps}
        cpu = {(n, g): [] for n in names for g in gaps}
        for g in gaps:
            for j in interleave_plan(len(libs), args.rounds, seed=g):
                w, c = _time_calls(libs[j], spec, shape, inputs, packed[j], args.calls, g * 1e-6)
                wall[(names[j], g)].append(w)
                cpu[(names[j], g)].append(c)
    console.print(f"# {spec.name}/{args.workload}, {hw.cpu_model}, {hw.cores} cores; load before "
                  f"{'/'.join(f'{x:.2f}' for x in load0)}, after {'/'.join(f'{x:.2f}' for x in os.getloadavg())}; "
                  f"{args.rounds} interleaved rounds of {args.calls} calls", highlight=False)
    ratio = {k: statistics.median(a / b for a, b in zip(v, wall[(names[0], k[1])])) for k, v in wall.items()}
    for title, cell in (("ms per call (median)", lambda k: fmt(statistics.median(wall[k]), 4)),
                        ("per call, 2 threads / 1 thread (median of same-round ratios)", lambda k: fmt(ratio[k], 2)),
                        ("process CPU ms per call, the gap's work included", lambda k: fmt(statistics.median(cpu[k]), 3))):
        table(title, ["build", *(f"gap {g} us" for g in gaps)], [[n, *(cell((n, g)) for g in gaps)] for n in names])
    if args.json:
        Path(args.json).write_text(json.dumps({"wall": {f"{n}|{g}": v for (n, g), v in wall.items()},
                                               "cpu": {f"{n}|{g}": v for (n, g), v in cpu.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
