"""Verbs `propose` (the tuner model's ranked configs for a workload) and `train` (retrain from records)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
import time
from pathlib import Path

from edgetune.errors import BadInput, EdgetuneError
from edgetune.output import console, emit, fmt, json_flag, table
from kernels.registry import get_spec
from kernels.space import format_config
from kernels.workloads import resolve
from tuner.train import FOCUS_SHARE, check_focus_share

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("propose", help="the tuner model's top-K configs for a kernel workload (no measuring)")
    p.add_argument("kernel")
    p.add_argument("--workload", help="a bundled workload name")
    p.add_argument("--shape", help="a custom shape, e.g. M=196,N=576,K=96")
    p.add_argument("-k", type=int, default=5, help="how many configs (default 5)")
    p.add_argument("--isa", help="cap the ISA, e.g. x86-64-v3, or a level of another arch (e.g. armv8-a)")
    p.add_argument("--model", help="GGUF model file (default: the bundled one, or $EDGETUNE_MODEL)")
    json_flag(p)
    p.set_defaults(func=cmd_propose)

    p = sub.add_parser("train", help="retrain the tuner model from tuning records (needs the [train] extra)")
    p.add_argument("--records", action="append", required=True, metavar="PATH",
                   help="a results DB (results.db) or a JSONL export of tuning records; repeatable")
    p.add_argument("--data", action="append", metavar="PATH",
                   help="collector data to train on as well, instead of the committed journal and device records")
    p.add_argument("--no-base", action="store_true",
                   help="train on the records only (not the committed journal and device records)")
    p.add_argument("--out", help="output dir (default: <state dir>/models)")
    p.add_argument("--steps", type=int, help="training steps (default: the shipped model's recipe)")
    p.add_argument("--focus-share", type=float, default=FOCUS_SHARE, metavar="S",
                   help=f"share of the training draws given to the cases of --records, the devices the model is for "
                        f"(0 to below 1; default {FOCUS_SHARE})")
    p.add_argument("--max-minutes", type=float, default=30.0)
    json_flag(p)
    p.set_defaults(func=cmd_train)


def cmd_propose(args: argparse.Namespace) -> int:
    if args.k <= 0:
        raise BadInput(f"-k must be a positive number of configs, got {args.k}")
    if args.model and not Path(args.model).is_file():
        raise BadInput(f"--model {args.model}: no such file; give a GGUF tuner model (or leave --model out for the "
                       "bundled one)")
    from hwprobe.target import describe
    from tuner.strategies.llm import load_proposer
    from tuner.model.inference import ModelError

    spec = get_spec(args.kernel)
    wl = resolve(spec, args.workload, args.shape)
    hw = describe(args.isa)
    try:
        prop = load_proposer(Path(args.model) if args.model else None)
    except ModelError as e:  # a file the user named is bad input; a broken bundled model is a failed install
        raise (BadInput if args.model else EdgetuneError)(str(e)) from e
    space = spec.space(wl.shape, hw)
    try:
        space.valid_default()  # cheap: the nearest valid config, pruned by the constraints
    except BadInput:
        raise BadInput(f"no config of {spec.name} is valid for {wl.name} on {hw.isa} ({hw.vector_bits}-bit vectors, "
                       f"{hw.cores} cores): nothing to propose; try a higher --isa") from None
    res = prop.propose(spec.name, space, args.k)
    configs = [p.config for p in res.proposals]
    scored = prop.scorer is not None and prop.scorer.knows(spec.name)
    pred = prop.scorer.score(spec.name, hw, wl.shape, configs) if scored else [None] * len(configs)
    out = {"kernel": spec.name, "workload": wl.name, "shape": wl.shape, "isa": hw.isa,
           "model": {"path": str(prop.m.path), "version": prop.version, "sha256": prop.m.info.sha256,
                     "scorer": scored},
           "latency_ms": res.latency_ms, "expansions": res.expansions, "decodes": res.decodes,
           "proposals": [{"rank": i + 1, "config": p.config, "logprob": p.logprob, "scorer_log_slowdown": s}
                         for i, (p, s) in enumerate(zip(res.proposals, pred))]}

    def render(d: dict) -> None:
        low = min((p["scorer_log_slowdown"] for p in d["proposals"] if p["scorer_log_slowdown"] is not None),
                  default=None)
        table(f"{d['kernel']}/{d['workload']} on {d['isa']} (model {d['model']['version']}, "
              f"{d['latency_ms']:.1f} ms)", ["#", "config", "log-prob", "prob", "scorer"],
              [[p["rank"], format_config(p["config"]), fmt(p["logprob"], 3), f"{math.exp(p['logprob']):.1%}",
                "-" if low is None else f"{math.exp(p['scorer_log_slowdown'] - low):.2f}x"]
               for p in d["proposals"]])
        if low is not None:
            console.print("scorer: the model file's regression trees, predicted time over the fastest listed (`tune` "
                          "takes its first batch from the model's top 15 in the scorer's order)")

    emit(out, args.json, render)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    try:
        from tuner.train import data as D
        from tuner.train.train import Recipe, run
    except ImportError as e:
        raise EdgetuneError(f"training needs the [train] extra (torch, sentencepiece, gguf, scikit-learn): {e}; "
                            "install it with `pip install -e '.[train]'`")
    from edgetune import paths

    if args.steps is not None and args.steps < 1:
        raise BadInput(f"--steps {args.steps}: give a positive number of training steps (or leave it out)")
    if args.max_minutes <= 0:
        raise BadInput(f"--max-minutes {args.max_minutes:g}: give a positive time limit")
    check_focus_share(args.focus_share)
    for r in args.records:
        if not Path(r).is_file():
            raise BadInput(f"records file {r} not found")
        sessions, other = D.check_records(Path(r))
        if other:
            log.warning("records file %s: %d of %d JSON records are not tuning sessions; training skips them", r,
                        other, sessions + other)
    out = Path(args.out) if args.out else paths.state_dir() / "models"
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out} is a file; the model and its card go in a directory")
    data, records = D.base_sources(args.data, args.no_base)
    t = time.time()
    with contextlib.redirect_stdout(sys.stderr):  # progress goes to stderr; stdout stays the result (--json)
        mine = [Path(r) for r in args.records]
        card = run([p for p in data if p.exists()], records + mine, out,
                   Recipe(**({"steps": args.steps} if args.steps else {}), focus_share=args.focus_share),
                   deadline_s=args.max_minutes * 60, focus=mine)
    res = {"model": str(out / card["file"]), "version": card["version"], "bytes": card["bytes"],
           "heldout": card["heldout"], "seconds": round(time.time() - t, 1)}
    emit(res, args.json, lambda d: print(f"wrote {d['model']} (version {d['version']}, {d['bytes']} bytes) in "
                                         f"{d['seconds']:.0f}s; use it with EDGETUNE_MODEL={d['model']}"))
    return 0
