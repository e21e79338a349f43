"""Verb `workloads`: import a model's layers into a workloads file, and list what a set of files resolves to."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgetune.errors import BadInput
from edgetune.output import emit, json_flag, say, table
from kernels.workload_files import BUNDLED, collect_workloads, expand_patterns, write_workloads_file

if TYPE_CHECKING:
    from kernels.onnx_import import ImportResult


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workloads", help="import workloads from an ONNX model; list workloads files")
    actions = p.add_subparsers(dest="action", required=True, metavar="{import,list}")

    q = actions.add_parser("import", help="map an ONNX model's layers onto the bundled kernels; write a workloads file")
    q.add_argument("model", help="the .onnx model")
    q.add_argument("-o", "--output", help="workloads file to write (default: ./<model stem>.workloads.toml)")
    q.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                   help="fix a symbolic input dim, e.g. --dim batch=1 (repeatable)")
    json_flag(q)
    q.set_defaults(func=cmd_import)

    q = actions.add_parser("list", help="show the workloads that files resolve to (duplicates merged)")
    q.add_argument("--workloads", action="append", metavar="FILE|DIR|GLOB",
                   help=f"a workloads file, a directory of *.toml, a glob, or {BUNDLED!r} (repeatable; default {BUNDLED})")
    json_flag(q)
    q.set_defaults(func=cmd_list)


def parse_dims(items: list[str]) -> dict[str, int]:
    """`batch=1` items → {"batch": 1}; anything else is a usage error naming the item."""
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name:
            raise BadInput(f"--dim {item!r} is not NAME=VALUE, e.g. --dim batch=1")
        if not value.isdigit() or int(value) < 1:
            raise BadInput(f"--dim {item!r}: the value must be a positive integer")
        if name in out and out[name] != int(value):
            raise BadInput(f"--dim {name} is given twice ({out[name]} and {value})")
        out[name] = int(value)
    return out


def _shape_text(shape: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def cmd_import(args: argparse.Namespace) -> int:
    from kernels.onnx_import import import_onnx

    dims = parse_dims(args.dim)
    result = import_onnx(args.model, dims)
    skipped = ", ".join(f"{op} x{n}" for op, n in result.skipped.items())
    check_mapped(result, skipped)
    out = Path(args.output) if args.output else Path.cwd() / f"{Path(args.model).stem}.workloads.toml"
    comment = "\n".join([f"imported from {Path(args.model).name}"]
                        + ([f"dims: {', '.join(f'{k}={v}' for k, v in dims.items())}"] if dims else [])
                        + ([f"not mapped: {skipped}"] if skipped else [])
                        + ([f"dynamic dims left unset: {', '.join(result.dynamic)}"] if result.dynamic else []))
    write_workloads_file(out, result.workload_entries(), comment)
    data = {**result.as_dict(), "output": str(out)}

    def render(d: dict[str, Any]) -> None:
        table(f"{Path(d['model']).name}: {len(d['entries'])} workload(s)", ["kernel", "name", "shape", "count", "layers"],
              [[e["kernel"], e["name"], _shape_text(e["shape"]), e["count"],
                "\n".join(e["sources"][:3] + ([f"+{len(e['sources']) - 3} more"] if len(e["sources"]) > 3 else []))]
               for e in d["entries"]])
        if d["skipped"]:
            table("not mapped", ["op", "nodes", "why"],
                  [[op, n, "\n".join(d["why"].get(op, []))] for op, n in d["skipped"].items()])
        if d["dynamic"]:
            say(f"{', '.join(d['dynamic'])} (fix with {' '.join(f'--dim {n}=N' for n in d['dynamic'])})",
                "dynamic dims left unset:", "yellow")
        for w in d["warnings"]:
            say(w, "warning:", "yellow")
        say(f"wrote {d['output']}")

    emit(data, args.json, render)
    return 0


def check_mapped(result: ImportResult, skipped: str) -> None:
    """Refuse a model of which no layer maps: a workloads file with no entry only fails later, at `tune`, far
    from the cause, which is most often a symbolic dim left unset."""
    if result.entries:
        return
    name = Path(result.model).name
    if result.dynamic:
        raise BadInput(f"no layer of {name} maps onto a bundled kernel while its symbolic dim(s) "
                       f"{', '.join(result.dynamic)} are unset (not mapped: {skipped}); fix them with "
                       + " ".join(f"--dim {n}=N" for n in result.dynamic) + "; nothing was written")
    raise BadInput(f"no layer of {name} maps onto a bundled kernel (not mapped: {skipped or 'no nodes'}); "
                   "nothing was written")


def cmd_list(args: argparse.Namespace) -> int:
    patterns = args.workloads or [BUNDLED]
    rows = [{"kernel": lw.spec.name, "name": lw.workload.name, "shape": lw.workload.shape, "count": lw.count,
             "source": lw.workload.source, "origin": lw.origin} for lw in collect_workloads(patterns)]
    data = {"files": expand_patterns(patterns), "workloads": rows}

    def render(d: dict[str, Any]) -> None:
        table(f"{len(d['workloads'])} workload(s)", ["kernel", "name", "shape", "count", "source", "from"],
              [[r["kernel"], r["name"], _shape_text(r["shape"]), r["count"], r["source"], r["origin"]]
               for r in d["workloads"]])

    emit(data, args.json, render)
    return 0
