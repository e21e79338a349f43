"""The worker contains variants that crash, hang or compute wrong values; the estimator is robust."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from hwprobe.compiler import CompilerMissing
from kernels.build import CompileError, build
from kernels.measure import estimate
from kernels.registry import get_spec
from kernels.spec import C_DIR
from kernels.worker import Runner

GEMM = get_spec("gemm")
SHAPE = {"M": 8, "N": 16, "K": 8}


def _variant(tmp_path, name: str, body: str):
    """gemm with a fault injected at the top of et_kernel, as its own C file."""
    head = "static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) {"
    src = (C_DIR / "gemm.c").read_text().replace(head, head + "\n" + body, 1)
    assert body in src
    path = tmp_path / f"{name}.c"
    path.write_text("#include <signal.h>\n" + src)
    return dataclasses.replace(GEMM, source=path)


def test_crashing_variant_is_contained(tmp_path, hw):
    spec = _variant(tmp_path, "crash", "raise(SIGSEGV);")
    with Runner() as r:
        m = r.measure(spec, SHAPE, build(spec, spec.default, hw).path)
        assert not m.ok and "SIGSEGV" in m.reason
        good = r.measure(GEMM, SHAPE, build(GEMM, GEMM.default, hw).path)  # the caller carries on
        assert good.ok


def test_hanging_variant_is_killed(tmp_path, hw):
    spec = _variant(tmp_path, "hang", "for (volatile int i = 0;; i++) {}")
    with Runner(timeout_s=2) as r:
        m = r.measure(spec, SHAPE, build(spec, spec.default, hw).path)
        assert not m.ok and m.reason.startswith("hung")
        assert r.measure(GEMM, SHAPE, build(GEMM, GEMM.default, hw).path).ok


def test_wrong_values_are_reported(tmp_path, hw):
    spec = _variant(tmp_path, "wrong", "bufs[3][0] = 1e9f; return 0;")
    with Runner() as r:
        m = r.measure(spec, SHAPE, build(spec, spec.default, hw).path)
    assert not m.ok and "wrong values" in m.reason


def test_compile_error_is_clean(tmp_path, hw):
    spec = _variant(tmp_path, "broken", "this is not C;")
    with pytest.raises(CompileError) as e:
        build(spec, spec.default, hw)
    assert "error" in str(e.value) and "broken.c" in str(e.value)


def test_no_compiler_names_the_fix(hw, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CompilerMissing, match="install one"):
        build(GEMM, {**GEMM.default, "kc": 64}, dataclasses.replace(hw, compiler=dataclasses.replace(hw.compiler, path=None)))


def test_a_bad_cc_is_named(hw, monkeypatch, tmp_path):
    """A CC with flags in it, and a CC that fails without a word: both errors say what CC was."""
    monkeypatch.setenv("CC", "gcc -O2")
    with pytest.raises(CompilerMissing, match=r"'gcc -O2' \(\$CC\) not found .*flags such as -O2"):
        build(GEMM, GEMM.default, hw)
    monkeypatch.setenv("CC", "/bin/false")
    spec = _variant(tmp_path, "silent", "")  # a source of its own: no cached build answers for it
    with pytest.raises(CompileError, match="compiler failed: /bin/false exited with status 1 and printed nothing"):
        build(spec, spec.default, hw)
    monkeypatch.setenv("CC", "/bin/true")  # exits 0 and writes nothing: named, not a FileNotFoundError
    with pytest.raises(CompileError, match="/bin/true exited 0 but wrote no shared object"):
        build(spec, spec.default, hw)


def test_tune_without_a_compiler_is_one_error_not_one_per_workload(tmp_path):
    p = subprocess.run([sys.executable, "-m", "edgetune.main", "tune", "--kernel", "gemm", "--budget", "2"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "CC": str(tmp_path / "no-cc")})
    assert p.returncode != 0 and p.stderr.count("not found") == 1 and "failed gemm/" not in p.stderr, p.stderr


def test_workers_are_recycled_per_distinct_library(hw):
    libs = [build(GEMM, {**GEMM.default, "kc": kc}, hw).path for kc in (32, 64, 128, 256)]
    with Runner(recycle_after=2) as r:
        pids = []
        for lib in [libs[0], libs[1], libs[0], libs[1], libs[2], libs[3]]:  # finals re-measure loaded libraries
            assert r.measure(GEMM, SHAPE, lib).ok
            pids.append(r._proc.pid)
    assert pids[:4] == [pids[0]] * 4, "re-measuring a loaded library must not recycle the worker"
    assert pids[4] == pids[5] != pids[0]


def test_a_runner_that_measured_nothing_kills_its_worker():
    """Entering starts a worker early (its imports overlap the caller's set-up); leaving before any measurement
    (a fully cached tune) kills it rather than waiting for those imports, and reaps it."""
    import signal

    with Runner() as r:
        worker = r._proc
    assert worker.returncode == -signal.SIGKILL


def test_estimator_prefers_undisturbed_reps():
    ms, cv, used, name = estimate([1.0, 1.1, 5.0, 1.05, 0.9], [0, 0, 3, 0, 1])
    assert name == "median-undisturbed" and used == 3 and ms == 1.05
    ms, _, used, name = estimate([2.0, 1.5, 3.0, 1.7], [1, 2, 1, 0])
    assert name == "min-fallback" and ms == 1.5 and used == 4


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgetune.main", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["bench", "nosuch", "--workload", "x"], "unknown kernel 'nosuch'"),
    (["bench", "gemm", "--workload", "nosuch"], "unknown workload 'nosuch'"),
    (["bench", "gemm", "--workload", "kws_dscnn.fc", "--config", '{"vec": 3}'], "vec=3 is not allowed"),
    (["bench", "gemm", "--workload", "kws_dscnn.fc", "--config", '{"mr": 8, "nv": 4}'], "violates"),
    (["bench", "gemm", "--workload", "kws_dscnn.fc", "--config", "{vec"], "not valid JSON"),
    (["bench", "gemm", "--workload", "kws_dscnn.fc", "--config", '{"bogus": 1}'], "unknown knob(s) bogus"),
])
def test_bench_bad_input_exits_2(args, needle):
    p = _cli(*args)
    assert p.returncode == 2, p.stderr
    assert needle in " ".join(p.stderr.split())


def test_bench_json_fields():
    p = _cli("bench", "gemm", "--workload", "kws_dscnn.pw4", "--default", "--ort", "--json")
    assert p.returncode == 0, p.stderr
    row = json.loads(p.stdout)
    for k in ("kernel", "workload", "config", "ms", "cv", "reps_used", "ok", "max_abs_err", "ort_ms", "gflops", "roofline"):
        assert k in row
    assert row["ok"] and row["ms"] > 0 and row["ort_ms"] > 0 and row["gflops"] > 0


def test_the_onnx_twin_runs_in_the_worker_not_beside_the_model():
    """onnxruntime (~55 MB with its arena and session) is timed in the measuring worker: a tuning session's own
    process, the one holding the tuner model, never loads it, and the result still carries the twin's time."""
    code = ("import atexit, sys; atexit.register(lambda: print('ORT LOADED:', 'onnxruntime' in sys.modules, "
            "file=sys.stderr)); from edgetune.main import main; sys.argv = ['edgetune', *sys.argv[1:]]; main()")
    p = subprocess.run([sys.executable, "-c", code, "tune", "--kernel", "gemm", "--workload", "kws_dscnn.pw4",
                        "--budget", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["results"][0]["ort_ms"] > 0
    assert "ORT LOADED: False" in p.stderr


def test_a_twin_that_hangs_is_a_failed_measurement_not_a_stuck_caller():
    """The twin goes through the same request as a variant, so a hang is killed at the timeout."""
    with Runner() as r:
        m = r.time_twin(get_spec("gemm"), {"M": 2048, "N": 2048, "K": 2048}, threads=1, min_time_s=60, timeout_s=1)
        assert not m.ok and "hung" in m.reason
        ok = r.time_twin(get_spec("gemm"), {"M": 8, "N": 16, "K": 32}, threads=1, min_time_s=0.01)
        assert ok.ok and ok.ms > 0  # the next request gets a fresh worker


def test_the_worker_times_variants_beside_no_threads_of_its_own(hw):
    """The numpy reference runs on one BLAS thread: idle OpenBLAS threads busy-wait after each call, and a
    threads=2 variant timed beside them shares its cores (it read ~2x slow on 2 cores). After a measurement whose
    reference ran a BLAS matmul, a threads=1 variant's worker holds its main thread only."""
    import os

    shape = {"M": 64, "N": 64, "K": 64}
    with Runner() as r:
        assert r.measure(GEMM, shape, build(GEMM, {**GEMM.default, "threads": 1}, hw).path).ok
        assert os.listdir(f"/proc/{r._proc.pid}/task") == [str(r._proc.pid)]
