"""The health check of a staged tuner model, in a child process (`python -m daemon.model_check`).

A candidate model may be broken in ways only llama.cpp finds (or crashes on), and measuring loads compilers and
a worker: neither belongs in the long-lived daemon, so the daemon runs this like a tune (daemon.tunejob) and
keeps only its verdict. It holds the state dir's tune lock meanwhile, so no tune measures at the same time.

The checks, in order, each failing with its reason code (edgetune.release):
1. the file passes the GGUF check (complete, an edgetune tuner, this prompt format) and llama.cpp loads it;
2. for every active workload the current model can propose for, it was trained for the same knobs, proposes
   at least one config, every proposal is valid, and proposing stays within the latency budget;
3. unless told not to compare (a signed rollback only needs to load), on each workload the best measured
   config of its top-K is not worse than the current model's top-K: both top-Ks are measured in the same
   interleaved rounds (tuner.evaluate, the one interleave protocol) and compared by their same-round ratio. A
   workload measured worse than the tolerance is measured again in fresh rounds, and fails only when the second
   look agrees: one look per workload over a device's dozens of workloads let noise alone condemn a model (a
   retrained model with 7 of 12 held-out layers in its top-5 against 3 was rolled back for one of 24 workloads at
   1.067x).

Protocol: one JSON request line on stdin; one JSON line on stdout: {"ok", "reason", "detail", "workloads",
"better"} where `better` lists the workloads the candidate measured better on (the daemon retunes those).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
from typing import Any

from edgetune import release as rel

log = logging.getLogger(__name__)


class Unhealthy(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def request(candidate: str, current: str, pairs: list, hw: Any, *, compare: bool, top_k: int, rounds: int,
            latency_budget_ms: float, tolerance: float) -> dict:
    return {"candidate": candidate, "current": current, "compare": compare, "top_k": top_k, "rounds": rounds,
            "latency_budget_ms": latency_budget_ms, "tolerance": tolerance, "hw": hw.to_dict(),
            "workloads": [{"kernel": s.name, "name": w.name, "shape": w.shape, "source": w.source} for s, w in pairs]}


def knobs_match(proposer: Any, spec: Any, space: Any) -> str | None:
    """None when the model was trained for this kernel's current knobs, else why not."""
    known = proposer.m.info.spaces().get(spec.name)
    if known is None:
        return f"it was not trained on kernel {spec.name}"
    if known != {p.name: [str(v) for v in p.values] for p in space.params}:
        return f"kernel {spec.name}'s knobs changed since it was trained"
    return None


def load(path: str) -> Any:
    from tuner.model.inference import ModelError, PromptFormatError
    from tuner.model.proposer import Proposer

    try:
        return Proposer(path=path)
    except PromptFormatError as e:
        raise Unhealthy(rel.WRONG_PROMPT_FORMAT, str(e)) from None
    except (ModelError, OSError) as e:
        raise Unhealthy(rel.LOAD_FAILED, str(e)) from None


def propose(proposer: Any, spec: Any, space: Any, k: int, budget_ms: float, target: str) -> tuple[list[dict], float]:
    """The model's top-k for one workload and how long proposing took (ms); Unhealthy when it cannot serve."""
    from tuner.model.inference import ModelError

    why = knobs_match(proposer, spec, space)
    if why:
        raise Unhealthy(rel.INVALID_PROPOSALS, f"{target}: {why}")
    try:
        res = proposer.propose(spec.name, space, k)
    except ModelError as e:
        raise Unhealthy(rel.INVALID_PROPOSALS, f"{target}: proposing failed: {e}") from None
    configs = [p.config for p in res.proposals]
    bad = [c for c in configs if not space.is_valid(c)]
    if not configs or bad:
        raise Unhealthy(rel.INVALID_PROPOSALS, f"{target}: {len(bad)} invalid of {len(configs)} proposed configs")
    if res.latency_ms > budget_ms:
        raise Unhealthy(rel.TOO_SLOW, f"{target}: proposing took {res.latency_ms:.0f} ms, the budget is "
                                      f"{budget_ms:.0f} ms ([model_update] latency_budget_ms)")
    return configs, res.latency_ms


def best_per_round(rounds: Any, idx: list[int]) -> list[float | None]:
    """For each round, the fastest ok measurement among configs `idx`: what a top-K gives a tuner that measures
    all of it."""
    out = []
    for r in range(len(rounds.per[idx[0]])):
        ok = [rounds.per[i][r].ms for i in idx if rounds.per[i][r].ok]
        out.append(min(ok) if ok else None)
    return out


def compare(new: list[dict], cur: list[dict], evaluator: Any, rounds: int, seed: str) -> dict:
    """Both top-Ks measured in the same rounds; ratio = median same-round ratio of their best (new / current)."""
    from kernels.space import config_key
    from tuner.evaluate import median_time, same_round_ratio

    union = list({config_key(c): c for c in new + cur}.values())
    keys = [config_key(c) for c in union]
    measured = evaluator.interleave(union, rounds, seed=seed)
    new_best = best_per_round(measured, [keys.index(config_key(c)) for c in new])
    cur_best = best_per_round(measured, [keys.index(config_key(c)) for c in cur])
    return {"ratio": same_round_ratio(new_best, cur_best), "new_ms": median_time(new_best),
            "current_ms": median_time(cur_best)}


def judge(new: list, cur: list, evaluator: Any, rounds: int, tolerance: float, target: str) -> dict:
    """`compare` on one workload; a ratio over 1 + `tolerance` is measured again in fresh rounds, and the second
    look decides (`first_ratio` keeps the first)."""
    got = compare(new, cur, evaluator, rounds, seed=target)
    first = got["ratio"]
    if first is not None and first > 1 + tolerance:
        got = compare(new, cur, evaluator, rounds, seed=f"{target} again")
    return got | {"target": target, "first_ratio": first}


def check(req: dict) -> dict:
    from hwprobe.descriptor import HwDescriptor
    from kernels.registry import get_spec
    from kernels.worker import Runner
    from tuner.evaluate import Measured

    hw = HwDescriptor.from_dict(req["hw"])
    cand = load(req["candidate"])
    cur = load(req["current"]) if req["compare"] else None
    out: list[dict] = []
    better: list[str] = []
    with Runner() as runner:
        for w in req["workloads"]:
            spec = get_spec(w["kernel"])
            target = f"{spec.name}/{w['name']}"
            space = spec.space(w["shape"], hw)
            cur_configs = None
            if cur is not None:
                if knobs_match(cur, spec, space):  # the current model cannot propose here either: nothing to keep
                    out.append({"target": target, "skipped": "the current model does not know this kernel"})
                    continue
                cur_configs, _ = propose(cur, spec, space, req["top_k"], float("inf"), target)
            new_configs, latency_ms = propose(cand, spec, space, req["top_k"], req["latency_budget_ms"], target)
            if cur_configs is None:
                out.append({"target": target, "proposed": len(new_configs), "latency_ms": latency_ms})
                continue
            ev = Measured(spec=spec, shape=w["shape"], hw=hw, runner=runner)
            got = judge(new_configs, cur_configs, ev, req["rounds"], req["tolerance"], target) | {
                "latency_ms": latency_ms}
            out.append(got)
            if got["ratio"] is None:
                raise Unhealthy(rel.REGRESSION, f"{target}: none of the new model's top-{req['top_k']} ran")
            if got["ratio"] > 1 + req["tolerance"]:
                raise Unhealthy(rel.REGRESSION, f"{target}: its measured top-{req['top_k']} is {got['ratio']:.3f}x "
                                                f"the current model's (same rounds; {got['first_ratio']:.3f}x at "
                                                f"the first look), over the 1+{req['tolerance']} allowed")
            if got["ratio"] < 1 - req["tolerance"]:
                better.append(target)
    return {"ok": True, "reason": None, "detail": f"{len(out)} workload(s) checked", "workloads": out,
            "better": better}


def main() -> int:
    from daemon.tunejob import die_with_parent
    from edgetune import paths

    out = os.fdopen(os.dup(1), "w")  # the verdict channel; anything else printed (C libraries too) goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    die_with_parent(int(os.environ.get("EDGETUNE_DAEMON_PID", os.getppid())))
    req = json.loads(sys.stdin.readline())
    lock = open(paths.state_dir() / "tune.lock", "w")  # no tune measures while we do; held until exit
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        verdict = check(req)
    except Unhealthy as e:
        verdict = {"ok": False, "reason": e.reason, "detail": e.detail, "workloads": [], "better": []}
    out.write(json.dumps(verdict, default=str) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
