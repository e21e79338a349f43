"""The fleet learning loop, measured end to end: `PYTHONPATH=. .venv/bin/python bench/fleet_loop.py`.

A device class the committed data lacks is simulated on this machine: N real daemons whose ISA is capped (`isa =
"x86-64"` in their config, the SSE2 baseline; the collector used x86-64-v4/v3/v2 only), so they build with
`-march=x86-64` and time that code, as such a device would. Each tunes its share of the class's workloads (training
shapes of every kernel, at an ISA no committed data holds) through a real mosquitto into a real `fleet serve`, one
daemon after the other: a device has its cores to itself, and two daemons timing at once on this machine would
record each other's load.

0. References: for the held-out real layers of bench/real_layers.toml (`--held` per kernel; training drops every
   record of them, on every ISA and device: `tuner.train.data.is_real_heldout`), a long search on this machine
   (`--ref-evals` evaluations of `anneal` through the real Session, bench/tuners_real.reference) at the class's ISA
   and at the other classes' (`--other-isa`, default this machine's own), cached per machine, ISA, kernel source
   and shape in `--refs`, so a rerun does not search again (`--refs-only` stops here).
1. records in: every class workload's tuning record is in the fleet DB (the clock starts);
2. retrain: `edgetune fleet model build --where isa=<class>` (the committed data plus the fleet's records);
3. sign and publish: `edgetune fleet model publish V --phases 34,100 --min-dwell 0`;
4. devices download, verify and health-check it (top-K side by side with the current model on their own
   workloads) and commit; the clock stops when the rollout is completed (100% committed) or aborted.

Then old (bundled) and new model side by side on those held-out layers: each model's top-D proposals over the full
space are compiled and measured in the same shuffled rounds with the layer's reference
(bench/compare_tuners.measure_lists, `Evaluator.interleave`), so both models are judged on the same rounds. Printed
per model: evals to within 5% of the reference (the rank of the first such proposal in its list; a miss counts as
D + 1; a proposal faster than the reference counts as within), top-1 and top-5 hits; a proposal clearly faster than
the reference becomes the cached reference of later runs. Target (issue 27): on the class, the new model's mean
evals at most half the old's; on the other classes, no more evals and no fewer top-5 hits. The machine's load is
printed with each phase: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import compare_tuners as CT  # noqa: E402
import tuners_real as TR  # noqa: E402
from bench.cli_args import output_file  # noqa: E402
from edgetune import paths  # noqa: E402
from edgetune.atomic import write_atomic  # noqa: E402
from fleet import rollout_store as rs  # noqa: E402
from fleet.rollout import rollout_summary  # noqa: E402
from fleet.store import open_fleet_store  # noqa: E402
from kernels.measure import TIE_THRESHOLD  # noqa: E402
from kernels.registry import all_specs  # noqa: E402
from kernels.space import Config  # noqa: E402
from kernels.spec import KernelSpec, Workload  # noqa: E402
from tests.broker import Mosquitto  # noqa: E402
from tests.fleet_server import FleetServer  # noqa: E402
from tests.test_daemon_support import DaemonProc, daemon_config, env_for  # noqa: E402
from tuner.evaluate import Evaluator  # noqa: E402
from tuner.strategies import DEFAULT_STRATEGY  # noqa: E402
from tuner.train import data as D  # noqa: E402

WITHIN = 1.05
FIXED_DIMS = {"stride", "K", "n_fft", "hop"}  # left alone when deriving a class shape


def load() -> str:
    return "load %.2f %.2f %.2f on %d cores" % (*os.getloadavg(), os.cpu_count())


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}; {load()}", flush=True)


def class_workloads(cases: dict, isa: str, per_kernel: int, hw) -> list[dict]:
    """Training shapes of the class, `per_kernel` per kernel, that the committed data does not hold at its ISA: a
    training shape of the committed data (any ISA; spread over them) with one dimension scaled by 3/2 (rounded to a
    multiple of 4), kept when the kernel accepts it and it is no held-out real layer."""
    known = {c.problem for c in cases.values()}
    specs = all_specs()
    out = []
    for kernel in sorted({c.kernel for c in cases.values()}):
        shapes = {json.dumps(c.shape, sort_keys=True): c for c in cases.values()
                  if c.kernel == kernel and c.split == "train"}
        ranked = [c for _, c in sorted(shapes.items())]
        stride = max(1, len(ranked) // max(1, per_kernel))  # spread over the training shapes, not the first few
        picked = 0
        for c in ranked[::stride] + [c for i, c in enumerate(ranked) if i % stride]:
            dims = [d for d, v in c.shape.items() if d not in FIXED_DIMS and isinstance(v, int) and v >= 8]
            for d in dims:
                shape = {**c.shape, d: max(4, round(c.shape[d] * 1.5 / 4) * 4)}
                if D.problem_key(kernel, isa, shape) in known or D.is_real_heldout(kernel, shape):
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
        db = Path(env["STATE_DIRECTORY"]) / "fleet.db"

        def records_in(device: str) -> bool:
            if not db.exists():
                return False
            with open_fleet_store(db) as s:
                got = {r["workload"] for r in s.query("SELECT workload FROM records WHERE device_id = ?", (device,))}
            return all(w["name"] in got for w in shares[device])

        t_tune = time.time()
        for n in names:  # one after the other: each device has its cores to itself, as in a real fleet
            (tmp / n).mkdir()
            cfg = daemon_config(tmp / n, broker, workload=workloads_toml(shares[n]), device_id=n, isa=a.isa,
                                tuning={"budget": a.budget, "strategy": a.strategy},
                                model_update={"trusted_keys": [key["public_key"]], "fleet_url": server.base})
            procs.append(DaemonProc(cfg, env=env_for(tmp / n, cache)).start())
            wait(f"every workload's tuning record of {n} in the fleet DB", lambda: records_in(n), a.timeout)
        t_in = time.time()
        say(f"records in after {t_in - t_tune:.0f} s of tuning")
        built = edgetune(env, "fleet", "model", "build", "--where", f"isa={a.isa}",
                         *(["--steps", str(a.steps)] if a.steps else []),
                         *(["--focus-share", str(a.focus_share)] if a.focus_share is not None else []),
                         timeout=a.timeout)
        t_built = time.time()
        card = built["card"]  # `fleet model build --json` carries the registered model's card
        say(f"retrained v{built['version']} on {built['records']} fleet records in {t_built - t_in:.0f} s "
            f"({card['training']['steps']} steps, final loss {card['training']['final_loss']:.3f}, "
            f"{card['cases']['train']} training cases)")
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
        if a.json:  # beside the figures: the model to judge again (--model), its records to retrain on (`edgetune
            #         train --records`)
            shutil.copyfile(built["file"], beside(a.json, ".gguf"))
            shutil.copyfile(Path(built["file"]).with_name("fleet-records.jsonl"), beside(a.json, ".records.jsonl"))
        return {"model": built["file"], "rollout": done["state"], "tuning_s": t_in - t_tune,
                "retrain_s": t_built - t_in, "rollout_s": t_done - t_built, "loop_s": t_done - t_in,
                "records": built["records"]}
    finally:
        for p in procs:
            p.stop()
        server.stop()
        broker.stop()


def beside(json_out: str, suffix: str) -> Path:
    return Path(json_out).with_suffix(suffix)


# ---- held-out layers and their references ------------------------------------------------------------------

@dataclass
class Layer:
    """A held-out real layer at one ISA, with the reference config the models are judged against."""

    spec: KernelSpec
    wl: Workload
    hw: object  # this machine's descriptor capped at the ISA
    ref: Config

    @property
    def isa(self) -> str:
        return self.hw.isa


def held_out_layers(per_kernel: int, kernels: list[str] = ()) -> list[tuple[KernelSpec, Workload]]:
    """The first `per_kernel` layers of each kernel (or of `kernels`) in bench/real_layers.toml: no model trains on
    them, at any ISA (the training drops them from the committed data and from every device record)."""
    return TR.load_layers(TR.LAYERS, list(kernels), per_kernel, [])


def references(layers: list[tuple[KernelSpec, Workload]], isa: str | None, evals: int, refs_path: Path,
               tmp: Path) -> list[Layer]:
    """Each layer's long-search winner at `isa` (None: this machine's own), from the cache or searched now."""
    from hwprobe import probe
    from kernels.worker import Runner
    from tuner.db import ResultsDB
    from tuner.session import Session

    hw = probe(isa_cap=isa, measure_bandwidth=False)
    refs = load_refs(refs_path)
    out = []
    db = ResultsDB(tmp / f"refs-{hw.isa}.db")
    try:
        with Runner() as runner:
            sess = Session(db, runner, hw, ort_twin=False)
            for spec, wl in layers:
                cached, t0 = TR.ref_key(hw, spec, wl) in refs, time.time()
                out.append(Layer(spec, wl, hw, TR.reference(sess, spec, wl, evals, refs, refs_path)))
                say(f"reference {spec.name}/{wl.name} at {hw.isa}: " + (
                    "cached" if cached else f"{evals} evals of anneal in {time.time() - t0:.0f} s"))
    finally:
        db.close()
    return out


def load_refs(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


# ---- old and new side by side ------------------------------------------------------------------------------------

def first_hit(ratios: list[float | None]) -> int | None:
    return next((i + 1 for i, r in enumerate(ratios) if r is not None and r <= WITHIN), None)


def compare(models: dict[str, Path], layers: list[Layer], depth: int, rounds: int, refs_path: Path) -> list[dict]:
    """Each model's top-`depth` on every layer, all measured in the same shuffled rounds with the reference."""
    from kernels.worker import Runner
    from tuner.model.proposer import Proposer

    proposers = {n: Proposer(path=p) for n, p in models.items()}
    rows = []
    with Runner() as runner:
        for i, L in enumerate(layers):
            space = L.spec.space(L.wl.shape, L.hw)
            lists = {n: [p.config for p in prop.propose(L.spec.name, space, depth).proposals]
                     for n, prop in proposers.items()}
            ratios, control, ref_ms = CT.measure_lists(runner, L.spec, L.wl.shape, L.ref, L.hw, lists, rounds,
                                                       seed=i)
            improve_reference(CT.measured(runner, L.spec, L.wl.shape, L.hw), L, lists, ratios, refs_path, rounds,
                              seed=f"{i}:confirm")
            rows.append({"kernel": L.spec.name, "isa": L.isa, "workload": L.wl.name, "ref_ms": ref_ms,
                         "ratios": ratios, "control": control, "lists": lists, "load1": os.getloadavg()[0]})
            print(f"  [{i + 1}/{len(layers)}] {L.spec.name} {L.isa} {L.wl.name}: " + "  ".join(
                f"{n} first hit {first_hit(ratios[n]) or '-'}" for n in models)
                + f"; control {control or float('nan'):.2f}; {load()}", flush=True)
    return rows


def improve_reference(ev: Evaluator, L: Layer, lists: dict[str, list[Config]], ratios: dict[str, list[float | None]],
                      refs_path: Path, rounds: int, seed: int | str) -> None:
    """A proposal measured faster than the reference, and confirmed so in rounds of its own against it
    (`tuners_real.confirmed_ratio`: the fastest of many proposals is partly luck), becomes the reference of later
    runs."""
    got = [(r, c) for n in lists for c, r in zip(lists[n], ratios[n]) if r]
    if got:
        best, cfg = min(got, key=lambda rc: rc[0])
        refs = load_refs(refs_path)
        key = TR.ref_key(L.hw, L.spec, L.wl)
        faster = TR.confirmed_ratio(ev, L.ref, cfg, rounds, seed) if key in refs and best < 1 - TIE_THRESHOLD \
            else None
        if faster:
            TR.improve_reference(refs, key, {"best_over_ref": faster, "best": cfg}, refs_path)


def figures(rows: list[dict], models: list[str], depth: int) -> dict[str, dict]:
    """Per model: evals to within 5% (median, mean; a miss counts as depth + 1), top-1 and top-5 hits."""
    out = {}
    for m in models:
        hits = [first_hit(r["ratios"][m]) for r in rows]
        e = [h or depth + 1 for h in hits]
        out[m] = {"cases": len(rows), "median_evals": statistics.median(e) if e else None,
                  "mean_evals": statistics.fmean(e) if e else None, "top1": sum(h == 1 for h in hits),
                  "top5": sum(h is not None and h <= 5 for h in hits)}
    return out


def summarize(rows: list[dict], models: list[str], depth: int, title: str) -> dict[str, dict]:
    f = figures(rows, models, depth)
    n = len(rows)
    print(f"\n{title}: {n} held-out layers, lists of {depth} (a miss counts {depth + 1}), {load()}")
    print(f"  {'model':8s} {'median evals to 5%':>19s} {'mean':>6s} {'top-1':>6s} {'top-5':>6s}")
    for m in models:
        if n:
            print(f"  {m:8s} {f[m]['median_evals']:19.1f} {f[m]['mean_evals']:6.2f} {f[m]['top1']:3d}/{n} "
                  f"{f[m]['top5']:3d}/{n}")
    if n:
        print(f"  control (the reference measured again as a proposal) within 5%: "
              f"{sum(1 for r in rows if r['control'] and r['control'] <= WITHIN)}/{n}")
    return f


def verdict(cls: dict[str, dict], other: dict[str, dict]) -> dict:
    """Issue 27's target: the new model needs at most half the old one's evals on the class (means), and on the
    other classes no more evals and no fewer top-5 hits."""
    half = cls["new"]["mean_evals"] <= 0.5 * cls["old"]["mean_evals"] if cls["old"]["cases"] else None
    same = (other["new"]["mean_evals"] <= other["old"]["mean_evals"] and other["new"]["top5"] >= other["old"]["top5"]
            ) if other and other["old"]["cases"] else None
    return {"half_the_evals": half, "no_regression": same,
            "new_over_old_evals": cls["new"]["mean_evals"] / cls["old"]["mean_evals"] if cls["old"]["cases"] else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default="x86-64", help="the simulated device class's ISA cap (default x86-64, the "
                                                    "SSE2 baseline no committed data holds)")
    ap.add_argument("--devices", type=int, default=2, help="daemons of the class (default 2)")
    ap.add_argument("--per-kernel", type=int, default=3, help="class training workloads per kernel (default 3)")
    ap.add_argument("--budget", type=int, default=20, help="evaluations per workload on the devices (default 20)")
    ap.add_argument("--strategy", default=DEFAULT_STRATEGY,
                    help=f"the devices' search strategy (default {DEFAULT_STRATEGY}, the devices' own: their records "
                         "hold what the shipped model proposes and what the search found beyond it)")
    ap.add_argument("--steps", type=int, help="training steps (default: the shipped recipe)")
    ap.add_argument("--focus-share", type=float, help="share of the training draws given to the fleet's records "
                                                        "(default: the recipe's)")
    ap.add_argument("--held", type=int, default=2, help="held-out real layers per kernel (default 2)")
    ap.add_argument("--kernels", default="", help="only these kernels' held-out layers (comma-separated)")
    ap.add_argument("--other-isa", default="", help="the other classes' ISA caps, comma-separated (default: this "
                                                    "machine's own ISA); 'none' skips them")
    ap.add_argument("--ref-evals", type=int, default=60, help="evaluations of each reference search (default 60)")
    ap.add_argument("--refs", type=output_file, default=str(paths.cache_dir() / "bench-real-refs.json"),
                    help="reference cache, per machine, ISA, kernel source and shape (shared with tuners_real.py)")
    ap.add_argument("--refs-only", action="store_true", help="compute (or check) the references and stop")
    ap.add_argument("--depth", type=int, default=10, help="proposals measured per model and layer (default 10)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=7200.0, help="give up on a phase after this long")
    ap.add_argument("--model", action="append", default=[],
                    help="skip the loop: compare this GGUF (as 'new'; repeat for 'new2', ...) with the bundled model")
    ap.add_argument("--json", type=output_file,
                    help="write the loop's timings, every layer's ratios and the figures here (and beside it the "
                         "new model, <name>.gguf, and the fleet's records, <name>.records.jsonl)")
    a = ap.parse_args(argv)
    from tuner.model.inference import bundled_model_path

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, capture_output=True)
    print(f"edgetune fleet loop at commit {commit.stdout.strip()}; {load()}", flush=True)
    refs_path = Path(a.refs)
    others = [None] if not a.other_isa else [] if a.other_isa == "none" else a.other_isa.split(",")
    with tempfile.TemporaryDirectory(prefix="edgetune-fleet-loop-") as td:
        layers = held_out_layers(a.held, [k for k in a.kernels.split(",") if k])
        mine = references(layers, a.isa, a.ref_evals, refs_path, Path(td))
        theirs = [L for isa in others for L in references(layers, isa, a.ref_evals, refs_path, Path(td))]
        if a.refs_only:
            return 0
        loop = None
        news = [Path(m) for m in a.model]
        if not news:
            loop = run_loop(a, Path(td))
            news = [Path(td) / "new.gguf"]
            news[0].write_bytes(Path(loop["model"]).read_bytes())
        models = {"old": bundled_model_path()} | {"new" + (str(i + 1) if i else ""): p for i, p in enumerate(news)}
        say(f"old and new side by side on {len(mine)} held-out {a.isa} layers and {len(theirs)} of other classes")
        rows = compare(models, mine, a.depth, a.rounds, refs_path)
        rows_other = compare(models, theirs, a.depth, a.rounds, refs_path) if theirs else []
    cls = summarize(rows, list(models), a.depth, f"class {a.isa}")
    other = summarize(rows_other, list(models), a.depth, "other classes") if rows_other else {}
    v = verdict(cls, other)
    print(f"\ntarget: new/old mean evals to 5% on {a.isa} {v['new_over_old_evals']:.2f} (at most 0.5: "
          f"{'met' if v['half_the_evals'] else 'not met'}); other classes: "
          + {True: "no regression", False: "regression", None: "not measured"}[v["no_regression"]])
    if loop:
        print(f"loop: records in -> {loop['rollout']} in {loop['loop_s']:.0f} s (retrain {loop['retrain_s']:.0f} s, "
              f"sign + staged rollout + device health checks {loop['rollout_s']:.0f} s); tuning before it "
              f"{loop['tuning_s']:.0f} s; {loop['records']} fleet records; {load()}")
    if a.json:
        write_atomic(Path(a.json), json.dumps({"args": vars(a), "loop": loop, "class": rows, "other": rows_other,
                                               "figures": {"class": cls, "other": other}, "verdict": v},
                                              indent=1, default=str).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
