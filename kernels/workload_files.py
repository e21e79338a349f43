"""Workloads files: TOML lists of real model layers to tune, beside the bundled workloads.

A file is what `edgetune workloads import` writes and what a device's workloads.d holds. It is read strictly,
because a typo there would otherwise silently tune the wrong shape: every problem names the file, the entry
and what is allowed.

    # edgetune workloads file
    [[workload]]
    kernel = "gemm"
    name = "mymodel.layer3"        # optional; default is custom_name(spec, shape)
    shape = { M = 196, N = 576, K = 96 }
    count = 2                      # optional: how often the layer occurs
    source = "mymodel.onnx: Conv /features/3/conv/0 (+1 more)"   # optional

`select_targets` is what `tune` and `bench` run: a file's workloads, a custom shape, named or all bundled ones.
"""

from __future__ import annotations

import glob
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from edgetune.atomic import write_output
from edgetune.errors import BadInput
from kernels.registry import all_specs, get_spec
from kernels.space import Shape
from kernels.spec import KernelSpec, Workload
from kernels.workloads import check_size, custom_name, resolve

BUNDLED = "bundled"  # the pattern that stands for every spec's bundled workloads
HEADER = "# edgetune workloads file"
KEYS = ("kernel", "name", "shape", "count", "source")
# names end up in DB keys and MQTT payload keys "<kernel>/<workload>", so no slashes or spaces
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class WorkloadEntry:
    """One [[workload]] table of a file."""

    kernel: str
    shape: Shape
    name: str | None = None  # None: the generated custom_name(spec, shape)
    count: int = 1
    source: str = ""


@dataclass(frozen=True)
class LoadedWorkload:
    """A workload a set of files resolves to, with its merged count and where it was first seen."""

    spec: KernelSpec
    workload: Workload
    count: int
    origin: str  # "bundled" or the file path


def load_workload_files(patterns: list[str]) -> list[tuple[KernelSpec, Workload]]:
    """The workloads of "bundled" and of files/globs, validated, with duplicate kernel+shape merged."""
    return [(lw.spec, lw.workload) for lw in collect_workloads(patterns)]


def collect_workloads(patterns: list[str]) -> list[LoadedWorkload]:
    """Like load_workload_files, keeping counts (summed over duplicates) and origins for listings."""
    merged: dict[tuple[str, tuple[int, ...]], LoadedWorkload] = {}
    # (kernel, name) → first shape and origin; the bundled names are taken whether or not "bundled" is listed, so a
    # file cannot reuse one for another shape (applications load active configs by that name)
    named: dict[tuple[str, str], tuple[Shape, str]] = {
        (s.name, w.name): (dict(w.shape), BUNDLED) for s in all_specs().values() for w in s.workloads}
    for origin, spec, entry in _entries(patterns):
        name = entry.name or custom_name(spec, entry.shape)
        seen = named.setdefault((spec.name, name), (entry.shape, origin))
        if seen[0] != entry.shape:
            raise BadInput(f"workload {spec.name}/{name} is {seen[0]} in {seen[1]} but {entry.shape} in {origin}; "
                           "a name must mean one shape")
        key = (spec.name, tuple(spec.dims_vector(entry.shape)))
        if key in merged:
            first = merged[key]
            merged[key] = LoadedWorkload(first.spec, first.workload, first.count + entry.count, first.origin)
        else:
            merged[key] = LoadedWorkload(spec, Workload(name, entry.shape, entry.source), entry.count, origin)
    return list(merged.values())


def read_workloads_file(path: str | Path) -> list[WorkloadEntry]:
    """The validated entries of one file, names filled in."""
    return [e for _, _, e in _read(Path(path))]


def write_workloads_file(path: str | Path, entries: Iterable[WorkloadEntry], comment: str = "") -> None:
    """Write atomically so a daemon never reads half a file; refuse what we could not read back."""
    path = Path(path)
    text = dumps(entries, comment)
    _parse(text, str(path))
    write_output(path, text.encode("utf-8"))


def dumps(entries: Iterable[WorkloadEntry], comment: str = "") -> str:
    """TOML text of a workloads file; shapes in the spec's dim order so files diff cleanly."""
    specs = all_specs()
    lines = [HEADER] + [f"# {c}".rstrip() for c in comment.splitlines()]
    for e in entries:
        order = [d.name for d in specs[e.kernel].dims] if e.kernel in specs else list(e.shape)
        dims = ", ".join(f"{_key(k)} = {int(e.shape[k])}" for k in order if k in e.shape)
        lines += ["", "[[workload]]", f"kernel = {_string(e.kernel)}"]
        if e.name:
            lines.append(f"name = {_string(e.name)}")
        lines.append(f"shape = {{ {dims} }}")
        if e.count != 1:
            lines.append(f"count = {int(e.count)}")
        if e.source:
            lines.append(f"source = {_string(e.source)}")
    return "\n".join(lines) + "\n"


def expand_patterns(patterns: list[str]) -> list[str]:
    """"bundled", paths, directories (their *.toml) and globs → "bundled" and file paths, in a stable order.

    A glob matching nothing is fine (an empty workloads.d); a missing literal path is a typo and an error.
    """
    out: list[str] = []
    for pat in patterns:
        if pat == BUNDLED:
            out.append(BUNDLED)
            continue
        p = os.path.expanduser(pat)
        if glob.has_magic(p):
            out += sorted(f for f in glob.glob(p) if os.path.isfile(f))
        elif os.path.isdir(p):
            out += sorted(glob.glob(os.path.join(glob.escape(p), "*.toml")))
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise BadInput(f"workloads file {pat} does not exist (give a file, a directory, a glob or {BUNDLED!r})")
    return list(dict.fromkeys(out))


def _entries(patterns: list[str]) -> Iterable[tuple[str, KernelSpec, WorkloadEntry]]:
    for item in expand_patterns(patterns):
        if item == BUNDLED:
            for spec in all_specs().values():
                for w in spec.workloads:
                    yield BUNDLED, spec, WorkloadEntry(spec.name, dict(w.shape), w.name, 1, w.source)
        else:
            yield from _read(Path(item))


def _read(path: Path) -> list[tuple[str, KernelSpec, WorkloadEntry]]:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise BadInput(f"cannot read workloads file {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text (byte {e.start})") from e
    return [(str(path), spec, e) for spec, e in _parse(text, str(path))]


def _parse(text: str, where: str) -> list[tuple[KernelSpec, WorkloadEntry]]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"{where}: not valid TOML: {e}") from e  # the message carries line and column
    extra = [k for k in doc if k != "workload"]
    if extra:
        raise BadInput(f"{where}: unknown top-level key(s) {', '.join(extra)}; a workloads file holds [[workload]] tables")
    tables = doc.get("workload", [])
    if not isinstance(tables, list):
        raise BadInput(f"{where}: 'workload' must be an array of tables: write [[workload]], not [workload]")
    return [_entry(raw, f"{where}: [[workload]] #{i}") for i, raw in enumerate(tables, 1)]


def _entry(raw: Any, where: str) -> tuple[KernelSpec, WorkloadEntry]:
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: must be a table")
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        raise BadInput(f"{where}: unknown key(s) {', '.join(unknown)}; keys are: {', '.join(KEYS)}")
    if "kernel" not in raw or "shape" not in raw:
        raise BadInput(f"{where}: needs kernel and shape, e.g. kernel = \"gemm\" and shape = {{ M = 196, N = 576, K = 96 }}")
    if not isinstance(raw["kernel"], str):
        raise BadInput(f"{where}: kernel must be a string")
    try:
        spec = get_spec(raw["kernel"])
        shape = raw["shape"]
        if not isinstance(shape, dict):
            raise BadInput(f"shape must be a table like {{ {', '.join(d.name + ' = <int>' for d in spec.dims)} }}")
        bad = [k for k, v in shape.items() if type(v) is not int]
        if bad:
            raise BadInput(f"shape value(s) {', '.join(f'{k}={shape[k]!r}' for k in bad)} must be integers")
        shape = check_size(spec, spec.validate_shape(shape))
    except BadInput as e:
        raise BadInput(f"{where}: {e}") from e
    name = raw.get("name")
    if name is not None and (not isinstance(name, str) or not NAME_RE.fullmatch(name)):
        raise BadInput(f"{where}: name {name!r} must be letters, digits, '_', '.' or '-' (not starting with '.' or '-')")
    if name and name.startswith("custom.") and name != custom_name(spec, shape):
        raise BadInput(f"{where}: names starting with 'custom.' are generated from the shape; "
                       f"this shape's is {custom_name(spec, shape)!r}, or choose another name")
    count = raw.get("count", 1)
    if type(count) is not int or count < 1:
        raise BadInput(f"{where}: count {count!r} must be a positive integer")
    source = raw.get("source", "")
    if not isinstance(source, str):
        raise BadInput(f"{where}: source must be a string")
    return spec, WorkloadEntry(spec.name, shape, name or custom_name(spec, shape), count, source)


def _string(s: str) -> str:
    """A TOML basic string: escape quotes, backslashes and the control characters TOML forbids raw."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append(ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _string(k)


def select_targets(kernels: list[str] | None, workloads: list[str] | None, shape: str | None,
                   files: list[str] | None, verb: str) -> list[tuple[KernelSpec, Workload]]:
    """What `tune` or `bench` should run: workload files, a custom shape, named workloads, or everything bundled."""
    if shape and workloads:
        raise BadInput("give either --workload or --shape, not both")
    if shape and files:
        raise BadInput(f"--shape and --workloads both name what to {verb}; give one")
    if files:
        names = {get_spec(k).name for k in kernels or ()}  # an unknown kernel is named, not matched by nothing
        targets = [(s, w) for s, w in load_workload_files(files) if not names or s.name in names]
        missing = sorted(set(workloads or ()) - {w.name for _, w in targets})
        if missing:
            raise BadInput(f"workload(s) {', '.join(missing)} are not in {', '.join(files)}"
                           + (f" for kernel(s) {', '.join(kernels)}" if kernels else ""))
        targets = [(s, w) for s, w in targets if not workloads or w.name in workloads]
        if not targets:
            raise BadInput(f"nothing to {verb}: the selection matched no workload (workloads files: "
                           f"{', '.join(files)})")
        return targets
    specs = [get_spec(k) for k in kernels] if kernels else list(all_specs().values())
    if shape:
        if len(specs) != 1:
            raise BadInput("--shape needs exactly one --kernel")
        return [(specs[0], resolve(specs[0], None, shape))]
    if workloads:
        if len(specs) == 1:
            return [(specs[0], resolve(specs[0], w, None)) for w in workloads]
        out = [(s, w) for s in specs for w in s.workloads if w.name in workloads]
        known = {w.name for s in specs for w in s.workloads}
        bad = [w for w in workloads if w not in known]
        if bad:
            raise BadInput(f"unknown workload(s) {', '.join(bad)}; name a --kernel, or see `edgetune kernels`")
        return out
    return [(s, w) for s in specs for w in s.workloads]
