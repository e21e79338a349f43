"""Every bundled kernel: default and random valid configs agree with the numpy reference and the ONNX twin."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kernels.build import build
from kernels.registry import all_specs
from kernels.spec import KernelSpec

SPECS = list(all_specs().values())
N_RANDOM = 3


def _cases():
    for spec in SPECS:
        for w in spec.workloads:
            yield pytest.param(spec, w.name, id=f"{spec.name}/{w.name}")


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
