"""Tuner models side by side on the held-out cases: `python bench/model_ab.py a=A.gguf b=B.gguf [--ensemble a,b]`.

For every held-out case, each model's exact top-K over the full space is compiled, and every distinct config of
all the lists is measured in the same 7 shuffled rounds with the case's best-known config
(`compare_tuners.measure_lists`). Models are thus judged on the same rounds, and a config two models share is
measured once. Taking turns case by case, as earlier A/Bs did, left each model its own rounds on a host whose
speed drifts between them. The output also pairs each model with the first one: the cases one hit within 5% and
the other missed, with an exact two-sided sign test over those discordant cases.

`--descriptor data` prompts each model with the hardware descriptor the case was collected under (the collection
host's caches, cores and bandwidth) instead of this machine's, which is what a device sends; the configs are
built and measured here either way. It separates how a model ranks configs from how it reads a device it was not
trained on.

`--real-layers --refs FILE` judges the models on bench/real_layers.toml instead (layers no model trained on), each
against its long-search reference from FILE (the one `compare_tuners.py --real-layers --refs FILE` built on this
machine): the models' exact top-K without the session's steering, so a model change is judged apart from the
noise of the sessions' own measurements.

`--ensemble a,b` adds the members' product of experts: the top-K by summed log-probability. Each member is searched
to its top-`--depth`; a config missing from a member's list scores that list's lowest log-probability, an upper
bound, so the ensemble's list is approximate below the members' depth. Training a model per seed:
`python -m tuner.train --seed N --out DIR` (the `[train]` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_tuners as CT  # noqa: E402  (puts the repository on sys.path)
from bench.cli_args import output_file  # noqa: E402
from kernels.registry import all_specs  # noqa: E402
from kernels.space import Config, config_key  # noqa: E402
from tuner.train import data as D  # noqa: E402

WITHIN = 1.05


@dataclasses.dataclass(frozen=True)
class Item:
    """One layer to judge: its shape, the descriptor the configs are built for, the one the prompt carries, and the
    reference config the lists are measured against."""
    kernel: str
    isa: str
    workload: str
    shape: dict
    hw: object
    asked_hw: object
    ref: Config


def data_items(path: Path, descriptor: str) -> list[Item]:
    """The collector's held-out cases, against each case's best-known config."""
    _, held = D.split_cases(D.load_collector(path))
    held.sort(key=lambda c: (c.kernel, c.isa, c.workload))
    hws: dict = {}
    return [Item(c.kernel, c.isa, c.workload, c.shape, CT.held_out_hw(c, hws),
                 CT.held_out_hw(c, hws) if descriptor == "here" else D.HwView(c.hw), c.ranked()[0][0])
            for c in held]


def real_items(refs_path: Path) -> list[Item]:
    """bench/real_layers.toml on this machine, against the references that tuners_real built here."""
    import tuners_real as TR
    from hwprobe import probe

    refs = json.loads(refs_path.read_text()) if refs_path.is_file() else {}
    hw = probe(measure_bandwidth=False)
    out = []
    for spec, wl in TR.load_layers(TR.LAYERS, [], None, []):
        key = TR.ref_key(hw, spec, wl)
        if key not in refs:
            raise SystemExit(f"no reference for {spec.name}/{wl.name} in {refs_path}: build them with "
                             f"`python bench/compare_tuners.py --real-layers --refs {refs_path}` on this machine")
        out.append(Item(spec.name, hw.isa, wl.name, dict(wl.shape), hw, hw, refs[key]["config"]))
    return out


def hit_at(ratios: list[float | None], k: int) -> bool:
    return any(r is not None and r <= WITHIN for r in ratios[:k])


def sign_test(b: int, c: int) -> float:
    """Exact two-sided p-value of b against c discordant cases under 50/50 (1.0 when there are none)."""
    from scipy.stats import binomtest  # the [bench] extra's scipy

    return binomtest(b, b + c).pvalue if b + c else 1.0


def ensemble_top(lists: list[dict[str, tuple[Config, float]]], k: int) -> list[Config]:
    floors = [min(lp for _, lp in lst.values()) for lst in lists]
    configs = {key: cfg for lst in lists for key, (cfg, _) in lst.items()}
    score = {key: sum(lst[key][1] if key in lst else floor for lst, floor in zip(lists, floors)) for key in configs}
    return [configs[key] for key in sorted(configs, key=lambda key: -score[key])[:k]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", metavar="NAME=GGUF")
    ap.add_argument("--ensemble", action="append", default=[], metavar="A,B[,...]",
                    help="also the product of experts of these models (repeatable)")
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--depth", type=int, default=40, help="each member's list length for ensembles")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cases", type=int, default=0, help="only the first N held-out cases (default: all)")
    ap.add_argument("--descriptor", choices=("here", "data"), default="here",
                    help="the prompts' hardware descriptor: this machine's (as a device sends) or the case's recorded one")
    ap.add_argument("--data", default=str(D.DEFAULT_DATA))
    ap.add_argument("--real-layers", action="store_true", help="judge on bench/real_layers.toml (needs --refs)")
    ap.add_argument("--refs", type=Path, help="the real layers' references (compare_tuners.py --refs)")
    ap.add_argument("--json", type=output_file, help="write the per-case rows to this file")
    a = ap.parse_args(argv)
    from kernels.worker import Runner
    from tuner.model.inference import ModelError
    from tuner.model.proposer import Proposer

    models: dict[str, Path] = {}
    for arg in a.models:
        name, sep, path = arg.partition("=")
        if not sep or not Path(path).is_file():
            ap.error(f"{arg!r}: expected NAME=PATH of an existing GGUF file")
        if name in models:
            ap.error(f"{arg!r}: the name {name!r} is already taken; give each model its own")
        models[name] = Path(path)
    ensembles = [e.split(",") for e in a.ensemble]
    for e in ensembles:
        unknown = [m for m in e if m not in models]
        if unknown or len(e) < 2:
            ap.error(f"--ensemble {','.join(e)}: needs two or more of the named models {', '.join(models)}")
    try:
        proposers = {name: Proposer(path=path) for name, path in models.items()}
    except ModelError as e:
        ap.error(str(e))
    if a.real_layers and not a.refs:
        ap.error("--real-layers needs --refs FILE (built by compare_tuners.py --real-layers --refs FILE)")
    if a.real_layers and a.descriptor != "here":
        ap.error("--real-layers prompts with this machine's descriptor: the layers have no recorded one")
    depth = max(a.k, a.depth) if ensembles else a.k
    held = real_items(a.refs) if a.real_layers else data_items(Path(a.data), a.descriptor)
    held = held[:a.cases] if a.cases > 0 else held
    specs = all_specs()
    names = list(models) + ["+".join(e) for e in ensembles]
    print(f"{len(held)} held-out {'real layers' if a.real_layers else 'cases'}; variants {', '.join(names)}; "
          f"top-{a.k}; {a.descriptor}'s descriptor; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    t0 = time.time()
    with Runner() as runner:
        for i, case in enumerate(held):
            spec = specs[case.kernel]
            space = spec.space(case.shape, case.hw)
            asked = spec.space(case.shape, case.asked_hw)
            ranked = {name: {config_key(p.config): (p.config, p.logprob)
                             for p in prop.propose(case.kernel, asked, depth).proposals}
                      for name, prop in proposers.items()}
            lists = {name: [cfg for cfg, _ in ranked[name].values()][:a.k] for name in models}
            for e in ensembles:
                lists["+".join(e)] = ensemble_top([ranked[m] for m in e], a.k)
            ratios, control, _ = CT.measure_lists(runner, spec, case.shape, case.ref, space.hw, lists,
                                                  a.rounds, seed=i)
            rows.append({"kernel": case.kernel, "isa": case.isa, "workload": case.workload, "ratios": ratios,
                         "control": control, "load1": os.getloadavg()[0]})
            print(f"  [{i + 1}/{len(held)}] {case.kernel} {case.isa} {case.workload}: "
                  + " ".join(f"{n} {'hit' if hit_at(ratios[n], a.k) else 'miss'}" for n in names)
                  + f"; control {control or float('nan'):.2f}; load {rows[-1]['load1']:.2f}", flush=True)
    n = len(rows)
    print(f"\nwithin 5% of the best-known, {n} cases, {time.time() - t0:.0f}s, load {os.getloadavg()[0]:.2f}; "
          f"control {sum(1 for r in rows if r['control'] and r['control'] <= WITHIN)}/{n}:")
    first = names[0]
    for name in names:
        top1 = sum(hit_at(r["ratios"][name], 1) for r in rows)
        topk = sum(hit_at(r["ratios"][name], a.k) for r in rows)
        lo, hi = CT.share_interval(topk, n)
        best = [min(x for x in r["ratios"][name] if x) for r in rows if any(r["ratios"][name])]
        line = (f"  {name:24s} top-1 {top1:2d}  top-{a.k} {topk:2d}/{n} ({lo:.0%}-{hi:.0%})  median best-of-top-{a.k} "
                f"{statistics.median(best):.3f}")
        if name != first:
            b = sum(hit_at(r["ratios"][name], a.k) and not hit_at(r["ratios"][first], a.k) for r in rows)
            c = sum(hit_at(r["ratios"][first], a.k) and not hit_at(r["ratios"][name], a.k) for r in rows)
            line += f"  vs {first}: +{b} -{c} (sign test p {sign_test(b, c):.2f})"
        print(line)
    union = sum(any(hit_at(r["ratios"][m], a.k) for m in models) for r in rows)
    print(f"  union of the {len(models)} models' top-{a.k}: {union}/{n}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
