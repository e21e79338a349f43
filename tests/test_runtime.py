"""kernels.load_tuned finds what `tune` and `pin` made active: by any slot's name (a model's imported layer too)
or by shape whatever the slot is named, and says why when it falls back to the default config."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kernels
from edgetune.errors import BadInput
from kernels.active import active_path
from kernels.registry import get_spec
from kernels.workload_files import WorkloadEntry, write_workloads_file

GEMM = get_spec("gemm")
FC = GEMM.workload("kws_dscnn.fc").shape  # M=1, N=12, K=64: small, so tuning takes a second or two
LAYER = {"M": 64, "N": 32, "K": 16}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgetune.main", *args], capture_output=True, text=True, timeout=300)


def _tune(*args: str) -> dict:
    p = _cli("tune", "--strategy", "random", "--budget", "2", "--json", *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["results"][0]


def _pin(workload: str, config: dict) -> None:
    p = _cli("pin", "gemm", workload, json.dumps(config))
    assert p.returncode == 0, p.stderr


def _workloads_file(tmp_path: Path, name: str, shape: dict) -> str:
    path = tmp_path / f"{name}.toml"
    write_workloads_file(path, [WorkloadEntry("gemm", shape, name)])
    return str(path)


def _check_runs(k: kernels.runtime.TunedKernel, shape: dict) -> None:
    x = GEMM.make_inputs(shape, np.random.default_rng(5))
    np.testing.assert_allclose(k(*x)[0], GEMM.reference(shape, x)[0], rtol=1e-4, atol=1e-4)


def test_an_imported_layer_loads_by_its_name_its_shape_and_its_generated_name(tmp_path):
    tuned = _tune("--workloads", _workloads_file(tmp_path, "net.gemm.1", LAYER), "--workload", "net.gemm.1")
    for k in (kernels.load_tuned("gemm", "net.gemm.1"), kernels.load_tuned("gemm", shape=LAYER),
              kernels.load_tuned("gemm", "custom.M64-N32-K16")):
        assert (k.tuned, k.workload, k.config, k.shape) == (True, "net.gemm.1", tuned["config"], LAYER)
        assert "tuned config of gemm/net.gemm.1" in k.why
        _check_runs(k, LAYER)
    assert "found by name" in kernels.load_tuned("gemm", "net.gemm.1").why
    assert "found by shape" in kernels.load_tuned("gemm", shape=LAYER).why


def test_shape_finds_a_bundled_workload_tuned_by_name():
    tuned = _tune("--kernel", "gemm", "--workload", "kws_dscnn.fc")
    k = kernels.load_tuned("gemm", shape=dict(FC))
    assert (k.tuned, k.workload, k.config) == (True, "kws_dscnn.fc", tuned["config"])


def test_one_shape_under_several_names_prefers_the_generated_name_then_the_newest(tmp_path):
    _tune("--workloads", _workloads_file(tmp_path, "net.fc", dict(FC)), "--workload", "net.fc")
    _pin("kws_dscnn.fc", {"unroll_k": 1})  # newer than net.fc
    k = kernels.load_tuned("gemm", shape=dict(FC))
    assert (k.workload, k.config["unroll_k"]) == ("kws_dscnn.fc", 1)
    _pin("M=1,N=12,K=64", {"unroll_k": 2})  # the shape's generated name, custom.M1-N12-K64
    _pin("kws_dscnn.fc", {"vec": 4})  # newest, yet the generated name is the shape's own
    k = kernels.load_tuned("gemm", shape=dict(FC))
    assert (k.workload, k.config["unroll_k"]) == ("custom.M1-N12-K64", 2)
    assert kernels.load_tuned("gemm", "net.fc").workload == "net.fc"  # a name still loads its own slot
    assert kernels.load_tuned("gemm", "kws_dscnn.fc").config["vec"] == 4


def test_nothing_tuned_and_unknown_names(caplog):
    with caplog.at_level(logging.WARNING):
        k = kernels.load_tuned("gemm", shape=LAYER)
    assert (k.tuned, k.workload) == (False, "custom.M64-N32-K16")
    assert "no tuned config on this device yet" in k.why and "no tuned config" in caplog.text
    with pytest.raises(BadInput, match="unknown workload 'net.gemm.9'.*No active config of gemm is named"):
        kernels.load_tuned("gemm", "net.gemm.9")
    with pytest.raises(BadInput, match="not both"):
        kernels.load_tuned("gemm", "kws_dscnn.fc", shape=dict(FC))


@pytest.mark.parametrize("damage", [b"{garbage", b"[1, 2]", b"\xff\xfe"])
def test_a_damaged_active_file_is_named_and_rerunning_the_tune_rewrites_it(caplog, damage):
    args = ("--kernel", "gemm", "--workload", "kws_dscnn.fc")
    tuned = _tune(*args)
    active_path().write_bytes(damage)
    with caplog.at_level(logging.WARNING):
        k = kernels.load_tuned("gemm", "kws_dscnn.fc")
    assert not k.tuned and "no tuned config" not in k.why
    for text in (k.why, caplog.text):
        assert f"{active_path()} is unreadable" in text and "rerun any `edgetune tune` you ran before" in text
    again = _tune(*args)  # what the warning says to do: cached, so it only rewrites the file
    assert again["cached"] and again["config"] == tuned["config"]
    k = kernels.load_tuned("gemm", "kws_dscnn.fc")
    assert k.tuned and k.config == tuned["config"]


def test_an_imported_name_behind_a_damaged_active_file_names_the_file(tmp_path):
    _tune("--workloads", _workloads_file(tmp_path, "net.gemm.1", LAYER), "--workload", "net.gemm.1")
    active_path().write_text("{garbage")
    with pytest.raises(BadInput, match=f"could not be searched for it: {active_path()} is unreadable"):
        kernels.load_tuned("gemm", "net.gemm.1")
