"""ONNX import and workloads files: every mapping on small graphs built here, real block patterns, the file
format's round trip and its errors, and the `workloads` verb."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgetune.errors import BadInput
from kernels.onnx_import import DEFAULT_MELS, import_onnx
from kernels.registry import all_specs
from kernels.workload_files import (WorkloadEntry, collect_workloads, load_workload_files, read_workloads_file,
                                    write_workloads_file)

REPO = Path(__file__).resolve().parent.parent


def need(*kernels: str) -> None:
    missing = [k for k in kernels if k not in all_specs()]
    if missing:
        pytest.skip(f"kernel spec(s) not bundled yet: {', '.join(missing)}")


def weight(name: str, *shape: int) -> TensorProto:
    return numpy_helper.from_array(np.zeros(shape, np.float32), name)


def ints(name: str, *values: int, scalar: bool = False) -> TensorProto:
    return numpy_helper.from_array(np.array(values[0] if scalar else list(values), np.int64), name)


def save(tmp_path: Path, nodes: list, inputs: dict[str, list], inits: list = (), name: str = "net",
         opset: int = 17) -> Path:
    """A model whose graph inputs have the given (possibly symbolic) shapes; outputs are left to inference."""
    out = nodes[-1].output[0]
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def conv(x: str, y: str, w: str, name: str, **attrs) -> object:
    return helper.make_node("Conv", [x, w], [y], name=name, **attrs)


def layers(result) -> list[tuple[str, dict, int]]:
    return [(e.kernel, e.shape, e.count) for e in result.entries]


# --- mappings ----------------------------------------------------------------------------------------------

def test_conv3x3_stride1_and_stride2(tmp_path):
    need("conv2d_3x3")
    p = save(tmp_path, [conv("x", "y1", "w1", "c1", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                        conv("y1", "y2", "w2", "c2", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])],
             {"x": [1, 3, 32, 32]}, [weight("w1", 16, 3, 3, 3), weight("w2", 32, 16, 3, 3)])
    r = import_onnx(p, {})
    assert layers(r) == [("conv2d_3x3", {"H": 32, "W": 32, "Cin": 3, "Cout": 16, "stride": 1}, 1),
                         ("conv2d_3x3", {"H": 32, "W": 32, "Cin": 16, "Cout": 32, "stride": 2}, 1)]
    assert [e.name for e in r.entries] == ["net.conv2d_3x3.1", "net.conv2d_3x3.2"]
    assert r.entries[1].sources == ["Conv c2"]
    assert r.skipped == {} and r.dynamic == [] and r.warnings == []


def test_conv3x3_padding_other_than_one(tmp_path):
    """SAME_UPPER at stride 2 pads [0, 1]: the same work as pad 1, so mapped with a note; pad 0 is not."""
    need("conv2d_3x3")
    p = save(tmp_path, [conv("x", "y1", "w1", "same", kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
                        conv("y1", "y2", "w2", "valid", kernel_shape=[3, 3]),
                        conv("y2", "y3", "w2", "stride3", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[3, 3])],
             {"x": [1, 8, 32, 32]}, [weight("w1", 8, 8, 3, 3), weight("w2", 8, 8, 3, 3)])
    r = import_onnx(p, {})
    assert layers(r) == [("conv2d_3x3", {"H": 32, "W": 32, "Cin": 8, "Cout": 8, "stride": 2}, 1)]
    assert r.skipped == {"Conv": 2}
    text = "\n".join(r.warnings)
    assert "pads [0, 0, 1, 1] instead of 1" in text and "Conv same" in text
    assert "pads [0, 0, 0, 0]: the kernels assume pad 1" in text and "Conv valid" in text
    assert "stride=3 not allowed" in text and "Conv stride3" in text


def test_depthwise_3x3(tmp_path):
    need("dwconv_3x3")
    p = save(tmp_path, [conv("x", "y", "w", "dw", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2], group=32),
                        conv("y", "z", "w2", "grouped", kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=4)],
             {"x": [1, 32, 28, 28]}, [weight("w", 32, 1, 3, 3), weight("w2", 32, 8, 3, 3)])
    r = import_onnx(p, {})
    assert layers(r) == [("dwconv_3x3", {"H": 28, "W": 28, "C": 32, "stride": 2}, 1)]
    assert r.skipped == {"Conv": 1} and "grouped 3x3 convolution (group 4" in r.warnings[0]


def test_pointwise_conv_is_gemm_over_batch_and_pixels(tmp_path):
    need("gemm")
    p = save(tmp_path, [conv("x", "y", "w", "pw", kernel_shape=[1, 1])], {"x": [2, 24, 14, 14]},
             [weight("w", 96, 24, 1, 1)])
    assert layers(import_onnx(p, {})) == [("gemm", {"M": 2 * 14 * 14, "N": 96, "K": 24}, 1)]


def test_matmul(tmp_path):
    """Weights fold A's leading dims into M; a batched activation x activation product counts each batch."""
    need("gemm")
    p = save(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["y"], name="fc"),
                        helper.make_node("MatMul", ["q", "k"], ["s"], name="attn")],
             {"x": [2, 49, 64], "q": [4, 10, 16], "k": [4, 16, 10]}, [weight("w", 64, 12)])
    assert layers(import_onnx(p, {})) == [("gemm", {"M": 98, "N": 12, "K": 64}, 1),
                                          ("gemm", {"M": 10, "N": 10, "K": 16}, 4)]


def test_gemm_trans_b(tmp_path):
    need("gemm")
    p = save(tmp_path, [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=1)], {"x": [1, 64]},
             [weight("w", 12, 64), weight("b", 12)])
    assert layers(import_onnx(p, {})) == [("gemm", {"M": 1, "N": 12, "K": 64}, 1)]


def test_conv1d(tmp_path):
    need("conv1d", "gemm")
    p = save(tmp_path, [conv("x", "y", "w", "c", kernel_shape=[9], pads=[4, 4], strides=[2]),
                        conv("y", "z", "w1", "pw", kernel_shape=[1])],
             {"x": [1, 24, 101]}, [weight("w", 36, 24, 9), weight("w1", 48, 36, 1)])
    assert layers(import_onnx(p, {})) == [("conv1d", {"T": 101, "Cin": 24, "Cout": 36, "K": 9, "stride": 2}, 1),
                                          ("gemm", {"M": 51, "N": 48, "K": 36}, 1)]


def test_gru(tmp_path):
    need("gru")
    p = save(tmp_path, [helper.make_node("GRU", ["x", "W", "R"], ["y"], name="gru", hidden_size=64,
                                         linear_before_reset=1),
                        helper.make_node("GRU", ["x", "W2", "R2"], ["y2"], name="bi", hidden_size=32,
                                         direction="bidirectional", linear_before_reset=1,
                                         activations=["Sigmoid", "Tanh", "Sigmoid", "Tanh"])],
             {"x": [49, 1, 40]}, [weight("W", 1, 192, 40), weight("R", 1, 192, 64),
                                  weight("W2", 2, 96, 40), weight("R2", 2, 96, 32)])
    assert layers(import_onnx(p, {})) == [("gru", {"T": 49, "I": 40, "H": 64}, 1),
                                          ("gru", {"T": 49, "I": 40, "H": 32}, 2)]


@pytest.mark.parametrize("lbr", [0, 1])
def test_gru_maps_only_what_the_kernel_computes(tmp_path, lbr):
    """The gru kernel computes linear_before_reset=1; ONNX's default 0 is another recurrence, so not mapped.
    onnxruntime runs each real GRU node: only linear_before_reset=1 agrees with the kernel's reference."""
    need("gru")
    import onnxruntime as ort

    spec, shape = all_specs()["gru"], {"T": 6, "I": 5, "H": 4}
    x, w, r, b, h0 = spec.make_inputs(shape, np.random.default_rng(7))
    inits = [numpy_helper.from_array(a[None], n) for a, n in ((w, "W"), (r, "R"), (b, "B"))]
    inits.append(numpy_helper.from_array(h0.reshape(1, 1, -1), "h0"))
    node = helper.make_node("GRU", ["x", "W", "R", "B", "", "h0"], ["y"], name="gru", hidden_size=4,
                            linear_before_reset=lbr)
    p = save(tmp_path, [node], {"x": [6, 1, 5]}, inits, name=f"gru{lbr}")
    y = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x[:, None, :]})[0]
    same = np.allclose(y.reshape(6, 4), spec.reference(shape, [x, w, r, b, h0])[0], atol=1e-5)
    assert same == bool(lbr)
    result = import_onnx(p, {})
    if lbr:
        assert layers(result) == [("gru", shape, 1)] and result.skipped == {}
    else:
        assert result.entries == [] and result.skipped == {"GRU": 1}
        assert result.why["GRU"] == ["GRU with linear_before_reset=0 (the ONNX default) has no kernel: "
                                     "the gru kernel computes linear_before_reset=1, as PyTorch's GRU"]


def test_gru_with_other_activations_or_clip_is_not_mapped(tmp_path):
    need("gru")
    nodes = [helper.make_node("GRU", ["x", "W", "R"], [f"y{i}"], name=f"g{i}", hidden_size=4, linear_before_reset=1,
                              **attrs)
             for i, attrs in enumerate([{"activations": ["HardSigmoid", "Tanh"]}, {"clip": 3.0}])]
    p = save(tmp_path, nodes, {"x": [6, 1, 5]}, [weight("W", 1, 12, 5), weight("R", 1, 12, 4)])
    r = import_onnx(p, {})
    assert r.entries == [] and r.why["GRU"] == [
        "GRU with activations hardsigmoid, tanh has no kernel: the gru kernel runs Sigmoid, Tanh",
        "GRU with clip has no kernel"]


def _power_mel_log(spec: str, mels: int | None, bins: int = 257) -> tuple[list, list]:
    """|X|^2 summed over re/im, then (optionally) a [bins, mels] filterbank MatMul, + eps, Log."""
    nodes = [helper.make_node("Mul", [spec, spec], ["sq"]),
             helper.make_node("ReduceSum", ["sq", "last"], ["power"], keepdims=0)]
    inits = [ints("last", -1)]
    if mels:
        nodes += [helper.make_node("MatMul", ["power", "melfb"], ["mel"], name="mel"),
                  helper.make_node("Add", ["mel", "eps"], ["mel_eps"]), helper.make_node("Log", ["mel_eps"], ["out"])]
        inits += [weight("melfb", bins, mels), numpy_helper.from_array(np.array(1e-6, np.float32), "eps")]
    return nodes, inits


def test_stft_logmel(tmp_path):
    need("logmel")
    tail, inits = _power_mel_log("spec", 64)
    p = save(tmp_path, [helper.make_node("STFT", ["sig", "step", "win"], ["spec"], name="stft", onesided=1), *tail],
             {"sig": [1, 16000, 1]}, [ints("step", 160, scalar=True), weight("win", 512), *inits])
    r = import_onnx(p, {})
    assert layers(r) == [("logmel", {"samples": 16000, "n_fft": 512, "hop": 160, "mels": 64}, 1)]
    assert r.entries[0].sources == ["STFT stft → MatMul mel"]
    assert r.skipped == {} and r.warnings == []  # power, mel MatMul and log are all the kernel's work


def test_stft_without_filterbank_assumes_default_mels(tmp_path):
    need("logmel")
    tail, inits = _power_mel_log("spec", None)
    p = save(tmp_path, [helper.make_node("STFT", ["sig", "step", "", "len"], ["spec"], onesided=1), *tail],
             {"sig": [1, 8000, 1]}, [ints("step", 128, scalar=True), ints("len", 256, scalar=True), *inits])
    r = import_onnx(p, {})
    assert layers(r) == [("logmel", {"samples": 8000, "n_fft": 256, "hop": 128, "mels": DEFAULT_MELS}, 1)]
    assert f"mels={DEFAULT_MELS} assumed" in r.warnings[0]
    assert r.skipped == {"Mul": 1, "ReduceSum": 1}


def test_dft_logmel_front_end(tmp_path):
    """Framing by Gather, a window, DFT over the frame axis, power, mel MatMul, Log: one logmel, no gemm."""
    need("logmel")
    n_fft, hop, samples = 512, 160, 16000
    frames = 1 + (samples - n_fft) // hop
    idx = (np.arange(n_fft)[None, :] + hop * np.arange(frames)[:, None]).astype(np.int64)
    tail, inits = _power_mel_log("spec", 40)
    p = save(tmp_path, [helper.make_node("Gather", ["sig", "idx"], ["fr"], axis=1),
                        helper.make_node("Unsqueeze", ["fr", "last"], ["fr1"]),
                        helper.make_node("Mul", ["fr1", "win"], ["frw"]),
                        helper.make_node("DFT", ["frw"], ["spec"], name="dft", axis=2, onesided=1), *tail],
             {"sig": [1, samples]}, [numpy_helper.from_array(idx, "idx"), weight("win", n_fft, 1), *inits])
    r = import_onnx(p, {})
    assert layers(r) == [("logmel", {"samples": samples, "n_fft": n_fft, "hop": hop, "mels": 40}, 1)]
    assert "MatMul" not in r.skipped and r.skipped == {"Gather": 1, "Unsqueeze": 1, "Mul": 1}


def test_dft_without_mel_and_log_is_not_a_front_end(tmp_path):
    need("logmel")
    p = save(tmp_path, [helper.make_node("DFT", ["x"], ["spec"], axis=2, onesided=1)], {"x": [1, 97, 512, 1]})
    r = import_onnx(p, {})
    assert r.entries == [] and r.skipped == {"DFT": 1} and "not a log-mel front end" in r.warnings[0]


def test_spec_twins_import_to_their_own_workload(tmp_path):
    """Each bundled workload's ONNX twin imports to exactly that kernel and shape."""
    for spec in all_specs().values():
        for w in spec.workloads:
            p = tmp_path / f"{spec.name}.{w.name}.onnx"
            p.write_bytes(spec.onnx_model(w.shape))
            r = import_onnx(p, {})
            assert layers(r) == [(spec.name, w.shape, 1)], (spec.name, w.name, r.warnings)


# --- dynamic dims, unsupported ops, bad files ---------------------------------------------------------------

def test_symbolic_dims_need_dim(tmp_path):
    need("gemm", "gru")
    p = save(tmp_path, [conv("x", "y", "w", "pw", kernel_shape=[1, 1]),
                        helper.make_node("GRU", ["seq", "W", "R"], ["h"], name="gru", hidden_size=16,
                                         linear_before_reset=1)],
             {"x": ["batch", 8, 10, 10], "seq": ["time", 1, 8]},
             [weight("w", 4, 8, 1, 1), weight("W", 1, 48, 8), weight("R", 1, 48, 16)])
    r = import_onnx(p, {})
    assert r.entries == [] and r.dynamic == ["batch", "time"] and r.skipped == {"Conv": 1, "GRU": 1}
    assert any("--dim batch=N" in w and "Conv pw" in w for w in r.warnings)
    assert r.why == {"Conv": ["symbolic dim(s) batch unset: pass --dim batch=N"],
                     "GRU": ["symbolic dim(s) time unset: pass --dim time=N"]}
    r = import_onnx(p, {"batch": 2})
    assert layers(r) == [("gemm", {"M": 200, "N": 4, "K": 8}, 1)] and r.dynamic == ["time"]
    r = import_onnx(p, {"batch": 1, "time": 50})
    assert layers(r) == [("gemm", {"M": 100, "N": 4, "K": 8}, 1), ("gru", {"T": 50, "I": 8, "H": 16}, 1)]
    assert r.dynamic == [] and r.skipped == {}


def test_unknown_dim_name_is_bad_input(tmp_path):
    p = save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], {"x": ["batch", 4]})
    with pytest.raises(BadInput, match="no symbolic input dim 'bacth'.*batch"):
        import_onnx(p, {"bacth": 1})


def test_unsupported_ops_are_counted(tmp_path):
    need("gemm")
    p = save(tmp_path, [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["m"]),
                        helper.make_node("Relu", ["m"], ["r2"]), helper.make_node("Softmax", ["r2"], ["y"]),
                        conv("y4", "z", "w5", "c5", kernel_shape=[5, 5])],
             {"x": [1, 8], "y4": [1, 4, 8, 8]}, [weight("w", 8, 4), weight("w5", 4, 4, 5, 5)])
    r = import_onnx(p, {})
    assert layers(r) == [("gemm", {"M": 1, "N": 4, "K": 8}, 1)]
    assert r.skipped == {"Relu": 2, "Conv": 1, "Softmax": 1}
    assert any("5x5 convolution has no kernel" in w for w in r.warnings)


def test_corrupt_and_missing_files_are_bad_input(tmp_path):
    p = tmp_path / "broken.onnx"
    p.write_bytes(b"\x08\x07\x12\x03abc\xff\xff\xff garbage")
    with pytest.raises(BadInput, match="broken.onnx"):
        import_onnx(p, {})
    good = save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], {"x": [1, 4]}, name="good")
    cut = tmp_path / "truncated.onnx"
    cut.write_bytes(good.read_bytes()[:-7])
    with pytest.raises(BadInput, match="truncated.onnx"):
        import_onnx(cut, {})
    with pytest.raises(BadInput, match="cannot read .*nowhere.onnx"):
        import_onnx(tmp_path / "nowhere.onnx", {})


def test_duplicate_layers_merge_with_count(tmp_path):
    need("gemm")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h0"], name="fc0")]
    for i in range(1, 4):
        nodes.append(helper.make_node("MatMul", [f"h{i - 1}", "w"], [f"h{i}"], name=f"fc{i}"))
    nodes.append(helper.make_node("MatMul", ["h3", "w2"], ["y"], name="head"))
    p = save(tmp_path, nodes, {"x": [1, 16]}, [weight("w", 16, 16), weight("w2", 16, 2)])
    r = import_onnx(p, {})
    assert layers(r) == [("gemm", {"M": 1, "N": 16, "K": 16}, 4), ("gemm", {"M": 1, "N": 2, "K": 16}, 1)]
    assert [e.name for e in r.entries] == ["net.gemm.1", "net.gemm.2"]
    assert r.entries[0].sources == ["MatMul fc0", "MatMul fc1", "MatMul fc2", "MatMul fc3"]
    assert r.workload_entries()[0].source == "net.onnx: MatMul fc0 (+3 more)"
    assert import_onnx(p, {}).entries == r.entries  # deterministic


# --- real block patterns ------------------------------------------------------------------------------------

def test_mobilenetv2_inverted_residual(tmp_path):
    """1x1 expand -> BN -> ReLU6 -> dw 3x3 -> BN -> ReLU6 -> 1x1 project -> BN -> + input (MobileNetV2 block 3)."""
    need("gemm", "dwconv_3x3")
    c, e, hw = 24, 144, 56
    bn = [weight(f"bn_{p}", e) for p in ("s", "b", "m", "v")]
    bnp = [weight(f"bnp_{p}", c) for p in ("s", "b", "m", "v")]
    nodes = [conv("x", "e", "w_expand", "expand", kernel_shape=[1, 1]),
             helper.make_node("BatchNormalization", ["e", "bn_s", "bn_b", "bn_m", "bn_v"], ["e_bn"]),
             helper.make_node("Clip", ["e_bn", "zero", "six"], ["e_act"]),
             conv("e_act", "d", "w_dw", "dw", kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=e),
             helper.make_node("BatchNormalization", ["d", "bn_s", "bn_b", "bn_m", "bn_v"], ["d_bn"]),
             helper.make_node("Clip", ["d_bn", "zero", "six"], ["d_act"]),
             conv("d_act", "p", "w_project", "project", kernel_shape=[1, 1]),
             helper.make_node("BatchNormalization", ["p", "bnp_s", "bnp_b", "bnp_m", "bnp_v"], ["p_bn"]),
             helper.make_node("Add", ["p_bn", "x"], ["y"])]
    inits = [weight("w_expand", e, c, 1, 1), weight("w_dw", e, 1, 3, 3), weight("w_project", c, e, 1, 1),
             *bn, *bnp, numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(np.array(6, np.float32), "six")]
    r = import_onnx(save(tmp_path, nodes, {"x": [1, c, hw, hw]}, inits, name="mbv2_block"), {})
    assert layers(r) == [("gemm", {"M": hw * hw, "N": e, "K": c}, 1),
                         ("dwconv_3x3", {"H": hw, "W": hw, "C": e, "stride": 1}, 1),
                         ("gemm", {"M": hw * hw, "N": c, "K": e}, 1)]
    assert r.entries[0].shape == all_specs()["gemm"].workload("mobilenetv2.b2.expand").shape
    assert r.entries[1].shape == all_specs()["dwconv_3x3"].workload("mobilenetv2.b2.dw").shape
    assert r.skipped == {"BatchNormalization": 3, "Clip": 2, "Add": 1}
    assert [e.name for e in r.entries] == ["mbv2_block.gemm.1", "mbv2_block.dwconv_3x3.1", "mbv2_block.gemm.2"]


def test_kws_dscnn(tmp_path):
    """DS-CNN (Hello Edge): 10x4 conv s2 on 49x10 MFCCs, 4 x (dw 3x3 + pw 1x1) at 25x5x64, avg pool, FC to 12."""
    need("gemm", "dwconv_3x3")
    ch = 64
    nodes = [conv("mfcc", "c0", "w0", "conv0", kernel_shape=[10, 4], strides=[2, 2], pads=[4, 1, 5, 2]),
             helper.make_node("Relu", ["c0"], ["a0"])]
    inits = [weight("w0", ch, 1, 10, 4), weight("fc_w", 12, ch), weight("fc_b", 12), ints("flat", 1, ch)]
    for i in range(1, 5):
        nodes += [conv(f"a{i - 1}", f"d{i}", f"dw{i}", f"dw{i}", kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=ch),
                  helper.make_node("Relu", [f"d{i}"], [f"da{i}"]),
                  conv(f"da{i}", f"p{i}", f"pw{i}", f"pw{i}", kernel_shape=[1, 1]),
                  helper.make_node("Relu", [f"p{i}"], [f"a{i}"])]
        inits += [weight(f"dw{i}", ch, 1, 3, 3), weight(f"pw{i}", ch, ch, 1, 1)]
    nodes += [helper.make_node("GlobalAveragePool", ["a4"], ["pool"]),
              helper.make_node("Reshape", ["pool", "flat"], ["feat"]),
              helper.make_node("Gemm", ["feat", "fc_w", "fc_b"], ["logits"], name="fc", transB=1)]
    r = import_onnx(save(tmp_path, nodes, {"mfcc": [1, 1, 49, 10]}, inits, name="kws_dscnn"), {})
    assert layers(r) == [("dwconv_3x3", {"H": 25, "W": 5, "C": ch, "stride": 1}, 4),
                         ("gemm", {"M": 125, "N": ch, "K": ch}, 4),
                         ("gemm", {"M": 1, "N": 12, "K": ch}, 1)]
    gemm = all_specs()["gemm"]
    assert r.entries[1].shape == gemm.workload("kws_dscnn.pw4").shape
    assert r.entries[2].shape == gemm.workload("kws_dscnn.fc").shape
    assert r.entries[0].sources == ["Conv dw1", "Conv dw2", "Conv dw3", "Conv dw4"]
    assert r.skipped == {"Relu": 9, "Conv": 1, "GlobalAveragePool": 1, "Reshape": 1}
    assert any("10x4 convolution has no kernel" in w and "Conv conv0" in w for w in r.warnings)


# --- workloads files ----------------------------------------------------------------------------------------

def test_file_round_trip(tmp_path):
    need("gemm", "dwconv_3x3")
    p = save(tmp_path, [conv("x", "y", "w", "dw", kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=8),
                        conv("y", "z", "w1", "pw", kernel_shape=[1, 1]), conv("z", "z2", "w2", "pw2", kernel_shape=[1, 1])],
             {"x": [1, 8, 10, 10]}, [weight("w", 8, 1, 3, 3), weight("w1", 8, 8, 1, 1), weight("w2", 8, 8, 1, 1)])
    r = import_onnx(p, {})
    out = tmp_path / "net.workloads.toml"
    write_workloads_file(out, r.workload_entries(), "imported from net.onnx\nsecond line")
    text = out.read_text()
    assert text.startswith("# edgetune workloads file\n# imported from net.onnx\n# second line\n")
    assert 'shape = { M = 100, N = 8, K = 8 }' in text and "count = 2" in text
    got = load_workload_files([str(out)])
    assert [(s.name, w.name, w.shape, w.source) for s, w in got] == [
        (e.kernel, e.name, e.shape, e.source) for e in r.workload_entries()]
    assert read_workloads_file(out) == r.workload_entries()
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]


def test_file_defaults_strings_and_merging(tmp_path):
    need("gemm")
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    write_workloads_file(a, [WorkloadEntry("gemm", {"M": 3, "N": 4, "K": 5}, count=2, source='odd "quoted"\\path\n'),
                             WorkloadEntry("gemm", {"M": 1, "N": 12, "K": 64}, "mine.fc")])
    b.write_text('[[workload]]\nkernel = "gemm"\nshape = { K = 5, M = 3, N = 4 }\ncount = 3\n')
    lws = collect_workloads([str(a), str(b)])
    assert [(lw.workload.name, lw.count, lw.origin) for lw in lws] == [
        ("custom.M3-N4-K5", 5, str(a)), ("mine.fc", 1, str(a))]
    assert lws[0].workload.source == 'odd "quoted"\\path\n'
    # "bundled" plus a glob: the duplicate of a bundled shape keeps the bundled name
    both = load_workload_files(["bundled", str(tmp_path / "*.toml")])
    names = [w.name for _, w in both]
    assert "kws_dscnn.fc" in names and "mine.fc" not in names
    assert len(both) == sum(len(s.workloads) for s in all_specs().values()) + 1
    assert load_workload_files([str(tmp_path / "none-*.toml")]) == []
    assert load_workload_files([str(tmp_path)]) == load_workload_files([str(a), str(b)])


@pytest.mark.parametrize("text,match", [
    ('[[workload]]\nkernel = "gemm"\nshape = { M = 1, N = 2 K = 3 }\n', r"bad\.toml: not valid TOML: .*line 3"),
    ('[[workload]]\nkernel = "gemm"\nshape = { M = 1, N = 2, K = 3 }\n\n[[workload]]\nkernel = "fft"\nshape = { N = 1 }\n',
     r"bad\.toml: \[\[workload\]\] #2: unknown kernel 'fft'; kernels: gemm"),
    ('[[workload]]\nkernel = "gemm"\nshape = { M = 1, N = 2, X = 3 }\n', r"#1: gemm: unknown dimension\(s\) X"),
    ('[[workload]]\nkernel = "gemm"\nshape = { M = 1, N = 2, K = 0 }\n', r"#1: gemm: dimension K=0 must be a positive"),
    ('[[workload]]\nkernel = "gemm"\nshape = { M = 1, N = 2, K = "3" }\n', r"#1: shape value\(s\) K='3' must be integers"),
    ('[[workload]]\nkernel = "gemm"\nshape = { M = 1, N = 2, K = 3 }\ncount = 0\n', r"#1: count 0 must be a positive"),
    ('[[workload]]\nkernel = "gemm"\nshap = { M = 1, N = 2, K = 3 }\n', r"#1: unknown key\(s\) shap"),
    ('[[workload]]\nkernel = "gemm"\nname = "a/b"\nshape = { M = 1, N = 2, K = 3 }\n', r"#1: name 'a/b' must be"),
    ('[[workload]]\nkernel = "gemm"\nname = "custom.M9-N9-K9"\nshape = { M = 1, N = 2, K = 3 }\n',
     r"#1: names starting with 'custom\.' .*'custom\.M1-N2-K3'"),
    ('[[workload]]\nkernel = "gemm"\nshape = { M = 1000000000000, N = 1, K = 1 }\n',
     r"#1: gemm shape .* MB of buffers, over the 512 MB cap"),  # refused before a worker tries to allocate it
    ('[workload]\nkernel = "gemm"\n', r"must be an array of tables"),
    ('kernel = "gemm"\n', r"unknown top-level key\(s\) kernel"),
])
def test_bad_files_are_bad_input(tmp_path, text, match):
    need("gemm")
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(BadInput, match=match):
        load_workload_files([str(p)])


def test_one_name_for_two_shapes_is_bad_input(tmp_path):
    need("gemm")
    p = tmp_path / "w.toml"
    p.write_text('[[workload]]\nkernel = "gemm"\nname = "kws_dscnn.fc"\nshape = { M = 2, N = 12, K = 64 }\n')
    with pytest.raises(BadInput, match=r"gemm/kws_dscnn\.fc is .* in bundled but .* in .*w\.toml"):
        load_workload_files(["bundled", str(p)])


def test_missing_file_and_unwritable_entries(tmp_path):
    need("gemm")
    with pytest.raises(BadInput, match="nope.toml does not exist"):
        load_workload_files([str(tmp_path / "nope.toml")])
    with pytest.raises(BadInput, match="unknown kernel 'fft'"):
        write_workloads_file(tmp_path / "x.toml", [WorkloadEntry("fft", {"N": 4})])
    assert not list(tmp_path.iterdir())


# --- the `workloads` verb -----------------------------------------------------------------------------------

def edgetune(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "edgetune.main", "workloads", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_import_and_list(tmp_path):
    need("gemm")
    p = save(tmp_path, [conv("x", "y", "w", "pw", kernel_shape=[1, 1]), helper.make_node("Relu", ["y"], ["z"])],
             {"x": ["batch", 8, 10, 10]}, [weight("w", 4, 8, 1, 1)], name="tiny")
    r = edgetune("import", str(p), "--dim", "batch=1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    out = tmp_path / "tiny.workloads.toml"
    assert data["output"] == str(out) and out.exists()
    assert [(e["kernel"], e["shape"], e["count"]) for e in data["entries"]] == [("gemm", {"M": 100, "N": 4, "K": 8}, 1)]
    assert data["skipped"] == {"Relu": 1} and data["dynamic"] == []
    assert "# dims: batch=1" in out.read_text()

    r = edgetune("import", str(p), "-o", str(tmp_path / "o.toml"), cwd=tmp_path)  # batch left open: nothing maps
    assert r.returncode == 2 and not (tmp_path / "o.toml").exists(), r.stderr
    err = " ".join(r.stderr.split())
    assert "no layer of tiny.onnx maps" in err and "dim(s) batch are unset" in err and "--dim batch=N" in err

    r = edgetune("list", "--workloads", str(out), "--workloads", "bundled", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["files"] == [str(out), "bundled"]
    assert data["workloads"][0] == {"kernel": "gemm", "name": "tiny.gemm.1", "shape": {"M": 100, "N": 4, "K": 8},
                                    "count": 1, "source": "tiny.onnx: Conv pw", "origin": str(out)}
    r = edgetune("list", cwd=tmp_path)
    assert r.returncode == 0 and "kws_dscnn.fc" in r.stdout


def test_cli_table_says_why_a_layer_is_not_mapped(tmp_path):
    """With part of a model mapped the file is written, and the not-mapped table says which dim would map the rest."""
    need("gemm")
    p = save(tmp_path, [conv("x", "y", "w", "pw", kernel_shape=[1, 1]), helper.make_node("MatMul", ["v", "m"], ["z"])],
             {"x": ["batch", 8, 10, 10], "v": [3, 8]}, [weight("w", 4, 8, 1, 1), weight("m", 8, 2)], name="half")
    r = edgetune("import", str(p), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["why"] == {"Conv": ["symbolic dim(s) batch unset: pass --dim batch=N"]}
    r = edgetune("import", str(p), cwd=tmp_path)
    assert r.returncode == 0 and "why" in r.stdout and "batch unset" in r.stdout, r.stdout
    assert "wrote" in r.stdout and "half.gemm.1" in (tmp_path / "half.workloads.toml").read_text()


def test_cli_refuses_a_model_of_which_nothing_maps(tmp_path):
    p = save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], {"x": [1, 4]}, name="relu")
    r = edgetune("import", str(p), cwd=tmp_path)
    assert r.returncode == 2 and not (tmp_path / "relu.workloads.toml").exists()
    assert "no layer of relu.onnx maps onto a bundled kernel (not mapped: Relu x1)" in " ".join(r.stderr.split())


@pytest.mark.parametrize("args,match", [
    (["--dim", "batch"], "not NAME=VALUE"),
    (["--dim", "batch=-1"], "positive integer"),
    (["--dim", "time=4"], "no symbolic input dim 'time'"),
])
def test_cli_bad_dim_exits_2(tmp_path, args, match):
    p = save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], {"x": ["batch", 4]})
    r = edgetune("import", str(p), *args, cwd=tmp_path)
    assert r.returncode == 2 and match in r.stderr, r.stderr


def test_cli_corrupt_model_and_bad_file_exit_2(tmp_path):
    p = tmp_path / "junk.onnx"
    p.write_bytes(b"\xff\xfe not protobuf")
    r = edgetune("import", str(p), cwd=tmp_path)
    assert r.returncode == 2 and "junk.onnx" in r.stderr
    assert not (tmp_path / "junk.workloads.toml").exists()
    bad = tmp_path / "bad.toml"
    bad.write_text("[[workload]\n")
    r = edgetune("list", "--workloads", str(bad), cwd=tmp_path)
    assert r.returncode == 2 and "bad.toml" in r.stderr and "line 1" in r.stderr
