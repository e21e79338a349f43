"""conv2d_3x3 and dwconv_3x3: odd shapes, both strides, borders, remainders, and shape validation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from edgetune.errors import BadInput
from kernels.build import build
from kernels.registry import get_spec
from tests.knob_values import every_knob_value

FAST = {"min_time_s": 0.01, "max_reps": 5}

CONV_SHAPES = [
    {"H": 7, "W": 7, "Cin": 13, "Cout": 19, "stride": 1},
    {"H": 7, "W": 7, "Cin": 13, "Cout": 19, "stride": 2},
    {"H": 1, "W": 1, "Cin": 5, "Cout": 3, "stride": 1},
    {"H": 1, "W": 1, "Cin": 5, "Cout": 3, "stride": 2},
    {"H": 2, "W": 3, "Cin": 1, "Cout": 64, "stride": 2},
    {"H": 9, "W": 23, "Cin": 3, "Cout": 37, "stride": 1},
    {"H": 10, "W": 20, "Cin": 17, "Cout": 100, "stride": 2},
]
DW_SHAPES = [
    {"H": 7, "W": 7, "C": 13, "stride": 1},
    {"H": 7, "W": 7, "C": 13, "stride": 2},
    {"H": 1, "W": 1, "C": 37, "stride": 1},
    {"H": 1, "W": 1, "C": 37, "stride": 2},
    {"H": 2, "W": 3, "C": 64, "stride": 2},
    {"H": 9, "W": 23, "C": 52, "stride": 1},
    {"H": 10, "W": 20, "C": 100, "stride": 2},
]


def _naive_conv(x: np.ndarray, w: np.ndarray, stride: int, depthwise: bool) -> np.ndarray:
    """Direct loops over every output pixel and tap: an independent check of the vectorized references."""
    H, W = x.shape[:2]
    Ho, Wo = (H - 1) // stride + 1, (W - 1) // stride + 1
    cout = x.shape[2] if depthwise else w.shape[3]
    y = np.zeros((Ho, Wo, cout))
    for oy in range(Ho):
        for ox in range(Wo):
            for ky in range(3):
                for kx in range(3):
                    iy, ix = oy * stride - 1 + ky, ox * stride - 1 + kx
                    if 0 <= iy < H and 0 <= ix < W:
                        px = x[iy, ix].astype(np.float64)
                        y[oy, ox] += px * w[ky, kx] if depthwise else px @ w[ky, kx].astype(np.float64)
    return y


def _check(spec, shape, cfgs, hw, runner, act="none"):
    for cfg in cfgs:
        m = runner.measure(spec, shape, build(spec, cfg, hw).path, act=act, **FAST)
        assert m.ok, f"{spec.name} {shape} {cfg} act={act}: {m.reason}"


def _widest_vec(hw) -> int:
    return max(v for v in (4, 8, 16) if v * 32 <= hw.vector_bits)


@pytest.mark.parametrize("name,shapes", [("conv2d_3x3", CONV_SHAPES), ("dwconv_3x3", DW_SHAPES)])
def test_reference_matches_naive_loops(name, shapes):
    spec = get_spec(name)
    for shape in shapes:
        x = spec.make_inputs(shape, np.random.default_rng(3))
        want = _naive_conv(x[0], x[1], shape["stride"], depthwise=name == "dwconv_3x3") + x[2]  # the bias
        got = spec.reference(shape, x)[0]
        assert got.shape == tuple(spec.output_shapes(shape)[0]) == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", CONV_SHAPES, ids=lambda s: "x".join(map(str, s.values())))
def test_conv2d_odd_shapes(shape, hw, runner):
    spec = get_spec("conv2d_3x3")
    space = spec.space(shape, hw)
    _check(spec, shape, [space.valid_default()] + space.sample(3, random.Random(11)), hw, runner)


@pytest.mark.parametrize("shape", DW_SHAPES, ids=lambda s: "x".join(map(str, s.values())))
def test_dwconv_odd_shapes(shape, hw, runner):
    spec = get_spec("dwconv_3x3")
    space = spec.space(shape, hw)
    _check(spec, shape, [space.valid_default()] + space.sample(3, random.Random(11)), hw, runner)


@pytest.mark.parametrize("stride", (1, 2))
def test_both_strides_every_loop_order(stride, hw, runner):
    """Each loop-order knob value, with big tiles on a shape that has borders and remainders everywhere."""
    v = _widest_vec(hw)
    conv = get_spec("conv2d_3x3")
    shape = {"H": 11, "W": 13, "Cin": 7, "Cout": 2 * v + 3, "stride": stride}
    for order in ("rows", "panels"):
        for mr, mb in ((5, 4), (12, 1)):  # tiles that span output rows, alias past the last pixel, mix borders
            cfg = dict(conv.space(shape, hw).valid_default(), order=order, vec=v, nv=2, mr=mr, mb=mb, nb=2,
                       prefetch=2)
            assert set(cfg) == {p.name for p in conv.params}
            _check(conv, shape, [cfg], hw, runner)
    dw = get_spec("dwconv_3x3")
    shape = {"H": 11, "W": 13, "C": 3 * v + 5, "stride": stride}
    for order in ("rows", "channels", "pixels"):
        for rt in (1, 2, 3, 4):
            cfg = dict(dw.space(shape, hw).valid_default(), order=order, rt=rt, vec=v, cv=2, wt=2, prefetch=1)
            _check(dw, shape, [cfg], hw, runner, act="relu6")


def test_dwconv_every_knob_value_and_activation(hw, runner):
    """Each value of each dwconv knob, in the valid config nearest the default, on a shape with borders, a channel
    tail (C not a multiple of any tile) and a partial last row tile, each with a fused activation."""
    dw = get_spec("dwconv_3x3")
    shape = {"H": 11, "W": 19, "C": 69, "stride": 1}
    acts = ("none", "relu", "relu6")
    for i, cfg in enumerate(every_knob_value(dw, shape, hw)):
        _check(dw, dict(shape, stride=1 + i % 2), [cfg], hw, runner, act=acts[i % 3])


def test_configs_tuned_for_other_shapes_stay_correct(hw, runner):
    """A config that breaks a shape constraint (tile bigger than the shape) is slow, never wrong: a tuned config
    may be reused on a neighbouring shape."""
    v = _widest_vec(hw)
    conv = get_spec("conv2d_3x3")
    big = dict(conv.default, vec=v, nv=4, mr=12, mb=64, nb=16, order="rows")
    for shape in ({"H": 1, "W": 1, "Cin": 2, "Cout": 1, "stride": 1},
                  {"H": 3, "W": 2, "Cin": 1, "Cout": 5, "stride": 2}):
        _check(conv, shape, [big], hw, runner)
    dw = get_spec("dwconv_3x3")
    big = dict(dw.default, vec=v, cv=2, wt=2, rt=4, order="pixels")
    for shape in ({"H": 1, "W": 1, "C": 3, "stride": 1}, {"H": 3, "W": 2, "C": v + 1, "stride": 2},
                  {"H": 5, "W": 9, "C": 3 * v, "stride": 1}):
        _check(dw, shape, [big], hw, runner)


@pytest.mark.parametrize("name", ("conv2d_3x3", "dwconv_3x3"))
def test_validate_shape(name):
    spec = get_spec(name)
    good = dict(spec.workloads[0].shape)
    assert spec.validate_shape(good) == good
    assert spec.validate_shape({**good, "stride": "2"})["stride"] == 2
    missing_w = {k: v for k, v in good.items() if k != "W"}
    for bad in ({**good, "stride": 3}, {**good, "stride": 0}, {**good, "H": 0}, missing_w):
        with pytest.raises(BadInput):
            spec.validate_shape(bad)


@pytest.mark.parametrize("name", ("conv2d_3x3", "dwconv_3x3"))
def test_kernel_refuses_unsupported_stride(name, hw, runner):
    """Even past validate_shape, the C kernel returns an error for a stride it does not implement."""
    spec = get_spec(name)
    shape = {**spec.workloads[0].shape, "H": 8, "W": 8, "stride": 3}
    m = runner.measure(spec, shape, build(spec, spec.space(shape, hw).valid_default(), hw).path, **FAST)
    assert not m.ok and "error code 2" in m.reason


@pytest.mark.parametrize("name", ("conv2d_3x3", "dwconv_3x3"))
def test_output_extent(name):
    spec = get_spec(name)
    base = dict(spec.workloads[0].shape)
    for h, s, ho in ((7, 2, 4), (8, 2, 4), (1, 2, 1), (2, 2, 1), (7, 1, 7)):
        assert spec.output_shapes({**base, "H": h, "W": h + 1, "stride": s})[0][:2] == (ho, (h + 1 - 1) // s + 1)


@pytest.mark.parametrize("name,shape", [("conv2d_3x3", CONV_SHAPES[1]), ("conv2d_3x3", CONV_SHAPES[3]),
                                        ("dwconv_3x3", DW_SHAPES[1]), ("dwconv_3x3", DW_SHAPES[3])])
def test_onnx_twin_on_odd_shapes(name, shape):
    pytest.importorskip("onnxruntime")
    from kernels.ort_twin import run_ort

    spec = get_spec(name)
    x = spec.make_inputs(shape, np.random.default_rng(0))
    got = run_ort(spec, shape, x, min_time_s=0.0, max_reps=5).outputs[0]
    np.testing.assert_allclose(got, spec.reference(shape, x)[0], rtol=spec.rtol * 10, atol=spec.atol * 10)


@pytest.mark.parametrize("name", ("conv2d_3x3", "dwconv_3x3"))
def test_stride_specialised_build_runs_its_stride_only(name, hw, runner):
    """A build for one workload bakes its stride in (a separate cached .so); it matches the reference at that stride
    and refuses the other with the kernel's unsupported-stride error, so a mix-up can never time the wrong code."""
    spec = get_spec(name)
    s1 = {**(CONV_SHAPES if name == "conv2d_3x3" else DW_SHAPES)[0], "stride": 1}
    s2 = {**s1, "stride": 2}
    cfg = spec.space(s1, hw).valid_default()
    generic, only1, only2 = build(spec, cfg, hw), build(spec, cfg, hw, shape=s1), build(spec, cfg, hw, shape=s2)
    assert len({generic.path, only1.path, only2.path}) == 3
    assert runner.measure(spec, s1, only1.path, **FAST).ok and runner.measure(spec, s2, only2.path, **FAST).ok
    wrong = runner.measure(spec, s2, only1.path, **FAST)
    assert not wrong.ok and "error code 2" in wrong.reason


def test_dwconv_build_for_one_shape_takes_only_its_paths(hw, runner):
    """A dwconv build for one workload also bakes in C and W, and compiles only the channel path (scalar, one-vector
    or cv-vector tiles) and the row path (narrower than wt pixels or not) that shape takes: each such build, with
    every activation, matches the reference, and refuses a shape that differs in C or in W alone."""
    dw, v = get_spec("dwconv_3x3"), _widest_vec(hw)
    base = dict(dw.default, vec=v, cv=2, wt=4)
    cases = [  # (shape, what it exercises)
        ({"H": 6, "W": 9, "C": v - 1, "stride": 1}, "scalar channels"),
        ({"H": 6, "W": 9, "C": v + 3, "stride": 2}, "one-vector tiles"),
        ({"H": 6, "W": 9, "C": 2 * v + 3, "stride": 1}, "cv-vector tiles and a shifted last tile"),
        ({"H": 7, "W": 5, "C": 2 * v + 3, "stride": 2}, "rows narrower than wt"),
    ]
    for i, (shape, what) in enumerate(cases):
        so = build(dw, base, hw, shape=shape).path
        m = runner.measure(dw, shape, so, act=("none", "relu", "relu6")[i % 3], **FAST)
        assert m.ok, f"{what} {shape}: {m.reason}"
    shape = cases[2][0]
    so = build(dw, base, hw, shape=shape).path
    for other in ({**shape, "C": shape["C"] + 1}, {**shape, "W": shape["W"] + 1}):
        wrong = runner.measure(dw, other, so, **FAST)
        assert not wrong.ok and "error code 2" in wrong.reason, other


def test_gemm_prunes_column_panels_wider_than_n(hw, runner):
    """A packed panel (nv * vec columns) holding a whole vector of padding past N only multiplies zeros: the space
    prunes it (nv=1 stays, its padding is a masked store), the default moves to its nearest valid neighbour, and a
    pruned config reused on such a shape is still correct."""
    gemm = get_spec("gemm")
    narrow = gemm.space({"M": 1, "N": 12, "K": 64}, hw)
    one_row = dict(gemm.default, mr=1)
    assert not narrow.is_valid(dict(one_row, nv=3, vec=8))  # 24 columns for 12: the third vector is all padding
    assert narrow.is_valid(dict(one_row, nv=2, vec=8)) and narrow.is_valid(dict(one_row, nv=3, vec=4))
    assert narrow.valid_default() == one_row  # the default's nv=2, vec=8 stays: 4 padded lanes, masked
    assert gemm.space({"M": 1, "N": 24, "K": 64}, hw).is_valid(dict(one_row, nv=3, vec=8))
    _check(gemm, {"M": 3, "N": 12, "K": 64}, [dict(gemm.default, nv=4, vec=8)], hw, runner)
