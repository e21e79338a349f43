"""Compare tuners side by side on the tuner model's held-out cases: `python bench/compare_tuners.py`.

`--real-layers` runs the comparison that the tuner's targets are judged by instead: held-out real model layers,
tuned for real on this machine and measured side by side with a long search's best (bench/tuners_real.py, whose
flags it takes).

Replay (eval counts): every held-out case of the committed dataset (quantized_models/data/runs.jsonl.gz) has a
reference table: every config measured on it (the seeded sample, the defaults and an annealing refinement),
whose best is the case's best-known. Each strategy tunes each case over that table as its universe (as Kernel
Tuner's simulation mode does off a cache file): asking for a config returns its recorded time instead of
compiling and measuring it. Configs outside the table do not exist for any strategy; peers that propose one
(Optuna, OpenTuner) are told it failed and it does not count as an evaluation.

Printed per strategy: evals to within 5% of best-known (median, p90; a case never reached counts as budget+1),
the share of cases within 5 evals, the estimated wall time to that point (recorded compile time + measurement
time per eval, plus model latency for llm), and the best found at budgets 5, 10 and 20 (geometric mean of
found/best-known, and the share within 5%).

Real run (`--real N`): N held-out bundled workloads on this machine through the real Session (compile + measure
+ interleaved finalists), for llm, anneal and random: wall time, evals, and the winner against the best-known
config, both measured again side by side after the run (the host factor says how much slower the machine is than
when the data was collected).

Measured top-K (`--measure-topk K`): the model's top-K over the full space (not the replay table) on every
held-out case, compiled and measured in 7 shuffled rounds with the case's best-known config, each judged by its
same-round ratios to it: the replay can only credit proposals the collection happened to measure; this credits
each at its real speed. A control, the best-known config measured again as if proposed, shows how much of a miss
this host's noise alone can cause.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cli_args import output_file  # noqa: E402
from kernels.registry import all_specs, get_spec  # noqa: E402
from kernels.space import Config, config_key  # noqa: E402
from tuner.evaluate import Measured, Replay, TableSpace  # noqa: E402
from tuner.train import data as D  # noqa: E402
from tuner.train.data import HwView as _HwView  # noqa: E402  (torch-free)

BUDGETS = (5, 10, 20)
# per-eval measurement time in a session (SEARCH_MIN_TIME_S 0.025 + the worker round trip): 31 ms a call, the mean
# over the 72 held-out cases of bench/finals_study.py's collection (27-38 ms per case)
MEASURE_S = 0.031


def recorded_compile_s(path: Path) -> dict[tuple[str, str], float]:
    """(kernel, ISA) -> seconds of batch wall per config of a cold compile at collection (build_many on the
    collector's 2 cores, as a session's batches), the largest such batch figure the data records; resumed runs that
    found their builds cached record ~0 and are ignored by taking the maximum."""
    out: dict[tuple[str, str], float] = {}
    for r in D._rows(path):
        if r.get("kind") == "m" and r.get("compile_s") is not None:
            k = (r["kernel"], r["isa"])
            out[k] = max(out.get(k, 0.0), float(r["compile_s"]))
    return out


# ---- the replay universe ----------------------------------------------------------------------------------

def case_replay(case: D.Case) -> Replay:
    """The case's reference table as a replay evaluator, over the table's own configs as the search space."""
    spec = all_specs()[case.kernel]
    table = case.table()
    universe = TableSpace.over(spec.space(case.shape, _HwView(case.hw)), (case.configs[k] for k in table))
    return Replay.of_ms(universe, table)


# ---- strategies as replay drivers -------------------------------------------------------------------------

def run_askteller(strat, ev: Replay, budget: int, batch: int = 2) -> list[float]:
    """Drive an ask/tell strategy; returns the recorded ms of each distinct config evaluated, in order (a config
    outside the table is told as failed and is no evaluation)."""
    out, seen = [], set()
    stalls = 0
    while len(out) < budget and stalls < 3:
        asked = strat.ask(min(batch, budget - len(out)))
        if not asked:
            stalls += 1
            continue
        for c, m in zip(asked, ev.evaluate(asked)):
            strat.tell(c, m)
            if config_key(c) not in seen and m.ok:
                seen.add(config_key(c))
                out.append(m.ms)
    return out


def run_builtin(name: str, ev: Replay, budget: int, seed: int) -> tuple[list[float], float]:
    from tuner.strategies import Anneal, RandomSearch

    cls = {"random": RandomSearch, "anneal": Anneal}[name]
    return run_askteller(cls(ev.space(), seed), ev, budget), 0.0


def run_llm(ev: Replay, budget: int, seed: int, kernel: str, proposer) -> tuple[list[float], float]:
    from tuner.strategies.llm import LLMStrategy

    s = LLMStrategy(ev.space(), seed, kernel=get_spec(kernel), proposer=proposer, patience=budget)
    # the proposer sees the table through the space's constraints (prefix-pruned), like every other strategy
    traj = run_askteller(s, ev, budget, batch=5)
    return traj, (s.latency_ms or 0.0) / 1e3


def project(space: TableSpace, cfg: Config) -> Config:
    """The table config nearest to a peer's suggestion (knob steps; first in table order on ties)."""
    return min(space.table, key=lambda c: space.distance(c, cfg))


def run_optuna(ev: Replay, budget: int, seed: int) -> tuple[list[float], float]:
    """Optuna TPE over the knobs as categoricals; a suggestion outside the table is projected onto the nearest
    table config, whose time is told back for the suggested params."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=5))
    space = ev.space()
    out, seen = [], set()
    for _ in range(budget * 10):
        if len(out) >= budget or len(seen) == len(ev.table):
            break
        t = study.ask()
        cfg = project(space, {p.name: t.suggest_categorical(p.name, list(p.values)) for p in space.params})
        k, ms = config_key(cfg), ev.evaluate([cfg])[0].ms
        study.tell(t, ms)
        if k not in seen:
            seen.add(k)
            out.append(ms)
    return out, 0.0


def run_opentuner(ev: Replay, budget: int, seed: int) -> tuple[list[float], float]:
    import logging

    import opentuner  # noqa: F401
    from opentuner.api import TuningRunManager
    from opentuner.measurement.interface import DefaultMeasurementInterface
    from opentuner.resultsdb.models import Result
    from opentuner.search.manipulator import ConfigurationManipulator, EnumParameter

    logging.getLogger("opentuner").setLevel(logging.ERROR)
    random.seed(seed)
    space = ev.space()
    man = ConfigurationManipulator()
    for p in space.params:
        man.add_parameter(EnumParameter(p.name, [str(v) for v in p.values]))
    with tempfile.TemporaryDirectory() as td, contextlib.chdir(td), warnings.catch_warnings():
        # opentuner writes opentuner.log in cwd; its driver's flush warns (SQLAlchemy 2) on every run, harmlessly
        warnings.filterwarnings("ignore", message=".*not in session.*")
        args = argparse.Namespace(**{**vars(_opentuner_args()), "database": f"sqlite:///{td}/ot.db",
                                     "seed": seed})
        mi = DefaultMeasurementInterface(args=args, manipulator=man, project_name="edgetune",
                                         program_name="replay", program_version="1")
        api = TuningRunManager(mi, args)
        out, seen = [], set()
        for _ in range(budget * 25):
            if len(out) >= budget:
                break
            dr = api.get_next_desired_result()
            if dr is None:
                continue
            raw = dr.configuration.data
            cfg = project(space, {p.name: p.coerce(raw[p.name]) for p in space.params})
            ms = ev.evaluate([cfg])[0].ms
            api.report_result(dr, Result(time=ms))
            if ms is not None and config_key(cfg) not in seen:
                seen.add(config_key(cfg))
                out.append(ms)
        api.finish()
    return out, 0.0


def _opentuner_args():
    from opentuner import default_argparser

    return default_argparser().parse_args([])


def run_kernel_tuner(ev: Replay, budget: int, seed: int,
                     strategy: str = "bayes_opt") -> tuple[list[float], float]:
    """Kernel Tuner's own simulation mode: a cache file holding the table, `tune_cache` with one strategy."""
    import contextlib
    import io

    import numpy as np
    from kernel_tuner import tune_cache

    space = ev.space()
    table = {k: m.ms for k, m in ev.table.items()}
    names = [p.name for p in space.params]
    cache = {}
    for c in space.table:
        key = ",".join(str(c[n]) for n in names)
        # the *_time fields are required by the cache format; max_fevals bounds the run, so none of them is used
        cache[key] = {**{n: c[n] for n in names}, "time": table[config_key(c)], "times": [table[config_key(c)]],
                      "compile_time": 0.0, "verification_time": 0.0, "benchmark_time": 0.0}
    doc = {"device_name": "edgetune-replay", "kernel_name": "replay", "problem_size": [1],
           "tune_params_keys": names, "tune_params": {p.name: list(p.values) for p in space.params},
           "objective": "time", "cache": cache}
    with tempfile.TemporaryDirectory() as td:
        path = Path(td) / "cache.json"
        path.write_text(json.dumps(doc))
        random.seed(seed)
        np.random.seed(seed)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results, _ = tune_cache(str(path), strategy=strategy, strategy_options={"max_fevals": budget},
                                    quiet=True, verbose=False)
    out, seen = [], set()
    for r in results:
        if not r or "__error__" in r or not isinstance(r.get("time"), float):
            continue
        k = config_key({n: r[n] for n in names})
        if k not in seen and k in table:
            seen.add(k)
            out.append(table[k])
    return out[:budget], 0.0


# ---- metrics ----------------------------------------------------------------------------------------------

def evals_to(traj: list[float], best: float, tol: float = 0.05) -> int | None:
    for i, ms in enumerate(traj):
        if ms <= best * (1 + tol):
            return i + 1
    return None


def best_at(traj: list[float], n: int) -> float | None:
    return min(traj[:n]) if traj[:n] else None


def share_interval(hits: int, n: int) -> tuple[float, float]:
    """95% Wilson interval of a hit share: 72 held-out cases cannot tell 75% from 80% (about ±10 points), and a
    rerun on this noisy host moves a share by ~5 points, so the bench prints the interval with the share."""
    from scipy.stats import binomtest  # the [bench] extra's scipy

    ci = binomtest(hits, n).proportion_ci(method="wilson")
    return float(ci.low), float(ci.high)


def summarise(name: str, rows: list[dict], budget: int) -> dict:
    ev = [r["evals_to"] if r["evals_to"] is not None else budget + 1 for r in rows]
    out = {"strategy": name, "cases": len(rows),
           "median_evals": statistics.median(ev), "p90_evals": sorted(ev)[max(0, math.ceil(0.9 * len(ev)) - 1)],
           "reached": sum(1 for r in rows if r["evals_to"] is not None) / len(rows),
           "within5": sum(1 for r in rows if r["evals_to"] is not None and r["evals_to"] <= 5) / len(rows),
           "wall_s_median": statistics.median([r["wall_s"] for r in rows])}
    for b in BUDGETS:
        ratios = [r["best_at"][b] / r["best"] if r["best_at"][b] else 10.0 for r in rows]
        out[f"gm_ratio@{b}"] = math.exp(statistics.fmean(math.log(x) for x in ratios))
        out[f"share5@{b}"] = sum(1 for x in ratios if x <= 1.05) / len(rows)
    return out


def replay(cases: list[D.Case], strategies: list[str], budget: int, seeds: int, model: Path | None,
           compile_s: dict[tuple[str, str], float]) -> dict:
    proposer = None
    if "llm" in strategies:
        from tuner.strategies.llm import load_proposer

        proposer = load_proposer(model)
    per: dict[str, list[dict]] = {s: [] for s in strategies}
    for case in cases:
        ev = case_replay(case)
        best = min(m.ms for m in ev.table.values())
        per_compile = compile_s[(case.kernel, case.isa)]
        for name in strategies:
            for seed in range(1 if name in ("llm", "opentuner") else seeds):  # llm is deterministic; opentuner slow
                t0 = time.perf_counter()
                try:
                    if name == "llm":
                        traj, model_s = run_llm(ev, budget, seed, case.kernel, proposer)
                    elif name in ("random", "anneal"):
                        traj, model_s = run_builtin(name, ev, budget, seed)
                    elif name == "optuna-tpe":
                        traj, model_s = run_optuna(ev, budget, seed)
                    elif name == "opentuner":
                        traj, model_s = run_opentuner(ev, budget, seed)
                    elif name.startswith("kerneltuner-"):
                        traj, model_s = run_kernel_tuner(ev, budget, seed, name.split("-", 1)[1])
                    else:
                        raise ValueError(name)
                except Exception as e:  # a peer failing on one case must not sink the comparison
                    print(f"  {name} failed on {case.kernel}/{case.workload}/{case.isa}: {type(e).__name__}: {e}",
                          file=sys.stderr)
                    traj, model_s = [], 0.0
                host_s = time.perf_counter() - t0
                e = evals_to(traj, best)
                n_to = e if e is not None else len(traj)
                per[name].append({
                    "kernel": case.kernel, "isa": case.isa, "workload": case.workload, "seed": seed, "best": best,
                    "evals_to": e, "best_at": {b: best_at(traj, b) for b in BUDGETS},
                    "wall_s": n_to * (per_compile + MEASURE_S) + model_s, "host_s": host_s,
                    "traj": traj})
    return per


# ---- real run ---------------------------------------------------------------------------------------------

def measured(runner, spec, shape: dict, hw) -> Measured:
    """The bench's real measurements: the collector's timing budget."""
    return Measured(spec=spec, shape=shape, hw=hw, runner=runner, min_time_s=0.02, max_reps=15, timeout_s=20)


def real_run(cases: list[D.Case], strategies: list[str], n: int) -> list[dict]:
    from hwprobe import probe
    from kernels.worker import Runner
    from tuner.db import ResultsDB
    from tuner.session import Budget, Session

    specs = all_specs()
    native = probe(measure_bandwidth=False).isa
    chosen = [c for c in cases if c.isa == native and not c.workload.startswith("synthetic.")][:n]
    chosen += [c for c in cases if c.isa == native and c.workload.startswith("synthetic.")][: max(0, n - len(chosen))]
    rows = []
    with tempfile.TemporaryDirectory() as td, Runner() as runner:
        os.environ["CACHE_DIRECTORY"] = str(Path(td) / "cache")  # cold build cache: compile time is real
        db = ResultsDB(Path(td) / "bench.db")
        hw = probe(measure_bandwidth=False)
        sess = Session(db, runner, hw, ort_twin=False)  # the ONNX twin is not part of tuning time
        for case in chosen:
            spec = specs[case.kernel]
            wl = next((w for w in spec.workloads if w.shape == case.shape), None)
            if wl is None:
                from kernels.spec import Workload

                wl = Workload(case.workload, case.shape)
            for name in strategies:
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                res = sess.tune(spec, wl, strategy=name, force=True,
                                budget=Budget(evals=20, patience=15))
                wall = time.perf_counter() - t0
                # the winner against the best-known config, both measured now: the recorded best-known ms
                # is from collection time, and host_factor says how much slower the machine is at the moment
                got = measured(runner, spec, case.shape, hw).interleave([case.ranked()[0][0], res.config], 7)
                ratio, ref_ms = got.ratios_to(0)[1] or float("inf"), got.median_ms(0)
                host = ref_ms / case.best_ms() if ref_ms else float("nan")
                rows.append({"kernel": case.kernel, "workload": case.workload, "strategy": name,
                             "wall_s": wall, "evals": res.evals, "ms": res.ms, "best_known_ms": case.best_ms(),
                             "ratio": ratio, "host_factor": host, "speedup_vs_default": res.speedup, "load1": load,
                             **res.timing})
                print(f"  real {name:8s} {case.kernel}/{case.workload}: {wall:.2f}s (compile "
                      f"{res.timing['compile_s']:.2f}s, measure {res.timing['measure_s']:.2f}s, strategy "
                      f"{res.timing['strategy_s']:.2f}s), {res.evals} evals, "
                      f"{res.ms:.4f} ms, {ratio:.2f}x best-known measured alongside (host {host:.2f}x slower "
                      f"than at collection), load {load:.2f}", flush=True)
    return rows


def measure_lists(runner, spec, shape: dict, ref: Config, hw, lists: dict[str, list[Config]], rounds: int = 7,
                  seed: int = 0) -> tuple[dict[str, list[float | None]], float | None, float | None]:
    """Each list's configs as same-round ratios to the reference config `ref` (a case's best-known, or a long
    search's winner), the control, and the reference's median ms now. Every distinct config of all lists is measured
    once per round (`Evaluator.interleave`), so lists that share a config share its measurement, and all lists are
    judged on the same rounds. The control is the reference measured again as if proposed: its share within 5% is
    the ceiling this host's noise leaves."""
    keys = list(dict.fromkeys(config_key(c) for cs in lists.values() for c in cs if config_key(c) != config_key(ref)))
    by_key = {config_key(c): c for cs in lists.values() for c in cs}
    cfgs = [ref] + [by_key[k] for k in keys] + [ref]
    got = measured(runner, spec, shape, hw).interleave(cfgs, rounds, seed=seed)
    ratios, ref_ms = got.ratios_to(0), got.median_ms(0)
    of = dict(zip([config_key(ref)] + keys, ratios[:-1]))
    return {name: [of[config_key(c)] for c in cs] for name, cs in lists.items()}, ratios[-1], ref_ms


def held_out_hw(case: D.Case, cache: dict) -> object:
    """This machine's descriptor capped at the case's ISA (one probe per ISA)."""
    from hwprobe import probe

    if case.isa not in cache:
        cache[case.isa] = probe(isa_cap=case.isa, measure_bandwidth=False)
    return cache[case.isa]


def measured_topk(cases: list[D.Case], k: int, model: Path | None, rounds: int = 7) -> list[dict]:
    """Strategy llm's first batch (the model's hedged top-k over the full space) on every held-out case, compiled
    and measured now in rounds with the case's best-known config (`measure_lists`).

    This is the product path (the full space, not the replay table): a proposal the collection never measured
    counts at its real speed. A proposal faster than the best-known counts as within 5%."""
    from kernels.worker import Runner
    from tuner.strategies.llm import LLMStrategy, load_proposer

    specs = all_specs()
    prop = load_proposer(model)
    hws: dict = {}
    rows = []
    with Runner() as runner:
        for i, case in enumerate(cases):
            spec = specs[case.kernel]
            space = spec.space(case.shape, held_out_hw(case, hws))
            top = LLMStrategy(space, kernel=spec, proposer=prop, k=k).ask(k)[:k]
            lists, control, ref_ms = measure_lists(runner, spec, case.shape, case.ranked()[0][0], space.hw,
                                                   {"llm": top}, rounds, seed=i)
            ratios = lists["llm"]
            hit = next((n + 1 for n, r in enumerate(ratios) if r is not None and r <= 1.05), None)
            rows.append({"kernel": case.kernel, "isa": case.isa, "workload": case.workload, "ref_ms": ref_ms,
                         "ratios": ratios, "evals_to": hit, "control": control, "load1": os.getloadavg()[0]})
            print(f"  [{i + 1}/{len(cases)}] {case.kernel} {case.isa} {case.workload}: top-{k} ratios "
                  + " ".join(f"{r:.2f}" if r else "fail" for r in ratios)
                  + f", control {control or float('nan'):.2f}, load {rows[-1]['load1']:.2f}", flush=True)
    return rows


def latency_and_rss(cases: list[D.Case], model: Path | None) -> dict:
    """Proposal latency on the full spaces (the product path, 1 thread) and process RSS with the model loaded."""
    import psutil

    from tuner.strategies.llm import load_proposer

    prop = load_proposer(model)
    lat, calls = [], []
    for c in cases:
        spec = all_specs()[c.kernel]
        space = spec.space(c.shape, _HwView(c.hw))
        prop.propose(c.kernel, space, 5)  # warm (grammar check cached, tokenizer cache)
        # a case's latency is the median of 3 calls: the tail across cases (hard prompts), not host hiccups
        ms = [prop.propose(c.kernel, space, 5).latency_ms for _ in range(3)]
        calls += ms
        lat.append(statistics.median(ms))
    # RSS of a clean process on the product path (what `edgetune propose` / the tuner load), not this bench's
    code = ("import psutil, resource; from tuner.strategies.llm import load_proposer; from hwprobe import probe; "
            "from kernels.registry import get_spec; s = get_spec('gemm'); p = load_proposer(None); "
            "p.propose('gemm', s.space(s.workloads[0].shape, probe(measure_bandwidth=False)), 5); "
            "print(psutil.Process().memory_info().rss / 1e6, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3)")
    import subprocess

    env = dict(os.environ, **({"EDGETUNE_MODEL": str(model)} if model else {}))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env).stdout.split()
    return {"n": len(lat), "p50_ms": float(statistics.median(lat)),
            "p95_ms": float(sorted(lat)[max(0, math.ceil(0.95 * len(lat)) - 1)]), "max_ms": max(lat),
            "p95_all_calls_ms": float(sorted(calls)[max(0, math.ceil(0.95 * len(calls)) - 1)]),
            # (ru_maxrss of a child is not usable here: Linux carries the forking parent's high-water mark over exec)
            "rss_mb": float(out[0]) if out else float("nan"),
            "bench_rss_mb": psutil.Process().memory_info().rss / 1e6, "load1": os.getloadavg()[0]}


# ---- main -------------------------------------------------------------------------------------------------

def available_peers() -> list[str]:
    out = []
    try:
        import optuna  # noqa: F401

        out.append("optuna-tpe")
    except ImportError:
        print("optuna not installed: skipping Optuna TPE (pip install -e '.[bench]')", file=sys.stderr)
    try:
        from opentuner.api import TuningRunManager  # noqa: F401

        out.append("opentuner")
    except Exception as e:
        print(f"opentuner not usable ({type(e).__name__}: {e}): skipping it", file=sys.stderr)
    try:
        import kernel_tuner  # noqa: F401

        out += ["kerneltuner-bayes_opt", "kerneltuner-genetic_algorithm", "kerneltuner-simulated_annealing"]
    except ImportError:
        print("kernel_tuner not installed: skipping Kernel Tuner", file=sys.stderr)
    return out


def print_table(summ: list[dict], budget: int) -> None:
    hdr = ["strategy", "cases", "evals→5% med", "p90", "≤5 evals", "est. wall s", *(f"best@{b} gm/≤5%" for b in BUDGETS)]
    rows = []
    for s in summ:
        rows.append([s["strategy"], str(s["cases"]), f"{s['median_evals']:.1f}",
                     f"{s['p90_evals']}" + ("+" if s["p90_evals"] > budget else ""), f"{s['within5']:.0%}",
                     f"{s['wall_s_median']:.2f}",
                     *(f"{s[f'gm_ratio@{b}']:.3f} / {s[f'share5@{b}']:.0%}" for b in BUDGETS)])
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(hdr)]
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(hdr)))
    for r in rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)))


def main(argv: list[str] | None = None) -> int:
    if "--real-layers" in (sys.argv[1:] if argv is None else argv):
        import tuners_real

        return tuners_real.main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # handled above, listed here so that --help shows the run the README quotes
    ap.add_argument("--real-layers", action="store_true",
                    help="instead: tune held-out real model layers for real (bench/tuners_real.py; "
                         "`--real-layers --help` lists its flags)")
    ap.add_argument("--data", default=str(D.DEFAULT_DATA))
    ap.add_argument("--model", help="GGUF (default: the bundled model)")
    ap.add_argument("--budget", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3, help="seeds per stochastic strategy and case")
    ap.add_argument("--strategies", default="llm,random,anneal,peers")
    ap.add_argument("--real", type=int, default=0, help="also tune N held-out workloads for real")
    ap.add_argument("--measure-topk", type=int, default=0, metavar="K",
                    help="also compile and measure the model's unrestricted top-K on every held-out case")
    ap.add_argument("--json", type=output_file, help="write all results to this file")
    a = ap.parse_args(argv)
    names = [s for s in a.strategies.split(",") if s != "peers"]
    if "peers" in a.strategies.split(","):
        names += available_peers()
    cases = D.load_collector(Path(a.data))
    _, held = D.split_cases(cases)
    held.sort(key=lambda c: (c.kernel, c.isa, c.workload))
    load0 = os.getloadavg()
    print(f"{len(held)} held-out cases; strategies {', '.join(names)}; budget {a.budget}; load {load0[0]:.2f}",
          flush=True)
    if "llm" in names:
        lr = latency_and_rss(held, Path(a.model) if a.model else None)
        print(f"llm proposal latency over {lr['n']} held-out cases (full spaces, top-5, 1 thread; a case's figure is the "
              f"median of 3 calls): p50 {lr['p50_ms']:.1f} ms, p95 {lr['p95_ms']:.1f} ms, max {lr['max_ms']:.1f} ms "
              f"(p95 over all calls {lr['p95_all_calls_ms']:.1f} ms); RSS of a process with the "
              f"model loaded (after a proposal) {lr['rss_mb']:.0f} MB; "
              f"load {lr['load1']:.2f}", flush=True)
    t0 = time.time()
    per = replay(held, names, a.budget, a.seeds, Path(a.model) if a.model else None, recorded_compile_s(Path(a.data)))
    summ = [summarise(n, per[n], a.budget) for n in names]
    print(f"\nreplay over the recorded reference tables ({len(held)} held-out cases, budget {a.budget}, "
          f"{a.seeds} seeds for stochastic strategies; {time.time() - t0:.0f}s, load {os.getloadavg()[0]:.2f}):")
    print_table(summ, a.budget)
    real = []
    if a.real:
        print(f"\nreal run on {a.real} held-out workloads (compile + measure + finalists):", flush=True)
        real = real_run(held, ["llm", "anneal", "random"], a.real)
        by: dict[str, list[dict]] = {}
        for r in real:
            by.setdefault(r["strategy"], []).append(r)
        for n, rs in by.items():
            print(f"  {n:8s} median wall {statistics.median(r['wall_s'] for r in rs):.2f}s  max "
                  f"{max(r['wall_s'] for r in rs):.2f}s  median evals {statistics.median(r['evals'] for r in rs):.0f}"
                  f"  within 5% of best-known (measured alongside) {sum(1 for r in rs if r['ratio'] <= 1.05)}/"
                  f"{len(rs)}  median ratio {statistics.median(r['ratio'] for r in rs):.3f}  host factor "
                  f"{statistics.median(r['host_factor'] for r in rs):.2f}  median compile "
                  f"{statistics.median(r['compile_s'] for r in rs):.2f}s, measure "
                  f"{statistics.median(r['measure_s'] for r in rs):.2f}s, strategy "
                  f"{statistics.median(r['strategy_s'] for r in rs):.2f}s")
    topk = []
    if a.measure_topk:
        print(f"\nthe model's unrestricted top-{a.measure_topk}, measured now against each case's best-known "
              f"config ({len(held)} held-out cases):", flush=True)
        topk = measured_topk(held, a.measure_topk, Path(a.model) if a.model else None)
        ev = [r["evals_to"] or a.measure_topk + 1 for r in topk]
        hits = sum(e <= a.measure_topk for e in ev)
        lo, hi = share_interval(hits, len(ev))
        control = sum(1 for r in topk if r["control"] is not None and r["control"] <= 1.05)
        print(f"  top-1 within 5%: {sum(e == 1 for e in ev) / len(ev):.0%}; top-{a.measure_topk} within 5%: "
              f"{hits}/{len(ev)} = {hits / len(ev):.0%} (95% interval {lo:.0%}-{hi:.0%}); evals to within 5% median "
              f"{statistics.median(ev):.1f} (a miss counts as {a.measure_topk + 1}); control (the best-known config "
              f"measured again as a proposal) within 5%: {control}/{len(ev)}; median best-of-top-"
              f"{a.measure_topk} ratio {statistics.median(min(x for x in r['ratios'] if x) for r in topk if any(r['ratios'])):.3f}; "
              f"load {statistics.median(r['load1'] for r in topk):.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summ, "replay": per, "real": real, "measured_topk": topk},
                                           indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
