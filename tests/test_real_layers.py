"""The held-out real layers (bench/real_layers.toml) stay held out: no training source holds one of their shapes.

The tuner comparison (`bench/compare_tuners.py --real-layers`) is only honest if the model never saw these shapes:
not in the committed data, not among the bundled workloads or the real-architecture training layers, not in the
collector's plan, and not through a device's records.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from edgetune.errors import BadInput
from kernels.registry import all_specs
from kernels.workload_files import collect_workloads, read_workloads_file
from tuner.collect import arch_shapes, extra_shapes, kernel_shapes
from tuner.train import data as D
from tuner.train.arch_layers import HELDOUT, OUT, arch_layers, heldout_keys, shape_id, spread

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "quantized_models" / "data"


@pytest.fixture(scope="module")
def held() -> set:
    return heldout_keys()


def test_the_held_out_set_is_real_layers_of_every_kernel(held):
    entries = read_workloads_file(HELDOUT)
    assert len(entries) == len(held) >= 30  # distinct shapes, every one valid for its spec (the loader checks)
    per = {k: sum(1 for e in entries if e.kernel == k) for k in all_specs()}
    assert min(per.values()) >= 4, per
    assert all(e.source and not e.name.startswith("custom.") for e in entries)


def test_no_held_out_shape_is_in_the_committed_data(held):
    files = sorted(DATA.glob("*.jsonl.gz"))
    assert any(f.name == "runs.jsonl.gz" for f in files)
    found = []
    for f in files:
        with gzip.open(f, "rt") as fh:
            for line in fh:
                r = json.loads(line)
                if "kernel" in r and "shape" in r:
                    shape = r["shape"] if isinstance(r["shape"], dict) else json.loads(r["shape"])
                    if shape_id(r["kernel"], shape) in held:
                        found.append((f.name, r["kernel"], shape))
    assert not found, found[:5]


def test_no_held_out_shape_is_a_bundled_or_training_layer(held):
    bundled = {shape_id(lw.spec.name, lw.workload.shape) for lw in collect_workloads(["bundled"])}
    assert not bundled & held
    arch = {shape_id(e.kernel, e.shape) for e in read_workloads_file(OUT)}
    assert len(arch) > 300 and not arch & held
    # the committed table is what the generator writes (families from the papers' tables, held-out shapes removed)
    assert [(e.kernel, e.name, e.shape, e.source) for e in arch_layers()] == \
        [(e.kernel, e.name, e.shape, e.source) for e in read_workloads_file(OUT)]


def test_the_collectors_plan_never_draws_a_held_out_shape(held):
    for spec in all_specs().values():
        base = kernel_shapes(spec, 22, 4)
        plan = base + arch_shapes(spec, base, 40) + extra_shapes(spec, base, 40)
        assert not {shape_id(spec.name, s) for _, s, _ in plan} & held, spec.name
        assert len({shape_id(spec.name, s) for _, s, _ in plan}) == len(plan)  # no shape twice


def test_extra_shapes_can_be_drawn_in_one_region_only():
    spec = all_specs()["conv1d"]
    base = kernel_shapes(spec, 22, 4)
    strided = extra_shapes(spec, base, 12, where={"stride": 2})
    assert len(strided) == 12 and all(s["stride"] == 2 for _, s, _ in strided)
    assert not {shape_id("conv1d", s) for _, s, _ in strided} & {shape_id("conv1d", s) for _, s, _ in base}
    with pytest.raises(BadInput, match="kernel gemm has no dim 'stride'"):
        extra_shapes(all_specs()["gemm"], [], 1, where={"stride": 2})


def test_spread_is_a_stable_prefix():
    gemm = [e for e in read_workloads_file(OUT) if e.kernel == "gemm"]
    small, large = spread(gemm, 10), spread(gemm, 30)
    assert large[:10] == small and len({e.name for e in large}) == 30


def test_device_records_of_a_held_out_layer_never_become_training_cases(tmp_path, held):
    entry = read_workloads_file(HELDOUT)[0]
    cfg = all_specs()[entry.kernel].default
    rec = {"kernel": entry.kernel, "workload": entry.name, "shape": entry.shape, "isa": "x86-64-v3",
           "measurements": [{"config": cfg, "ok": True, "ms": 0.5}]}
    other = dict(rec, shape={**entry.shape, next(iter(entry.shape)): next(iter(entry.shape.values())) + 1})
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(rec) + "\n" + json.dumps(other) + "\n")
    cases, n = D.load_records(path)
    assert n == 2
    assert [c.shape for c in cases.values()] == [other["shape"]]


def test_arch_layers_help_and_a_typo_do_not_rewrite_the_committed_file():
    import subprocess
    import sys

    from tuner.train.arch_layers import OUT

    before = OUT.stat().st_mtime_ns
    for args, code in ((["--help"], 0), (["--prnt"], 2)):
        r = subprocess.run([sys.executable, "-m", "tuner.train.arch_layers", *args], capture_output=True, text=True,
                           cwd=OUT.parents[2], timeout=120)
        assert r.returncode == code, r.stderr
    assert OUT.stat().st_mtime_ns == before
