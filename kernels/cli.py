"""Verbs `kernels` (what is bundled) and `bench` (measure one config in place)."""

from __future__ import annotations

import argparse
from typing import Any

from edgetune.errors import BadInput
from edgetune.output import emit, fmt, fmt_ms, json_flag, progress, table
from kernels.build import build
from kernels.registry import all_specs, get_spec
from kernels.roofline import roofline_fraction
from kernels.space import config_from_json, format_config
from kernels.spec import KernelSpec, Workload
from kernels.worker import Runner
from kernels.workload_files import select_targets
from kernels.workloads import resolve


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels", help="list bundled kernels, workloads, knobs and space sizes")
    json_flag(p)
    p.add_argument("--isa", help="cap the ISA (space sizes depend on vector width), or a level of another arch "
                                 "(e.g. armv8-a, armv7-a+neon) for a generic 4-core device of that level")
    p.set_defaults(func=cmd_kernels)

    p = sub.add_parser("bench", help="measure one config of a kernel on a workload, in place")
    p.add_argument("kernel", nargs="?", help="kernel name (see `edgetune kernels`)")
    p.add_argument("--workload", help="workload name: bundled, or from --workloads")
    p.add_argument("--shape", help="custom shape, e.g. M=196,N=576,K=96 (see `edgetune kernels`)")
    p.add_argument("--workloads", action="append", metavar="FILE",
                   help="a workloads file (e.g. from `edgetune workloads import`): bench its workloads, or the one "
                        "--workload names; repeatable")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--config", help='JSON object of knobs, e.g. \'{"vec": 8, "threads": 2}\'; missing knobs take defaults')
    g.add_argument("--default", action="store_true", help="the kernel's default config (the default)")
    p.add_argument("--all", action="store_true", help="every bundled kernel and workload (default config)")
    p.add_argument("--ort", action="store_true", help="also time the onnxruntime twin")
    p.add_argument("--isa", help="cap the ISA, e.g. x86-64-v3")
    json_flag(p)
    p.set_defaults(func=cmd_bench)


def _hw(isa: str | None, bandwidth: bool = False) -> Any:
    from hwprobe import probe

    return probe(isa_cap=isa, measure_bandwidth=bandwidth)


def cmd_kernels(args: argparse.Namespace) -> int:
    from hwprobe.target import describe

    hw = describe(args.isa)
    specs = list(all_specs().values())
    out = []
    with progress(not args.json) as bar:  # counting the valid configs enumerates each space: seconds
        task = bar.add_task("counting valid configs", total=sum(len(s.workloads) for s in specs)) if bar else None

        def size(spec: KernelSpec, w: Workload) -> int:
            n = spec.space(w.shape, hw).size()
            if bar and task is not None:
                bar.advance(task)
            return n

        for spec in specs:
            out.append({
                "name": spec.name, "domain": spec.domain, "summary": spec.summary,
                "shape": [{"name": d.name, "help": d.help, **({"choices": list(d.choices)} if d.choices else {})}
                          for d in spec.dims],
                "knobs": {p.name: list(p.values) for p in spec.params},
                "default": spec.default,
                "workloads": [{"name": w.name, "shape": w.shape, "source": w.source, "space_size": size(spec, w)}
                              for w in spec.workloads],
            })

    def render(rows: list[dict]) -> None:
        # the counts depend on the device (vector width, registers, cores): say which one, above all for --isa armv8-a
        title = f"bundled kernels: valid configs on {hw.cpu_model} ({hw.isa}, {hw.cores} cores)"
        table(title, ["kernel", "domain", "shape (--shape)", "knobs", "workloads (valid configs)"], [
            [k["name"], k["domain"], ",".join(d["name"] + "=" for d in k["shape"]),
             "\n".join(f"{n}: {' '.join(map(str, v))}" for n, v in k["knobs"].items()),
             "\n".join(f"{w['name']} ({w['space_size']})" for w in k["workloads"])]
            for k in rows])

    emit(out, args.json, render)
    return 0


def bench_one(spec: KernelSpec, wl: Workload, cfg: dict, hw: Any, runner: Runner, with_ort: bool) -> dict:
    """Build, check and time one config; optionally the ORT twin on the same inputs."""
    m = runner.measure(spec, wl.shape, build(spec, cfg, hw, shape=wl.shape).path)
    row: dict[str, Any] = {
        "kernel": spec.name, "workload": wl.name, "shape": wl.shape, "config": cfg, "ms": m.ms, "cv": m.cv,
        "reps_used": m.reps_used, "reps": m.reps, "ok": m.ok, "reason": m.reason, "max_abs_err": m.max_abs_err,
        "load1": m.load1, "gflops": None, "roofline": None,
    }
    if m.ok:
        row["gflops"] = spec.flops(wl.shape) / (m.ms * 1e6)
        row["roofline"] = roofline_fraction(row["gflops"], spec.flops(wl.shape), spec.bytes_moved(wl.shape),
                                            int(cfg.get("threads", 1)), hw)
    if with_ort:
        r = runner.time_twin(spec, wl.shape, threads=hw.cores)
        row["ort_ms"], row["ort_reason"] = r.ms, r.reason or None  # the twin's failure is shown, not raised
        row["ort_ratio"] = (m.ms / r.ms) if m.ok and r.ok else None
    return row


def _check_all(args: argparse.Namespace) -> None:
    """--all benches every bundled workload: a kernel, --workload, --shape or --workloads beside it would be
    silently ignored, and the user would read rows for what they did not ask."""
    given = [f"{flag}{value}" for flag, value in (("", args.kernel), ("--workload ", args.workload),
                                                   ("--shape ", args.shape)) if value]
    given += [f"--workloads {f}" for f in args.workloads or ()]
    if given:
        raise BadInput(f"--all benches every bundled workload; drop {', '.join(given)} (or drop --all)")


def bench_targets(args: argparse.Namespace) -> list[tuple[KernelSpec, Workload]]:
    """--all: every bundled workload; --workloads: a file's (narrowed by the kernel and --workload); else one."""
    if args.all:
        _check_all(args)
        return [(s, w) for s in all_specs().values() for w in s.workloads]
    if args.workloads:
        return select_targets([args.kernel] if args.kernel else None, [args.workload] if args.workload else None,
                              args.shape, args.workloads, verb="bench")
    if not args.kernel:
        raise BadInput("name a kernel (see `edgetune kernels`), or pass --workloads FILE or --all")
    spec = get_spec(args.kernel)
    return [(spec, resolve(spec, args.workload, args.shape))]


def cmd_bench(args: argparse.Namespace) -> int:
    targets = bench_targets(args)
    hw = _hw(args.isa, bandwidth=True)
    rows = []
    with Runner() as runner, progress(not args.json) as bar:
        task = bar.add_task("bench", total=len(targets)) if bar else None
        for spec, wl in targets:
            space = spec.space(wl.shape, hw)
            cfg = space.validate(config_from_json(args.config, "--config")) if args.config else space.valid_default()
            if bar:
                bar.update(task, description=f"{spec.name}/{wl.name}")
            rows.append(bench_one(spec, wl, cfg, hw, runner, args.ort))
            if bar:
                bar.advance(task)

    def render(rs: list[dict]) -> None:
        table(None, ["kernel", "workload", "config", "ms", "cv", "reps", "ok", "max_abs_err"]
              + (["ort_ms", "ms/ort"] if args.ort else []) + ["GFLOP/s", "roofline"], [
            [r["kernel"], r["workload"], format_config(r["config"]), fmt_ms(r["ms"]), fmt(r["cv"], 3),
             r["reps_used"], "yes" if r["ok"] else f"NO: {r['reason']}",
             "-" if r["max_abs_err"] is None else f"{r['max_abs_err']:.2g}"]
            + ([fmt_ms(r["ort_ms"]) if r["ort_reason"] is None else f"NO: {r['ort_reason']}", fmt(r["ort_ratio"], 2)]
               if args.ort else [])
            + [fmt(r["gflops"], 2), fmt(r["roofline"], 2)] for r in rs])

    many = args.all or bool(args.workloads)
    emit(rows if many else rows[0], args.json, lambda d: render(d if many else [d]))
    return 0 if all(r["ok"] for r in rows) else 1
