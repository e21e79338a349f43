"""Custom shapes are first-class workloads on every verb; an imported ONNX model tunes exactly its layers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kernels.workload_files import WorkloadEntry, write_workloads_file


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgetune.main", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def test_bench_custom_shape():
    p = _cli("bench", "gemm", "--shape", "M=100,N=200,K=300", "--default", "--json")
    assert p.returncode == 0, p.stderr
    row = json.loads(p.stdout)
    assert row["ok"] and row["workload"] == "custom.M100-N200-K300" and row["shape"] == {"M": 100, "N": 200, "K": 300}


def test_tune_custom_shape_then_report_pin_verify():
    p = _cli("tune", "--kernel", "dwconv_3x3", "--shape", "H=20,W=20,C=96,stride=1", "--budget", "10", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)["results"][0]
    assert res["workload"] == "custom.H20-W20-C96-stride1" and 1 <= res["evals"] <= 10
    rep = json.loads(_cli("report", "--json").stdout)
    assert [r["workload"] for r in rep] == ["custom.H20-W20-C96-stride1"]
    v = _cli("verify", "--kernel", "dwconv_3x3", "--shape", "H=20,W=20,C=96,stride=1", "--threshold", "10", "--json")
    assert v.returncode == 0, v.stderr
    assert json.loads(v.stdout)[0]["workload"] == "custom.H20-W20-C96-stride1"
    pin = _cli("pin", "dwconv_3x3", "H=20,W=20,C=96,stride=1", '{"vec": 4}', "--json")
    assert pin.returncode == 0, pin.stderr
    assert json.loads(_cli("report", "--json").stdout)[0]["config"]["vec"] == 4
    un = _cli("unpin", "dwconv_3x3", "H=20,W=20,C=96,stride=1", "--json")  # the shape, as pin took it
    assert un.returncode == 0 and json.loads(un.stdout) == {"unpinned": 1}, un.stderr
    un = _cli("unpin", "dwconv_3x3", "no.such.layer")
    assert un.returncode == 2 and "no pin for dwconv_3x3/no.such.layer" in un.stderr
    gone = _cli("forget", "dwconv_3x3", "H=20,W=20,C=96,stride=1", "--json")  # the shape, as tune took it
    assert gone.returncode == 0 and json.loads(gone.stdout)["workload"] == "custom.H20-W20-C96-stride1", gone.stderr
    assert json.loads(_cli("report", "--json").stdout) == []


def test_tune_table_says_where_the_time_went():
    """A fresh result's time is split into compile, measure and strategy; a cached one took no time, so no line."""
    args = ("tune", "--kernel", "gemm", "--shape", "M=30,N=40,K=50", "--strategy", "random", "--budget", "3")
    fresh = _cli(*args)
    assert fresh.returncode == 0, fresh.stderr
    line = next(ln for ln in fresh.stdout.splitlines() if ln.startswith("tuning time "))
    assert all(f"{part} " in line for part in ("compile", "measure", "strategy")), line
    cached = _cli(*args)
    assert cached.returncode == 0 and "(cached)" in cached.stdout and "tuning time " not in cached.stdout


@pytest.mark.parametrize("shape,needle", [
    ("M=100,N=200", "missing dimension(s) K; dimensions are: M, N, K"),
    ("M=100,N=200,K=300,Z=1", "unknown dimension(s) Z"),
    ("M=100,N=0,K=300", "dimension N=0 must be a positive integer"),
    ("M=100,N=-4,K=300", "dimension N=-4 must be a positive integer"),
    ("M=100,N=abc,K=300", "dimension N=abc must be a positive integer"),
    ("M=100,N,K=300", "is not NAME=VALUE"),
    ("M=200000,N=200000,K=300", "MB of buffers, over the 512 MB cap"),
])
def test_bad_shapes_exit_2(shape, needle):
    p = _cli("bench", "gemm", "--shape", shape, "--default")
    assert p.returncode == 2, p.stderr
    assert needle in " ".join(p.stderr.split())


@pytest.mark.parametrize("cap", ["abc", "-5", "0", "nan", "inf"])
def test_a_bad_input_cap_names_the_variable_and_the_valid_range(cap):
    p = _cli("bench", "gemm", "--shape", "M=10,N=20,K=30", env={**os.environ, "EDGETUNE_MAX_INPUT_MB": cap})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert (f"EDGETUNE_MAX_INPUT_MB='{cap}' is not a valid cap: give a number of megabytes above 0"
            in " ".join(p.stderr.split())), p.stderr


def test_a_small_cap_reads_as_its_value_not_zero():
    p = _cli("bench", "gemm", "--shape", "M=100,N=100,K=100", env={**os.environ, "EDGETUNE_MAX_INPUT_MB": "0.05"})
    assert p.returncode == 2
    assert "needs about 0.12 MB of buffers, over the 0.05 MB cap" in " ".join(p.stderr.split()), p.stderr


def test_dwconv_bad_stride_names_allowed():
    p = _cli("tune", "--kernel", "dwconv_3x3", "--shape", "H=20,W=20,C=96,stride=3")
    assert p.returncode == 2 and "stride=3 not allowed; allowed: 1, 2" in " ".join(p.stderr.split())


def test_import_onnx_then_tune_exactly_those_layers(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    rng = np.random.default_rng(0)
    w_pw = numpy_helper.from_array(rng.standard_normal((32, 16, 1, 1)).astype(np.float32), "w_pw")
    w_dw = numpy_helper.from_array(rng.standard_normal((32, 1, 3, 3)).astype(np.float32), "w_dw")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w_pw"], ["a"], kernel_shape=[1, 1]),
         helper.make_node("Relu", ["a"], ["b"]),
         helper.make_node("Conv", ["b", "w_dw"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=32)],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 12, 12])], initializer=[w_pw, w_dw])
    model = tmp_path / "tiny.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    wl_file = tmp_path / "tiny.workloads.toml"
    p = _cli("workloads", "import", str(model), "-o", str(wl_file), "--json")
    assert p.returncode == 0, p.stderr
    p = _cli("tune", "--workloads", str(wl_file), "--budget", "3", "--json")
    assert p.returncode == 0, p.stderr
    tuned = {(r["kernel"], tuple(sorted(r["shape"].items()))) for r in json.loads(p.stdout)["results"]}
    assert tuned == {("gemm", (("K", 16), ("M", 144), ("N", 32))),
                     ("dwconv_3x3", (("C", 32), ("H", 12), ("W", 12), ("stride", 1)))}
    import tomllib

    imported = {(w["kernel"], w["name"]) for w in tomllib.loads(wl_file.read_text())["workload"]}
    rep = json.loads(_cli("report", "--json").stdout)
    assert {(r["kernel"], r["workload"]) for r in rep} == imported and len(imported) == 2
    v = _cli("verify", "--threshold", "10", "--json")  # every active config, imported ones without their file
    assert v.returncode == 0, v.stderr
    assert {(r["kernel"], r["workload"]) for r in json.loads(v.stdout)} == imported
    kernel, name = sorted(imported)[0]
    v = _cli("verify", "--workload", name, "--threshold", "10", "--json")
    assert v.returncode == 0 and [r["workload"] for r in json.loads(v.stdout)] == [name], v.stderr
    pin = _cli("pin", kernel, name, "{}", "--json")
    assert pin.returncode == 0 and json.loads(pin.stdout)["workload"] == name, pin.stderr
    bad = _cli("verify", "--workload", "no.such.layer")
    assert bad.returncode == 2 and "no active config for workload 'no.such.layer'" in bad.stderr


def test_a_workloads_file_cannot_reuse_a_bundled_name_for_another_shape(tmp_path):
    """Applications load an active config by its workload name: a file's kws_dscnn.fc of another shape would
    replace the bundled layer's config, so tune refuses it as `workloads list` does."""
    f = tmp_path / "clash.toml"
    f.write_text('[[workload]]\nkernel = "gemm"\nname = "kws_dscnn.fc"\nshape = { M = 2, N = 12, K = 64 }\n')
    p = _cli("tune", "--workloads", str(f), "--budget", "2")
    err = " ".join(p.stderr.split())  # rich wraps long lines
    assert p.returncode == 2 and "in bundled" in err and "a name must mean one shape" in err, err
    assert _cli("report", "--json").stdout.strip() == "[]"


def test_tune_refuses_a_workload_and_a_shape_together():
    p = _cli("tune", "--kernel", "gemm", "--workload", "kws_dscnn.fc", "--shape", "M=1,N=2,K=3")
    assert p.returncode == 2 and "not both" in p.stderr


def test_user_values_print_verbatim_not_as_markup(tmp_path):
    """Errors and tables go through rich: a name holding `[/x]` must not crash it, `[bold]` must not vanish."""
    p = _cli("bench", "[/x]", "--workload", "a")
    assert p.returncode == 2 and "unknown kernel '[/x]'" in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = _cli("bench", "gemm", "--workload", "[bold]kws")
    assert p.returncode == 2 and "'[bold]kws'" in p.stderr, p.stderr
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tuning]\nobjective = "energy"\n')
    p = _cli("config", "check", "--config", str(cfg))
    assert p.returncode == 2 and "set [power] meter" in p.stdout, p.stdout


@pytest.mark.parametrize("var, verb", [("STATE_DIRECTORY", ("report",)),
                                       ("CACHE_DIRECTORY", ("bench", "gemm", "--workload", "kws_dscnn.fc"))])
def test_an_unusable_state_or_cache_dir_is_a_clear_error(tmp_path, var, verb):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    p = _cli(*verb, env={**os.environ, var: str(blocker)})
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    err = " ".join(p.stderr.split())
    assert f"cannot use {blocker}" in err and "not a directory" in err and f"set {var}" in err, err


@pytest.mark.parametrize("verb", [("bench", "gemm", "--shape"), ("pin", "gemm")])
def test_a_dimension_given_twice_is_refused(verb):
    """`M=1,...,M=5` used to run (or pin) M=5 without a word: a shape other than the one the user reads."""
    p = _cli(*verb, "M=1,N=2,K=3,M=5", *(("{}",) if verb[0] == "pin" else ()))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "--shape gives M twice (M=1 and M=5)" in " ".join(p.stderr.split()), p.stderr
    assert json.loads(_cli("report", "--json").stdout) == []  # nothing was pinned


@pytest.mark.parametrize("extra, named", [(("gemm",), "gemm"),
                                          (("--workload", "kws_dscnn.fc"), "--workload kws_dscnn.fc"),
                                          (("--shape", "M=1,N=2,K=3"), "--shape M=1,N=2,K=3"),
                                          (("--workloads", "w.toml"), "--workloads w.toml")])
def test_bench_all_refuses_a_kernel_workload_or_shape_beside_it(extra, named):
    """--all benches every bundled workload; a selection beside it was ignored, so its rows were not the ones asked."""
    p = _cli("bench", "--all", *extra)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"--all benches every bundled workload; drop {named}" in " ".join(p.stderr.split()), p.stderr


def test_bench_takes_an_imported_layer_by_name_from_its_workloads_file(tmp_path):
    """A layer from `workloads import` has no bundled name: bench finds it in the file, as tune does."""
    path = tmp_path / "net.toml"
    write_workloads_file(path, [WorkloadEntry("gemm", {"M": 12, "N": 16, "K": 24}, "net.fc1"),
                                WorkloadEntry("dwconv_3x3", {"H": 8, "W": 8, "C": 16, "stride": 1}, "net.dw1")])
    one = _cli("bench", "gemm", "--workload", "net.fc1", "--workloads", str(path), "--json")
    assert one.returncode == 0, one.stderr
    rows = json.loads(one.stdout)
    assert [(r["workload"], r["shape"], r["ok"]) for r in rows] == [("net.fc1", {"M": 12, "N": 16, "K": 24}, True)]
    both = _cli("bench", "--workloads", str(path), "--json")
    assert both.returncode == 0 and {r["workload"] for r in json.loads(both.stdout)} == {"net.fc1", "net.dw1"}
    missing = _cli("bench", "gemm", "--workload", "net.fc9", "--workloads", str(path))
    assert missing.returncode == 2 and f"workload(s) net.fc9 are not in {path}" in " ".join(missing.stderr.split())
    shape = _cli("bench", "gemm", "--shape", "M=1,N=2,K=3", "--workloads", str(path))
    assert shape.returncode == 2 and "--shape and --workloads both name what to bench" in shape.stderr
    none = _cli("bench", "conv1d", "--workloads", str(path))
    assert none.returncode == 2 and "nothing to bench: the selection matched no workload" in none.stderr
    assert "unknown kernel 'nosuch'" in _cli("bench", "nosuch", "--workloads", str(path)).stderr
