"""Strategies side by side on the same workloads: evaluations and wall time to reach within 5% of best known.

Best known = the fastest config any strategy measured in this run (exhaustive makes it exact on its workload, the
smallest bundled space: every config is compiled and measured, minutes).

    python bench/strategies.py [--budget 40] [--seeds 3] [--no-exhaustive]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cli_args import at_least  # noqa: E402
from hwprobe import probe  # noqa: E402
from kernels.registry import get_spec  # noqa: E402
from kernels.worker import Runner  # noqa: E402
from tuner.db import ResultsDB  # noqa: E402
from tuner.session import Budget, Session  # noqa: E402
from tuner.strategies.exhaustive import EXHAUSTIVE_LIMIT  # noqa: E402

# exhaustive refuses spaces over EXHAUSTIVE_LIMIT valid configs: its case is the smallest bundled space (1296 on
# AVX-512, fewer at narrower vectors); gemm's are hundreds of thousands, searched by the others only
EXHAUSTIVE_CASE = ("logmel", "kws.logmel")
CASES = [EXHAUSTIVE_CASE, ("gemm", "mobilenetv2.b2.expand"), ("dwconv_3x3", None), ("conv1d", None), ("gru", None)]


def trace(db: ResultsDB, session_id: int) -> list[tuple[float, float | None]]:
    """(seconds since session start, ms or None) per search evaluation, in order."""
    rows = db.measurements(session_id, "search")
    start = db.session_info(session_id)["started_at"]
    return [(r["ts"] - start, r["ms"] if r["ok"] else None) for r in rows]


def reach(tr: list[tuple[float, float | None]], target: float) -> tuple[int | None, float | None]:
    for i, (t, ms) in enumerate(tr, 1):
        if ms is not None and ms <= target:
            return i, t
    return None, None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=at_least(1), default=40, help="evaluations per run (default 40)")
    ap.add_argument("--seeds", type=at_least(1), default=3, help="runs per strategy and workload (default 3)")
    ap.add_argument("--no-exhaustive", action="store_true",
                    help="skip the exhaustive walk (minutes): best known is then the best any run measured")
    args = ap.parse_args(argv)
    if not os.environ.get("STATE_DIRECTORY"):  # a throwaway results DB, removed when the run ends
        scratch = tempfile.TemporaryDirectory(prefix="et-bench-")
        os.environ["STATE_DIRECTORY"] = scratch.name
    hw = probe(measure_bandwidth=False)
    db = ResultsDB()
    print(f"# {hw.cpu_model}, {hw.isa}, {hw.cores} cores, budget {args.budget}, {args.seeds} seeds; "
          f"load1 {os.getloadavg()[0]:.2f}")
    with Runner() as runner:
        session = Session(db, runner, hw)
        for kernel, wname in CASES:
            spec = get_spec(kernel)
            wl = spec.workload(wname) if wname else spec.workloads[0]
            traces: dict[str, list] = {}
            size = spec.space(wl.shape, hw).size()
            wanted = (kernel, wname) == EXHAUSTIVE_CASE and not args.no_exhaustive
            exhaustive = wanted and size <= EXHAUSTIVE_LIMIT  # the strategy refuses a larger space
            runs = [("exhaustive", 0)] if exhaustive else []
            runs += [(s, seed) for s in ("random", "anneal") for seed in range(args.seeds)]
            for strat, seed in runs:
                budget = Budget(evals=100_000 if strat == "exhaustive" else args.budget, patience=None)
                r = session.tune(spec, wl, strategy=strat, seed=seed, budget=budget, force=True)
                traces.setdefault(strat, []).append(trace(db, r.session_id))
            best = min(ms for ts in traces.values() for tr in ts for _, ms in tr if ms is not None)
            skipped = f" (no exhaustive walk: over its limit of {EXHAUSTIVE_LIMIT})" if wanted and not exhaustive \
                else ""
            print(f"\n{spec.name}/{wl.name}  space {size} configs{skipped}, best known {best:.4g} ms")
            print(f"  {'strategy':11} {'runs':>4} {'evals to 5% (median)':>21} {'reached':>8} {'wall s to 5%':>13} "
                  f"{'best at budget':>15}")
            for strat, ts in traces.items():
                hits = [reach(tr, best * 1.05) for tr in ts]
                evals = [e for e, _ in hits if e is not None]
                secs = [t for _, t in hits if t is not None]
                bests = [min(ms for _, ms in tr if ms is not None) for tr in ts]
                print(f"  {strat:11} {len(ts):4d} {statistics.median(evals) if evals else float('nan'):21.1f} "
                      f"{len(evals):>4d}/{len(ts):<3d} {statistics.median(secs) if secs else float('nan'):13.1f} "
                      f"{statistics.median(bests) / best:14.3f}x", flush=True)
    print(f"\n# load1 at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
