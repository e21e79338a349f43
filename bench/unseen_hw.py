"""The tuner model on devices its data never described: `python bench/unseen_hw.py`.

The data describes a few x86 hosts under three ISA caps (quantized_models/data: the collector's `hw` rows and the
device records' descriptors). A device outside them must still get valid proposals, and proposals no worse than
the model would give were the device the nearest one it knows. Per device and held-out real layer
(bench/real_layers.toml), the model's top-K is asked twice with the device's own constraints: once prompted with
the device's descriptor, once with the nearest known descriptor (same vector width, closest caches and cores).

- Measured here: this host itself when the data never described it (another CPU model or other caches: a real
  unseen device; nearest known: the same ISA and vector width), and this host posing as the device: `x86-64` (the
  SSE2 baseline, an ISA level no data has; nearest known: x86-64-v2, also 128-bit) and `1 core` (this process and
  its worker pinned to one CPU; the data's hosts have two). Both top-Ks are built for the device and measured side
  by side in shuffled rounds (`Evaluator.interleave`); the ratio is the median over rounds of best-of-own-top-K over
  best-of-nearest-top-K (above 1: the unseen descriptor made the proposals worse).
- Described only (no such CPU here): the ARM boards of tests/data/hwtrees and a small-cache gateway (an x86-64-v3
  host with 256 KiB L2 and no L3): every proposal valid for the device, the top-1 kept from the nearest known's,
  the top-K overlap, the proposal's CPU time (its latency on an idle core: llama.cpp runs on the calling thread).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.cli_args import output_file  # noqa: E402
from kernels.space import config_key  # noqa: E402

TREES = ROOT / "tests" / "data" / "hwtrees"


def known_descriptors() -> list[dict]:
    """The distinct descriptors (prompt fields) the committed data trains under."""
    from tuner.train import data as D

    out = {}
    for path in [D.DEFAULT_DATA, *D.DEFAULT_RECORDS]:
        for r in D._rows(path):
            hw = r.get("hw") if r.get("kind") == "hw" or "measurements" in r else None
            if isinstance(hw, dict) and "caches" in hw:
                from hwprobe.descriptor import HwDescriptor
                from tuner.collect import hw_summary

                hw = hw_summary(HwDescriptor.from_dict(hw))
            if isinstance(hw, dict) and hw.get("isa"):
                out.setdefault(json.dumps({k: hw.get(k) for k in ("isa", "vector_bits", "cores", "l1d", "l2", "l3",
                                                                   "bandwidth_gbps", "cpu_model")}, sort_keys=True), hw)
    return list(out.values())


def nearest(device: dict, known: list[dict]) -> dict:
    """The known descriptor of the same vector width closest in caches and cores (log2 distance), same CPU model
    first."""
    def dist(k: dict) -> float:
        d = 0.0
        for f in ("l1d", "l2", "l3", "cores"):
            a, b = device.get(f) or 1, k.get(f) or 1
            d += abs(math.log2(a) - math.log2(b))
        same_cpu = k.get("cpu_model") == device.get("cpu_model")
        return d + (0 if same_cpu else 2) + (0 if k["isa"] == device["isa"] else 0.5)

    same = [k for k in known if k.get("vector_bits") == device.get("vector_bits")] or known
    return min(same, key=dist)


def prompt_fields(d: dict) -> dict:
    """What tells descriptors apart: the prompt's fields, and the CPU model (the data's hosts by name)."""
    from tuner.model.prompt import hw_fields

    return {**hw_fields(d), "cpu_model": d.get("cpu_model")}


def is_unseen(hw, known: list[dict]) -> bool:
    """The data holds no descriptor like this one (bandwidth aside: it is measured, and moves from run to run)."""
    mine = {**prompt_fields(summary_of(hw)), "bandwidth_gbps": None}
    return all({**prompt_fields(k), "bandwidth_gbps": None} != mine for k in known)


def summary_of(hw) -> dict:
    from tuner.collect import hw_summary

    return hw_summary(hw)


def top_lists(prop, spec, space, own: dict, near: dict, k: int) -> tuple[list, list, float]:
    a = prop.propose(spec.name, space, k, prompt_hw=own)
    b = prop.propose(spec.name, space, k, prompt_hw=near)
    return [p.config for p in a.proposals], [p.config for p in b.proposals], a.cpu_ms


def measured_device(name: str, hw, layers, prop, known: list[dict], k: int, rounds: int) -> list[dict]:
    from kernels.worker import Runner
    from tuner.evaluate import Measured, same_round_ratio

    own = summary_of(hw)
    near = nearest(own, [d for d in known if prompt_fields(d) != prompt_fields(own)])
    print(f"{name}: {own['isa']}, {own['cores']} core(s); nearest known: {near.get('cpu_model')} {near['isa']} "
          f"{near.get('cores')} cores", flush=True)
    rows = []
    with Runner() as runner:
        for i, (spec, wl) in enumerate(layers):
            space = spec.space(wl.shape, hw)
            mine, theirs, lat = top_lists(prop, spec, space, own, near, k)
            allc = list({config_key(c): c for c in mine + theirs}.values())
            keys = [config_key(c) for c in allc]
            got = Measured(spec=spec, shape=wl.shape, hw=hw, runner=runner, min_time_s=0.02, max_reps=15,
                           timeout_s=20).interleave(allc, rounds, seed=i)

            def best(cfgs):
                idx = [keys.index(config_key(c)) for c in cfgs]
                return [min((got.per[j][r].ms for j in idx if got.per[j][r].ok), default=None)
                        for r in range(rounds)]

            ratio = same_round_ratio(best(mine), best(theirs))
            rows.append({"device": name, "kernel": spec.name, "workload": wl.name, "ratio": ratio,
                         "valid": all(space.is_valid(c) for c in mine),
                         "same_top1": config_key(mine[0]) == config_key(theirs[0]),
                         "overlap": len(set(map(config_key, mine)) & set(map(config_key, theirs))),
                         "cpu_ms": lat, "load1": os.getloadavg()[0]})
            print(f"  [{i + 1}/{len(layers)}] {spec.name}/{wl.name}: own/nearest best-of-top-{k} "
                  f"{ratio if ratio else float('nan'):.3f}, same top-1 {rows[-1]['same_top1']}, overlap "
                  f"{rows[-1]['overlap']}/{k}, load {rows[-1]['load1']:.1f}", flush=True)
    return rows


def measured_posed(layers, prop, known: list[dict], k: int, rounds: int) -> list[dict]:
    """This host posing as an SSE2-only device, then as a 1-core one."""
    from hwprobe import probe

    rows = measured_device("x86-64 baseline", probe(isa_cap="x86-64", measure_bandwidth=False), layers, prop,
                           known, k, rounds)
    cpus = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cpus)})
        rows += measured_device("1 core", probe(measure_bandwidth=False), layers, prop, known, k, rounds)
    finally:
        os.sched_setaffinity(0, cpus)
    return rows


def described_device(name: str, hw, layers, prop, known: list[dict], k: int) -> list[dict]:
    own = summary_of(hw)
    near = nearest(own, known)
    rows = []
    for spec, wl in layers:
        space = spec.space(wl.shape, hw)
        mine, theirs, lat = top_lists(prop, spec, space, own, near, k)
        rows.append({"device": name, "kernel": spec.name, "workload": wl.name, "ratio": None,
                     "valid": bool(mine) and all(space.is_valid(c) for c in mine),
                     "same_top1": bool(mine and theirs) and config_key(mine[0]) == config_key(theirs[0]),
                     "overlap": len(set(map(config_key, mine)) & set(map(config_key, theirs))), "cpu_ms": lat})
    print(f"{name} ({own['isa']}, v{own['vector_bits']}, {own['cores']} cores, L2 {own['l2']}, L3 {own['l3']}; "
          f"nearest known {near.get('cpu_model')} {near['isa']}): valid {sum(r['valid'] for r in rows)}/{len(rows)}, "
          f"same top-1 {sum(r['same_top1'] for r in rows)}/{len(rows)}, mean overlap "
          f"{statistics.fmean(r['overlap'] for r in rows):.1f}/{k}, proposal CPU time p95 "
          f"{sorted(r['cpu_ms'] for r in rows)[int(0.95 * (len(rows) - 1))]:.1f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    import dataclasses

    from hwprobe import probe
    from tuners_real import LAYERS, load_layers

    from tuner.strategies.llm import load_proposer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default=str(LAYERS))
    ap.add_argument("--per-kernel", type=int, help="only the first N layers of each kernel")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-measure", action="store_true", help="only the described devices (no timing)")
    ap.add_argument("--host-only", action="store_true",
                    help="measure only this host (when the data never described it), not the posed devices")
    ap.add_argument("--json", type=output_file, help="write the per-layer rows to this file")
    a = ap.parse_args(argv)
    layers = load_layers(Path(a.layers), [], a.per_kernel, [])
    prop = load_proposer()
    known = known_descriptors()
    rows: list[dict] = []
    t0 = time.time()
    print(f"{len(layers)} held-out layers; {len(known)} known descriptors; load {os.getloadavg()[0]:.2f}", flush=True)
    for tree in sorted(TREES.iterdir()) if TREES.is_dir() else []:
        if tree.is_dir():
            rows += described_device(tree.name, probe(root=tree, measure_bandwidth=False), layers, prop, known, a.k)
    gw = probe(isa_cap="x86-64-v3", measure_bandwidth=False)
    small = tuple(dataclasses.replace(c, size_bytes=256 << 10) if c.level == 2 else c for c in gw.caches if c.level < 3)
    rows += described_device("small-cache gateway", dataclasses.replace(gw, caches=small), layers, prop, known, a.k)
    if not a.no_measure:
        host = probe()
        if is_unseen(host, known):
            rows += measured_device("this host", host, layers, prop, known, a.k, a.rounds)
        else:
            print(f"this host ({host.cpu_model}, {host.isa}) is one the data describes: not measured as unseen")
        if not a.host_only:
            rows += measured_posed(layers, prop, known, a.k, a.rounds)
        for dev in dict.fromkeys(r["device"] for r in rows if r["ratio"] is not None):
            rs = [r["ratio"] for r in rows if r["device"] == dev and r["ratio"]]
            gm = math.exp(statistics.fmean(math.log(x) for x in rs))
            print(f"{dev}: own/nearest-known best-of-top-{a.k} geomean {gm:.3f}, worse by >5% on "
                  f"{sum(x > 1.05 for x in rs)}/{len(rs)}, better by >5% on {sum(x < 0.95 for x in rs)}/{len(rs)}")
    print(f"{time.time() - t0:.0f}s, load {os.getloadavg()[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
