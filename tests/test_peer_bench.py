"""bench/kernels_vs_peers.py's peers compute the kernel's op: each native-layout graph matches the spec's reference
(with and without a fused epilogue, one copy and R copies), and the ORT profile parses into per-round op times."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.peers.cases import Epilogue, make_case
from kernels.registry import get_spec

pytest.importorskip("onnxruntime")

# one workload per kernel, the smallest; the stride-2 ones take TFLite's explicit-PAD path
ONE_PER_KERNEL = [("gemm", "kws_dscnn.pw4"), ("conv2d_3x3", "kws_res8.conv0"), ("dwconv_3x3", "kws_dscnn_l.dw1"),
                  ("conv1d", "tc_resnet8.block1.conv2"), ("gru", "kws_crnn.gru"), ("logmel", "wakeword.stream.logmel")]
STRIDE2 = [("conv2d_3x3", "mobilenetv2.stem"), ("dwconv_3x3", "mobilenetv2.b1.dw"), ("conv1d", "whisper_tiny.conv2")]
EPILOGUES = [Epilogue(), Epilogue(bias=True, act="relu6")]


def _case(kernel: str, workload: str, ep: Epilogue = Epilogue()):
    spec = get_spec(kernel)
    return make_case(spec, spec.workload(workload), ep)


def test_epilogue_extends_the_reference():
    """gemm fuses the epilogue: its bias is the kernel's own input (already in the reference), the activation
    applies on top, for the kernel and every peer alike."""
    plain, fused = _case("gemm", "kws_dscnn.fc"), _case("gemm", "kws_dscnn.fc", Epilogue(act="relu6"))
    assert fused.bias is fused.inputs[2] and fused.bias.shape == (12,)
    np.testing.assert_allclose(fused.want, np.clip(plain.want, 0, 6), rtol=1e-6)
    assert (fused.want == 0).any() and (plain.want < 0).any()  # the activation clips something
    assert _case("gru", "kws_crnn.gru", Epilogue(bias=True, act="relu")).bias is None  # no epilogue on a GRU


def test_a_bad_activation_is_refused_by_name():
    from edgetune.errors import BadInput

    with pytest.raises(BadInput, match="'gelu'.*relu6"):
        Epilogue(act="gelu")


@pytest.mark.parametrize("ep", EPILOGUES, ids=lambda e: e.label)
@pytest.mark.parametrize("kernel,workload", ONE_PER_KERNEL + STRIDE2)
def test_ort_native_graph_matches_the_reference(kernel, workload, ep):
    import onnxruntime as ort

    from bench.peers.ort_native import GRAPHS

    case = _case(kernel, workload, ep)
    for copies in (1, 2):
        g = GRAPHS[kernel](case, copies)
        sess = ort.InferenceSession(g.model, providers=["CPUExecutionProvider"])
        outs = sess.run(None, g.feed)
        assert len(outs) == copies
        for y in outs:
            assert case.check(g.to_kernel(y)) is None


def test_ort_profile_gives_op_times_per_round():
    from bench.peers.ort_native import OrtPeer

    peer = OrtPeer(_case("dwconv_3x3", "kws_dscnn_l.dw1"), threads=1, min_time_s=0.001)
    assert peer.error is None
    for _ in range(3):
        peer.sample()
    series = peer.series()
    assert set(series) == {"ORT", "ORT -reorder"} and all(len(v) == 3 for v in series.values())
    assert all(0 < lo <= hi for lo, hi in zip(series["ORT -reorder"], series["ORT"]))


def test_a_wrong_peer_is_not_timed():
    from bench.peers.ort_native import OrtPeer

    case = _case("gemm", "kws_dscnn.pw4")
    assert "wrong values" in OrtPeer(dataclasses.replace(case, want=case.want + 1.0), threads=1).error


@pytest.mark.parametrize("ep", EPILOGUES, ids=lambda e: e.label)
@pytest.mark.parametrize("kernel,workload", [kw for kw in ONE_PER_KERNEL if kw[0] not in ("gru", "logmel")] + STRIDE2)
def test_tflite_one_op_model_runs_on_xnnpack_and_matches(kernel, workload, ep):
    pytest.importorskip("ai_edge_litert", reason="ai-edge-litert is a bench extra")
    from bench.peers.tflite_xnnpack import TflitePeer

    peer = TflitePeer(_case(kernel, workload, ep), threads=1, min_time_s=0.001)
    assert peer.error is None  # delegated to XNNPACK, and the (possibly R-copy) model's first output matches
    peer.sample()
    assert peer.series()["XNNPACK"][0] > 0


def test_bench_rows_time_every_contender_and_rate_against_the_best_peer(tmp_path):
    import json

    from bench.kernels_vs_peers import main

    out = tmp_path / "peers.json"
    rc = main(["--kernels", "gemm,conv1d", "--workloads", "kws_dscnn.fc,tc_resnet8.block1.conv2", "--threads", "1",
               "--rounds", "2", "--tune-evals", "0", "--min-time", "0.002", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["workload"], r["threads"]) for r in rows] == [
        ("gemm", "kws_dscnn.fc", 1), ("conv1d", "tc_resnet8.block1.conv2", 1)]
    for r in rows:
        assert all(len(r["rounds"][n]) == 2 and all(t > 0 for t in r["rounds"][n])
                   for n in ("edgetune default", "edgetune tuned", "ORT", "ORT -reorder"))
        assert r["best_peer"] in ("ORT -reorder", "XNNPACK") and r["tuned_vs_best"] > 0
        assert r["tuned_source"] == "the default (no tuned config)"
        # the tuned config is the default: timed once, so tuned/default is exactly 1, not two samples' noise
        assert r["rounds"]["edgetune tuned"] == r["rounds"]["edgetune default"]


def test_bench_cells_keep_four_significant_digits_of_sub_microsecond_kernels():
    from bench.kernels_vs_peers import _ms

    assert [_ms(0.00009312), _ms(0.30741), _ms(12.3456), _ms(0.02)] == ["0.00009312", "0.3074", "12.35", "0.02"]


def test_bench_refuses_unknown_filters_by_name(capsys):
    from bench.kernels_vs_peers import main

    assert main(["--kernels", "gemm", "--workloads", "nosuch.layer"]) == 2
    assert "nosuch.layer" in capsys.readouterr().err
    assert main(["--threads", "one"]) == 2
    assert "--threads 'one'" in capsys.readouterr().err


def test_bench_runs_as_the_verbs_do(capsys):
    """Through edgetune.main.run_module, as bench/noise.py and bench/compile_time.py: the verbs' -v (debug logging)
    and their error handling, not a print-and-exit copy of it."""
    from bench.kernels_vs_peers import main

    assert main(["-v", "--threads", "one"]) == 2
    assert "error: --threads 'one' must be comma-separated integers" in " ".join(capsys.readouterr().err.split())
