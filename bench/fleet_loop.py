"""The fleet learning loop, measured end to end: `PYTHONPATH=. .venv/bin/python bench/fleet_loop.py`.

A device class is simulated on this machine: N real daemons whose ISA is capped (`isa = "x86-64-v2"` in their
config: they build and tune as such a device would), each tuning its share of the class's workloads (shapes of
every kernel that no committed data holds) through a real mosquitto into a real `fleet serve`. Then the loop:

1. records in: every class workload's tuning record is in the fleet DB (the clock starts);
2. retrain: `edgetune fleet model build --where isa=<class>` (the committed data plus the fleet's records);
3. sign and publish: `edgetune fleet model publish V --phases 34,100 --min-dwell 0`;
4. devices download, verify and health-check it (top-K side by side with the current model on their own
   workloads) and commit; the clock stops when the rollout is completed (100% committed) or aborted.

Then old (bundled) and new model side by side, on the committed data's held-out cases of the class (problems
that neither model trained on: the training skips held-out problems in the fleet's records too) and on a few
held-out cases of the other classes: each model's top-D proposals over the full space are compiled and measured
in the same shuffled rounds with the case's best-known config (bench/compare_tuners.measure_lists), so both models
are judged on the same rounds. Printed per model: evals to within 5% of the best-known (the rank of the first
such proposal in its list; a miss counts as D + 1), top-1 and top-5 hits. The machine's load is printed with
each phase: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import compare_tuners as CT  # noqa: E402
from fleet import rollout_store as rs  # noqa: E402
from fleet.rollout import rollout_summary  # noqa: E402
from fleet.store import open_fleet_store  # noqa: E402
from kernels.registry import all_specs  # noqa: E402
from tests.broker import Mosquitto  # noqa: E402
from tests.fleet_server import FleetServer  # noqa: E402
from tests.test_daemon_support import DaemonProc, daemon_config, env_for  # noqa: E402
from tuner.train import data as D  # noqa: E402

WITHIN = 1.05
FIXED_DIMS = {"stride", "K", "n_fft", "hop"}  # left alone when deriving a class shape


def load() -> str:
    return "load %.2f %.2f %.2f on %d cores" % (*os.getloadavg(), os.cpu_count())


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}; {load()}", flush=True)


def class_workloads(cases: dict, isa: str, per_kernel: int, hw) -> list[dict]:
    """Shapes of every kernel that the committed data does not hold: a train shape of the class with one
    dimension scaled by 3/2 (rounded to a multiple of 4), kept when the kernel accepts it."""
    known = {c.problem for c in cases.values()}
    specs = all_specs()
    out = []
    for kernel in sorted({c.kernel for c in cases.values()}):
        train = sorted((c for c in cases.values() if c.kernel == kernel and c.isa == isa and c.split == "train"),
                       key=lambda c: json.dumps(c.shape, sort_keys=True))
        picked = 0
        for c in train:
            dims = [d for d, v in c.shape.items() if d not in FIXED_DIMS and isinstance(v, int) and v >= 8]
            for d in dims:
                shape = {**c.shape, d: max(4, round(c.shape[d] * 1.5 / 4) * 4)}
                if D.problem_key(kernel, isa, shape) in known:
                    continue
                try:
                    specs[kernel].space(shape, hw)
                except Exception:  # noqa: BLE001  (a shape the kernel refuses is simply not used)
                    continue
                known.add(D.problem_key(kernel, isa, shape))
                out.append({"kernel": kernel, "name": f"class.{c.workload}.{d}x1.5", "shape": shape})
                picked += 1
                break
            if picked >= per_kernel:
                break
    return out


def workloads_toml(items: list[dict]) -> str:
    lines = ["# edgetune workloads file (bench/fleet_loop.py: the simulated device class)"]
    for w in items:
        shape = ", ".join(f"{k} = {v}" for k, v in w["shape"].items())
        lines += ["[[workload]]", f'kernel = "{w["kernel"]}"', f'name = "{w["name"]}"', f"shape = {{ {shape} }}"]
    return "\n".join(lines) + "\n"


def edgetune(env: dict, *args: str, timeout: float = 3600) -> dict:
    r = subprocess.run([sys.executable, "-m", "edgetune.main", *args, "--json"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"edgetune {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def wait(what: str, pred, timeout: float, every: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


# ---- the loop ----------------------------------------------------------------------------------------------------

def run_loop(a: argparse.Namespace, tmp: Path) -> dict:
    from hwprobe import probe

    cases = D.load_collector(D.DEFAULT_DATA)
    hw = probe(isa_cap=a.isa, measure_bandwidth=False)
    wls = class_workloads(cases, a.isa, a.per_kernel, hw)
    names = [f"{a.isa}-dev-{i}" for i in range(a.devices)]
    shares = {n: wls[i::a.devices] for i, n in enumerate(names)}
    say(f"class {a.isa}: {len(wls)} workloads over {a.devices} daemons, budget {a.budget} each ({a.strategy})")
    cache = tmp / "cache"
    broker = Mosquitto(tmp / "broker").start()
    server = FleetServer(broker, env_for(tmp / "fleet", cache))
    procs: list[DaemonProc] = []
    try:
        server.start()
        env = server.env
        key = edgetune(env, "fleet", "key", "create", "--out", str(tmp / "keys" / "release.key"))
        for n in names:
            (tmp / n).mkdir()
            cfg = daemon_config(tmp / n, broker, workload=workloads_toml(shares[n]), device_id=n, isa=a.isa,
                                tuning={"budget": a.budget, "strategy": a.strategy},
                                model_update={"trusted_keys": [key["public_key"]], "fleet_url": server.base})
            procs.append(DaemonProc(cfg, env=env_for(tmp / n, cache)).start())
        db = Path(env["STATE_DIRECTORY"]) / "fleet.db"

        def records_in() -> bool:
            if not db.exists():
                return False
            with open_fleet_store(db) as s:
                got = {(r["device_id"], r["workload"]) for r in s.query("SELECT device_id, workload FROM records")}
            return all((n, w["name"]) in got for n in names for w in shares[n])

        t_tune = time.time()
        wait("every class workload's tuning record in the fleet DB", records_in, a.timeout)
        t_in = time.time()
        say(f"records in after {t_in - t_tune:.0f} s of tuning")
        built = edgetune(env, "fleet", "model", "build", "--where", f"isa={a.isa}",
                         *(["--steps", str(a.steps)] if a.steps else []), timeout=a.timeout)
        t_built = time.time()
        say(f"retrained v{built['version']} on {built['records']} fleet records in {t_built - t_in:.0f} s")
        rid = edgetune(env, "fleet", "model", "publish", str(built["version"]), "--key", key["private_key"],
                       "--phases", "34,100", "--min-dwell", "0")["rollout"]

        def finished() -> dict | None:
            with open_fleet_store(db) as s:
                r = rs.rollout(s, rid)
                return {**rollout_summary(r, rs.targets(s, rid)), "devices": rs.targets(s, rid)} \
                    if r["state"] in ("completed", "aborted") else None

        done = wait("the rollout to complete", finished, a.timeout, every=1.0)
        t_done = time.time()
        say(f"rollout {rid} {done['state']} after {t_done - t_built:.0f} s: {done['totals']}"
            + (f" ({done['reason']})" if done["reason"] else ""))
        for d in done["devices"]:
            print(f"    {d['device_id']}: {d['state']} {d['reason'] or ''} {d['detail'] or ''}", flush=True)
        return {"model": built["file"], "rollout": done["state"], "tuning_s": t_in - t_tune,
                "retrain_s": t_built - t_in, "rollout_s": t_done - t_built, "loop_s": t_done - t_in,
                "records": built["records"]}
    finally:
        for p in procs:
            p.stop()
        server.stop()
        broker.stop()


# ---- old and new side by side ------------------------------------------------------------------------------------

def first_hit(ratios: list[float | None]) -> int | None:
    return next((i + 1 for i, r in enumerate(ratios) if r is not None and r <= WITHIN), None)


def compare(models: dict[str, Path], cases: list[D.Case], depth: int, rounds: int) -> list[dict]:
    from kernels.worker import Runner
    from tuner.model.proposer import Proposer

    proposers = {n: Proposer(path=p) for n, p in models.items()}
    specs, hws, rows = all_specs(), {}, []
    with Runner() as runner:
        for i, case in enumerate(cases):
            spec = specs[case.kernel]
            space = spec.space(case.shape, CT.held_out_hw(case, hws))
            lists = {n: [p.config for p in prop.propose(case.kernel, space, depth).proposals]
                     for n, prop in proposers.items()}
            ratios, control, _ = CT.measure_lists(runner, spec, case, space.hw, lists, rounds, seed=i)
            rows.append({"kernel": case.kernel, "isa": case.isa, "workload": case.workload, "ratios": ratios,
                         "control": control})
            print(f"  [{i + 1}/{len(cases)}] {case.kernel} {case.isa} {case.workload}: " + "  ".join(
                f"{n} first hit {first_hit(ratios[n]) or '-'}" for n in models) + f"; {load()}", flush=True)
    return rows


def summarize(rows: list[dict], models: list[str], depth: int, title: str) -> None:
    n = len(rows)
    print(f"\n{title}: {n} held-out cases, lists of {depth}, {load()}")
    print(f"  {'model':8s} {'median evals to 5%':>19s} {'mean':>6s} {'top-1':>6s} {'top-5':>6s}")
    evals = {}
    for m in models:
        e = [first_hit(r["ratios"][m]) or depth + 1 for r in rows]
        evals[m] = e
        top1 = sum(1 for r in rows if (first_hit(r["ratios"][m]) or 99) <= 1)
        top5 = sum(1 for r in rows if (first_hit(r["ratios"][m]) or 99) <= 5)
        print(f"  {m:8s} {statistics.median(e):19.1f} {statistics.mean(e):6.2f} {top1:3d}/{n} {top5:3d}/{n}")
    if len(models) == 2 and n:
        old, new = models
        print(f"  new/old evals: median {statistics.median(evals[new]) / statistics.median(evals[old]):.2f}, "
              f"mean {statistics.mean(evals[new]) / statistics.mean(evals[old]):.2f}; control within 5%: "
              f"{sum(1 for r in rows if r['control'] and r['control'] <= WITHIN)}/{n}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default="x86-64-v2", help="the simulated device class's ISA cap (default x86-64-v2)")
    ap.add_argument("--devices", type=int, default=3, help="daemons of the class (default 3)")
    ap.add_argument("--per-kernel", type=int, default=2, help="class workloads per kernel (default 2)")
    ap.add_argument("--budget", type=int, default=20, help="evaluations per workload on the devices (default 20)")
    ap.add_argument("--strategy", default="anneal", help="the devices' search strategy (default anneal)")
    ap.add_argument("--steps", type=int, help="training steps (default: the shipped recipe)")
    ap.add_argument("--depth", type=int, default=10, help="proposals measured per model and case (default 10)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cases", type=int, default=0, help="only the first N held-out cases of the class (0: all)")
    ap.add_argument("--other", type=int, default=6, help="held-out cases of the other classes (default 6)")
    ap.add_argument("--timeout", type=float, default=7200.0, help="give up on a phase after this long")
    ap.add_argument("--model", help="skip the loop: compare this GGUF with the bundled model")
    a = ap.parse_args(argv)
    from tuner.model.inference import bundled_model_path

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, capture_output=True)
    print(f"edgetune fleet loop at commit {commit.stdout.strip()}; {load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="edgetune-fleet-loop-") as td:
        loop = None
        if a.model:
            new = Path(a.model)
        else:
            loop = run_loop(a, Path(td))
            new = Path(td) / "new.gguf"
            new.write_bytes(Path(loop["model"]).read_bytes())
        cases = D.load_collector(D.DEFAULT_DATA)
        _, held = D.split_cases(cases)
        held.sort(key=lambda c: (c.kernel, c.workload))
        mine = [c for c in held if c.isa == a.isa]
        mine = mine[:a.cases] if a.cases else mine
        others = [c for c in held if c.isa != a.isa]
        others = others[:: max(1, len(others) // max(1, a.other))][:a.other]
        models = {"old": bundled_model_path(), "new": new}
        say(f"old and new side by side on {len(mine)} held-out {a.isa} cases")
        rows = compare(models, mine, a.depth, a.rounds)
        rows_other = compare(models, others, a.depth, a.rounds) if others else []
    summarize(rows, list(models), a.depth, f"class {a.isa}")
    if rows_other:
        summarize(rows_other, list(models), a.depth, "other classes")
    if loop:
        print(f"\nloop: records in -> {loop['rollout']} in {loop['loop_s']:.0f} s (retrain {loop['retrain_s']:.0f} s, "
              f"sign + staged rollout + device health checks {loop['rollout_s']:.0f} s); tuning before it "
              f"{loop['tuning_s']:.0f} s; {loop['records']} fleet records; {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
