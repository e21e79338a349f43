"""hwprobe: the live machine, captured device trees (tests/data/hwtrees), fallbacks, --isa caps and the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from edgetune.errors import BadInput
from hwprobe import CacheLevel, HwDescriptor, probe
from hwprobe.fingerprint import hw_fingerprint

REPO = Path(__file__).resolve().parent.parent
TREES = Path(__file__).resolve().parent / "data" / "hwtrees"
KiB, MiB = 1 << 10, 1 << 20
NO_CC = "/nonexistent/cc"  # captured trees need no compiler; also checks a missing one is not fatal


def tree_copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(TREES / name, dst)
    return dst


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def fake_cc(tmp_path: Path, banner: str) -> str:
    script = tmp_path / "fakecc"
    script.write_text(f"#!/bin/sh\necho '{banner}'\n")
    script.chmod(0o755)
    return str(script)


# --- the live machine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live() -> HwDescriptor:
    return probe()


def test_live_probe(live: HwDescriptor) -> None:
    assert live.arch != "unknown"
    assert 1 <= live.cores <= live.cores_online <= os.cpu_count()
    assert live.cores <= len(os.sched_getaffinity(0))
    assert live.bandwidth_gbps is not None and live.bandwidth_gbps > 0
    assert live.mem_total_bytes and live.mem_total_bytes > 0
    assert live.vector_bits in (32, 128, 256, 512, 1024, 2048)
    assert live.isa == live.detected_isa
    assert len(live.hw_fingerprint) == len(live.fw_fingerprint) == 16
    assert live.firmware["kernel"] == os.uname().release
    assert HwDescriptor.from_dict(json.loads(json.dumps(live.to_dict()))) == live


def test_live_fingerprints_stable(live: HwDescriptor, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    assert probe(measure_bandwidth=False).bandwidth_gbps is None  # never measured on this cache
    measured = probe()
    again = probe(measure_bandwidth=False)
    assert again.bandwidth_gbps == measured.bandwidth_gbps  # not re-measured: the last measurement is remembered
    if live.isa == "x86-64-v4":  # an ISA cap describes the same memory system
        assert probe(isa_cap="x86-64-v3", measure_bandwidth=False).bandwidth_gbps == measured.bandwidth_gbps
    assert (again.hw_fingerprint, again.fw_fingerprint) == (live.hw_fingerprint, live.fw_fingerprint)


def test_live_isa_cap_to_v3(live: HwDescriptor) -> None:
    if live.detected_isa != "x86-64-v4":
        pytest.skip(f"host is {live.detected_isa}, not x86-64-v4")
    capped = probe(isa_cap="x86-64-v3", measure_bandwidth=False)
    assert (capped.isa, capped.march, capped.vector_bits, capped.isa_level) == ("x86-64-v3", "x86-64-v3", 256, 3)
    assert capped.detected_isa == "x86-64-v4"
    assert capped.features == live.features  # the hardware did not change, only what builds may use
    assert capped.hw_fingerprint != live.hw_fingerprint


# --- captured trees -----------------------------------------------------------------------------


def test_rpi4() -> None:
    d = probe(TREES / "rpi4", cc=NO_CC)
    assert (d.arch, d.cpu_model, d.isa, d.isa_level, d.march) == ("aarch64", "Cortex-A72", "armv8-a", 0, "armv8-a")
    assert d.vector_bits == 128 and d.features == ("asimd",)
    assert (d.cores, d.cores_online) == (4, 4)
    assert d.caches == (
        CacheLevel(1, "Data", 32 * KiB, 64, 1),
        CacheLevel(1, "Instruction", 48 * KiB, 64, 1),
        CacheLevel(2, "Unified", 1 * MiB, 64, 4),
    )
    assert d.cache_bytes(3) is None  # no L3 on the Pi 4
    assert d.cache_bytes(1) == 32 * KiB and d.cache_bytes(1, "Instruction") == 48 * KiB
    assert d.mem_total_bytes == 3882276 * KiB
    assert d.bandwidth_gbps is None
    assert d.firmware == {"image_version": "", "build_id": "", "version_id": "12", "kernel": "6.6.51+rpt-rpi-v8",
                          "model": "Raspberry Pi 4 Model B Rev 1.4", "edgetune": d.firmware["edgetune"]}


def test_rk3588_dotprod_big_little() -> None:
    d = probe(TREES / "armv82_dotprod", cc=NO_CC)
    assert (d.arch, d.isa, d.isa_level, d.march) == ("aarch64", "armv8.2-a+dotprod", 1, "armv8.2-a+dotprod+fp16")
    assert d.cpu_model == "Cortex-A55 + Cortex-A76"
    # big.LITTLE from cpu_capacity: the A76 cluster first, and threads count against its 4 cores
    assert [(c.cpus, c.capacity, c.max_khz, c.core) for c in d.clusters] == [
        ((4, 5, 6, 7), 1024, 2400000, "Cortex-A76"), ((0, 1, 2, 3), 414, 1800000, "Cortex-A55")]
    assert d.big_cores == 4
    assert d.vector_bits == 128 and "dotprod" in d.features and "asimddp" not in d.features
    assert (d.cores, d.cores_online) == (8, 8)
    # both core types' caches, the big core's first; the shared L3 once
    assert d.cache_bytes(1) == 64 * KiB and d.cache_bytes(2) == 512 * KiB and d.cache_bytes(3) == 3 * MiB
    assert CacheLevel(2, "Unified", 128 * KiB, 64, 1) in d.caches
    assert [c.level for c in d.caches].count(3) == 1
    assert d.firmware["image_version"] == "2024.06.1" and d.firmware["build_id"] == "20240612-1"
    assert d.firmware["model"] == "Radxa ROCK 5B"  # from proc/device-tree


def test_rpi5() -> None:
    d = probe(TREES / "rpi5", cc=NO_CC)
    assert (d.arch, d.cpu_model, d.isa, d.isa_level, d.march) == (
        "aarch64", "Cortex-A76", "armv8.2-a+dotprod", 1, "armv8.2-a+dotprod+fp16")
    assert (d.vector_bits, d.vector_registers) == (128, 32) and d.features == ("asimd", "asimdhp", "dotprod")
    assert (d.cores, d.cores_online, d.big_cores) == (4, 4, 4)
    assert [(c.cpus, c.capacity) for c in d.clusters] == [((0, 1, 2, 3), 1024)]  # one class: all cores big
    assert d.caches == (
        CacheLevel(1, "Data", 64 * KiB, 64, 1), CacheLevel(1, "Instruction", 64 * KiB, 64, 1),
        CacheLevel(2, "Unified", 512 * KiB, 64, 1), CacheLevel(3, "Unified", 2 * MiB, 64, 4),
    )
    assert d.mem_total_bytes == 8245456 * KiB
    assert (d.firmware["model"], d.firmware["version_id"], d.firmware["kernel"]) == (
        "Raspberry Pi 5 Model B Rev 1.0", "12", "6.6.51+rpt-rpi-2712")


def test_jetson_orin_nano_clusters_from_cpufreq() -> None:
    d = probe(TREES / "jetson_orin_nano", cc=NO_CC)
    assert (d.arch, d.cpu_model, d.isa, d.march) == ("aarch64", "Cortex-A78AE", "armv8.2-a+dotprod",
                                                     "armv8.2-a+dotprod+fp16")
    assert (d.cores, d.big_cores) == (6, 6)
    assert [(c.cpus, c.capacity, c.max_khz) for c in d.clusters] == [((0, 1, 2, 3, 4, 5), None, 1510400)]
    assert (d.cache_bytes(1), d.cache_bytes(2), d.cache_bytes(3)) == (64 * KiB, 256 * KiB, 2 * MiB)
    assert CacheLevel(3, "Unified", 2 * MiB, 64, 4) in d.caches  # per 4-core cluster, not the whole chip
    assert d.firmware["model"] == "NVIDIA Jetson Orin Nano Developer Kit" and d.firmware["version_id"] == "22.04"
    assert d.firmware["kernel"] == "5.15.148-tegra"


def test_imx8mp() -> None:
    d = probe(TREES / "imx8mp", cc=NO_CC)
    assert (d.arch, d.cpu_model, d.isa, d.isa_level, d.march, d.vector_bits) == (
        "aarch64", "Cortex-A53", "armv8-a", 0, "armv8-a", 128)
    assert d.features == ("asimd",) and (d.cores, d.big_cores) == (4, 4)
    assert d.caches == (
        CacheLevel(1, "Data", 32 * KiB, 64, 1), CacheLevel(1, "Instruction", 32 * KiB, 64, 1),
        CacheLevel(2, "Unified", 512 * KiB, 64, 4),
    )
    assert d.cache_bytes(3) is None
    assert d.firmware["model"] == "NXP i.MX8MPlus EVK board"  # from sys/firmware/devicetree
    assert d.firmware["version_id"] == "6.6-scarthgap" and d.firmware["image_version"] == ""


ARM_TREES = ("rpi4", "armv82_dotprod", "rpi5", "jetson_orin_nano", "imx8mp")


def test_arm_trees_fingerprints_distinct_and_stable() -> None:
    first = [probe(TREES / t, cc=NO_CC) for t in ARM_TREES]
    again = [probe(TREES / t, cc=NO_CC) for t in ARM_TREES]
    assert len({d.hw_fingerprint for d in first}) == len({d.fw_fingerprint for d in first}) == len(ARM_TREES)
    assert [(d.hw_fingerprint, d.fw_fingerprint) for d in first] == [(d.hw_fingerprint, d.fw_fingerprint)
                                                                      for d in again]
    assert all(HwDescriptor.from_dict(json.loads(json.dumps(d.to_dict()))) == d for d in first)


def test_clusters_from_cpufreq_split_and_quota(tmp_path: Path) -> None:
    """Maxima more than 10% apart are two classes; a cgroup quota below the big cluster caps big_cores too."""
    root = tree_copy(tmp_path, "jetson_orin_nano")
    for cpu in (4, 5):
        (root / f"sys/devices/system/cpu/cpu{cpu}/cpufreq/cpuinfo_max_freq").write_text("1113600\n")
    (root / "sys/devices/system/cpu/cpu3/cpufreq/cpuinfo_max_freq").write_text("1420800\n")  # within 10%: same
    d = probe(root, cc=NO_CC)
    assert [(c.cpus, c.max_khz) for c in d.clusters] == [((0, 1, 2, 3), 1510400), ((4, 5), 1113600)]
    assert (d.cores, d.big_cores) == (6, 4)
    (root / "sys/fs/cgroup").mkdir(parents=True)
    (root / "sys/fs/cgroup/cpu.max").write_text("300000 100000\n")
    assert (probe(root, cc=NO_CC).cores, probe(root, cc=NO_CC).big_cores) == (3, 3)
    (root / "sys/devices/system/cpu/cpu2/cpufreq/cpuinfo_max_freq").unlink()  # one cpu unknown: no clusters
    assert probe(root, cc=NO_CC).clusters == ()


def test_x86_avx2() -> None:
    d = probe(TREES / "x86_avx2", cc=NO_CC)
    assert d.cpu_model == "Intel(R) Core(TM) i5-8250U CPU @ 1.60GHz"
    assert (d.arch, d.isa, d.isa_level, d.march, d.vector_bits) == ("x86_64", "x86-64-v3", 3, "x86-64-v3", 256)
    assert "avx2" in d.features and not any(f.startswith("avx512") for f in d.features)
    assert (d.cores, d.cores_online) == (8, 8)
    assert [(c.level, c.type, c.size_bytes, c.shared_cpus) for c in d.caches] == [
        (1, "Data", 32 * KiB, 2), (1, "Instruction", 32 * KiB, 2), (2, "Unified", 256 * KiB, 2),
        (3, "Unified", 6 * MiB, 8),
    ]
    assert d.firmware["model"] == "" and d.firmware["version_id"] == "22.04"
    assert d.clusters == () and d.big_cores == d.cores == 8  # no cpufreq in the tree: cores count as equal


def test_x86_level_needs_every_flag(tmp_path: Path) -> None:
    """A VM that hides movbe cannot take -march=x86-64-v3 code."""
    root = tree_copy(tmp_path, "x86_avx2")
    edit(root / "proc/cpuinfo", " movbe ", " ")
    d = probe(root, cc=NO_CC)
    assert (d.isa, d.vector_bits) == ("x86-64-v2", 128)


def test_sve_rung_and_vector_length(tmp_path: Path) -> None:
    root = tree_copy(tmp_path, "armv82_dotprod")
    edit(root / "proc/cpuinfo", "asimddp\n", "asimddp i8mm sve sve2\n")
    (root / "proc/sys/abi").mkdir(parents=True)
    (root / "proc/sys/abi/sve_default_vector_length").write_text("32\n")
    d = probe(root, cc=NO_CC)
    assert (d.isa, d.isa_level, d.vector_bits) == ("armv8.2-a+dotprod+i8mm+sve2", 4, 256)
    assert {"i8mm", "sve", "sve2"} <= set(d.features)
    assert probe(root, isa_cap="armv8.2-a+dotprod+i8mm", cc=NO_CC).vector_bits == 128


def test_armv7_userland(tmp_path: Path) -> None:
    root = tree_copy(tmp_path, "rpi4")
    edit(root / "proc/cpuinfo", "CPU architecture: 8", "CPU architecture: 7")
    edit(root / "proc/cpuinfo", "fp asimd evtstrm crc32 cpuid", "half thumb vfp edsp neon vfpv3 tls vfpv4 idiva")
    d = probe(root, cc=NO_CC)
    assert (d.arch, d.isa, d.vector_bits, d.cpu_model) == ("armv7l", "armv7-a+neon", 128, "Cortex-A72")
    assert (d.march, d.vector_registers) == ("armv7-a+neon-vfpv4", 16)  # VFPv4's fused multiply-add, 16 q registers


def test_missing_cache_sysfs(tmp_path: Path) -> None:
    root = tree_copy(tmp_path, "rpi4")
    shutil.rmtree(root / "sys/devices/system/cpu/cpu0/cache")
    d = probe(root, cc=NO_CC)
    assert d.caches == () and d.cache_bytes(1) is None
    assert d.isa == "armv8-a" and d.cores == 4


def test_empty_root_never_crashes(tmp_path: Path) -> None:
    d = probe(tmp_path, cc=NO_CC)
    assert (d.arch, d.cpu_model, d.isa, d.march, d.features) == ("unknown", "unknown", "unknown", "", ())
    assert (d.cores, d.cores_online, d.caches, d.mem_total_bytes) == (1, 1, (), None)
    assert d.compiler.id == "none" and d.compiler.path is None
    assert d.firmware["kernel"] == d.firmware["model"] == d.firmware["version_id"] == ""


@pytest.mark.parametrize(
    ("cgroup", "limits", "cores"),
    [
        (None, {"": "max 100000"}, 8),
        (None, {"": "150000 100000"}, 2),
        ("0::/system.slice/edgetune.service\n", {"system.slice/edgetune.service": "50000 100000",
                                                  "system.slice": "400000 100000"}, 1),
    ],
)
def test_cgroup_cpu_quota(tmp_path: Path, cgroup: str | None, limits: dict[str, str], cores: int) -> None:
    root = tree_copy(tmp_path, "x86_avx2")
    if cgroup:
        (root / "proc/self").mkdir(parents=True)
        (root / "proc/self/cgroup").write_text(cgroup)
    for rel, value in limits.items():
        (root / "sys/fs/cgroup" / rel).mkdir(parents=True, exist_ok=True)
        (root / "sys/fs/cgroup" / rel / "cpu.max").write_text(value + "\n")
    d = probe(root, cc=NO_CC)
    assert (d.cores, d.cores_online) == (cores, 8)


# --- --isa caps ---------------------------------------------------------------------------------


def test_cap_lowers_isa() -> None:
    d = probe(TREES / "armv82_dotprod", isa_cap="armv8-a", cc=NO_CC)
    assert (d.isa, d.march, d.isa_level, d.detected_isa) == ("armv8-a", "armv8-a", 0, "armv8.2-a+dotprod")


@pytest.mark.parametrize(
    ("tree", "cap", "allowed"),
    [
        ("x86_avx2", "x86-64-v4", "x86-64, x86-64-v2, x86-64-v3"),  # above the hardware
        ("x86_avx2", "armv8-a", "x86-64, x86-64-v2, x86-64-v3"),  # wrong arch
        ("rpi4", "armv8.2-a+dotprod", "armv8-a"),
        ("rpi4", "native", "armv8-a"),
    ],
)
def test_bad_isa(tree: str, cap: str, allowed: str) -> None:
    with pytest.raises(BadInput) as e:
        probe(TREES / tree, isa_cap=cap, cc=NO_CC)
    assert repr(cap) in str(e.value) and allowed in str(e.value)
    assert e.value.exit_code == 2


# --- fingerprints and compiler ------------------------------------------------------------------


def test_hw_fingerprint_tracks_compiler_and_isa(tmp_path: Path) -> None:
    clang = fake_cc(tmp_path, "Debian clang version 17.0.6 (++20231208)")
    base = probe(TREES / "x86_avx2", cc=NO_CC)
    with_clang = probe(TREES / "x86_avx2", cc=clang)
    capped = probe(TREES / "x86_avx2", isa_cap="x86-64-v2", cc=NO_CC)
    assert with_clang.compiler.id == "clang-17.0.6" and with_clang.compiler.path == clang
    assert len({base.hw_fingerprint, with_clang.hw_fingerprint, capped.hw_fingerprint}) == 3
    assert base.fw_fingerprint == with_clang.fw_fingerprint == capped.fw_fingerprint
    assert base.hw_fingerprint == probe(TREES / "x86_avx2", cc=NO_CC).hw_fingerprint
    # measured bandwidth is noise, not identity: it is not an input
    noisy = replace(base, bandwidth_gbps=9.9)
    assert hw_fingerprint(noisy.arch, noisy.cpu_model, noisy.isa, noisy.features, noisy.caches, noisy.cores,
                          noisy.compiler.id) == base.hw_fingerprint


def test_fw_fingerprint_tracks_kernel(tmp_path: Path) -> None:
    root = tree_copy(tmp_path, "rpi4")
    before = probe(root, cc=NO_CC)
    (root / "proc/sys/kernel/osrelease").write_text("6.6.62+rpt-rpi-v8\n")
    after = probe(root, cc=NO_CC)
    assert after.fw_fingerprint != before.fw_fingerprint and after.hw_fingerprint == before.hw_fingerprint


def test_compiler_detection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert probe(TREES / "rpi4", cc=NO_CC).compiler.id == "none"
    monkeypatch.setenv("CC", fake_cc(tmp_path, "tcc version 0.9.27"))
    d = probe(TREES / "rpi4")
    assert (d.compiler.path, d.compiler.id) == (os.environ["CC"], "unknown")
    gcc = shutil.which("gcc")
    if gcc:
        assert probe(TREES / "rpi4", cc=gcc).compiler.id.startswith("gcc-")


# --- CLI ----------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgetune.main", "probe", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_json() -> None:
    r = run_cli("--json")
    assert r.returncode == 0, r.stderr
    d = HwDescriptor.from_dict(json.loads(r.stdout))
    assert d.cores >= 1 and d.bandwidth_gbps and d.bandwidth_gbps > 0 and len(d.hw_fingerprint) == 16


def test_cli_human(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))  # no remembered bandwidth
    r = run_cli("--no-bandwidth")
    assert r.returncode == 0, r.stderr
    assert "hw_fingerprint" in r.stdout and "not measured" in r.stdout


def test_cli_bad_isa() -> None:
    r = run_cli("--isa", "armv9-bogus", "--no-bandwidth")
    assert r.returncode == 2
    assert "armv9-bogus" in r.stderr and "allowed" in r.stderr


@pytest.mark.parametrize("verb", [("kernels",), ("propose", "gemm", "--workload", "kws_dscnn.fc")])
def test_kernels_and_propose_name_the_cross_levels_they_take(verb) -> None:
    """`kernels` and `propose` take another arch's level (a generic device of it): a bad --isa lists those too,
    not only this host's caps, or the error hides the values the README tells the user to pass."""
    from hwprobe.cpuinfo import host_arch
    from hwprobe.isa import LADDERS
    from hwprobe.target import TOOLCHAINS

    cross = [r.name for a in TOOLCHAINS if a != host_arch() for r in LADDERS[a]]
    r = subprocess.run([sys.executable, "-m", "edgetune.main", *verb, "--isa", "armv9-bogus"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "Traceback" not in err and "'armv9-bogus'" in err, err
    assert cross and f"for a generic device of another arch: {', '.join(cross)}" in err, err


def test_kernels_says_which_device_its_counts_are_for() -> None:
    """The valid-config counts of `kernels --isa armv8-a` are a generic 4-core device's, not this host's: the table
    said only 'bundled kernels'."""
    r = subprocess.run([sys.executable, "-m", "edgetune.main", "kernels", "--isa", "armv8-a"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "valid configs on generic armv8-a target (armv8-a, 4 cores)" in r.stdout, r.stdout[:500]


def test_propose_on_a_level_where_no_config_is_valid_says_so() -> None:
    """armv7-a without NEON has no vector width the kernels take: `propose` said nothing, in an empty table, exit 0."""
    r = subprocess.run([sys.executable, "-m", "edgetune.main", "propose", "gemm", "--workload", "kws_dscnn.fc",
                        "--isa", "armv7-a"], cwd=REPO, capture_output=True, text=True, timeout=120)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "no config of gemm is valid for kws_dscnn.fc on armv7-a" in err, err
    assert "try a higher --isa" in err
