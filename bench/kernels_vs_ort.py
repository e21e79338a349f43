"""Default vs best-of-30-random vs onnxruntime, per kernel/workload, measured side by side in one run.

    python bench/kernels_vs_ort.py [--random 30] [--kernel K]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hwprobe import probe  # noqa: E402
from kernels.registry import all_specs  # noqa: E402
from kernels.worker import Runner  # noqa: E402
from tuner.evaluate import Measured  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random", type=int, default=30)
    ap.add_argument("--kernel", action="append")
    args = ap.parse_args()
    hw = probe(measure_bandwidth=False)
    print(f"# {hw.cpu_model}, {hw.isa}, {hw.cores} cores; load1 at start {os.getloadavg()[0]:.2f}")
    print(f"{'kernel/workload':42} {'default ms':>10} {'best30 ms':>10} {'ORT ms':>9} {'def/ORT':>8} {'best/ORT':>9} "
          f"{'best/def':>8} {'load1':>5}")
    t0 = time.time()
    with Runner() as runner:
        for spec in all_specs().values():
            if args.kernel and spec.name not in args.kernel:
                continue
            for wl in spec.workloads:
                ev = Measured(spec=spec, shape=wl.shape, hw=hw, runner=runner)
                space = ev.space()
                cfgs = [space.valid_default()] + space.sample(args.random, random.Random(0))
                ms = [m.ms if m.ok else None for m in ev.evaluate(cfgs)]
                ok = [m for m in ms[1:] if m is not None]
                ort = ev.ort_ms()
                best = min(ok + [ms[0]])
                print(f"{spec.name + '/' + wl.name:42} {ms[0]:10.4f} {best:10.4f} {ort:9.4f} {ms[0] / ort:8.2f} "
                      f"{best / ort:9.2f} {best / ms[0]:8.2f} {os.getloadavg()[0]:5.2f}", flush=True)
    print(f"# {time.time() - t0:.0f} s; ratios < 1 mean faster than onnxruntime; load1 at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
