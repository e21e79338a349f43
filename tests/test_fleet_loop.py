"""bench/fleet_loop.py's measuring parts on a tiny configuration: the simulated class is one the committed data
lacks, its held-out layers never reach training, each reference is searched once and then read from the cache, and
two models are judged on the same rounds. (The loop itself, daemons to committed rollout, is test_rollout_e2e's.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import fleet_loop as F  # noqa: E402
from tuner.train import data as D  # noqa: E402

CLASS = "x86-64"


@pytest.fixture(scope="module")
def cases() -> dict:
    return D.load_collector(D.DEFAULT_DATA)


def test_the_class_is_one_the_committed_data_lacks_and_its_workloads_are_new(cases):
    from hwprobe import probe

    assert CLASS not in {c.isa for c in cases.values()}
    wls = F.class_workloads(cases, CLASS, 1, probe(isa_cap=CLASS, measure_bandwidth=False))
    assert sorted(w["kernel"] for w in wls) == sorted({c.kernel for c in cases.values()})  # one per kernel
    for w in wls:
        assert not D.is_real_heldout(w["kernel"], w["shape"])
        assert D.problem_key(w["kernel"], CLASS, w["shape"]) not in {c.problem for c in cases.values()}


def _record(kernel: str, workload: str, shape: dict, hw) -> dict:
    from kernels.registry import get_spec

    spec = get_spec(kernel)
    cfg = spec.space(shape, hw).valid_default()
    return {"kernel": kernel, "workload": workload, "shape": shape, "isa": CLASS, "source_hash": spec.source_hash(),
            "measurements": [{"config": cfg, "ok": True, "ms": 1.0}]}


def test_a_device_record_of_a_held_out_layer_never_becomes_training_data(cases, tmp_path):
    from hwprobe import probe

    hw = probe(isa_cap=CLASS, measure_bandwidth=False)
    layers = F.held_out_layers(1)
    assert len(layers) == len({c.kernel for c in cases.values()})
    new = F.class_workloads(cases, CLASS, 1, hw)[0]
    recs = [_record(spec.name, wl.name, wl.shape, hw) for spec, wl in layers]
    recs.append(_record(new["kernel"], new["name"], new["shape"], hw))
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    got, sessions = D.load_records(path, {})
    assert sessions == len(recs)
    assert [c.problem for c in got.values()] == [D.problem_key(new["kernel"], CLASS, new["shape"])]


def _bench(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    from tuner.model.inference import bundled_model_path

    return subprocess.run([sys.executable, "bench/fleet_loop.py", "--kernels", "gru", "--held", "1", "--ref-evals",
                           "3", "--refs", str(tmp_path / "refs.json"), "--model", str(bundled_model_path()),
                           "--depth", "3", "--rounds", "2", "--other-isa", "x86-64-v2", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.timeout(1200)
def test_references_are_cached_and_every_model_is_judged_on_the_same_rounds(tmp_path):
    from tuner.model.inference import bundled_model_path

    p = _bench(tmp_path, "--json", str(tmp_path / "out.json"), "--model", str(bundled_model_path()))
    assert p.returncode == 0, p.stderr[-3000:]
    refs = json.loads((tmp_path / "refs.json").read_text())
    assert sorted(k.split("|")[1] for k in refs) == [CLASS, "x86-64-v2"]  # one reference per ISA
    assert all(r["evals"] == 3 and r["kernel"] == "gru" for r in refs.values())
    doc = json.loads((tmp_path / "out.json").read_text())
    rows = doc["class"] + doc["other"]
    assert [(r["isa"], r["workload"]) for r in rows] == [(CLASS, "rnnoise.vad_gru"), ("x86-64-v2", "rnnoise.vad_gru")]
    for r in rows:
        # the same model three times: the same lists, each config measured once per round for all
        assert r["lists"]["old"] == r["lists"]["new"] == r["lists"]["new2"] and len(r["lists"]["old"]) == 3
        assert r["ratios"]["old"] == r["ratios"]["new"] == r["ratios"]["new2"] and r["ref_ms"] > 0
    cls = doc["figures"]["class"]
    assert cls["old"] == cls["new"] == cls["new2"] and 1 <= cls["old"]["mean_evals"] <= 4  # a miss counts depth + 1
    hits = [next((i + 1 for i, x in enumerate(r["ratios"]["old"]) if x and x <= 1.05), None) for r in doc["class"]]
    assert cls["old"]["top1"] == (hits[0] == 1) and cls["old"]["top5"] == (hits[0] is not None)
    assert doc["verdict"]["half_the_evals"] is False and doc["verdict"]["no_regression"] is True
    assert "target: new/old mean evals to 5% on x86-64 1.00" in p.stdout

    again = _bench(tmp_path, "--refs-only")  # a rerun reads both references from the cache
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count(": cached;") == 2 and "evals of anneal" not in again.stdout
    assert json.loads((tmp_path / "refs.json").read_text()).keys() == refs.keys()


def test_the_target_needs_half_the_evals_on_the_class_and_nothing_lost_elsewhere():
    def fig(mean: float, top5: int) -> dict:
        return {"cases": 6, "mean_evals": mean, "top5": top5}

    met = F.verdict({"old": fig(6.0, 2), "new": fig(3.0, 5)}, {"old": fig(2.0, 5), "new": fig(2.0, 5)})
    assert met == {"half_the_evals": True, "no_regression": True, "new_over_old_evals": 0.5}
    short = F.verdict({"old": fig(6.0, 2), "new": fig(3.5, 5)}, {"old": fig(2.0, 5), "new": fig(1.5, 4)})
    assert short["half_the_evals"] is False and short["no_regression"] is False  # one top-5 hit fewer elsewhere
