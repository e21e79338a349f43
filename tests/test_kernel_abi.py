"""ABI 2 in process: packing, the fused epilogue and the thread pool, as an application runs a build."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from edgetune.errors import BadInput
from kernels.abi import KernelLibrary
from kernels.build import build
from kernels.registry import all_specs, get_spec
from kernels.spec import ACTIVATIONS

EPILOGUE = [s for s in all_specs().values() if s.epilogue]
FAST = {"min_time_s": 0.01, "max_reps": 5}


def _small(spec):
    return min((w.shape for w in spec.workloads), key=spec.flops)


def _call(lib: KernelLibrary, spec, shape, inputs, packed, act="none") -> tuple[int, list[np.ndarray]]:
    outs = [np.full(s, np.nan, np.float32) for s in spec.output_shapes(shape)]
    rc = lib.run(lib.dims(shape), lib.pointers(inputs + outs), packed, act)
    return rc, outs


def test_every_spec_names_its_inputs():
    for spec in all_specs().values():
        shape = _small(spec)
        assert len(spec.inputs) == len(spec.make_inputs(shape, np.random.default_rng(0))), spec.name
        assert all(0 < i < len(spec.inputs) for i in spec.constant_inputs), spec.name
        if spec.epilogue:  # the bias is the input after the weights
            assert spec.inputs[2] == "bias" and 2 in spec.constant_inputs


@pytest.mark.parametrize("act", ACTIVATIONS[1:])
@pytest.mark.parametrize("spec", EPILOGUE, ids=lambda s: s.name)
def test_fused_activation_matches_reference(spec, act, hw, runner):
    """Default and a 2-thread config, with relu and relu6 fused after the bias."""
    shape = max((w.shape for w in spec.workloads), key=spec.flops)
    space = spec.space(shape, hw)
    for cfg in (space.valid_default(), dict(space.valid_default(), threads=2)):
        m = runner.measure(spec, shape, build(spec, cfg, hw, shape=shape).path, act=act, **FAST)
        assert m.ok, f"{cfg} {act}: {m.reason}"


def test_kernels_without_epilogue_refuse_an_activation(hw, runner):
    spec = get_spec("gru")
    shape = _small(spec)
    so = build(spec, spec.space(shape, hw).valid_default(), hw, shape=shape).path
    with pytest.raises(BadInput, match="no fused activation"):
        runner.measure(spec, shape, so, act="relu", **FAST)
    lib = KernelLibrary(so, spec)
    inputs = spec.make_inputs(shape, np.random.default_rng(0))
    assert _call(lib, spec, shape, inputs, None)[0] == 0
    lib.lib.et_run.argtypes = None  # an out-of-range code straight through C: ET_ERR_ACT
    outs = [np.empty(s, np.float32) for s in spec.output_shapes(shape)]
    assert lib.lib.et_run(lib.dims(shape), lib.pointers(inputs + outs), None, 7) == 64


@pytest.mark.parametrize("spec", EPILOGUE, ids=lambda s: s.name)
def test_packed_once_equals_packed_per_call(spec, hw):
    """A run on et_pack's buffer computes what a call with no buffer (packing into a temporary) does; kernels that
    do not pack report 0 floats."""
    shape = _small(spec)
    lib = KernelLibrary(build(spec, spec.space(shape, hw).valid_default(), hw, shape=shape).path, spec)
    inputs = [np.ascontiguousarray(a) for a in spec.make_inputs(shape, np.random.default_rng(5))]
    packed = lib.pack(lib.dims(shape), lib.pointers(inputs + [None]))
    assert (packed is None) == (lib.lib.et_packed_floats(lib.dims(shape)) == 0)
    rc1, once = _call(lib, spec, shape, inputs, packed, "relu")
    rc2, per_call = _call(lib, spec, shape, inputs, None, "relu")
    assert rc1 == rc2 == 0
    np.testing.assert_array_equal(once[0], per_call[0])
    np.testing.assert_allclose(once[0], spec.activated(spec.reference(shape, inputs), "relu")[0],
                               rtol=spec.rtol, atol=spec.atol)


def _pool_library(hw):
    spec = get_spec("gemm")
    shape = spec.workload("mobilenetv2.b6.project").shape
    cfg = dict(spec.space(shape, hw).valid_default(), threads=2)
    lib = KernelLibrary(build(spec, cfg, hw, shape=shape).path, spec)
    inputs = spec.make_inputs(shape, np.random.default_rng(7))
    return lib, spec, shape, inputs, spec.reference(shape, inputs)[0]


def test_pool_serves_concurrent_callers(hw):
    """Two application threads calling one 2-thread library at once take turns; every result is right."""
    lib, spec, shape, inputs, want = _pool_library(hw)
    packed = lib.pack(lib.dims(shape), lib.pointers(inputs + [None]))
    errors: list[str] = []

    def caller() -> None:
        for _ in range(50):
            rc, outs = _call(lib, spec, shape, inputs, packed)
            if rc or not np.allclose(outs[0], want, rtol=spec.rtol, atol=spec.atol):
                errors.append(f"rc={rc}")

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not errors


def test_pool_restarts_in_a_forked_child(hw):
    """fork() copies no threads: a child of a process whose pool ran starts its own instead of waiting forever on
    workers it does not have."""
    lib, spec, shape, inputs, want = _pool_library(hw)
    assert _call(lib, spec, shape, inputs, None)[0] == 0  # the parent's pool is up
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the kernel ran and is right
        ok = False
        try:
            rc, outs = _call(lib, spec, shape, inputs, None)
            ok = rc == 0 and np.allclose(outs[0], want, rtol=spec.rtol, atol=spec.atol)
        finally:
            os._exit(0 if ok else 1)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in the kernel")
    assert os.waitstatus_to_exitcode(status) == 0
