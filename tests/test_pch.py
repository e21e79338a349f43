"""The precompiled <immintrin.h> (kernels.pch): used where et_gemm.h includes it, the same code, never a failure."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from hwprobe.target import host_arch
from kernels import pch
from kernels.build import build, code_flags, compile_command, precompiled, target_compiler
from kernels.registry import get_spec

pytestmark = pytest.mark.skipif(host_arch() != "x86_64", reason="an x86-64 compiler makes the AVX-512 builds")
GEMM_CORE = ("gemm", "conv2d_3x3", "conv1d")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty build cache and no header given up on yet: each test makes its own .gch."""
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    monkeypatch.setattr(pch, "_failed", set())


def at(hw, march: str):
    return dataclasses.replace(hw, march=march)  # compiled only: the host need not run it


def code(so: Path) -> str:
    """The disassembly without the file name line."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True, check=True)
    return out.stdout.split("\n", 2)[2]


def gch(header: Path) -> Path:
    return header.with_name(header.name + ".gch")


def test_gemm_core_builds_for_avx512_use_it_and_compile_to_the_same_code(hw, tmp_path, fresh):
    v4 = at(hw, "x86-64-v4")
    cc, cc_id = target_compiler(v4)
    for name in GEMM_CORE:
        spec = get_spec(name)
        header = precompiled(spec, v4, cc, cc_id)
        assert header is not None, name
        built = build(spec, spec.default, v4)
        assert gch(header).stat().st_size > 1 << 20  # made, and shared by the three kernels
        plain = tmp_path / f"{name}-plain.so"
        subprocess.run(compile_command(spec, spec.default, v4, plain, cc), check=True)
        assert code(built.path) == code(plain), name


def test_other_kernels_and_targets_without_avx512_build_as_before(hw, fresh):
    v4, v3 = at(hw, "x86-64-v4"), at(hw, "x86-64-v3")
    cc, cc_id = target_compiler(v4)
    assert precompiled(get_spec("gemm"), v3, cc, cc_id) is None  # et_gemm.h includes nothing there
    for name in ("dwconv_3x3", "gru", "logmel"):  # they never include it: loading it would cost more than it saves
        assert precompiled(get_spec(name), v4, cc, cc_id) is None, name
    build(get_spec("gemm"), get_spec("gemm").default, v3)
    assert not list(Path(pch.paths.cache_dir()).glob("pch/*/*.gch"))


def test_an_unreadable_precompiled_header_is_removed_and_the_build_still_succeeds(hw, tmp_path, fresh):
    v4, spec = at(hw, "x86-64-v4"), get_spec("gemm")
    cc, cc_id = target_compiler(v4)
    header = pch.ensure(cc, cc_id, code_flags(v4))
    damaged = gch(header).read_bytes()[: 1 << 20]  # truncated: fatal to gcc, where a mismatched one is skipped
    gch(header).write_bytes(damaged)
    cfg = {**spec.default, "kc": 64}
    built = build(spec, cfg, v4)
    assert not gch(header).exists()
    plain = tmp_path / "plain.so"
    subprocess.run(compile_command(spec, cfg, v4, plain, cc), check=True)
    assert code(built.path) == code(plain)
    build(spec, {**cfg, "kc": 128}, v4)
    assert not gch(header).exists()  # given up on for this process, not made again before every build


def test_a_compiler_that_cannot_precompile_leaves_builds_as_they_were(hw, tmp_path, monkeypatch, fresh, caplog):
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\ncase " $* " in *" c-header "*) echo "no precompiled headers here" >&2; exit 1;; esac\n'
                  'exec gcc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    v4, spec = at(hw, "x86-64-v4"), get_spec("conv1d")
    built = build(spec, spec.default, v4)
    assert built.path.exists() and not built.cached
    assert "no precompiled <immintrin.h>" in caplog.text and "no precompiled headers here" in caplog.text
    assert not list(Path(pch.paths.cache_dir()).glob("pch/*/*.gch"))


def test_a_cache_that_cannot_hold_the_header_builds_without_it(hw, tmp_path, monkeypatch, fresh):
    v4, spec = at(hw, "x86-64-v4"), get_spec("gemm")
    cc, cc_id = target_compiler(v4)
    blocker = pch.header(cc_id, code_flags(v4)).parent
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where the header's directory should be")  # mkdir fails as on a full disk
    built = build(spec, spec.default, v4)
    assert built.path.exists() and not built.cached
