"""Every bundled kernel: default and random valid configs agree with the numpy reference and the ONNX twin."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kernels.build import build, build_many
from kernels.registry import all_specs
from kernels.spec import KernelSpec

SPECS = list(all_specs().values())
N_RANDOM = 3


def _cases():
    for spec in SPECS:
        for w in spec.workloads:
            yield pytest.param(spec, w.name, id=f"{spec.name}/{w.name}")


def test_one_batch_may_hold_a_config_twice(hw, tmp_path, monkeypatch):
    """All copies build in parallel on a cold cache and get the same library (each thread has its own temp file;
    with a shared one, every rename after the first failed)."""
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cold"))
    spec = all_specs()["gemm"]
    cfg = spec.space(spec.workloads[0].shape, hw).valid_default()
    builds = build_many(spec, [cfg] * 8, hw, jobs=8)  # 8 threads at once: with the old shared name, 4 runs of 4 failed
    assert not [b for b in builds if isinstance(b, Exception)], builds
    assert len({b.path for b in builds}) == 1 and builds[0].path.exists()
    assert not list(builds[0].path.parent.glob("*.tmp.so"))


def test_all_six_kernels_bundled():
    assert {"gemm", "conv2d_3x3", "dwconv_3x3", "logmel", "conv1d", "gru"} <= set(all_specs())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_spec_is_complete(spec: KernelSpec, hw):
    assert spec.domain in ("vision", "speech")
    assert len(spec.params) >= 4
    assert len(spec.workloads) >= 3
    w = spec.workloads[0]
    space = spec.space(w.shape, hw)
    assert space.is_valid(space.valid_default())
    assert any(spec.space(w.shape, hw).is_valid(spec.default) for w in spec.workloads)
    assert space.size() >= 500, f"{spec.name} has only {space.size()} valid configs on this machine"
    assert spec.flops(w.shape) > 0 and spec.bytes_moved(w.shape) > 0


@pytest.mark.parametrize("spec,workload", list(_cases()))
def test_default_and_random_configs_match_reference(spec: KernelSpec, workload: str, hw, runner):
    shape = spec.workload(workload).shape
    space = spec.space(shape, hw)
    cfgs = [space.valid_default()] + space.sample(N_RANDOM, random.Random(hash(workload) & 0xFFFF))
    for cfg in cfgs:
        m = runner.measure(spec, shape, build(spec, cfg, hw).path, min_time_s=0.01, max_reps=5)
        assert m.ok, f"{cfg}: {m.reason}"
        assert m.max_abs_err is not None and m.ms > 0


@pytest.mark.parametrize("spec,workload", list(_cases()))
def test_onnx_twin_agrees_with_reference(spec: KernelSpec, workload: str):
    from kernels.ort_twin import run_ort

    shape = spec.workload(workload).shape
    inputs = spec.make_inputs(shape, np.random.default_rng(0))
    ref = spec.reference(shape, inputs)
    got = run_ort(spec, shape, inputs, min_time_s=0.0, max_reps=5).outputs
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.reshape(r.shape), r, rtol=spec.rtol * 10, atol=spec.atol * 10)


def test_gemm_remainders_handled(hw, runner):
    """Shapes that are multiples of no tile or vector width still compute the right values."""
    from kernels.registry import get_spec

    spec = get_spec("gemm")
    for shape in ({"M": 37, "N": 29, "K": 53}, {"M": 1, "N": 1, "K": 1}, {"M": 9, "N": 67, "K": 300}):
        space = spec.space(shape, hw)
        for cfg in [space.valid_default()] + space.sample(2, random.Random(7)):
            m = runner.measure(spec, shape, build(spec, cfg, hw).path, min_time_s=0.01, max_reps=5)
            assert m.ok, f"{shape} {cfg}: {m.reason}"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_threads_need_work(spec: KernelSpec):
    """A fork-join outweighs a tiny workload: threads > 1 is pruned below MIN_FLOPS_PER_THREAD flops per thread,
    naming the reason, and stays in the space once each thread has that much work."""
    from kernels.spec import MIN_FLOPS_PER_THREAD
    from tuner.train.data import HwView

    hw = HwView({"isa": "x86-64-v3", "vector_bits": 256, "cores": 4})
    by_flops = sorted((spec.flops(w.shape), w.shape) for w in spec.workloads)
    small = dict(by_flops[0][1])
    while spec.flops(small) >= 2 * MIN_FLOPS_PER_THREAD:  # shrink the smallest bundled workload below the bound
        big_dim = max((d.name for d in spec.dims if not d.choices and small[d.name] > 1), key=lambda n: small[n])
        small[big_dim] = max(1, small[big_dim] // 2)
        if spec.shape_problems(small):
            pytest.skip(f"{spec.name}: no valid shape below {2 * MIN_FLOPS_PER_THREAD:.0e} flops")
    tiny = spec.space(small, hw)
    cfg = dict(tiny.valid_default(), threads=2)
    assert not tiny.is_valid(cfg)
    assert any("flops" in why for why in tiny.violations(cfg))
    large = spec.space(by_flops[-1][1], hw)
    assert spec.flops(large.shape) >= 4 * MIN_FLOPS_PER_THREAD
    assert large.is_valid(dict(large.valid_default(), threads=2))


def test_thread_bound_matches_the_collected_data():
    """The bound is the data's: in every collected case below 2 * MIN_FLOPS_PER_THREAD flops, the fastest measured
    config runs one thread (so pruning more threads there never drops a best config)."""
    from pathlib import Path

    from kernels.spec import MIN_FLOPS_PER_THREAD
    from tuner.train import data as D

    cases = D.load_collector(Path(D.DEFAULT_DATA))
    specs = all_specs()
    tiny = [c for c in cases.values() if c.table() and specs[c.kernel].flops(c.shape) < 2 * MIN_FLOPS_PER_THREAD]
    assert tiny, "the dataset holds no case below the bound: nothing checks it"
    multi = [c for c in tiny if c.ranked()[0][0]["threads"] != 1]
    assert not multi, [(c.kernel, c.isa, c.workload, c.ranked()[0]) for c in multi[:3]]


def test_valid_default_is_the_nearest_valid_config():
    """The nudged default is the valid config fewest knob steps from the spec's, ties to enumeration order: the
    search that finds it agrees with a walk over every valid config (on an SSE-capped host, where vec=8 is out)."""
    from hwprobe import probe

    hw = probe(isa_cap="x86-64-v2", measure_bandwidth=False)
    for spec in SPECS:
        for w in spec.workloads:
            space = spec.space(w.shape, hw)
            if space.cardinality() > 1e6:
                continue
            brute = min(space.enumerate(), key=lambda c: space.distance(c, space.default))
            assert space.valid_default() == brute, (spec.name, w.name)


def test_sampling_a_space_the_constraints_nearly_empty():
    """When the constraints reject nearly all of the cross product, rejection sampling alone finds nothing: the
    sampler then draws knob by knob among the values no constraint rules out yet."""
    import dataclasses

    from kernels.registry import get_spec
    from kernels.space import Constraint

    gemm = get_spec("gemm")
    hw = type("Hw", (), {"vector_bits": 512, "vector_registers": 32, "cores": 2, "big_cores": 2})()
    base = gemm.space({"M": 1, "N": 12, "K": 64}, hw)
    rare = Constraint("a rare corner", lambda c, s, h: c["kc"] == 16 and c["unroll_k"] == 8 and c["nb"] == 16
                      and c["mb"] == 64)
    space = dataclasses.replace(base, constraints=base.constraints + (rare,))
    assert 10 <= space.size() < space.cardinality() / 2000
    got = space.sample(10, random.Random(3))
    assert len(got) == 10 and len({tuple(sorted(c.items())) for c in got}) == 10
    assert all(space.is_valid(c) for c in got) and len({c["nv"] for c in got}) > 1
