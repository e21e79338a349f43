"""Tuning-run dataset collector: the training data of the tuner model (`python -m tuner.collect`).

For every bundled kernel and every ISA cap (x86-64-v2/v3/v4 by default) it

1. picks the kernel's shapes: its bundled workloads plus seeded synthetic shapes spanning edge ranges
   (`--shapes` per kernel in all), and marks a seeded subset per kernel as *held out* (never trained on); then
   `--arch-layers` training shapes per kernel from real architectures (quantized_models/data/arch_layers.toml)
   and `--extra-shapes` more synthetic ones. No shape of bench/real_layers.toml (the held-out real layers the
   tuners are compared on) is ever drawn;
2. samples a seeded set of configs (`--configs`, plus the default) that are valid for at least one shape,
   compiles each once for that ISA (content-hashed .so, so a restart recompiles nothing) and
3. measures every config on every shape it is valid for, in one recycled worker per (kernel, ISA);
4. for every case, refines the best sampled config with a short annealing run: `--refine` evals for a
   training case, so its top configs (the model's training targets) are near-optimal rather than the best of a
   random sample, and `--refine-heldout` evals for a held-out case, so it has a strong best-known reference;
5. with `--sweep KNOBS` (e.g. `mr,nv,vec`, the register tile), measures every valid joint setting of those knobs
   from each training case's fastest config, the other knobs held (`sweep_cases`);
6. measures each training case's `--confirm-top` fastest configs `--confirm-rounds` more times, side by side in a
   shuffled order per round, so the ranking the model learns is not the noise of single measurements. When a later
   run changes a case's leaders (a grown sample or refinement found faster configs), all of them are confirmed
   again side by side, and training ranks the case by that latest confirmation.

Every measurement is one JSON line appended to the output and fsynced: a kill loses at most the
measurement in flight, and rerunning the same command resumes (finished measurements are skipped).
Each line carries the full stats (every rep's wall time, CV, estimator, context switches) and the load.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from edgetune.errors import BadInput
from kernels.measure import Measurement
from kernels.registry import all_specs, get_spec
from kernels.space import Config, SearchSpace, config_key
from kernels.spec import KernelSpec
from kernels.worker import Runner
from tuner.evaluate import Measured

ISAS = ("x86-64-v4", "x86-64-v3", "x86-64-v2")
FORMAT = "edgetune-runs-1"


def shape_key(shape: dict) -> str:
    return ",".join(f"{k}={shape[k]}" for k in shape)


# ---- shapes ------------------------------------------------------------------------------------------------

def _never_drawn(spec: KernelSpec) -> set[str]:
    """Shape keys the collector must not draw for `spec`: the held-out real layers of the tuner comparison."""
    from tuner.train.arch_layers import HELDOUT
    from kernels.workload_files import read_workloads_file

    return {shape_key(spec.validate_shape(e.shape)) for e in read_workloads_file(HELDOUT) if e.kernel == spec.name}


def _draw_synthetic(spec: KernelSpec, rng: random.Random, n: int, seen: set[str],
                    max_mflop: float, where: dict[str, int] | None = None) -> list[tuple[str, dict]]:
    """Up to `n` new (name, shape) synthetic shapes from `rng` (the spec's own generator), none in `seen` (which
    grows), nor a held-out real layer, nor over max_mflop, each matching `where` (dim -> value) if given."""
    if spec.synthetic is None:
        raise BadInput(f"kernel {spec.name} has no synthetic shape generator: set `synthetic` in its spec")
    seen |= _never_drawn(spec)
    out: list[tuple[str, dict]] = []
    for _ in range(10_000):
        if len(out) >= n:
            break
        try:
            s = spec.validate_shape(spec.synthetic(rng))
        except Exception:
            continue
        if spec.flops(s) / 1e6 > max_mflop or shape_key(s) in seen:
            continue
        if where and any(s[d] != v for d, v in where.items()):
            continue
        seen.add(shape_key(s))
        out.append(("synthetic." + "-".join(f"{d.name}{s[d.name]}" for d in spec.dims), s))
    return out


def kernel_shapes(spec: KernelSpec, total: int, heldout: int, seed: int = 0,
                  max_mflop: float = 40.0) -> list[tuple[str, dict, str]]:
    """(name, shape, split) for a kernel: its bundled workloads plus synthetic ones, `heldout` of them held out.

    The held-out set is one bundled workload (a real layer) plus synthetic shapes, chosen by a seeded rng.
    """
    rng = random.Random(f"shapes-{spec.name}-{seed}")
    out = [(w.name, dict(w.shape)) for w in spec.workloads]
    out += _draw_synthetic(spec, rng, total - len(out), {shape_key(s) for _, s in out}, max_mflop)
    n_bundled = len(spec.workloads)
    held = {rng.randrange(n_bundled)}
    synth = list(range(n_bundled, len(out)))
    rng.shuffle(synth)
    held.update(synth[: max(0, heldout - 1)])
    return [(name, s, "heldout" if i in held else "train") for i, (name, s) in enumerate(out)]


def extra_shapes(spec: KernelSpec, base: list[tuple[str, dict, str]], n: int, seed: int = 0,
                 max_mflop: float = 40.0, where: dict[str, int] | None = None) -> list[tuple[str, dict, str]]:
    """`n` more synthetic training shapes from their own seeded stream, so adding them leaves the base shapes
    and the held-out split unchanged; none repeats a base shape. `where` (dim -> value) keeps only the shapes of
    a region the data under-covers (e.g. stride 2), drawn from the same stream."""
    for d in where or {}:
        if d not in {x.name for x in spec.dims}:
            raise BadInput(f"--extra-where {d}=...: kernel {spec.name} has no dim {d!r} "
                           f"(its dims: {', '.join(x.name for x in spec.dims)}); select kernels with --kernel")
    rng = random.Random(f"extra-shapes-{spec.name}-{seed}")
    drawn = _draw_synthetic(spec, rng, n, {shape_key(s) for _, s, _ in base}, max_mflop, where)
    return [(name, s, "train") for name, s in drawn]


def arch_shapes(spec: KernelSpec, base: list[tuple[str, dict, str]], n: int) -> list[tuple[str, dict, str]]:
    """`n` training shapes from real architectures (tuner.train.arch_layers.spread over the kernel's layers of
    quantized_models/data/arch_layers.toml), none repeating a base shape."""
    from tuner.train.arch_layers import read_arch_layers, spread

    have = {shape_key(s) for _, s, _ in base}
    mine = [e for e in read_arch_layers() if e.kernel == spec.name and shape_key(e.shape) not in have]
    return [(e.name, dict(e.shape), "train") for e in spread(mine, n)]


def sample_configs(spec: KernelSpec, shapes: list[dict], hw: Any, n: int, seed: int = 0) -> list[Config]:
    """The default plus n seeded configs, each valid for at least one of the shapes on this hw."""
    rng = random.Random(f"configs-{spec.name}-{hw.isa}-{seed}")
    spaces = [spec.space(s, hw) for s in shapes]
    out: list[Config] = []
    seen: set[str] = set()
    for sp in spaces:  # each shape's (possibly nudged) default first
        d = sp.valid_default()
        if config_key(d) not in seen:
            seen.add(config_key(d))
            out.append(d)
    target = len(out) + n
    for _ in range(n * 500):
        if len(out) >= target:
            break
        cfg = {p.name: rng.choice(p.values) for p in spec.params}
        k = config_key(cfg)
        if k in seen or not any(sp.is_valid(cfg) for sp in spaces):
            continue
        seen.add(k)
        out.append(cfg)
    return out


# ---- output ------------------------------------------------------------------------------------------------

class Journal:
    """Append-only JSONL with an fsync per line; reading tolerates a torn last line."""

    def __init__(self, path: Path):
        self.path = path
        self.done: set[tuple] = set()
        self.rows: list[dict] = []
        if path.exists():
            for row in read_rows(path):
                self.rows.append(row)
                if row.get("kind") == "m":
                    self.done.add(self._key(row))
        self.f = None  # opened on the first append: a dry run creates nothing

    @staticmethod
    def _key(row: dict) -> tuple:
        return (row["kernel"], row["isa"], row["shape_key"], row["config_key"])

    def cases(self, kernel: str, isa: str) -> dict[str, list[dict]]:
        """The measurement rows of one kernel and ISA, by shape (a case), in journal order."""
        out: dict[str, list[dict]] = {}
        for r in self.rows:
            if r.get("kind") == "m" and r["kernel"] == kernel and r["isa"] == isa:
                out.setdefault(r["shape_key"], []).append(r)
        return out

    def append(self, row: dict) -> None:
        if self.f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(self.path, "a")
        self.f.write(json.dumps(row, separators=(",", ":")) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.rows.append(row)
        if row.get("kind") == "m":
            self.done.add(self._key(row))


def read_rows(path: Path) -> Iterator[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:  # torn last line of a killed run
                continue


def hw_summary(hw: Any) -> dict:
    """The descriptor fields the model's prompt uses (stable across runs on this machine)."""
    return {"isa": hw.isa, "vector_bits": hw.vector_bits, "cores": hw.cores, "arch": hw.arch,
            "l1d": hw.cache_bytes(1), "l2": hw.cache_bytes(2), "l3": hw.cache_bytes(3),
            "bandwidth_gbps": hw.bandwidth_gbps, "cpu_model": hw.cpu_model, "compiler": hw.compiler.id,
            "hw_fingerprint": hw.hw_fingerprint, "march": hw.march}


# ---- collection --------------------------------------------------------------------------------------------

def _measure_row(spec: KernelSpec, isa: str, name: str, shape: dict, split: str, cfg: Config, m: Measurement,
                 phase: str, compile_s: float | None) -> dict:
    return {"kind": "m", "kernel": spec.name, "source_hash": spec.source_hash(), "isa": isa, "workload": name,
            "shape": shape,
            "shape_key": shape_key(shape), "split": split, "phase": phase, "config": cfg,
            "config_key": config_key(cfg), "ok": m.ok, "reason": m.reason, "ms": m.ms, "cv": m.cv, "reps": m.reps,
            "reps_used": m.reps_used, "estimator": m.estimator, "cpu_ms": m.cpu_ms, "nivcsw": m.nivcsw,
            "max_abs_err": m.max_abs_err, "load1": m.load1, "loadavg": list(os.getloadavg()),
            "wall_ms": [round(w, 6) for w in m.wall_ms], "compile_s": compile_s, "ts": round(time.time(), 3)}


def _evaluator(spec: KernelSpec, shape: dict, hw: Any, runner: Runner, min_time_s: float,
               max_reps: int) -> Measured:
    """The collector's measurements: shape-generic builds (one .so serves every shape), the run's timing budget."""
    return Measured(spec=spec, shape=shape, hw=hw, runner=runner, min_time_s=min_time_s, max_reps=max_reps,
                    timeout_s=20, bake=False)


def _by_shape(todo: list[tuple]) -> list[tuple[tuple, list[Config]]]:
    """The (name, shape, split, config) plan as consecutive runs of one shape: (name, shape, split), configs."""
    out: list[tuple[tuple, list[Config]]] = []
    for name, s, split, c in todo:
        if not out or out[-1][0][1] != s:
            out.append(((name, s, split), []))
        out[-1][1].append(c)
    return out


def collect(out: Path, kernels: list[str], isas: list[str], n_configs: int, n_shapes: int, n_heldout: int,
            refine: int, refine_heldout: int, min_time_s: float, max_reps: int, seed: int,
            dry_run: bool = False, n_extra: int = 0, confirm_top: int = 0, confirm_rounds: int = 0,
            n_arch: int = 0, extra_where: dict[str, int] | None = None,
            sweep: list[tuple[str, ...]] | None = None) -> None:
    from hwprobe import probe

    j = Journal(out)
    if not dry_run:  # the settings of every invocation, for the data card
        j.append({"kind": "run", "format": FORMAT, "kernels": kernels, "isas": isas, "configs": n_configs,
                  "shapes": n_shapes, "extra_shapes": n_extra, "extra_where": extra_where or {}, "arch_layers": n_arch,
                  "sweep": [list(g) for g in sweep or []],
                  "heldout": n_heldout, "refine": refine, "refine_heldout": refine_heldout, "confirm_top": confirm_top,
                  "confirm_rounds": confirm_rounds, "min_time_s": min_time_s, "max_reps": max_reps, "seed": seed,
                  "ts": round(time.time(), 3)})
    specs = [s for n, s in all_specs().items() if not kernels or n in kernels]
    bw = None
    for r in j.rows:
        if r.get("kind") == "hw" and r["hw"].get("bandwidth_gbps"):
            bw = r["hw"]["bandwidth_gbps"]
    if bw is None and not dry_run:
        bw = probe(measure_bandwidth=True).bandwidth_gbps
    have_hw = {r["hw"]["isa"] for r in j.rows if r.get("kind") == "hw"}
    t_start = time.time()
    total_planned = 0
    for isa in isas:
        hw = probe(isa_cap=isa, measure_bandwidth=False)
        summary = hw_summary(hw) | {"bandwidth_gbps": bw}
        if isa not in have_hw and not dry_run:
            j.append({"kind": "hw", "format": FORMAT, "hw": summary, "ts": time.time()})
        for spec in specs:
            shapes = kernel_shapes(spec, n_shapes, n_heldout, seed)
            cfgs = sample_configs(spec, [s for _, s, _ in shapes], hw, n_configs, seed)
            shapes += arch_shapes(spec, shapes, n_arch)
            shapes += extra_shapes(spec, shapes, n_extra, seed, where=extra_where)
            plan = [(name, s, split, c) for name, s, split in shapes for c in cfgs if spec.space(s, hw).is_valid(c)]
            todo = [p for p in plan if (spec.name, isa, shape_key(p[1]), config_key(p[3])) not in j.done]
            total_planned += len(plan)
            print(f"[{time.strftime('%H:%M:%S')}] {spec.name} {isa}: {len(shapes)} shapes, {len(cfgs)} configs, "
                  f"{len(plan)} measurements ({len(todo)} to do), load {os.getloadavg()[0]:.2f}", flush=True)
            if dry_run or not todo:
                continue
            t = time.time()
            needed = list({config_key(c): c for *_, c in todo}.values())
            with Runner(recycle_after=10**9) as runner:
                ev = _evaluator(spec, {}, hw, runner, min_time_s, max_reps)
                ev.evaluate([], prebuild=needed)  # every config once, for every shape (no baked dims)
                compile_s = ev.timing["compile_s"] / max(1, len(needed))
                print(f"    compiled {len(needed)} in {time.time() - t:.1f}s", flush=True)
                t = time.time()
                for (name, s, split), cfgs in _by_shape(todo):  # shape-major: each reference is computed once
                    default = spec.space(s, hw).valid_default()

                    def record(_: int, c: Config, m: Measurement, name=name, s=s, split=split,
                               default=default) -> None:
                        phase = "default" if c == default else "sample"
                        j.append(_measure_row(spec, isa, name, s, split, c, m, phase, compile_s))

                    dataclasses.replace(ev, shape=s).evaluate(cfgs, record=record)  # ev's builds
            print(f"    measured {len(todo)} in {time.time() - t:.1f}s "
                  f"({(time.time() - t) / len(todo) * 1e3:.0f} ms each), load {os.getloadavg()[0]:.2f}", flush=True)
    if dry_run:
        print(f"planned measurements: {total_planned}")
        return
    if refine > 0 or refine_heldout > 0:
        refine_cases(j, specs, isas, {"train": refine, "heldout": refine_heldout}, min_time_s, max_reps, seed)
    if sweep:
        sweep_cases(j, specs, isas, sweep, min_time_s, max_reps)
    if confirm_top > 0 and confirm_rounds > 0:
        confirm_leaders(j, specs, isas, confirm_top, confirm_rounds, min_time_s, max_reps, seed)
    print(f"done in {time.time() - t_start:.0f}s; {sum(1 for r in j.rows if r.get('kind') == 'm')} measurements")


def _phase_cases(j: Journal, specs: list[KernelSpec], isas: list[str], *, train_only: bool = False
                 ) -> Iterator[tuple[KernelSpec, str, Any, Runner, str, list[dict]]]:
    """Each case a phase after sampling works on, as (spec, isa, hw, runner, shape key, its rows so far): one
    descriptor per ISA, one worker per kernel and ISA (never recycled: the collector's builds are shape-generic)."""
    from hwprobe import probe

    for isa in isas:
        hw = probe(isa_cap=isa, measure_bandwidth=False)
        for spec in specs:
            cases = {sk: rows for sk, rows in j.cases(spec.name, isa).items()
                     if not train_only or rows[0]["split"] == "train"}
            with Runner(recycle_after=10**9) as runner:
                for sk, rows in cases.items():
                    yield spec, isa, hw, runner, sk, rows


def _progress(what: str, t: float) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what} in {time.time() - t:.1f}s, load {os.getloadavg()[0]:.2f}", flush=True)


def refine_cases(j: Journal, specs: list[KernelSpec], isas: list[str], evals: dict[str, int], min_time_s: float,
                 max_reps: int, seed: int) -> None:
    """Anneal from each case's best sampled config for `evals[split]` more configs (training targets near the
    optimum; best-known references for held-out cases)."""
    from tuner.strategies import Anneal

    for spec, isa, hw, runner, _, rows in _phase_cases(j, specs, isas):
        done_refine = sum(1 for r in rows if r["phase"] == "refine")
        shape, name, split = rows[0]["shape"], rows[0]["workload"], rows[0]["split"]
        target = evals.get(split, 0)
        if done_refine >= target:
            continue
        strat = Anneal(spec.space(shape, hw), seed=seed, t0=0.02)
        # replay everything measured so far (sample first, then earlier refinement), best last
        ok = sorted((r for r in rows if r["ok"]), key=lambda r: -r["ms"])
        for r in [r for r in rows if not r["ok"]] + ok:
            strat.tell(r["config"], Measurement(ok=r["ok"], ms=r["ms"], reason=r["reason"] or ""))
        strat.current = strat.best  # start at the best sampled config
        n = done_refine
        t = time.time()
        ev = _evaluator(spec, shape, hw, runner, min_time_s, max_reps)

        def record(_: int, c: Config, m: Measurement, spec=spec, isa=isa, name=name, shape=shape,
                   split=split) -> None:
            j.append(_measure_row(spec, isa, name, shape, split, c, m, "refine", None))

        while n < target:
            asked = strat.ask(min(2, target - n))
            if not asked:
                break
            for c, m in zip(asked, ev.evaluate(asked, record=record)):
                strat.tell(c, m)
                n += 1
        _progress(f"refine {spec.name} {isa} {name} ({split}): {n} evals", t)


def sweep_groups(spec: KernelSpec, groups: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The groups of `--sweep` knobs that `spec` has all of."""
    return [g for g in groups if set(g) <= {p.name for p in spec.params}]


def sweep_cases(j: Journal, specs: list[KernelSpec], isas: list[str], groups: list[tuple[str, ...]],
                min_time_s: float, max_reps: int) -> None:
    """From each training case's fastest config before sweeping, measure every valid joint setting of each group of
    knobs, the other knobs held (phase "sweep").

    Why: the sampled configs are shared by every shape, so each register tile (mr x nv x vec) was measured once per
    case, with whatever other knobs its sampled config drew, and a one-knob refinement rarely moves two tile knobs
    at once. A tile that wins only beside the case's best blocking was thus almost never measured there (conv1d on
    x86-64-v4: mr=5 nv=4 vec=16 in 1 of 52 training cases, while it is the best tile of 3 of 6 held-out real
    conv1d layers), and the model cannot propose what its data never ranked. The base is the fastest non-sweep,
    non-confirm measurement, so a resumed run sweeps from the same config and skips what it measured."""
    swept = [s for s in specs if sweep_groups(s, groups)]
    for spec, isa, hw, runner, sk, rows in _phase_cases(j, swept, isas, train_only=True):
        base = min((r for r in rows if r["ok"] and r["phase"] not in ("sweep", "confirm")),
                   key=lambda r: r["ms"], default=None)
        if base is None:
            continue
        shape, name = rows[0]["shape"], rows[0]["workload"]
        todo = [c for c in sweep_configs(spec.space(shape, hw), base["config"], sweep_groups(spec, groups))
                if (spec.name, isa, sk, config_key(c)) not in j.done]
        if not todo:
            continue
        t = time.time()

        def record(_: int, c: Config, m: Measurement, spec=spec, isa=isa, name=name, shape=shape) -> None:
            j.append(_measure_row(spec, isa, name, shape, "train", c, m, "sweep", None))

        _evaluator(spec, shape, hw, runner, min_time_s, max_reps).evaluate(todo, record=record)
        _progress(f"sweep {spec.name} {isa} {name}: {len(todo)} configs", t)


def sweep_configs(space: SearchSpace, base: Config, groups: list[tuple[str, ...]]) -> list[Config]:
    """`base` with every joint setting of each group's knobs that the space allows (`base` itself excluded)."""
    values = {p.name: p.values for p in space.params}
    out: dict[str, Config] = {}
    for g in groups:
        for combo in itertools.product(*(values[n] for n in g)):
            c = dict(base) | dict(zip(g, combo))
            if c != base and space.is_valid(c):
                out.setdefault(config_key(c), c)
    return list(out.values())


def leaders_id(keys: Iterable[str]) -> str:
    """The id of one confirmation: its set of leaders (config keys), order-free."""
    return hashlib.sha256(",".join(sorted(set(keys))).encode()).hexdigest()[:12]


def confirmed_rows(rows: list[dict], lid: str) -> int:
    """How many of a case's confirmation rows belong to the confirmation of leaders `lid`. Rows carry their
    leaders' id; rows from before ids (one confirmation per case) belong to the set of configs they measured."""
    confirm = [r for r in rows if r["phase"] == "confirm"]
    untagged = leaders_id(r["config_key"] for r in confirm if "leaders" not in r)
    return sum(1 for r in confirm if r.get("leaders", untagged) == lid)


def confirm_leaders(j: Journal, specs: list[KernelSpec], isas: list[str], top: int, rounds: int, min_time_s: float,
                    max_reps: int, seed: int) -> None:
    """Measure each training case's `top` fastest configs `rounds` more times, in a seeded shuffled order per round
    (phase "confirm"). One measurement on a shared host disagrees with a re-measurement of the same binary by more
    than 5% about a third of the time (by 20% one time in ten), so a case's ranking of its leaders, which is the
    model's training target, would otherwise be mostly noise. Held-out cases keep their references as collected.

    Rounds measured hours apart are not comparable (the host's speed drifts), so when the leaders change, e.g. a
    grown `--configs` sample put a new config among them, all of them are measured again in fresh rounds (rows
    tagged with the leaders' id) rather than only the newcomers."""
    for spec, isa, hw, runner, sk, rows in _phase_cases(j, specs, isas, train_only=True):
        first = {}  # the leaders as ranked before confirmation: a resumed run picks the same ones
        for r in rows:
            if r["ok"] and r["phase"] != "confirm":
                first.setdefault(r["config_key"], r)
        leaders = [r["config"] for r in sorted(first.values(), key=lambda r: r["ms"])[:top]]
        lid = leaders_id(config_key(c) for c in leaders)
        done = confirmed_rows(rows, lid)
        if done >= rounds * len(leaders):
            continue
        shape, name = rows[0]["shape"], rows[0]["workload"]
        t = time.time()

        def record(_: int, c: Config, m: Measurement, spec=spec, isa=isa, name=name, shape=shape, lid=lid) -> None:
            row = _measure_row(spec, isa, name, shape, "train", c, m, "confirm", None)
            j.append(row | {"leaders": lid})

        _evaluator(spec, shape, hw, runner, min_time_s, max_reps).interleave(
            leaders, rounds, seed=f"{seed}:{spec.name}:{isa}:{sk}", done=done, record=record)
        _progress(f"confirm {spec.name} {isa} {name}: {rounds * len(leaders) - done} measurements", t)


def data_card(path: Path) -> str:
    """The data card (markdown) of a collector journal: how, where, under what load, how much."""
    import statistics as st

    rows = list(read_rows(path))
    hws = [r["hw"] for r in rows if r.get("kind") == "hw"]
    ms = [r for r in rows if r.get("kind") == "m"]
    ok = [r for r in ms if r["ok"]]
    by = _card_counts(ms)
    held = {(r["kernel"], r["isa"], r["shape_key"]) for r in ms if r["split"] == "heldout"}
    lines = [
        "# Data card: edgetune tuning runs", "",
        f"File: `{path.name}` ({path.stat().st_size / 1e6:.1f} MB), sha256 `{dataset_hash(path)[:16]}…`. "
        "One JSON object per line: `kind=run` lines hold the collector's settings, `kind=hw` lines the hardware "
        "descriptor of each ISA cap, `kind=m` lines one measurement each.", "",
        "## How it was collected", "",
        _card_method(rows, by, len(held)), "",
        *_card_machine(rows, hws, ms),
        "## Counts", "",
        f"{len(ms)} measurements ({len(ok)} ok, {len(ms) - len(ok)} failed"
        + "".join(f"; {k} {v}" for k, v in sorted(_card_failures(ms).items(), key=lambda kv: -kv[1])) + ").", "",
        "| kernel | ISA | shapes | held-out | configs | rows | ok | refine | sweep | confirm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (k, isa), d in sorted(by.items()):
        lines.append(f"| {k} | {isa} | {len(d['shapes'])} | {len(d['held'])} | {len(d['cfgs'])} | {d['rows']} | "
                     f"{d['ok']} | {d['refine']} | {d['sweep']} | {d['confirm']} |")
    cases = {(r["kernel"], r["isa"], r["shape_key"]) for r in ms}
    lines += ["", f"{len(cases)} cases (kernel x ISA x shape): {len(cases) - len(held)} train, {len(held)} held-out.",
              f"Median CV of ok measurements: {st.median(r['cv'] for r in ok if r['cv'] is not None):.3f}.", ""]
    return "\n".join(lines)


def _card_counts(ms: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (kernel, ISA): rows, ok rows, shapes, held-out shapes, configs and rows per phase."""
    by: dict[tuple[str, str], dict] = {}
    for r in ms:
        d = by.setdefault((r["kernel"], r["isa"]), {"rows": 0, "ok": 0, "shapes": set(), "held": set(), "cfgs": set(),
                                                   "refine": 0, "sweep": 0, "confirm": 0})
        d["rows"] += 1
        d["ok"] += r["ok"]
        d["shapes"].add(r["shape_key"])
        d["cfgs"].add(r["config_key"])
        d["refine"] += r["phase"] == "refine"
        d["sweep"] += r["phase"] == "sweep"
        d["confirm"] += r["phase"] == "confirm"
        if r["split"] == "heldout":
            d["held"].add(r["shape_key"])
    return by


def _card_failures(ms: list[dict]) -> dict[str, int]:
    """Failed measurements by the first part of their reason (compile error, crash, ...)."""
    fails: dict[str, int] = {}
    for r in ms:
        if not r["ok"]:
            why = (r["reason"] or "?").split(":")[0]
            fails[why] = fails.get(why, 0) + 1
    return fails


def _card_method(rows: list[dict], by: dict[tuple[str, str], dict], n_held_cases: int) -> str:
    """The card's "how it was collected" paragraphs, from the settings of the journal's runs."""
    run = ([r for r in rows if r.get("kind") == "run"] or [{}])[-1]  # the settings of the last invocation
    sweeps = list({tuple(g): None for r in rows if r.get("kind") == "run" for g in r.get("sweep", [])})
    n_shapes = max((len(d["shapes"]) for d in by.values()), default=0)
    n_held = max((len(d["held"]) for d in by.values()), default=0)
    return (
        "`python -m tuner.collect` (tuner/collect.py; resumable: an fsynced JSONL journal, a rerun skips finished "
        "measurements). For every bundled kernel and each ISA cap x86-64-v4 / v3 / v2 (AVX-512 / AVX2 / SSE4.2 via "
        "`-march`; the descriptor's ISA and vector bits change with the cap): the kernel's bundled workloads plus "
        f"seeded synthetic shapes spanning edge ranges (up to {n_shapes} per kernel: {run.get('shapes', '?')} from the "
        f"base stream, held-out ones included, up to {run.get('arch_layers', 0)} training layers of real "
        "architectures (quantized_models/data/arch_layers.toml, spread over each kernel's layers), plus "
        f"{run.get('extra_shapes', 0)} training-only synthetic shapes from a second stream"
        + "".join(f" with {d}={v}" for d, v in run.get("extra_where", {}).items())
        + f" (settings of the last run{', kernels ' + ', '.join(run['kernels']) if run.get('kernels') else ''}); "
        "synthetic shapes capped at "
        "40 MFLOP; no shape of the held-out real layers of bench/real_layers.toml); the base shapes' defaults plus a "
        "seeded sample of "
        f"{run.get('configs', '?')} configs valid for at least one base shape, each compiled once per ISA and "
        "measured on every shape it is valid for (worker subprocess, "
        "correctness checked against the numpy reference before timing; min_time "
        f"{run.get('min_time_s', '?')} s, at most {run.get('max_reps', '?')} reps, estimator = median of reps "
        "without involuntary context switches). Then every case (kernel, ISA, shape) got an annealing refinement "
        "from its best sampled config (`phase=refine`, one-knob moves, 2 configs compiled per step): "
        f"{run.get('refine', '?')} evals for a training case, so its fastest configs, the model's training "
        "targets, come from a local search and not only from a random sample; "
        f"{run.get('refine_heldout', '?')} evals for a held-out case. "
        + (f"Where a run named `--sweep` groups ({'; '.join(','.join(g) for g in sweeps)}), each training case got "
           "every valid joint setting of a group's knobs from its fastest config so far, the others held "
           "(`phase=sweep`): the shared sample measures each register tile beside one random blocking only. "
           if sweeps else "")
        + "Last, each training case's "
        f"{run.get('confirm_top', 0)} fastest configs were measured {run.get('confirm_rounds', 0)} more times, "
        "in a shuffled order per round (`phase=confirm`); training ranks a case's leaders by these side-by-side "
        "rounds alone, since single measurements hours apart on this shared host disagree by more than 5% about a "
        "third of the time (a case whose leaders a later run changed was confirmed again, all leaders side by side, "
        "and training uses that latest confirmation). Every line keeps all rep times, CV, reps "
        "used, estimator, thread-CPU ms, context switches and the load average at that moment.\n\n"
        f"Split by shape: {n_held} shapes per kernel (one bundled workload + the rest synthetic, seeded) are held "
        "out and never trained on (`split=heldout`). A held-out case's best-known reference is the best of its "
        "sample, the defaults and its refinement (the spaces, up to 3,672 configs, are too large to measure "
        f"exhaustively for {n_held_cases} cases in the time available).")


def _card_machine(rows: list[dict], hws: list[dict], ms: list[dict]) -> list[str]:
    """The card's machine and load sections (lines, each section ending in a blank line)."""
    h = hws[0] if hws else {}
    loads = sorted(r["load1"] for r in ms if r.get("load1") is not None)
    q = lambda p: loads[min(len(loads) - 1, int(p * len(loads)))] if loads else float("nan")  # noqa: E731
    return [
        "## Machine", "",
        f"- CPU: {h.get('cpu_model')} ({h.get('arch')}), {h.get('cores')} usable cores (shared with other jobs)",
        f"- caches: L1d {h.get('l1d')} B, L2 {h.get('l2')} B, L3 {h.get('l3')} B; bandwidth {h.get('bandwidth_gbps')} "
        f"GB/s (measured); compiler {h.get('compiler')}",
        f"- ISA caps: {', '.join(x['isa'] + ' (' + str(x['vector_bits']) + '-bit)' for x in hws)}", "",
        "## Load during collection", "",
        f"1-minute load average over the {len(ms)} measurements: median {q(0.5):.2f}, p10 {q(0.1):.2f}, "
        f"p90 {q(0.9):.2f}, max {loads[-1] if loads else float('nan'):.2f} on {h.get('cores')} cores; `cv` and "
        "`load1` on each line say how noisy each timing was.",
        f"Wall time: {_wall_time(rows)}.", "",
    ]


def _wall_time(rows: list[dict]) -> str:
    """Collection time summed over the collector's invocations (a resumed or extended journal spans days of idle
    time between runs): each run's first to last measurement, with its UTC span."""
    runs: list[list[float]] = []
    for r in rows:
        if r.get("kind") == "run" or not runs:
            runs.append([])
        if r.get("kind") == "m":
            runs[-1].append(r["ts"])
    spans = [(min(t), max(t)) for t in runs if t]
    if not spans:
        return "no measurements"
    fmt = lambda t: time.strftime("%Y-%m-%d %H:%M", time.gmtime(t))  # noqa: E731
    total = sum(b - a for a, b in spans) / 60
    return f"{total:.0f} min in {len(spans)} run{'s' if len(spans) > 1 else ''} (" + "; ".join(
        f"{fmt(a)} to {time.strftime('%H:%M', time.gmtime(b))}" for a, b in spans) + " UTC)"


def dataset_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="quantized_models/data/runs.jsonl", help="JSONL journal (appended, resumable)")
    ap.add_argument("--kernel", action="append", help="only these kernels (default: all bundled)")
    ap.add_argument("--isa", action="append", help=f"ISA caps (default: {', '.join(ISAS)})")
    ap.add_argument("--configs", type=int, default=100, help="sampled configs per kernel and ISA (plus defaults)")
    ap.add_argument("--shapes", type=int, default=22, help="shapes per kernel, bundled workloads included")
    ap.add_argument("--extra-shapes", type=int, default=22,
                    help="more synthetic training shapes per kernel (their own seeded stream: the base shapes and "
                         "the held-out split do not change)")
    ap.add_argument("--extra-where", action="append", default=[], metavar="DIM=VALUE",
                    help="only extra shapes with this dim value, e.g. stride=2 (repeatable)")
    ap.add_argument("--arch-layers", type=int, default=30,
                    help="training shapes per kernel from real architectures (quantized_models/data/arch_layers.toml)")
    ap.add_argument("--heldout", type=int, default=4, help="held-out shapes per kernel")
    ap.add_argument("--refine", type=int, default=10, help="annealing evals per training case (training targets)")
    ap.add_argument("--refine-heldout", type=int, default=30,
                    help="annealing evals per held-out case (its best-known reference)")
    ap.add_argument("--sweep", action="append", default=[], metavar="KNOB,KNOB",
                    help="from each training case's best, measure every valid joint setting of these knobs, e.g. "
                         "mr,nv,vec (repeatable; a kernel without all of a group's knobs skips it)")
    ap.add_argument("--confirm-top", type=int, default=12,
                    help="leaders measured again per training case (at least the training recipe's --top, 10)")
    ap.add_argument("--confirm-rounds", type=int, default=4, help="extra measurements of each leader")
    ap.add_argument("--min-time", type=float, default=0.02, help="timing budget per measurement, seconds")
    ap.add_argument("--max-reps", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="print the plan (measurement counts) only")
    ap.add_argument("--card", metavar="DATA", help="print the data card of a journal (.jsonl or .jsonl.gz) and exit")


def _parse_where(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        dim, _, value = item.partition("=")
        if not dim or not value.strip().lstrip("-").isdigit():
            raise BadInput(f"--extra-where {item!r}: expected DIM=INTEGER, e.g. --extra-where stride=2")
        out[dim.strip()] = int(value)
    return out


def _parse_sweep(items: list[str], kernels: list[str]) -> list[tuple[str, ...]]:
    """--sweep groups, each a tuple of knob names that at least one selected kernel has all of."""
    specs = [s for n, s in all_specs().items() if not kernels or n in kernels]
    out = []
    for item in items:
        g = tuple(n.strip() for n in item.split(",") if n.strip())
        if not g or not any(sweep_groups(s, [g]) for s in specs):
            raise BadInput(f"--sweep {item!r}: no selected kernel has all of these knobs; name knobs of one kernel, "
                           f"e.g. --sweep mr,nv,vec (knobs: " + "; ".join(
                               f"{s.name} {','.join(p.name for p in s.params)}" for s in specs) + ")")
        out.append(g)
    return out


def cmd_collect(a: argparse.Namespace) -> int:
    if a.card:
        print(data_card(Path(a.card)))
        return 0
    for k in a.kernel or []:
        get_spec(k)  # BadInput names the bundled kernels
    collect(Path(a.out), a.kernel or [], a.isa or list(ISAS), a.configs, a.shapes, a.heldout, a.refine,
            a.refine_heldout, a.min_time, a.max_reps, a.seed, a.dry_run, a.extra_shapes,
            a.confirm_top, a.confirm_rounds, a.arch_layers, _parse_where(a.extra_where),
            _parse_sweep(a.sweep, a.kernel or []))
    return 0


def main(argv: list[str] | None = None) -> int:
    from edgetune.main import run_module

    return run_module("python -m tuner.collect", __doc__.split("\n\n")[0], add_arguments, cmd_collect, argv)


if __name__ == "__main__":
    sys.exit(main())
