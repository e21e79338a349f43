"""ARM: cross builds checked under qemu-user for every kernel, ARM spaces, and the tuner model on ARM descriptors.

The emulated checks are generic over the spec: inputs from its generator, outputs against its numpy reference with
its tolerance, configs from its space. Nothing here times a variant: emulated time says nothing about a device.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgetune.errors import BadInput
from hwprobe import probe
from hwprobe.cpuinfo import host_arch
from hwprobe.descriptor import Cluster
from hwprobe.target import target_descriptor, toolchain
from kernels.build import build
from kernels.emulate import check, check_all, covering_cases
from kernels.registry import all_specs, get_spec
from kernels.spec import KernelSpec
from tests.conftest import model_kernels

REPO = Path(__file__).resolve().parent.parent
TREES = Path(__file__).resolve().parent / "data" / "hwtrees"
ARM_TREES = ("rpi4", "armv82_dotprod", "rpi5", "jetson_orin_nano", "imx8mp")
SWEPT = ("armv8-a", "armv7-a+neon")  # one level per arch: every knob value, and the seeded sample
SPECS = list(all_specs().values())
ELF_MACHINE = {"aarch64": 0xB7, "armv7l": 0x28}


def _target(isa: str):
    hw = target_descriptor(isa)
    if hw.arch == host_arch():
        pytest.skip(f"{hw.arch} is this host's arch: the worker tests check its builds natively")
    return hw


def _failures(spec: KernelSpec, cases: list[tuple[str, dict]], hw) -> list[str]:
    results = check_all(spec, [(spec.workload(w).shape, cfg) for w, cfg in cases], hw)
    return [f"{w} {cfg}: {r.reason}" for (w, cfg), r in zip(cases, results) if not r.ok]


# the 32-bit sweep is opt-in (`pytest -m slow`), to keep the default run under CI's time: 64-bit runs by default
@pytest.mark.parametrize("spec,isa", [
    pytest.param(spec, isa, id=f"{spec.name}-{isa}", marks=[pytest.mark.slow] if isa == "armv7-a+neon" else [])
    for isa in SWEPT for spec in SPECS])
def test_emulated_defaults_and_every_knob_value(spec: KernelSpec, isa: str):
    """Every workload's valid default and every knob value of the target's space, at least once, compute the
    reference's values when cross-built and run under emulation."""
    hw = _target(isa)
    cases, absent = covering_cases(spec, hw)
    in_space = {(p.name, v) for p in spec.params for v in p.values} - set(absent)
    assert in_space <= {kv for _, cfg in cases for kv in cfg.items()}
    assert _failures(spec, cases, hw) == []


@pytest.mark.parametrize("isa", SWEPT)
@pytest.mark.parametrize("spec", [s for s in SPECS if s.epilogue], ids=lambda s: s.name)
def test_emulated_fused_activation_on_two_threads(spec: KernelSpec, isa: str):
    """The epilogue (bias + relu6) and the thread pool, packed and run as an application runs them."""
    hw = _target(isa)
    w = min(spec.workloads, key=lambda w: spec.flops(w.shape))
    cfg = dict(spec.space(w.shape, hw).valid_default(), threads=2)
    r = check(spec, w.shape, cfg, hw, act="relu6")
    assert r.ok, r.reason


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_emulated_defaults_at_dotprod_level(spec: KernelSpec):
    """-march=armv8.2-a+dotprod+fp16 builds too, and computes the same values."""
    hw = _target("armv8.2-a+dotprod")
    assert _failures(spec, [(w.name, spec.space(w.shape, hw).valid_default()) for w in spec.workloads], hw) == []


@pytest.mark.slow
@pytest.mark.parametrize("isa", SWEPT)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_emulated_seeded_sample(spec: KernelSpec, isa: str):
    """A seeded sample of valid configs for each bundled workload (`pytest -m slow`)."""
    hw = _target(isa)
    cases = [(w.name, cfg) for w in spec.workloads
             for cfg in spec.space(w.shape, hw).sample(4, random.Random(f"{spec.name}/{w.name}/{isa}"))]
    assert len(cases) >= 4 * len(spec.workloads) // 2
    assert _failures(spec, cases, hw) == []


def _broken(tmp_path: Path, body: str) -> KernelSpec:
    """gemm's spec around a C file whose kernel does `body` instead."""
    src = tmp_path / "broken.c"
    src.write_text('#include "edgetune_kernel.h"\n'
                   "static int et_kernel(const int64_t *dims, float *const *bufs, const float *packed, int act) "
                   f"{{ {body} }}\n")
    return dataclasses.replace(get_spec("gemm"), source=src)


@pytest.mark.parametrize(("body", "reason"), [
    ("float *c = bufs[3]; for (int64_t i = 0; i < dims[0] * dims[1] / 2; i++) c[i] = 0; return 0;", "non-finite"),
    ("float *c = bufs[3]; for (int64_t i = 0; i < dims[0] * dims[1]; i++) c[i] = 1; return 0;", "max_abs_err"),
    ("return 7;", "error code 7"),
    ("volatile float *p = 0; *p = 1; return 0;", "SIGSEGV"),
])
def test_emulation_reports_wrong_and_crashing_variants(tmp_path: Path, body: str, reason: str):
    hw = _target("armv7-a+neon")
    spec = _broken(tmp_path, body)
    shape = spec.workload("kws_dscnn.pw4").shape
    r = check(spec, shape, spec.space(shape, hw).valid_default(), hw)
    assert not r.ok and reason in r.reason, r


@pytest.mark.parametrize("isa", SWEPT)
def test_cross_builds_are_keyed_by_target(isa: str):
    """One config, three targets: three cache entries, each an ELF for its own machine."""
    spec = get_spec("gemm")
    shape = spec.workload("kws_dscnn.fc").shape
    hw = _target(isa)
    cfg = spec.space(shape, hw).valid_default()
    cross, native = build(spec, cfg, hw, shape=shape), build(spec, cfg, probe(measure_bandwidth=False), shape=shape)
    assert cross.key != native.key
    header = cross.path.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == ELF_MACHINE[hw.arch]


def test_armv7_vector_code_is_neon():
    """GCC lowers vector-extension float arithmetic to scalar VFP on armv7 unless told NEON's flush-to-zero is fine:
    every kernel's armv7 build must multiply-add on quad (q) registers."""
    hw = _target("armv7-a+neon")
    objdump = shutil.which(f"{toolchain(hw.arch).triple}-objdump")
    assert objdump, "binutils for armv7 come with the cross compiler"
    for spec in SPECS:
        w = spec.workloads[0]
        so = build(spec, spec.space(w.shape, hw).valid_default(), hw, shape=w.shape).path
        text = subprocess.run([objdump, "-d", str(so)], capture_output=True, text=True, check=True).stdout
        assert re.search(r"\tv(fma|mla)\.f32\s+q", text), f"{spec.name}: no NEON multiply-add"


# --- ARM spaces ------------------------------------------------------------------------------------------


def test_register_file_and_big_cores_shape_the_space():
    gemm = get_spec("gemm")
    shape = gemm.workload("mobilenetv2.b6.project").shape
    wide = dict(gemm.default, vec=4, mr=6, nv=4)  # 24 accumulators + 4 panel vectors + 1 broadcast
    a64, a32 = (gemm.space(shape, target_descriptor(isa)) for isa in ("armv8-a", "armv7-a+neon"))
    assert a64.is_valid(wide) and not a32.is_valid(wide)
    assert any("vector registers" in why for why in a32.violations(wide))
    assert not a64.is_valid(dict(wide, vec=8)) and any("vector width" in w for w in a64.violations(dict(wide, vec=8)))
    # RK3588: 4 big + 4 LITTLE cores; with two A76 cores taken (cpuset), 4 threads would run on LITTLE cores too
    rk = probe(TREES / "armv82_dotprod", cc="/nonexistent/cc")
    four = dict(a64.valid_default(), threads=4)
    assert gemm.space(shape, rk).is_valid(four)
    clusters = (Cluster((6, 7), 1024, 2400000, "Cortex-A76"), Cluster((0, 1, 2, 3), 414, 1800000, "Cortex-A55"))
    partial = dataclasses.replace(rk, cores=6, clusters=clusters)
    assert partial.big_cores == 2
    assert any("big cores" in why for why in gemm.space(shape, partial).violations(four))


@pytest.mark.slow  # every ARM level's counts (~40 s); test_hwprobe runs `kernels --isa armv8-a` by default
def test_kernels_cli_lists_arm_spaces():
    p = subprocess.run([sys.executable, "-m", "edgetune.main", "kernels", "--isa", "armv8-a", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr
    arm = target_descriptor("armv8-a")
    for k in json.loads(p.stdout):
        spec = get_spec(k["name"])
        for w in k["workloads"]:
            space = spec.space(w["shape"], arm)
            assert w["space_size"] == space.size() > 0
    bad = subprocess.run([sys.executable, "-m", "edgetune.main", "kernels", "--isa", "armv9-bogus"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "armv9-bogus" in bad.stderr and "allowed" in bad.stderr


def test_target_descriptor_rejects_a_level_of_no_cross_arch():
    with pytest.raises(BadInput, match="x86-64-v3"):
        target_descriptor("x86-64-v3")


# --- the tuner model on ARM descriptors ------------------------------------------------------------------


@pytest.fixture(scope="module")
def proposer():
    from tuner.model.inference import default_model_path
    from tuner.model.proposer import Proposer

    return Proposer(path=default_model_path())


@pytest.mark.parametrize("tree", [pytest.param(t, marks=[] if t in ("rpi4", "jetson_orin_nano") else [pytest.mark.slow])
                                  for t in ARM_TREES])  # two devices by default, every one with -m slow
def test_propose_on_arm_trees(tree: str, proposer):
    """Valid, distinct top-5 configs for every kernel's bundled workloads on each ARM device; the model has no ARM
    timing data, so this holds the grammar and constraints, not the ranking."""
    from kernels.space import config_key

    hw = probe(TREES / tree, cc="/nonexistent/cc")
    for spec in model_kernels():
        for w in spec.workloads:
            space = spec.space(w.shape, hw)
            res = proposer.propose(spec.name, space, 5)
            keys = [config_key(p.config) for p in res.proposals]
            assert len(keys) == len(set(keys)) == min(5, space.size()), (tree, spec.name, w.name)
            assert all(space.is_valid(p.config) for p in res.proposals)
            assert 0 < res.latency_ms < 5000  # loose: tests never check speed
