"""How steady is the estimator? CV of a fixed config, quiet and with a background CPU hog, side by side.

    python bench/noise.py [--kernel gemm --workload mobilenetv2.b6.project] [--runs 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cli_args import at_least  # noqa: E402
from hwprobe import probe  # noqa: E402
from kernels.registry import get_spec  # noqa: E402
from kernels.worker import Runner  # noqa: E402
from tuner.evaluate import Measured  # noqa: E402


def _hog(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _series(ev: Measured, cfg: dict, runs: int) -> dict:
    ms = ev.evaluate([cfg] * runs)
    est = [m.ms for m in ms]
    return {"median_ms": statistics.median(est), "between_runs_cv": statistics.pstdev(est) / statistics.fmean(est),
            "within_run_cv": statistics.median(m.cv for m in ms), "reps_used": statistics.median(m.reps_used for m in ms),
            "reps": statistics.median(m.reps for m in ms), "fallbacks": sum(m.estimator == "min-fallback" for m in ms),
            "load1": os.getloadavg()[0]}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kernel", default="gemm")
    ap.add_argument("--workload", default="mobilenetv2.b6.project")
    ap.add_argument("--runs", type=at_least(1), default=10, help="estimates per condition (default 10)")
    ap.add_argument("--hogs", type=at_least(0), default=os.cpu_count() or 2,
                    help="background CPU hog processes (default: one per core)")


def run(args: argparse.Namespace) -> int:
    spec = get_spec(args.kernel)  # a bad name is a usage error, before anything is measured
    wl = spec.workload(args.workload)
    hw = probe(measure_bandwidth=False)
    with Runner() as runner:
        ev = Measured(spec=spec, shape=wl.shape, hw=hw, runner=runner)
        cfg = ev.space().valid_default()
        ev.evaluate([], prebuild=[cfg])  # built before the quiet series, so neither series times the compiler
        quiet = _series(ev, cfg, args.runs)
        stop = mp.Event()
        hogs = [mp.Process(target=_hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
        for h in hogs:
            h.start()
        try:
            loaded = _series(ev, cfg, args.runs)
        finally:
            stop.set()
            for h in hogs:
                h.join()
    print(f"# {spec.name}/{wl.name}, default config, {args.runs} estimates each, {args.hogs} hog process(es)")
    print(f"{'condition':10} {'median ms':>10} {'CV between':>11} {'CV within':>10} {'reps used/reps':>15} "
          f"{'min-fallbacks':>13} {'load1':>6}")
    for name, s in (("quiet", quiet), ("cpu hog", loaded)):
        print(f"{name:10} {s['median_ms']:10.4g} {s['between_runs_cv']:11.3f} {s['within_run_cv']:10.3f} "
              f"{s['reps_used']:>7.0f}/{s['reps']:<7.0f} {s['fallbacks']:13d} {s['load1']:6.2f}")
    print(f"# hog/quiet median ratio {loaded['median_ms'] / quiet['median_ms']:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from edgetune.main import run_module

    return run_module("python bench/noise.py", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
