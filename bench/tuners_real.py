"""Tuners on held-out real layers, measured on this machine: `python bench/compare_tuners.py --real-layers`.

For every layer of bench/real_layers.toml (shapes the tuner model never trained on; tests/test_real_layers.py):

1. Reference: the winner of a long search on this machine (`--ref-evals` evaluations of `anneal` through the real
   Session), cached per machine, ISA, kernel source and shape in `--refs` (a new kernel or host searches again);
   a run that measures something faster, confirmed in rounds of its own (step 4), makes that the reference of
   later runs.
2. Every strategy tunes the layer from a cold build cache through the real Session (compile, worker, finalists),
   each on a results DB of its own, which holds its winners on the layers before (the device's winners that an
   llm session's first batch draws on; a `--resume` starts that history afresh),
   with a budget of the largest of `--budgets`, spent whole (no patience stop): `llm`, `anneal`, `random`, Optuna
   TPE and Kernel Tuner (bench/peer_tuners.py). Where a strategy said it had converged (llm) is kept: a session
   without an explicit budget stops there, and "auto" reports that session (its evals, quality and wall time).
3. The winner at budget b of a run is what its session would have kept had it stopped there: the session's own
   finalists of its first b evaluations (`tuner.session.pick_finalists`: the fastest few by search measurement
   within its margin, and the default), the fastest of them in the side-by-side rounds. The reference, every run's
   finalists at every budget and each session's final winner are measured side by side in `--rounds` shuffled
   rounds (`Evaluator.interleave`, one protocol for all), in one warm build cache.
4. Quality = a config's median over rounds of its time over the round's fastest candidate (the issue's protocol),
   over the best known's: the reference's, measured twice in the same rounds (as a candidate and as the control;
   the geometric mean of the two). Not over the fastest candidate's: that one is the candidate whose noise ran
   lowest, and the more candidates a run measures the lower it reads (the winner's curse), so a share "within 5%"
   would fall with every strategy added. A candidate that leads the reference beyond the 3% noise threshold is
   measured again against it alone, in fresh rounds (`confirmed_ratio`); only if it is faster there too does it
   become the best known, of this layer's qualities and of later runs (`--refs`). "Within 5%" is quality <= 1.05
   (a lucky config reads below 1.0); evals to 5% is the first budget b
   whose winner is within 5% (a run that never gets there counts as budget + 1). The control, the reference's
   second measurement over its first, shows how far apart this host's noise puts one config from itself: the
   ceiling of any "within 5%" share.

Printed: per strategy the geometric mean quality at each budget, the share within 5%, median evals to 5%, the
median wall time of a cold session (compile included) and of reaching 5 evals, the "auto" session (median evals,
quality, seconds to its last eval); then the same per kernel; the load
average beside each layer. Only ratios measured in the same rounds are compared (the machine is shared).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.cli_args import output_file  # noqa: E402
from edgetune import paths  # noqa: E402
from edgetune.atomic import write_atomic  # noqa: E402
from kernels.measure import TIE_THRESHOLD  # noqa: E402
from kernels.space import Config, config_key  # noqa: E402
from kernels.spec import KernelSpec, Workload  # noqa: E402
from tuner.evaluate import Evaluator, same_round_ratio  # noqa: E402

BUDGETS = (5, 10, 20)
LAYERS = ROOT / "bench" / "real_layers.toml"
STRATEGIES = "llm,anneal,random,optuna-tpe,kerneltuner-bayes_opt"
PEERS = ("optuna-tpe", "kerneltuner-")
WITHIN = 1.05
CONFIRM_ROUNDS = 7  # fresh rounds in which a lead over the reference must hold (`confirmed_ratio`)


@dataclass
class Run:
    """One strategy's session on one layer."""

    strategy: str
    evals: int
    wall_s: float
    timing: dict
    traj: list[tuple[Config, float | None, float]]  # (config, search ms or None, seconds since start) per eval
    final: Config
    note: str = ""
    calls: list = field(default_factory=list)  # the tuner model's (wall ms, CPU ms) per proposal call
    quality: dict = field(default_factory=dict)  # budget -> quality of its winner at that budget
    final_quality: float | None = None
    evals_to: int | None = None
    converged_at: int | None = None  # evals done when the strategy said it had converged (a default session stops)
    auto_quality: float | None = None  # the winner of that session

    @property
    def auto_evals(self) -> int:
        return min(self.converged_at or len(self.traj), len(self.traj))

    def finalists_at(self, n: int, default: Config) -> list[Config]:
        """The session's finalists had it stopped after n evaluations."""
        from kernels.measure import Measurement
        from tuner.session import pick_finalists

        ok = sorted(((c, Measurement(ok=True, ms=ms)) for c, ms, _ in self.traj[:n] if ms is not None),
                    key=lambda cm: cm[1].value)
        return pick_finalists(ok, default) if ok else []

    def seconds_to(self, n: int) -> float | None:
        return self.traj[n - 1][2] if len(self.traj) >= n else None


def load_layers(path: Path, kernels: list[str], per_kernel: int | None,
                names: list[str]) -> list[tuple[KernelSpec, Workload]]:
    from kernels.workload_files import load_workload_files

    out, count = [], {}
    for spec, wl in load_workload_files([str(path)]):
        if (kernels and spec.name not in kernels) or (names and wl.name not in names):
            continue
        count[spec.name] = count.get(spec.name, 0) + 1
        if per_kernel is None or count[spec.name] <= per_kernel:
            out.append((spec, wl))
    return out


# ---- sessions ---------------------------------------------------------------------------------------------

def plain_name(tag: str) -> str:
    """An arm's tag (`llm:warm=off,k=3`) as a file name: only letters, digits and `_.=-`."""
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", tag)


def _cold(td: Path, tag: str) -> None:
    """A fresh build cache for the next session: its compile time is real. The tag is made a plain name, since
    CACHE_DIRECTORY is cut at its first ':' (systemd's list) and `llm:k=5` would share `llm`'s builds. The
    precompiled header (kernels.pch) is shared: a device makes it once, not once per session."""
    cold = td / "cold" / plain_name(tag)
    (td / "pch").mkdir(exist_ok=True)
    cold.mkdir(parents=True, exist_ok=True)
    if not (cold / "pch").exists():
        (cold / "pch").symlink_to(td / "pch")
    os.environ["CACHE_DIRECTORY"] = str(cold)


def strategy_obj(name: str, spec: KernelSpec, space, seed: int, budget: int):
    """A peer (bench/peer_tuners.py), or one of ours by name, with settings after a colon (`llm:k=5+history=0`)."""
    from peer_tuners import make_peer

    from tuner.strategies import STRATEGIES

    if name.startswith(PEERS):
        return make_peer(name, space, seed, budget)
    base, _, opts = name.partition(":")
    cls = STRATEGIES[base]
    lists = {n for n, p in inspect.signature(cls).parameters.items() if isinstance(p.default, tuple)}
    kw = {k: _setting(k in lists, v) for k, v in (o.split("=", 1) for o in opts.split(",") if o)}
    return cls(space, seed, kernel=spec, **kw)


def _setting(is_list: bool, v: str) -> int | float | str | tuple[str, ...]:
    """A strategy setting from the command line: a list of '/'-separated names for a setting whose default is a
    tuple (`llm:always_hedge=threads/vec`, `llm:always_hedge=vec`, `llm:always_hedge=` for none), else a number,
    else a string (`llm:model_path=other.gguf`)."""
    if is_list:
        return tuple(x for x in v.split("/") if x)
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def tune(sess, spec: KernelSpec, wl: Workload, name: str, budget: int, seed: int) -> Run:
    from tuner.session import Budget

    strat = strategy_obj(name, spec, spec.space(wl.shape, sess.hw), seed, budget)
    t0 = time.time()
    try:
        res = sess.tune(spec, wl, strategy_obj=strat, seed=seed, force=True,
                        budget=Budget.whole(budget))
    finally:
        if hasattr(strat, "close"):
            strat.close()
    rows = sess.db.measurements(res.session_id, "search")
    start = sess.db.session_info(res.session_id)["started_at"]
    traj = [(r["config"], r["ms"] if r["ok"] else None,
             r["ts"] - start) for r in rows]
    note = "fell back to anneal (no usable model)" if "fallback" in (res.strategy_version or "") else ""
    return Run(name, res.evals, res.tuning_s or (time.time() - t0), res.timing, traj, res.config, note,
               calls=list(getattr(strat, "calls", [])), converged_at=res.converged_at)


def reference(sess, spec: KernelSpec, wl: Workload, evals: int, refs: dict, refs_path: Path) -> Config:
    """The cached long-search winner for this machine, ISA, kernel source and shape, or a new search."""
    key = ref_key(sess.hw, spec, wl)
    if key in refs:
        return refs[key]["config"]
    t0 = time.time()
    run = tune(sess, spec, wl, "anneal", evals, seed=12345)
    refs[key] = {"config": run.final, "kernel": spec.name, "workload": wl.name, "evals": run.evals,
                 "seconds": round(time.time() - t0, 1), "load1": os.getloadavg()[0], "ts": time.time()}
    refs_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(refs_path, json.dumps(refs, indent=1).encode())
    return run.final


def ref_key(hw, spec: KernelSpec, wl: Workload) -> str:
    return f"{hw.hw_fingerprint}|{hw.isa}|{spec.name}|{spec.source_hash()}|{json.dumps(wl.shape, sort_keys=True)}"


# ---- side by side -----------------------------------------------------------------------------------------

def judge(runner, hw, spec: KernelSpec, wl: Workload, ref: Config, runs: list[Run], rounds: int, seed: int,
          budget: int) -> dict:
    """Measure the reference and every run's finalists side by side; fill each run's qualities."""
    from tuner.evaluate import Measured

    default = spec.space(wl.shape, hw).valid_default()
    wanted: dict[str, Config] = {config_key(ref): ref}
    for r in runs:
        for n in range(1, len(r.traj) + 1):
            for c in r.finalists_at(n, default):
                wanted.setdefault(config_key(c), c)
        wanted.setdefault(config_key(r.final), r.final)
    keys = list(wanted)
    ev = Measured(spec=spec, shape=wl.shape, hw=hw, runner=runner, min_time_s=0.02, max_reps=15, timeout_s=20)
    got = ev.interleave([wanted[k] for k in keys] + [ref], rounds, seed=seed)  # the last: the control
    ratios = ratios_to_fastest(got)
    ratio = dict(zip(keys, ratios))
    rk, control = config_key(ref), ratios[-1]
    known = math.sqrt(ratio[rk] * control) if ratio[rk] and control else ratio[rk] or control or 1.0
    lead = min((k for k in keys if ratio[k] and k != rk), key=lambda k: ratio[k], default=None)
    faster = None
    if lead is not None and ratio[lead] < known * (1 - TIE_THRESHOLD):
        faster = confirmed_ratio(ev, ref, wanted[lead], rounds, seed=f"{seed}:confirm", seen=ratio[lead] / known)
    best = known * faster if faster else known
    q = {k: (x / best if x else None) for k, x in ratio.items()}
    for r in runs:
        at = {n: min((q[config_key(c)] for c in r.finalists_at(n, default) if q.get(config_key(c))), default=None)
              for n in range(1, len(r.traj) + 1)}
        r.quality = {b: at.get(min(b, len(r.traj))) for b in BUDGETS if b <= budget}
        r.final_quality = q.get(config_key(r.final))
        r.auto_quality = at.get(r.auto_evals)
        r.evals_to = next((n for n in range(1, len(r.traj) + 1) if at.get(n) is not None and at[n] <= WITHIN), None)
    return {"configs": len(keys), "ref_ms": got.median_ms(0), "best": wanted[lead] if faster else ref,
            "rounds": {k: got.times(i) for i, k in enumerate(keys + ["control"])},  # ms per round, for re-analysis
            "best_over_ref": faster or 1.0,
            "lead_over_ref": ratio[lead] / known if lead is not None else None,
            "control": control / ratio[rk] if control and ratio[rk] else None,
            "compile_s": ev.timing.get("compile_s", 0.0)}


def confirmed_ratio(ev: Evaluator, ref: Config, challenger: Config, rounds: int, seed: int | str = 0,
                    seen: float = 0.0) -> float | None:
    """The challenger's time over the reference's in fresh shuffled rounds of the two alone (at least
    CONFIRM_ROUNDS), when it is faster there beyond the noise threshold; None when it is not. Its lead is the
    smaller of that one and the one `seen` among all candidates: a short kernel's few rounds can fall inside a
    burst of load, which once read a 5% lead as 4.7x, and the reference then kept the slower config for good.

    A lead seen among many candidates is partly the leader's luck: in one run's rounds of 35 candidates per layer
    (five strategies), the reference read within 5% of the fastest candidate on 18 of 35 layers; judged against
    only its own session's 10-12 candidates, on 24-27. So a lead is checked where no other candidate competes."""
    got = ev.interleave([ref, challenger], max(rounds, CONFIRM_ROUNDS), seed=seed)
    r = got.ratios_to(0)[1]
    return max(r, seen) if r is not None and r < 1 - TIE_THRESHOLD else None


def ratios_to_fastest(got) -> list[float | None]:
    """Each config's median over rounds of its time over the round's fastest config (the issue's protocol).

    A ratio to one reference config would inherit that config's noise: on this busy 2-core host a 2-thread config
    measured from 1x to 70x its best from one round to the next, so every ratio to it would be noise; the round's
    fastest of many candidates is stable."""
    n_rounds = len(got.per[0])
    fastest = [min((got.per[i][r].ms for i in range(len(got.per)) if got.per[i][r].ok), default=None)
               for r in range(n_rounds)]
    return [same_round_ratio(got.times(i), fastest) for i in range(len(got.per))]


def improve_reference(refs: dict, key: str, info: dict, path: Path) -> None:
    """A config confirmed faster than the reference (`confirmed_ratio`) becomes the next run's: the reference is
    the best known on this machine, and grows with every run."""
    if info["best_over_ref"] and info["best_over_ref"] < 1 - TIE_THRESHOLD:
        refs[key] |= {"config": info["best"], "improved_by": round(1 / info["best_over_ref"], 3), "ts": time.time()}
        write_atomic(path, json.dumps(refs, indent=1).encode())


# ---- summary ----------------------------------------------------------------------------------------------

def gmean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def summary(rows: list[dict], strategies: list[str], budget: int) -> list[dict]:
    out = []
    for s in strategies:
        runs = [r["runs"][s] for r in rows if s in r["runs"]]
        if not runs:
            continue
        d = {"strategy": s, "layers": len(runs)}
        for b in (b for b in BUDGETS if b <= budget):
            qs = [r["quality"].get(str(b), r["quality"].get(b)) or 10.0 for r in runs]
            d[f"gm@{b}"] = gmean(qs)
            d[f"within@{b}"] = sum(q <= WITHIN for q in qs) / len(qs)
        d["median_evals_to"] = statistics.median(r["evals_to"] or budget + 1 for r in runs)
        d["median_wall_s"] = statistics.median(r["wall_s"] for r in runs)
        t5 = [r["seconds_to_5"] for r in runs if r["seconds_to_5"] is not None]
        d["median_s_to_5"] = statistics.median(t5) if t5 else None
        d["median_evals"] = statistics.median(r["evals"] for r in runs)
        d["gm_final"] = gmean([r["final_quality"] or 10.0 for r in runs])
        autos = [r.get("auto_quality") or 10.0 for r in runs]
        d["gm_auto"], d["within_auto"] = gmean(autos), sum(q <= WITHIN for q in autos) / len(autos)
        d["median_auto_evals"] = statistics.median(r.get("auto_evals", r["evals"]) for r in runs)
        auto_s = [r["auto_s"] for r in runs if r.get("auto_s") is not None]
        d["median_auto_s"] = statistics.median(auto_s) if auto_s else None
        out.append(d)
    return out


def print_summary(summ: list[dict], title: str) -> None:
    budgets = [b for b in BUDGETS if summ and f"gm@{b}" in summ[0]]
    hdr = ["strategy", "layers", *(f"@{b} gm / ≤5%" for b in budgets), "evals→5% med", "session gm", "evals",
           "wall s", "s to 5 evals", "auto: evals", "gm / ≤5%", "s"]
    rows = [[d["strategy"], str(d["layers"]), *(f"{d[f'gm@{b}']:.3f} / {d[f'within@{b}']:.0%}" for b in budgets),
             f"{d['median_evals_to']:.1f}", f"{d['gm_final']:.3f}", f"{d['median_evals']:.0f}",
             f"{d['median_wall_s']:.2f}", f"{d['median_s_to_5']:.2f}" if d["median_s_to_5"] is not None else "-",
             f"{d['median_auto_evals']:.0f}", f"{d['gm_auto']:.3f} / {d['within_auto']:.0%}",
             f"{d['median_auto_s']:.2f}" if d["median_auto_s"] is not None else "-"]
            for d in summ]
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(hdr)]
    print(title)
    print("  " + "  ".join(h.ljust(w[i]) for i, h in enumerate(hdr)))
    for r in rows:
        print("  " + "  ".join(c.ljust(w[i]) for i, c in enumerate(r)))


def print_latency(rows: list[dict], strategies: list[str]) -> None:
    """p50/p95 of the tuner model's proposal calls: wall time, and CPU time (its latency on an idle core)."""
    for s in strategies:
        calls = [c for r in rows if s in r["runs"] for c in r["runs"][s].get("calls", [])]
        if calls:
            q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
            wall, cpu = [c[0] for c in calls], [c[1] for c in calls]
            print(f"{s}: {len(calls)} proposal calls, wall p50 {q(wall, .5):.1f} / p95 {q(wall, .95):.1f} ms, "
                  f"CPU p50 {q(cpu, .5):.1f} / p95 {q(cpu, .95):.1f} ms (1 thread)")


def run_dict(r: Run) -> dict:
    return {"evals": r.evals, "wall_s": r.wall_s, "timing": r.timing, "note": r.note, "final": r.final,
            "calls": r.calls,
            "final_quality": r.final_quality, "quality": r.quality, "evals_to": r.evals_to,
            "seconds_to_5": r.seconds_to(5), "converged_at": r.converged_at, "auto_evals": r.auto_evals,
            "auto_quality": r.auto_quality, "auto_s": r.seconds_to(r.auto_evals) if r.traj else None, "traj": [[c, ms, round(t, 3)] for c, ms, t in r.traj]}


# ---- main -------------------------------------------------------------------------------------------------

class ArmSessions(dict):
    """A Session per arm (and one for the reference search), each on its own results DB, as on a device that runs
    that one strategy over the layers in order: what an arm's session finds of the device's earlier winners
    (`Strategy.warm_start`) is its own, never the reference search's or another arm's."""

    def __init__(self, td: Path, runner, hw):
        super().__init__()
        self.td, self.runner, self.hw = td, runner, hw

    def __missing__(self, arm: str):
        from tuner.db import ResultsDB
        from tuner.session import Session

        db = ResultsDB(self.td / f"{plain_name(arm)}.db")
        self[arm] = sess = Session(db, self.runner, self.hw, ort_twin=False)
        return sess


def run_layer(sessions: ArmSessions, runner, td: Path, i: int, spec: KernelSpec, wl: Workload,
              strategies: list[str], a: argparse.Namespace, refs: dict, refs_path: Path) -> dict:
    """One layer: its reference, every strategy's cold session, the side-by-side rounds."""
    load = os.getloadavg()[0]
    t0 = time.time()
    _cold(td, "ref")
    hw = sessions.hw
    ref = reference(sessions["ref"], spec, wl, a.ref_evals, refs, refs_path)
    runs = []
    for s in strategies:
        _cold(td, f"{i}-{s}")
        try:
            runs.append(tune(sessions[s], spec, wl, s, a.budget, a.seed))
        except Exception as e:  # one peer failing on one layer must not sink the comparison
            print(f"  {s} failed on {spec.name}/{wl.name}: {type(e).__name__}: {e}", file=sys.stderr)
    os.environ["CACHE_DIRECTORY"] = str(td / "warm")
    info = judge(runner, hw, spec, wl, ref, runs, a.rounds, seed=i, budget=a.budget)
    improve_reference(refs, ref_key(hw, spec, wl), info, refs_path)
    return {"kernel": spec.name, "workload": wl.name, "shape": wl.shape, "reference": ref, "load1": load,
            "load1_end": os.getloadavg()[0], "seconds": time.time() - t0, **info,
            "runs": {r.strategy: run_dict(r) for r in runs}}


def resumed(path: Path | None, strategies: list[str]) -> list[dict]:
    """The layers an earlier run of the same strategies wrote to `path`."""
    if path is None or not path.exists():
        return []
    doc = json.loads(path.read_text())
    if doc.get("strategies") != strategies:
        raise SystemExit(f"{path} holds a run of other strategies ({doc.get('strategies')}); give another --json")
    print(f"resuming: {len(doc['layers'])} layers from {path}", flush=True)
    return doc["layers"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--real-layers", action="store_true", help="(selects this bench in compare_tuners.py)")
    ap.add_argument("--layers", default=str(LAYERS), help="held-out layers (a workloads file)")
    ap.add_argument("--kernels", default="", help="only these kernels (comma-separated)")
    ap.add_argument("--per-kernel", type=int, help="only the first N layers of each kernel (a quick subset)")
    ap.add_argument("--names", default="", help="only these layers (comma-separated names)")
    ap.add_argument("--strategies", default=STRATEGIES,
                    help="comma-separated; also peers (optuna-tpe, kerneltuner-<strategy>) and variants of ours with "
                         "settings after a colon, separated by '+': llm:k=5+patience=6, llm:model_path=B.gguf")
    ap.add_argument("--budget", type=int, default=max(BUDGETS), help="evaluations per session")
    ap.add_argument("--rounds", type=int, default=5, help="side-by-side rounds per layer")
    ap.add_argument("--ref-evals", type=int, default=80, help="evaluations of the reference search")
    ap.add_argument("--refs", type=output_file, default=str(paths.cache_dir() / "bench-real-refs.json"),
                    help="reference cache (per machine, ISA, kernel source and shape)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=output_file,
                    help="write every layer's runs (after each layer) and the summaries here")
    ap.add_argument("--resume", action="store_true", help="skip the layers --json already holds")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    a = ap.parse_args(argv)
    from hwprobe import probe
    from kernels.worker import Runner

    strategies = [s.replace("+", ",") if ":" in s else s for s in a.strategies.split(",") if s]
    layers = load_layers(Path(a.layers), [k for k in a.kernels.split(",") if k], a.per_kernel,
                         [n for n in a.names.split(",") if n])
    refs_path = Path(a.refs)
    refs = json.loads(refs_path.read_text()) if refs_path.exists() else {}
    hw = probe(measure_bandwidth=False)
    warm = os.environ.get("CACHE_DIRECTORY")
    print(f"{len(layers)} held-out real layers; strategies {', '.join(strategies)}; budget {a.budget}; "
          f"{a.rounds} rounds; {hw.cpu_model}, {hw.isa}, {hw.cores} cores; load {os.getloadavg()[0]:.2f}", flush=True)
    out = Path(a.json) if a.json else None
    rows: list[dict] = resumed(out, strategies) if a.resume else []
    done = {(r["kernel"], r["workload"]) for r in rows}
    t_all = time.time()
    with tempfile.TemporaryDirectory(prefix="et-real-") as tdir, Runner() as runner:
        td = Path(tdir)
        sessions = ArmSessions(td, runner, hw)
        for i, (spec, wl) in enumerate(layers):
            if (spec.name, wl.name) in done:
                continue
            row = run_layer(sessions, runner, td, i, spec, wl, strategies, a, refs, refs_path)
            rows.append(row)
            print(f"[{i + 1}/{len(layers)}] {spec.name}/{wl.name}: "
                  + "  ".join(f"{n} " + "/".join(f"{r['quality'].get(b) or float('nan'):.2f}" for b in BUDGETS
                                                 if b <= a.budget)
                              + f" ({r['evals']}ev {r['wall_s']:.1f}s{', ' + r['note'] if r['note'] else ''})"
                              for n, r in row["runs"].items())
                  + f"; best/ref {row['best_over_ref']:.2f} (lead {row['lead_over_ref'] or float('nan'):.2f}), control "
                    f"{row['control'] or float('nan'):.2f}, load "
                    f"{row['load1']:.1f}-{row['load1_end']:.1f}, {row['seconds']:.0f}s", flush=True)
            if out:  # after every layer: a killed run keeps what it measured (--resume continues it)
                write_atomic(out, json.dumps({"layers": rows, "strategies": strategies, "args": vars(a)},
                                             indent=1, default=str).encode())
    if warm is not None:
        os.environ["CACHE_DIRECTORY"] = warm
    report(rows, strategies, a, hw, time.time() - t_all)
    return 0


def report(rows: list[dict], strategies: list[str], a: argparse.Namespace, hw, seconds: float) -> None:
    summ = summary(rows, strategies, a.budget)
    loads = [r["load1"] for r in rows] + [r["load1_end"] for r in rows]
    controls = [r["control"] for r in rows if r.get("control")]
    print()
    if controls:
        print(f"control (the reference measured again as a candidate, over its first measurement): within 5% on "
              f"{sum(c <= WITHIN for c in controls)}/{len(controls)} layers, geomean {gmean(controls):.3f}")
    print_summary(summ, f"all {len(rows)} layers (quality = same-round ratio to the best known; load "
                        f"{min(loads):.1f}-{max(loads):.1f}, {seconds:.0f}s):")
    per_kernel = {}
    for k in dict.fromkeys(r["kernel"] for r in rows):
        per_kernel[k] = summary([r for r in rows if r["kernel"] == k], strategies, a.budget)
        print()
        print_summary(per_kernel[k], f"{k} ({sum(r['kernel'] == k for r in rows)} layers):")
    print_latency(rows, strategies)
    if a.json:
        write_atomic(Path(a.json), json.dumps({"summary": summ, "per_kernel": per_kernel, "layers": rows,
                                               "strategies": strategies, "args": vars(a),
                                               "hw": {"cpu": hw.cpu_model, "isa": hw.isa, "cores": hw.cores}},
                                              indent=1, default=str).encode())


if __name__ == "__main__":
    sys.exit(main())
