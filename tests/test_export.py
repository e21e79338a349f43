"""`edgetune export --format c-header`: one macro per workload, so a firmware build takes the knobs it names;
workload names that would share a macro are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgetune.errors import BadInput
from kernels.registry import get_spec
from kernels.spec import C_DIR
from kernels.workload_files import WorkloadEntry, write_workloads_file
from tuner.export import to_c_header

GEMM = get_spec("gemm")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgetune.main", *args], capture_output=True, text=True, timeout=300)


def _tune_file(tmp_path: Path, entries: dict[str, dict]) -> None:
    path = tmp_path / f"w{len(list(tmp_path.glob('w*.toml')))}.toml"
    write_workloads_file(path, [WorkloadEntry("gemm", shape, name) for name, shape in entries.items()])
    p = _cli("tune", "--workloads", str(path), "--strategy", "random", "--budget", "2")
    assert p.returncode == 0, p.stderr


def _compile(tmp_path: Path, header: Path, hw, *defines: str) -> subprocess.CompletedProcess:
    return subprocess.run(["cc", "-O1", f"-march={hw.march}", "-fPIC", "-shared", "-pthread", "-Wall", "-Werror",
                           "-include", str(header), *defines, f"-I{C_DIR}", str(C_DIR / "gemm.c"),
                           "-o", str(tmp_path / "gemm_fw.so"), "-lm"], capture_output=True, text=True)


def test_names_differing_in_punctuation_get_one_macro_each_or_are_refused(tmp_path, hw):
    _tune_file(tmp_path, {"net.fc-1": {"M": 1, "N": 16, "K": 32}, "net.fc2": {"M": 2, "N": 16, "K": 32}})
    header = tmp_path / "edgetune_tuned.h"
    p = _cli("export", "--format", "c-header", "-o", str(header))
    assert p.returncode == 0, p.stderr
    doc = json.loads(_cli("export", "--format", "json").stdout)["kernels"]
    for slot, define in (("gemm/net.fc-1", "-DEDGETUNE_GEMM_NET_FC_1"), ("gemm/net.fc2", "-DEDGETUNE_GEMM_NET_FC2")):
        cc = _compile(tmp_path, header, hw, define)  # -Werror: a redefined macro would fail the build
        assert cc.returncode == 0, cc.stderr
        assert f"#define ET_KC {doc[slot]['config']['kc']}" in header.read_text()

    _tune_file(tmp_path, {"net.fc.1": {"M": 3, "N": 16, "K": 32}})  # differs from net.fc-1 by '.' only
    p = _cli("export", "--format", "c-header", "-o", str(tmp_path / "clash.h"))
    assert p.returncode == 2 and "Traceback" not in p.stderr and not (tmp_path / "clash.h").exists()
    err = " ".join(p.stderr.split())
    assert "active configs gemm/net.fc-1 and gemm/net.fc.1 both map to the C macro EDGETUNE_GEMM_NET_FC_1" in err
    assert _cli("export", "--format", "json").returncode == 0  # JSON keeps the names as they are

    gone = _cli("forget", "gemm", "net.fc.1", "--json")  # the way out the error names
    assert gone.returncode == 0 and json.loads(gone.stdout)["workload"] == "net.fc.1", gone.stderr
    assert _cli("export", "--format", "c-header", "-o", str(tmp_path / "clash.h")).returncode == 0
    assert set(json.loads(_cli("export", "--format", "json").stdout)["kernels"]) == {"gemm/net.fc-1", "gemm/net.fc2"}
    again = _cli("forget", "gemm", "net.fc.1")
    assert again.returncode == 2 and "no active config for gemm/net.fc.1" in again.stderr


def test_a_selector_equal_to_another_slots_threads_macro_is_refused():
    """`fc.threads` selects with EDGETUNE_GEMM_FC_THREADS, which `fc`'s block always defines: its knobs would
    apply to every build."""
    entry = {"config": GEMM.default, "ms": 1.0, "speedup": 1.0, "strategy": "random"}
    doc = {"hw_fingerprint": "x", "kernels": {"gemm/fc": entry, "gemm/fc.threads": entry}}
    with pytest.raises(BadInput, match="gemm/fc and gemm/fc.threads both map to the C macro EDGETUNE_GEMM_FC_THREADS"):
        to_c_header(doc)
    assert "#ifdef EDGETUNE_GEMM_FC\n" in to_c_header({**doc, "kernels": {"gemm/fc": entry}})


def test_the_comment_line_keeps_a_tiny_kernels_time():
    """A 20 ns kernel's comment must not read `0.0000 ms`; an entry without a time reads `-`."""
    fast = {"config": GEMM.default, "ms": 2.0e-05, "speedup": 3.0, "strategy": "llm"}
    untimed = {"config": GEMM.default, "speedup": 1.0, "strategy": "pin"}
    header = to_c_header({"hw_fingerprint": "x", "kernels": {"gemm/tiny": fast, "gemm/pinned": untimed}})
    assert "/* gemm/tiny: 2e-05 ms, speedup 3.00x, strategy llm */" in header
    assert "/* gemm/pinned: - ms, speedup 1.00x, strategy pin */" in header
