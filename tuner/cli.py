"""Verbs `tune`, `report`, `pin`, `unpin`, `forget`, `verify`, `export`: tune, inspect and consume the active
configs."""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
from pathlib import Path
from typing import Any

from edgetune.atomic import write_output
from edgetune.config import config_files, load_or_raise
from edgetune.errors import BadInput, EdgetuneError
from hwprobe.compiler import CompilerMissing
from hwprobe.power import meter_from_config
from edgetune.output import console, emit, fmt, fmt_ms, json_flag, progress, say, table
from kernels.measure import TIE_THRESHOLD
from kernels.registry import get_spec
from kernels.space import config_from_json, format_config
from kernels.spec import KernelSpec, Workload
from kernels.worker import Runner
from kernels.workload_files import select_targets
from kernels.workloads import custom_workload, resolve
from tuner import active
from tuner.db import ResultsDB
from tuner.evaluate import Measured
from tuner.export import to_c_header
from tuner.objective import OBJECTIVES, Objective
from tuner.session import Budget, Session
from tuner.strategies import DEFAULT_STRATEGY, STRATEGIES, check_strategy
from tuner.strategies.llm import FALLBACK_SUFFIX

TWIN_NOTE = ("ORT twin ms: one sess.run of the kernel's ONNX twin (kernels/ort_twin.py), wall time from Python on all "
             "cores, right after tuning. The twin reads the kernel's layout, so it includes NHWC<->NCHW and weight "
             "transposes, weights fed as inputs and the call overhead: it is the correctness oracle, not a fair "
             "speed peer. For edgetune against onnxruntime and XNNPACK, quote bench/kernels_vs_peers.py.")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="tune kernels on this device (default: every bundled kernel and workload)")
    p.add_argument("--kernel", action="append", help="kernel to tune (repeatable)")
    p.add_argument("--workload", action="append", help="workload to tune (repeatable)")
    p.add_argument("--shape", help="a custom shape for --kernel, e.g. M=196,N=576,K=96")
    p.add_argument("--workloads", action="append", metavar="FILE",
                   help="a workloads file (TOML, e.g. from `edgetune workloads import`); repeatable")
    p.add_argument("--strategy", default=DEFAULT_STRATEGY, help=f"one of: {', '.join(STRATEGIES)}")
    p.add_argument("--budget", type=int,
                   help=f"evaluations per workload, spent whole (default: up to {Budget.evals}, stopping when the "
                        "strategy has converged; llm converges in about 7-9)")
    p.add_argument("--seconds", type=float, help="max tuning seconds per workload")
    p.add_argument("--seed", type=int, default=0, help="the search's random seed (a rerun with it repeats its choices)")
    p.add_argument("--force", action="store_true", help="retune even if this key is already tuned")
    p.add_argument("--isa", help="cap the ISA, e.g. x86-64-v3")
    p.add_argument("--objective", choices=OBJECTIVES,
                   help="what to minimise (default: the config's tuning.objective, else latency); "
                        "energy and edp read the [power] meter from the config")
    p.add_argument("--config", help="config file (default: /etc/edgetune/edgetune.toml + conf.d/)")
    p.add_argument("--reset", action="store_true", help="move a corrupt results DB aside first (never deletes)")
    json_flag(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("report", help="the active configs: default vs tuned, and the ONNX twin's time")
    p.add_argument("--reset", action="store_true", help="move a corrupt results DB aside first (never deletes)")
    json_flag(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("pin", help="pin a config for a kernel/workload; a pin wins over tuning")
    p.add_argument("kernel")
    p.add_argument("workload", help="workload name, or a custom shape like M=100,N=200,K=300")
    p.add_argument("config", help='JSON object of knobs, e.g. \'{"vec": 8}\' (missing knobs take defaults)')
    p.add_argument("--isa", help="build for a capped ISA, e.g. x86-64-v3 (default: this CPU's)")
    json_flag(p)
    p.set_defaults(func=cmd_pin)

    p = sub.add_parser("unpin", help="drop pins (all, or one kernel/workload)")
    p.add_argument("kernel", nargs="?", help="only this kernel's pins")
    p.add_argument("workload", nargs="?", help="only this workload's pin: its name, or a custom shape as given to pin")
    json_flag(p)
    p.set_defaults(func=cmd_unpin)

    p = sub.add_parser("forget", help="drop one kernel/workload from the active configs (pin included); "
                                      "its measurements stay")
    p.add_argument("kernel")
    p.add_argument("workload", help="workload name, or a custom shape as given to tune/pin")
    json_flag(p)
    p.set_defaults(func=cmd_forget)

    p = sub.add_parser("verify", help="re-measure active configs and report drift beyond the noise threshold "
                                      "(exit 1 when one got slower or failed)")
    p.add_argument("--kernel", help="only this kernel's active configs")
    p.add_argument("--workload", help="only this workload's (bundled, imported or custom.* name)")
    p.add_argument("--shape", help="only this custom shape of --kernel, e.g. M=196,N=576,K=96")
    p.add_argument("--threshold", type=float, default=0.10, help="relative drift that counts (default 0.10)")
    p.add_argument("--isa", help="measure under a capped ISA, e.g. x86-64-v3 (default: this CPU's)")
    json_flag(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("export", help="export active configs as JSON or a C header for firmware builds, or every "
                                      "ended tuning session as records for training")
    p.add_argument("--format", choices=["json", "c-header", "records"], default="json",
                   help="records: one JSON line per ended tuning session with its measurements and this device's "
                        "descriptor (what `edgetune train --records` reads on any machine)")
    p.add_argument("-o", "--output", help="file to write (default: stdout; records to a .gz name are gzipped)")
    json_flag(p)
    p.set_defaults(func=cmd_export)

    from tuner.model.cli import register as register_model  # verbs `propose` and `train`

    register_model(sub)


def _hw(isa: str | None) -> Any:
    from hwprobe import probe

    return probe(isa_cap=isa, measure_bandwidth=False)


def open_db(reset: bool = False) -> ResultsDB:
    if reset:
        aside = ResultsDB.reset()
        say(f"moved the old results DB aside to {aside}" if aside else
            "--reset: the results DB is healthy (or absent); nothing moved", err=True)
    return ResultsDB()


def cmd_tune(args: argparse.Namespace) -> int:
    if args.budget is not None and args.budget <= 0:
        raise BadInput(f"--budget must be a positive number of evaluations, got {args.budget}")
    if args.seconds is not None and args.seconds <= 0:
        raise BadInput(f"--seconds must be positive, got {args.seconds}")
    check_strategy(args.strategy)
    targets = select_targets(args.kernel, args.workload, args.shape, args.workloads, verb="tune")
    hw = _hw(args.isa)
    db = open_db(args.reset)
    results, failures = [], []
    # the config matters only for the objective: read it when asked for energy/edp, or when one exists to say so
    cfg = load_or_raise(args.config) if args.objective != "latency" and (args.objective or config_files(args.config)) \
        else None
    objective_name = args.objective or (cfg.tuning.objective if cfg else "latency")
    meter = meter_from_config(cfg.power) if cfg and objective_name != "latency" else None
    if meter:
        meter.start()
    budget = Budget(seconds=args.seconds) if args.budget is None else Budget.whole(args.budget, args.seconds)
    try:
        _tune_targets(args, targets, hw, db, budget, Objective.create(objective_name, meter), results, failures)
    finally:  # the meter's reader thread ends with the verb, an error or ^C included
        if meter:
            meter.stop()
    emit({"results": results, "failures": failures}, args.json, _render_tuned)
    return 1 if failures else 0


def _tune_targets(args: argparse.Namespace, targets: list, hw: Any, db: Any, budget: Budget, objective: Objective,
                  results: list[dict], failures: list[dict]) -> None:
    """Tune each target in turn under one progress display, appending to `results` and `failures` as they end (so
    the caller has what finished when one raises)."""
    with Runner() as runner, progress(not args.json) as bar:
        session = Session(db, runner, hw)
        overall = bar.add_task("tuning", total=len(targets)) if bar else None
        for spec, wl in targets:
            task = bar.add_task(f"  {spec.name}/{wl.name}", total=budget.evals) if bar else None

            def tick(done: int, total: int, msg: str, task: Any = task) -> None:
                if bar:
                    bar.update(task, completed=done, description=f"  {msg}")

            try:
                res = session.tune(spec, wl, strategy=args.strategy, seed=args.seed, force=args.force,
                                   budget=budget, progress=tick,
                                   objective=objective)
                results.append(res.to_dict())
            except CompilerMissing:
                raise  # no workload can build: one error, not one per workload
            except EdgetuneError as e:
                if e.exit_code == 2:
                    raise
                failures.append({"kernel": spec.name, "workload": wl.name, "error": str(e)})
            except KeyboardInterrupt:
                say(f"interrupted during {spec.name}/{wl.name}; {len(results)} workload(s) finished before it. "
                    "Its measurements are kept: the same command resumes it.", err=True)
                raise
            if bar:
                bar.update(task, completed=budget.evals)
                bar.advance(overall)


def _render_tuned(d: dict) -> None:
    energy = any(r["energy_j"] for r in d["results"])
    table("tuned", ["kernel", "workload", "best config", "ms", "default ms", "speedup"]
          + (["uJ/call", "default uJ/call"] if energy else []) + ["evals", "tuning s", "strategy"], [
        [r["kernel"], r["workload"], format_config(r["config"]), fmt_ms(r["ms"]), fmt_ms(r["default_ms"]),
         fmt(r["speedup"], 2) + ("x" if r["speedup"] else "")]
        + ([fmt(r["energy_j"] and r["energy_j"] * 1e6, 2), fmt(r["default_energy_j"] and r["default_energy_j"] * 1e6, 2)]
           if energy else [])
        + [r["evals"], fmt(r["tuning_s"], 1) + (" (cached)" if r["cached"] else ""),
           strategy_label(r) + (f" ({r['objective']})" if r["objective"] != "latency" else "")]
        for r in d["results"]])
    fresh = [r for r in d["results"] if not r["cached"] and r.get("timing")]
    if fresh:
        t = {k: sum(r["timing"].get(k, 0.0) for r in fresh) for k in ("compile_s", "measure_s", "strategy_s")}
        console.print(f"tuning time {sum(r['tuning_s'] for r in fresh):.1f}s: compile {t['compile_s']:.1f}s, "
                      f"measure {t['measure_s']:.1f}s, strategy {t['strategy_s']:.2f}s (the rest: results DB "
                      "and start-up)")
    for r in d["results"]:
        if r["objective_note"]:
            say(f"{r['kernel']}/{r['workload']}: ranked by latency: {r['objective_note']}", err=True)
    for f in d["failures"]:
        say(f"{f['kernel']}/{f['workload']}: {f['error']}", "failed", "red", err=True)


def strategy_label(r: dict) -> str:
    """What searched: an llm session whose model could not load ran anneal, and the table says so."""
    fell_back = (r.get("strategy_version") or "").endswith(FALLBACK_SUFFIX)
    return r["strategy"] + (" (fell back to anneal: no usable model)" if fell_back else "")


def _when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def report_rows(db: ResultsDB) -> list[dict]:
    rows = []
    for slot, e in db.active().items():
        kernel, workload = slot.split("/", 1)
        rows.append({"kernel": kernel, "workload": workload, "config": e["config"], "default_ms": e.get("default_ms"),
                     "tuned_ms": e.get("ms"), "speedup": e.get("speedup"), "ort_ms": e.get("ort_ms"),
                     "tuned_vs_ort": (e["ms"] / e["ort_ms"]) if e.get("ms") and e.get("ort_ms") else None,
                     "evals": e.get("evals"), "strategy": e.get("strategy"),
                     "strategy_version": e.get("strategy_version"), "tuned_at": e.get("tuned_at"),
                     "pinned": e.get("pinned", False)})
    return rows


def cmd_report(args: argparse.Namespace) -> int:
    rows = report_rows(open_db(args.reset))

    def render(rs: list[dict]) -> None:
        if not rs:
            print("nothing tuned yet: run `edgetune tune`")
            return
        table("active configs", ["kernel", "workload", "default ms", "tuned ms", "speedup", "ORT twin ms",
                                 "tuned/twin", "evals", "strategy", "tuned_at"], [
            [r["kernel"], r["workload"] + (" (pinned)" if r["pinned"] else ""), fmt_ms(r["default_ms"]),
             fmt_ms(r["tuned_ms"]), fmt(r["speedup"], 2), fmt_ms(r["ort_ms"]), fmt(r["tuned_vs_ort"], 2),
             r["evals"], strategy_label(r), _when(r["tuned_at"])] for r in rs])
        console.print(TWIN_NOTE, highlight=False)

    emit(rows, args.json, render)
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    spec = get_spec(args.kernel)
    db = ResultsDB()
    wl = resolve(spec, None, args.workload) if "=" in args.workload \
        else active_workload(spec, args.workload, db.active_entry(spec.name, args.workload))
    hw = _hw(args.isa)
    cfg = spec.space(wl.shape, hw).validate(config_from_json(args.config, "config"))
    with Runner() as runner:
        m = Measured(spec=spec, shape=wl.shape, hw=hw, runner=runner).evaluate([cfg])[0]
    if not m.ok:
        raise EdgetuneError(f"pinned config fails on this device: {m.reason}")
    active.pin(db, spec, wl, cfg, m, hw)
    out = {"kernel": spec.name, "workload": wl.name, "config": cfg, "ms": m.ms}
    emit(out, args.json, lambda d: print(f"pinned {d['kernel']}/{d['workload']}: {format_config(d['config'])} "
                                         f"({fmt_ms(d['ms'])} ms)"))
    return 0


def cmd_unpin(args: argparse.Namespace) -> int:
    workload = args.workload
    if args.kernel:
        spec = get_spec(args.kernel)  # an unknown kernel is named, with or without a workload
        workload = slot_name(spec, workload) if workload else workload
    n = active.unpin(ResultsDB(), args.kernel, workload)
    if workload and not n:
        raise BadInput(f"no pin for {args.kernel}/{workload}; `edgetune report` shows the pinned configs")
    emit({"unpinned": n}, args.json, lambda d: print(f"unpinned {d['unpinned']} config(s)"))
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    spec = get_spec(args.kernel)
    workload = slot_name(spec, args.workload)
    entry = active.forget(ResultsDB(), spec.name, workload)
    if entry is None:
        raise BadInput(f"no active config for {spec.name}/{workload}; `edgetune report` lists the active ones")
    out = {"kernel": spec.name, "workload": workload, "config": entry["config"], "pinned": entry["pinned"]}
    emit(out, args.json, lambda d: print(
        f"forgot {d['kernel']}/{d['workload']} ({format_config(d['config'])}); its measurements stay, so "
        "`edgetune tune` brings it back at once (`--force` measures again)"))
    return 0


def slot_name(spec: KernelSpec, text: str) -> str:
    """The workload name of an active slot given as a name or as a custom shape (`M=196,N=64,K=384`, as `pin` and
    `tune --shape` take it: its slot is the shape's generated `custom.…` name)."""
    return custom_workload(spec, text).name if "=" in text else text


def active_workload(spec: KernelSpec, name: str, entry: dict | None) -> Workload:
    """The workload of an active slot by the shape its entry keeps, else by name (bundled or custom.*): a layer
    tuned from a workloads file has no other record of its shape, so `pin` and `verify` work without the file."""
    if entry and entry.get("shape"):
        return Workload(name, spec.validate_shape(entry["shape"]), "active")
    return resolve(spec, name, None)


def verify_selection(slots: dict[str, dict], kernel: str | None, workload: str | None,
                     shape: str | None) -> dict[str, dict]:
    """The active slots `verify` re-measures: all, or those of --kernel, narrowed by --workload or --shape."""
    if shape and not kernel:
        raise BadInput("--shape needs --kernel (a shape's dimensions are the kernel's)")
    if workload and shape:
        raise BadInput("give either --workload or --shape, not both")
    if kernel:
        spec = get_spec(kernel)
        slots = {k: v for k, v in slots.items() if k.startswith(spec.name + "/")}
        if shape:
            workload = custom_workload(spec, shape).name
    if workload:
        slots = {k: v for k, v in slots.items() if k.split("/", 1)[1] == workload}
        if not slots:
            raise BadInput(f"no active config for workload {workload!r}" + (f" of {kernel}" if kernel else "")
                           + "; `edgetune report` lists the active ones")
    return slots


def cmd_verify(args: argparse.Namespace) -> int:
    if not args.threshold > 0:
        raise BadInput(f"--threshold {args.threshold:g}: give the relative drift that counts, e.g. 0.10 for 10%")
    db = ResultsDB()
    hw = _hw(args.isa)
    slots = verify_selection(db.active(), args.kernel, args.workload, args.shape)
    rows = []
    with Runner() as runner:
        session = Session(db, runner, hw)
        for slot, e in slots.items():
            kernel, workload = slot.split("/", 1)
            spec = get_spec(kernel)
            wl = active_workload(spec, workload, e)
            if e.get("session_id"):
                m = session.remeasure(spec, wl, [e["config"]], e["session_id"], "verify", rounds=2)[0]
            else:  # a pin made before any tuning has no session to journal under
                m = Measured(spec=spec, shape=wl.shape, hw=hw, runner=runner).evaluate([e["config"]])[0]
            drift = (m.ms - e["ms"]) / e["ms"] if m.ok and e.get("ms") else None
            rows.append({"kernel": kernel, "workload": workload, "config": e["config"], "stored_ms": e.get("ms"),
                         "now_ms": m.ms, "drift": drift, "ok": m.ok, "reason": m.reason,
                         "status": drift_status(m.ok, drift, args.threshold)})

    def render(rs: list[dict]) -> None:
        if not rs:
            print("nothing to verify: no active configs")
            return
        table(f"verify (drift threshold {args.threshold:.0%}, ties under {TIE_THRESHOLD:.0%})",
              ["kernel", "workload", "stored ms", "now ms", "drift", "status"], [
                  [r["kernel"], r["workload"], fmt_ms(r["stored_ms"]), fmt_ms(r["now_ms"]),
                   "-" if r["drift"] is None else f"{r['drift']:+.1%}", r["status"] if r["ok"] else r["reason"]]
                  for r in rs])

    emit(rows, args.json, render)
    return 1 if any(r["status"] in ("failed", "slower") for r in rows) else 0


def drift_status(ok: bool, drift: float | None, threshold: float) -> str:
    """"slower" and "failed" fail the verb (a regression, as a CI gate reads it); "faster" is reported, since the
    stored time no longer describes the device, but is no failure."""
    if not ok:
        return "failed"
    if drift is not None and abs(drift) > threshold:
        return "slower" if drift > 0 else "faster"
    return "ok"


def _export_records(args: argparse.Namespace) -> int:
    """The results DB's sessions as tuning records, each carrying this device's descriptor at its ISA (probed once
    per ISA), so the times mean the same to a trainer on another machine."""
    probed: dict[str, Any] = {}

    def hw_at(isa: str) -> Any:
        if isa not in probed:
            try:
                probed[isa] = _hw(isa)
            except BadInput:  # an ISA this CPU does not offer (a DB from another device): no descriptor to give
                probed[isa] = None
        return probed[isa]

    records = list(ResultsDB().iter_records(hw_at))
    if args.json and not args.output:
        emit({"format": "records", "entries": len(records), "records": records}, True)
        return 0
    text = "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in records)
    if args.output:
        data = text.encode()
        write_output(Path(args.output), gzip.compress(data) if args.output.endswith(".gz") else data)
        emit({"written": args.output, "format": "records", "entries": len(records)}, args.json,
             lambda d: print(f"wrote {d['entries']} tuning record(s) to {d['written']}"))
    else:
        print(text, end="")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.format == "records":
        return _export_records(args)
    doc = ResultsDB().active_document()
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n" if args.format == "json" else to_c_header(doc)
    if args.output:
        write_output(Path(args.output), text.encode())
        emit({"written": args.output, "format": args.format, "entries": len(doc["kernels"])}, args.json,
             lambda d: print(f"wrote {d['entries']} config(s) to {d['written']}"))
    elif args.json and args.format != "json":  # --json is JSON on stdout: the C header travels as a string
        emit({"format": args.format, "entries": len(doc["kernels"]), "text": text}, True)
    else:
        print(text, end="")
    return 0
