"""Speech kernels (logmel, conv1d, gru): odd shapes, every knob value, shape validation and reference sanity."""

from __future__ import annotations

import random

import numpy as np
import pytest

from edgetune.errors import BadInput
from kernels.build import build, build_many
from kernels.registry import get_spec
from tests.knob_values import every_knob_value

# Shapes that are multiples of no vector width or tile: remainders in every loop.
ODD_SHAPES = {
    "logmel": [
        {"samples": 1000, "n_fft": 256, "hop": 77, "mels": 13},  # samples not aligned to hop, 10 frames
        {"samples": 512, "n_fft": 512, "hop": 160, "mels": 40},  # exactly one frame
        {"samples": 5000, "n_fft": 1024, "hop": 1024, "mels": 7},  # hop == n_fft, 4 frames
    ],
    "conv1d": [
        {"T": 7, "Cin": 13, "Cout": 19, "K": 5, "stride": 1},
        {"T": 7, "Cin": 13, "Cout": 19, "K": 5, "stride": 2},
        {"T": 1, "Cin": 1, "Cout": 1, "K": 1, "stride": 1},
        {"T": 2, "Cin": 3, "Cout": 50, "K": 4, "stride": 2},  # even K, kernel longer than the input
        {"T": 33, "Cin": 17, "Cout": 71, "K": 9, "stride": 2},
    ],
    "gru": [
        {"T": 3, "I": 7, "H": 13},
        {"T": 1, "I": 1, "H": 1},
        {"T": 5, "I": 33, "H": 40},
        {"T": 4, "I": 17, "H": 100},
    ],
}
KERNELS = list(ODD_SHAPES)
# the odd shape on which every knob value is valid (no tile is pruned as wider than the problem)
KNOB_SHAPE = {"logmel": {"samples": 16000, "n_fft": 256, "hop": 77, "mels": 13}, "conv1d": ODD_SHAPES["conv1d"][4],
              "gru": ODD_SHAPES["gru"][3]}


def _odd_cases():
    for name, shapes in ODD_SHAPES.items():
        for i, shape in enumerate(shapes):
            yield pytest.param(name, shape, id=f"{name}-{i}")


def _measure_ok(runner, spec, shape, cfgs, hw):
    builds = build_many(spec, cfgs, hw)
    for cfg, b in zip(cfgs, builds):
        assert not isinstance(b, Exception), f"{cfg}: {b}"
        m = runner.measure(spec, shape, b.path, min_time_s=0.01, max_reps=5)
        assert m.ok, f"{spec.name} {shape} {cfg}: {m.reason}"


@pytest.mark.parametrize("name,shape", list(_odd_cases()))
def test_odd_shapes_match_reference(name, shape, hw, runner):
    spec = get_spec(name)
    shape = spec.validate_shape(shape)
    space = spec.space(shape, hw)
    cfgs = [space.valid_default()] + space.sample(3, random.Random(11))
    _measure_ok(runner, spec, shape, cfgs, hw)


@pytest.mark.parametrize("name", KERNELS)
def test_every_knob_value_is_correct(name, hw, runner):
    """Each value of each knob, in the valid config nearest the default: every code path computes right values."""
    spec = get_spec(name)
    shape = KNOB_SHAPE[name]
    _measure_ok(runner, spec, shape, every_knob_value(spec, shape, hw), hw)


def test_defaults_are_valid_on_avx2():
    from types import SimpleNamespace

    avx2 = SimpleNamespace(vector_bits=256, cores=2, big_cores=2, vector_registers=16, march="x86-64-v3")
    for name in KERNELS:
        spec = get_spec(name)
        for w in spec.workloads:
            space = spec.space(w.shape, avx2)
            assert space.is_valid(spec.default), (name, w.name, space.violations(spec.default))
            assert spec.default["vec"] == 8


@pytest.mark.parametrize("shape,why", [
    ({"samples": 255, "n_fft": 256, "hop": 128, "mels": 40}, "samples"),
    ({"samples": 16000, "n_fft": 300, "hop": 160, "mels": 40}, "n_fft"),
    ({"samples": 16000, "n_fft": 500, "hop": 160, "mels": 40}, "n_fft"),
    ({"samples": 16000, "n_fft": 256, "hop": 300, "mels": 40}, "hop"),
    ({"samples": 16000, "n_fft": 256, "hop": 0, "mels": 40}, "hop"),
    ({"samples": 16000, "n_fft": 256, "hop": 128}, "missing"),
])
def test_logmel_rejects_bad_shapes(shape, why):
    with pytest.raises(BadInput, match=why):
        get_spec("logmel").validate_shape(shape)


def test_conv1d_and_gru_reject_bad_shapes():
    conv = get_spec("conv1d")
    with pytest.raises(BadInput, match="stride"):
        conv.validate_shape({"T": 10, "Cin": 4, "Cout": 4, "K": 3, "stride": 3})
    with pytest.raises(BadInput, match="K"):
        conv.validate_shape({"T": 10, "Cin": 4, "Cout": 4, "K": 0, "stride": 1})
    with pytest.raises(BadInput, match="unknown"):
        get_spec("gru").validate_shape({"T": 3, "I": 7, "H": 13, "layers": 2})


def test_logmel_reference_finds_a_tone():
    """A 1 kHz tone lands in the mel filter whose centre is nearest 1 kHz; frames = 1 + (samples - n_fft) // hop."""
    from kernels.specs import logmel

    shape = {"samples": 4000, "n_fft": 512, "hop": 160, "mels": 40}
    spec = get_spec("logmel")
    _, win, tw, fb = spec.make_inputs(shape, np.random.default_rng(0))
    audio = np.sin(2 * np.pi * 1000.0 * np.arange(4000) / logmel.SAMPLE_RATE).astype(np.float32)
    (out,) = spec.reference(shape, [audio, win, tw, fb])
    assert out.shape == (1 + (4000 - 512) // 160, 40)
    bin_1k = round(1000.0 * 512 / logmel.SAMPLE_RATE)
    assert set(np.argmax(out, axis=1)) == {int(np.argmax(fb[bin_1k]))}
    # the twiddle input is exp(-2 pi i k / n_fft)
    k = np.arange(256)
    np.testing.assert_allclose(tw[0] + 1j * tw[1], np.exp(-2j * np.pi * k / 512), atol=1e-6)


def test_conv1d_reference_against_direct_sum():
    spec = get_spec("conv1d")
    shape = {"T": 9, "Cin": 3, "Cout": 4, "K": 3, "stride": 2}
    x, w, bias = spec.make_inputs(shape, np.random.default_rng(1))
    (out,) = spec.reference(shape, [x, w, bias])
    assert out.shape == (5, 4)
    for t in range(5):
        want = bias + sum(x[t * 2 + k - 1] @ w[k] for k in range(3) if 0 <= t * 2 + k - 1 < 9)
        np.testing.assert_allclose(out[t], want, rtol=1e-5, atol=1e-6)


def test_gru_reference_first_step_by_hand():
    spec = get_spec("gru")
    shape = {"T": 2, "I": 3, "H": 2}
    x, W, R, B, h0 = spec.make_inputs(shape, np.random.default_rng(2))
    (Y,) = spec.reference(shape, [x, W, R, B, h0])
    H = 2
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    gx, gh = W @ x[0] + B[:3 * H], R @ h0 + B[3 * H:]
    z, r = sig(gx[:H] + gh[:H]), sig(gx[H:2 * H] + gh[H:2 * H])
    n = np.tanh(gx[2 * H:] + r * gh[2 * H:])  # linear_before_reset=1
    np.testing.assert_allclose(Y[0], (1 - z) * n + z * h0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,shape", list(_odd_cases()))
def test_onnx_twin_on_odd_shapes(name, shape):
    pytest.importorskip("onnxruntime")
    from kernels.ort_twin import run_ort

    spec = get_spec(name)
    inputs = spec.make_inputs(shape, np.random.default_rng(0))
    (ref,) = spec.reference(shape, inputs)
    (got,) = run_ort(spec, shape, inputs, min_time_s=0.0, max_reps=5).outputs
    np.testing.assert_allclose(got.reshape(ref.shape), ref, rtol=spec.rtol * 10, atol=spec.atol * 10)


def test_kernel_rejects_bad_dims_in_c(hw):
    """The C side refuses shapes it cannot compute (non-pow2 n_fft, samples < n_fft) instead of reading past ends."""
    import ctypes

    spec = get_spec("logmel")
    lib = ctypes.CDLL(str(build(spec, spec.space({"samples": 512, "n_fft": 256, "hop": 128, "mels": 8}, hw)
                                .valid_default(), hw).path))
    buf = (ctypes.c_float * 4096)()
    bufs = (ctypes.c_void_p * 5)(*[ctypes.addressof(buf)] * 5)
    for dims in ((100, 256, 128, 8), (512, 300, 128, 8), (512, 256, 0, 8)):
        assert lib.et_run((ctypes.c_int64 * 4)(*dims), bufs, None, 0) != 0
