"""edgetune's kernels against the runtimes a device already ships, measured fairly, side by side in one run.

    python bench/kernels_vs_peers.py [--kernels gemm,conv1d] [--workloads NAME,...] [--threads 1,2] [--rounds 7]
                                     [--tune-evals 60 | --tuned-from results.db] [--bias] [--act relu] [--json FILE]

For every bundled workload at each thread count: edgetune's default config and its best tuned config (threads
pinned), onnxruntime's op in its native layout timed by ORT's profiler (with and without its NCHWc reorder nodes),
XNNPACK through LiteRT on a one-op .tflite model, numpy/OpenBLAS for gemm and torch.stft for log-mel. Every peer's
output is checked against the spec's reference before it is timed. Contenders are measured in interleaved rounds
(a fresh shuffled order per round); a contender's time is its median over rounds, and tuned/best-peer is the median
of the same-round ratios, against the peer with the lowest median. The best peer is chosen among ORT without
reorders (a layer inside an NCHWc network pays no reorder), XNNPACK and torch; numpy is a sanity line.

This is the figure to quote for edgetune against its peers (`edgetune report`'s ORT twin is a correctness oracle).
The long tune is cached in the build cache's peerbench/ (`--tune-evals 0` skips it: tuned is then the default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cli_args import at_least, output_file, positive  # noqa: E402
from bench.peers import ort_native, tflite_xnnpack, torch_logmel  # noqa: E402
from bench.peers.cases import ACTIVATIONS, Epilogue, PeerCase, fuses_epilogue, make_case  # noqa: E402
from bench.peers.edgetune_kernels import (EdgetunePeer, LongTune, Tuned, default_config,  # noqa: E402
                                          from_results_db, pinned_spec)
from bench.peers.numpy_blas import NumpyPeer, NumpyProcess  # noqa: E402
from edgetune.errors import BadInput  # noqa: E402
from edgetune.output import console, fmt, progress, table  # noqa: E402
from fleet.store import geomean  # noqa: E402
from kernels.build import CompileError  # noqa: E402
from kernels.space import config_key  # noqa: E402
from kernels.registry import all_specs  # noqa: E402
from kernels.spec import KernelSpec, Workload  # noqa: E402
from tuner.evaluate import Measured, interleave_plan, median_time, same_round_ratio  # noqa: E402

DEFAULT, TUNED = "edgetune default", "edgetune tuned"
BEST_PEER_CANDIDATES = ("ORT -reorder", "XNNPACK", "torch")
COLUMNS = (DEFAULT, TUNED, "ORT", "ORT -reorder", "XNNPACK", "numpy", "torch")


@dataclass
class Row:
    kernel: str
    workload: str
    domain: str
    threads: int
    ms: dict[str, float | None] = field(default_factory=dict)  # median over rounds
    rounds: dict[str, list[float | None]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # why a contender has no time
    copies: dict[str, int] = field(default_factory=dict)  # R of a peer's R-copy graph
    configs: dict[str, Any] = field(default_factory=dict)
    tuned_source: str = ""
    best_peer: str | None = None
    tuned_vs_best: float | None = None
    default_vs_best: float | None = None
    load1: float = 0.0

    @property
    def vision_or_conv1d(self) -> bool:
        return self.domain == "vision" or self.kernel == "conv1d"


def _edgetune(spec: KernelSpec, wl: Workload, threads: int, hw: Any, runner: Any, tuned_of: Any, row: Row,
              min_time_s: float, act: str) -> list[Any]:
    pinned = pinned_spec(spec, threads)
    default, why = default_config(pinned, wl, hw)
    if default is None:
        row.notes[DEFAULT] = row.notes[TUNED] = f"no config runs on {threads} threads: {why}"
        return []
    tuned = tuned_of(pinned, wl, threads) or Tuned(default, "the default (no tuned config)")
    row.configs, row.tuned_source = {DEFAULT: default, TUNED: tuned.config}, tuned.source
    ev = Measured(spec=spec, shape=wl.shape, hw=hw, runner=runner, min_time_s=min_time_s, max_reps=15, timeout_s=30,
                  act=act)
    ev.evaluate([], prebuild=[default, tuned.config])  # both built in one parallel batch, before any timing
    # a tune that kept the default times it once for both names: two series of one build would differ by noise alone
    same = config_key(default) == config_key(tuned.config)
    out = []
    for names, cfg in ([((DEFAULT, TUNED), default)] if same else [((DEFAULT,), default), ((TUNED,), tuned.config)]):
        b = ev.builds[config_key(cfg)]
        if isinstance(b, CompileError):
            row.notes.update({n: f"compile error: {b}" for n in names})
        else:
            out.append(EdgetunePeer(names, ev, cfg))
    return out


def _peers(case: PeerCase, threads: int, numpy_proc: NumpyProcess | None, row: Row, min_time_s: float) -> list[Any]:
    """The peers that run this op, each checked against the reference; the others get a note saying why not."""
    kernel, out = case.spec.name, []

    def add(names: tuple[str, ...], make: Any) -> None:
        try:
            peer = make()
        except Exception as e:  # a peer that cannot build or run this op is a finding, not a crash of the bench
            peer, error = None, f"failed: {type(e).__name__}: {e}"
        else:
            error = peer.error and f"WRONG, not timed: {peer.error}"
        if error:
            row.notes.update({n: error for n in names})
            return
        row.copies.update({n: peer.copies for n in names if getattr(peer, "copies", 1) > 1})
        out.append(peer)

    add(("ORT", "ORT -reorder"), lambda: ort_native.OrtPeer(case, threads, min_time_s))
    if kernel in tflite_xnnpack.NO_XNNPACK:
        row.notes["XNNPACK"] = "skipped: " + tflite_xnnpack.NO_XNNPACK[kernel]
    elif tflite_xnnpack.available():
        row.notes["XNNPACK"] = "skipped: " + tflite_xnnpack.available()
    else:
        add(("XNNPACK",), lambda: tflite_xnnpack.TflitePeer(case, threads, min_time_s))
    if kernel == "gemm" and numpy_proc:
        add(("numpy",), lambda: NumpyPeer(case, threads, numpy_proc, min_time_s))
    if kernel == "logmel":
        if torch_logmel.available():
            row.notes["torch"] = "skipped: " + torch_logmel.available()
        else:
            add(("torch",), lambda: torch_logmel.TorchPeer(case, threads, min_time_s))
    return out


def _score(row: Row) -> None:
    """Medians, the best peer by median, and the same-round ratios to it."""
    row.ms = {n: median_time(t) for n, t in row.rounds.items()}
    peers = {n: row.ms[n] for n in BEST_PEER_CANDIDATES if row.ms.get(n)}
    if not peers:
        return
    row.best_peer = min(peers, key=peers.get)
    best = row.rounds[row.best_peer]
    row.tuned_vs_best = same_round_ratio(row.rounds.get(TUNED, []), best)
    row.default_vs_best = same_round_ratio(row.rounds.get(DEFAULT, []), best)


def bench_row(spec: KernelSpec, wl: Workload, threads: int, ctx: "Context", bar: Any, task: Any) -> Row:
    row = Row(spec.name, wl.name, spec.domain, threads)
    case = make_case(spec, wl, ctx.epilogue)
    contenders = _edgetune(spec, wl, threads, ctx.hw, ctx.runner, ctx.tuned_of, row,
                           ctx.min_time_s, case.epilogue.act)
    contenders += _peers(case, threads, ctx.numpy_proc, row, ctx.min_time_s)
    for pos, j in enumerate(interleave_plan(len(contenders), ctx.rounds, seed=ctx.seed)):
        contenders[j].sample()
        if bar:
            r = pos // len(contenders)
            bar.update(task, description=f"{spec.name}/{wl.name} {threads}T round {r + 1}/{ctx.rounds}")
    for c in contenders:
        row.rounds.update(c.series())
        if isinstance(c, EdgetunePeer) and c.error:  # a config that failed while timed
            row.notes.update({n: c.error for n in c.names})
    _score(row)
    row.load1 = os.getloadavg()[0]
    return row


@dataclass
class Context:
    hw: Any
    runner: Any
    numpy_proc: NumpyProcess | None
    tuned_of: Any  # (pinned spec, workload, threads) -> Tuned | None
    epilogue: Epilogue
    rounds: int
    seed: int
    min_time_s: float


def _csv(values: list[str] | None) -> list[str] | None:
    return [v for s in values for v in s.split(",") if v] if values else None


def targets(kernels: list[str] | None, workloads: list[str] | None) -> list[tuple[KernelSpec, Workload]]:
    specs = all_specs()
    bad = [k for k in kernels or [] if k not in specs]
    if bad:
        raise BadInput(f"unknown kernel(s) {', '.join(bad)}; kernels: {', '.join(specs)}")
    out = [(s, w) for s in specs.values() if not kernels or s.name in kernels
           for w in s.workloads if not workloads or w.name in workloads]
    known = {w.name for s in specs.values() for w in s.workloads}
    missing = [w for w in workloads or [] if w not in known]
    if missing:
        raise BadInput(f"unknown workload(s) {', '.join(missing)}; `edgetune kernels` lists them")
    if not out:
        raise BadInput("the --kernels/--workloads filters matched no workload")
    return out


def _tuned_source(args: argparse.Namespace, runner: Any, hw: Any, bar: Any) -> Any:
    if args.tuned_from:
        path = Path(args.tuned_from)
        return lambda spec, wl, threads: from_results_db(path, spec, wl, threads, hw)
    if args.tune_evals <= 0:
        return lambda spec, wl, threads: None
    tune = LongTune(runner, hw, args.tune_evals, args.seed)

    def tuned(spec: KernelSpec, wl: Workload, threads: int) -> Tuned:
        task = bar.add_task(f"  tune {spec.name}/{wl.name} {threads}T", total=args.tune_evals) if bar else None

        def tick(done: int, total: int, msg: str) -> None:
            if bar:
                bar.update(task, completed=done, description=f"  tune {threads}T {msg}")

        try:
            return tune(spec, wl, threads, tick)
        finally:
            if bar:
                bar.remove_task(task)

    return tuned


def _cell(row: Row, name: str) -> str:
    if row.ms.get(name) is None:
        note = row.notes.get(name, "")
        return "WRONG" if note.startswith("WRONG") else "n/a" if not note or note.startswith(("no ", "skipped")) \
            else "fail"
    return _ms(row.ms[name]) + (f" x{row.copies[name]}" if name in row.copies else "")


def _ms(ms: float) -> str:
    """4 significant digits: a sub-microsecond kernel (gemm kws_dscnn.fc) keeps its digits, not 0.0001."""
    return np.format_float_positional(ms, precision=4, unique=False, fractional=False, trim="-")


def render(rows: list[Row], threads: list[int], header: list[str], footer: list[str]) -> None:
    for line in header:
        console.print(line, highlight=False)
    for t in threads:
        rs = [r for r in rows if r.threads == t]
        table(f"ms per call, {t} thread{'s' if t > 1 else ''} (xR: timed as a graph of R copies)",
              ["kernel/workload", *COLUMNS, "best peer", "tuned/best", "default/best"],
              [[f"{r.kernel}/{r.workload}", *(_cell(r, c) for c in COLUMNS), r.best_peer or "-",
                fmt(r.tuned_vs_best, 2), fmt(r.default_vs_best, 2)] for r in rs])
    by = {(r.kernel, r.workload, r.threads): r for r in rows}
    names = list(dict.fromkeys((r.kernel, r.workload) for r in rows))
    summary = [[f"{k}/{w}", *(x for t in threads for x in (
        by[(k, w, t)].best_peer or "-", fmt(by[(k, w, t)].tuned_vs_best, 2)))] for k, w in names]
    for label, keep in (("geomean, vision + conv1d", lambda r: r.vision_or_conv1d), ("geomean, all", lambda r: True)):
        summary.append([label, *(x for t in threads for x in (
            f"{sum(1 for r in rows if r.threads == t and keep(r) and r.tuned_vs_best)} rows",
            fmt(geomean([r.tuned_vs_best for r in rows if r.threads == t and keep(r)]), 2)))])
    table("tuned / best peer (median of same-round ratios; < 1 means edgetune is faster)",
          ["kernel/workload", *(x for t in threads for x in (f"best peer {t}T", f"tuned/best {t}T"))], summary)
    per_kernel = {f"{r.kernel} {n}: {why}" for r in rows for n, why in r.notes.items() if why.startswith("skipped")}
    per_row = [f"{r.kernel}/{r.workload} {r.threads}T {n}: {why}" for r in rows for n, why in r.notes.items()
               if not why.startswith("skipped") and not (n == TUNED and why == r.notes.get(DEFAULT))]
    ops = [f"{k}: ORT {ort_native.OP_NAMES[k]}" + (f", XNNPACK {tflite_xnnpack.OP_NAMES[k]}"
                                                   if k in tflite_xnnpack.OP_NAMES else "")
           for k in dict.fromkeys(r.kernel for r in rows)]
    notes = [f"peer ops: {'; '.join(ops)}", *sorted(per_kernel), *per_row]
    sources = sorted({r.tuned_source for r in rows if r.tuned_source})
    for line in [*(f"note: {n}" for n in notes), *(f"tuned config: {s}" for s in sources), *footer]:
        console.print(line, highlight=False)


def _versions(numpy_proc: NumpyProcess | None) -> dict[str, str]:
    import onnxruntime

    out = {"onnxruntime": onnxruntime.__version__}
    try:
        from importlib.metadata import version

        out["ai-edge-litert"] = version("ai-edge-litert")
    except Exception:
        out["ai-edge-litert"] = "not installed"
    if numpy_proc:
        out["numpy"] = numpy_proc.describe()
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kernels", action="append", help="kernels to bench, comma-separated (default: all)")
    ap.add_argument("--workloads", action="append", help="workloads to bench, comma-separated (default: all)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default: 1,2)")
    ap.add_argument("--rounds", type=at_least(1), default=7, help="interleaved rounds per row (default: 7)")
    ap.add_argument("--tune-evals", type=at_least(0), default=60,
                    help="evals of the long tune per workload and thread count, cached (0: tuned = default)")
    ap.add_argument("--tuned-from", metavar="RESULTS_DB", help="take the tuned configs from a prior `edgetune tune`'s "
                    "results.db (its active configs, threads set to each row's count) instead of tuning")
    ap.add_argument("--bias", action="store_true", help="peers add a bias vector (a fused epilogue)")
    ap.add_argument("--act", default="none", choices=ACTIVATIONS, help="peers' fused activation (default: none)")
    ap.add_argument("--min-time", type=positive, default=0.02, help="seconds each contender runs per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", type=output_file,
                    help="also write every round's times and the ratios to FILE")


def _parse_lists(args: argparse.Namespace) -> None:
    """--threads as a list of counts and the filters as lists, refused by name (exit 2) before anything runs."""
    text = args.threads
    try:
        args.threads = [int(t) for t in text.split(",")]
    except ValueError:
        raise BadInput(f"--threads {text!r} must be comma-separated integers, e.g. 1,2")
    if any(t < 1 for t in args.threads):
        raise BadInput(f"--threads {text!r}: every thread count must be at least 1, e.g. 1,2")
    args.kernels, args.workloads = _csv(args.kernels), _csv(args.workloads)


def run(args: argparse.Namespace) -> int:
    from hwprobe import probe
    from kernels.worker import Runner

    _parse_lists(args)
    todo = targets(args.kernels, args.workloads)
    hw = probe(measure_bandwidth=False)
    epilogue = Epilogue(args.bias, args.act)
    load0 = os.getloadavg()
    rows: list[Row] = []
    with Runner() as runner, _numpy_process(todo) as numpy_proc, progress(True) as bar:
        ctx = Context(hw, runner, numpy_proc, _tuned_source(args, runner, hw, bar), epilogue, args.rounds, args.seed,
                      args.min_time)
        task = bar.add_task("bench", total=len(todo) * len(args.threads)) if bar else None
        for spec, wl in todo:
            for t in args.threads:
                rows.append(bench_row(spec, wl, t, ctx, bar, task))
                if bar:
                    bar.advance(task)
        versions = _versions(numpy_proc)
    load1 = os.getloadavg()
    header = [f"# {hw.cpu_model}, {hw.isa}, {hw.cores} cores; load 1/5/15 min before {_load(load0)}",
              f"# peers: {', '.join(f'{k} {v}' for k, v in versions.items())}; epilogue {epilogue.label}"
              + _epilogue_note(epilogue, [s for s, _ in todo]),
              f"# {args.rounds} interleaved rounds, {args.min_time * 1e3:.0f} ms per contender per round"]
    render(rows, args.threads, header, [f"# load 1/5/15 min after {_load(load1)}"])
    if args.json:
        doc = {"machine": {"cpu": hw.cpu_model, "isa": hw.isa, "cores": hw.cores}, "versions": versions,
               "load": {"before": load0, "after": load1}, "epilogue": epilogue.label, "rounds": args.rounds,
               "rows": [r.__dict__ for r in rows],
               "geomean": {f"{t}T": {"vision+conv1d": geomean([r.tuned_vs_best for r in rows
                                                                if r.threads == t and r.vision_or_conv1d]),
                                     "all": geomean([r.tuned_vs_best for r in rows if r.threads == t])}
                           for t in args.threads}}
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str))
    return 0


def _epilogue_note(epilogue: Epilogue, specs: list[KernelSpec]) -> str:
    fused = sorted({s.name for s in specs if fuses_epilogue(s)})
    if fused:
        return f" (the bias is the kernel's own input for {', '.join(fused)}, where edgetune runs the epilogue too)"
    return "" if epilogue.label == "none" else " (peers only: edgetune's kernels take none yet)"


def _numpy_process(todo: list[tuple[KernelSpec, Workload]]) -> Any:
    """The numpy child when gemm is benched and it can start (it needs threadpoolctl to set its threads)."""
    if not any(s.name == "gemm" for s, _ in todo):
        return nullcontext()
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        print("note: numpy is not timed: threadpoolctl is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return nullcontext()
    return NumpyProcess()


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


def main(argv: list[str] | None = None) -> int:
    from edgetune.main import run_module

    return run_module("python bench/kernels_vs_peers.py", __doc__.split("\n\n")[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
