"""Finals study: which timing window and finals policy picks the truly fastest config for the least measuring.

Per held-out case, the model's top-5, the best-known config and the default are measured in R shuffled rounds,
each config once per round at every window under study. A bootstrap then splits the rounds of each case: the first
drives a policy's search sample, the next ones its final rounds, and the rest (never seen by the policy) give the
truth, each config's median speed relative to config 0 in the same round. A policy is a search window, final-round
windows, and whether the search sample joins the final median; it decides with the session's own
`pick_finalists` and `pick_winner`. Printed per policy: the share of picks within 5% and 3% of the truth's best,
the mean regret, measuring seconds per case (from the measured cost of each window), and the paired difference to
the session's policy with a 95% interval over cases.

    python bench/finals_study.py [--rounds 10] [--json study.json]      # collect (~8 min for 72 cases), then analyse
    python bench/finals_study.py --load study.json                      # analyse a collected study again
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cli_args import at_least, output_file  # noqa: E402
from kernels.measure import Measurement  # noqa: E402
from kernels.registry import all_specs  # noqa: E402
from kernels.space import config_key  # noqa: E402
from tuner.session import FINAL_ROUNDS, SEARCH_MIN_TIME_S, pick_finalists, pick_winner  # noqa: E402
from tuner.train import data as D  # noqa: E402

SESSION = "session"
# name: (search window s, final-round windows s, the search sample joins the final median)
POLICIES = {
    "former: 0.05 s, 3 rounds": (0.05, [0.05] * 3, False),
    SESSION: (SEARCH_MIN_TIME_S, [SEARCH_MIN_TIME_S] * FINAL_ROUNDS, True),
    "0.05 s, search + 2 rounds": (0.05, [0.05] * 2, True),
    "0.025 s, 3 rounds": (0.025, [0.025] * 3, False),
    "0.025 s, search + 2 rounds": (0.025, [0.025] * 2, True),
    "0.025 s, search + 4 rounds": (0.025, [0.025] * 4, True),
}
WINDOWS = sorted({w for sw, fws, _ in POLICIES.values() for w in [sw, *fws]})
POLICY_ROUNDS = 1 + max(len(fws) for _, fws, _ in POLICIES.values())  # a search round + the most final rounds


def collect(rounds: int, cases: int | None = None) -> list[dict]:
    from hwprobe import probe
    from kernels.build import CompileError
    from kernels.worker import Runner
    from tuner.evaluate import Measured
    from tuner.strategies.llm import LLMStrategy, load_proposer

    _, held = D.split_cases(D.load_collector(D.DEFAULT_DATA))
    held.sort(key=lambda c: (c.kernel, c.isa, c.workload))
    held = held[:cases]
    specs, prop, hws, out = all_specs(), load_proposer(None), {}, []
    with Runner() as runner:
        for i, case in enumerate(held):
            spec = specs[case.kernel]
            hw = hws.get(case.isa) or hws.setdefault(case.isa, probe(isa_cap=case.isa, measure_bandwidth=False))
            space = spec.space(case.shape, hw)
            top = LLMStrategy(space, kernel=spec, proposer=prop, k=5).ask(5)[:5]
            default = space.valid_default()
            cfgs = list({config_key(c): c for c in [*top, case.ranked()[0][0], default]}.values())
            ev = Measured(spec=spec, shape=case.shape, hw=hw, runner=runner)
            ev.evaluate([], prebuild=cfgs)
            broken = {j for j, c in enumerate(cfgs) if isinstance(ev.builds[config_key(c)], CompileError)}
            evs = [dataclasses.replace(ev, min_time_s=w) for w in WINDOWS]  # sharing ev's builds
            rng = random.Random(i)
            ms = [[[None] * len(WINDOWS) for _ in range(rounds)] for _ in cfgs]
            cost: dict[float, list[float]] = {w: [] for w in WINDOWS}
            for r in range(rounds):
                # the interleave protocol, each config once per round in a shuffled order, at every window in a
                # shuffled order of its own
                for j in rng.sample(range(len(cfgs)), len(cfgs)):
                    if j in broken:
                        continue
                    for k in rng.sample(range(len(WINDOWS)), len(WINDOWS)):
                        t = time.perf_counter()
                        m = evs[k].evaluate([cfgs[j]])[0]
                        cost[WINDOWS[k]].append(time.perf_counter() - t)
                        ms[j][r][k] = m.ms if m.ok else None
            out.append({"kernel": case.kernel, "isa": case.isa, "workload": case.workload, "shape": case.shape,
                        "configs": cfgs, "ms": ms,
                        # a session searches its proposals, and the default only when it is one of them
                        "searched": [c in top or c != default for c in cfgs],
                        "cost_s": {str(w): statistics.fmean(v) for w, v in cost.items() if v},
                        "load1": os.getloadavg()[0]})
            print(f"  [{i + 1}/{len(held)}] {case.kernel} {case.isa} {case.workload}: {len(cfgs)} configs x {rounds} "
                  f"rounds, load {out[-1]['load1']:.2f}", flush=True)
    return out


def truth(ms: list, rounds: list[int]) -> list[float | None]:
    """Each config's median over `rounds` (all windows) of its ms over config 0's in the same round and window."""
    out = []
    for row in ms:
        rs = [row[r][k] / ms[0][r][k] for r in rounds for k in range(len(WINDOWS)) if row[r][k] and ms[0][r][k]]
        out.append(statistics.median(rs) if rs else None)
    return out


def decide(case: dict, space, default: dict, rounds: list[int], policy: tuple) -> tuple[int | None, float]:
    """Run one policy on the given rounds: (index of the config it keeps, its measuring seconds)."""
    sw, fws, pooled = policy
    cfgs, ms = case["configs"], case["ms"]
    idx = {config_key(c): j for j, c in enumerate(cfgs)}

    def meas(j: int, r: int, w: float) -> Measurement | None:
        v = ms[j][r][WINDOWS.index(w)]
        return Measurement(ok=True, ms=v, load1=0.0) if v else None

    searched = [j for j, s in enumerate(case["searched"]) if s]
    ok = sorted(((cfgs[j], m) for j in searched if (m := meas(j, rounds[0], sw))), key=lambda cm: cm[1].value)
    if not ok:
        return None, 0.0
    finalists = pick_finalists(ok, default)
    prior = {config_key(c): m for c, m in ok}
    scored = []
    for c in finalists:
        j = idx[config_key(c)]
        got = [m for i, w in enumerate(fws) if (m := meas(j, rounds[1 + i], w))]
        if pooled and config_key(c) in prior:
            got.append(prior[config_key(c)])
        if got:
            scored.append((c, Measurement(ok=True, ms=statistics.median(m.ms for m in got), load1=0.0)))
    winner, _ = pick_winner(scored, default)
    cost = len(searched) * case["cost_s"][str(sw)] + len(finalists) * sum(case["cost_s"][str(w)] for w in fws)
    return idx[config_key(winner)], cost


def analyse(cases: list[dict], draws: int, seed: int = 0) -> None:
    from hwprobe import probe

    specs, hws, rng = all_specs(), {}, random.Random(seed)
    used = POLICY_ROUNDS
    per_case: dict[str, list[tuple[float, float]]] = {p: [] for p in POLICIES}
    totals = {p: {"hit5": 0, "hit3": 0, "regret": [], "cost": 0.0} for p in POLICIES}
    for case in cases:
        hw = hws.get(case["isa"]) or hws.setdefault(case["isa"], probe(isa_cap=case["isa"], measure_bandwidth=False))
        space = specs[case["kernel"]].space(case["shape"], hw)
        default = space.valid_default()
        rounds_n = len(case["ms"][0])
        acc: dict[str, list[tuple[float, float]]] = {p: [] for p in POLICIES}
        for _ in range(draws):
            perm = rng.sample(range(rounds_n), rounds_n)
            t = truth(case["ms"], perm[used:])
            if not any(t):
                continue
            best = min(x for x in t if x)
            for p, policy in POLICIES.items():
                j, cost = decide(case, space, default, perm[:used], policy)
                if j is None or t[j] is None:
                    continue
                regret = t[j] / best
                acc[p].append((regret, cost))
                tot = totals[p]
                tot["hit5"] += regret <= 1.05
                tot["hit3"] += regret <= 1.03
                tot["regret"].append(regret)
                tot["cost"] += cost
        for p in POLICIES:
            if acc[p]:
                per_case[p].append((statistics.fmean(r for r, _ in acc[p]),
                                    statistics.fmean(r <= 1.05 for r, _ in acc[p])))
    print(f"{len(cases)} cases x {draws} draws; policy rounds {used}, truth rounds {rounds_n - used}")
    print(f"{'policy':30s} {'within 5%':>9s} {'within 3%':>9s} {'regret':>7s} {'measure s':>9s}  "
          f"{'regret vs session [95%]':>28s}  {'within 5% vs session [95%]':>28s}")
    n = len(per_case[SESSION])
    for p, tot in totals.items():
        k = len(tot["regret"])
        line = (f"{p:30s} {tot['hit5'] / k:9.3f} {tot['hit3'] / k:9.3f} {statistics.fmean(tot['regret']):7.4f} "
                f"{tot['cost'] / k:9.3f}")
        if p != SESSION:
            dr = [per_case[p][i][0] - per_case[SESSION][i][0] for i in range(n)]
            dh = [per_case[p][i][1] - per_case[SESSION][i][1] for i in range(n)]
            line += f"  {_paired(dr, rng, '+.4f'):>28s}  {_paired(dh, rng, '+.3f'):>28s}"
        print(line)


def _paired(diffs: list[float], rng: random.Random, fmt: str, boots: int = 2000) -> str:
    """Mean paired difference over cases and its bootstrap 95% interval."""
    n = len(diffs)
    means = sorted(statistics.fmean(diffs[rng.randrange(n)] for _ in range(n)) for _ in range(boots))
    return f"{statistics.fmean(diffs):{fmt}} [{means[int(.025 * boots)]:{fmt}}, {means[int(.975 * boots)]:{fmt}}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2 * POLICY_ROUNDS,
                    help=f"rounds measured per case (a policy uses {POLICY_ROUNDS}, the truth the rest)")
    ap.add_argument("--draws", type=at_least(1), default=300, help="bootstrap splits of the rounds per case")
    ap.add_argument("--cases", type=at_least(1), help="only the first N held-out cases (a quick run; default: all)")
    ap.add_argument("--json", type=output_file, help="write the collected measurements here")
    ap.add_argument("--load", help="analyse measurements collected earlier instead of measuring")
    a = ap.parse_args(argv)
    if not a.load and a.rounds < 2 * POLICY_ROUNDS:
        ap.error(f"--rounds {a.rounds}: a policy uses {POLICY_ROUNDS} rounds and the truth as many again; "
                 f"use at least {2 * POLICY_ROUNDS}")
    if a.load:
        try:
            cases = json.loads(Path(a.load).read_text())["cases"][:a.cases]
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--load {a.load}: cannot read a study written by --json ({e})")
    else:
        load0 = os.getloadavg()[0]
        cases = collect(a.rounds, a.cases)
        print(f"collected at load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
        if a.json:
            Path(a.json).write_text(json.dumps({"windows": WINDOWS, "cases": cases}))
    analyse(cases, a.draws)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
