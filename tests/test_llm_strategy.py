"""Strategy `llm`: real model, real compiler; fallbacks when the model file is missing or damaged."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.measure import Measurement
from kernels.registry import get_spec
from kernels.space import config_key
from tuner.db import ResultsDB
from tuner.strategies.llm import LLMStrategy, _PROPOSERS
from tuner.model.inference import default_model_path
from tuner.session import Budget, Session
from tuner.strategies import STRATEGIES, make_strategy

REPO = Path(__file__).resolve().parent.parent
GEMM = get_spec("gemm")
FC = GEMM.workload("kws_dscnn.fc")


def test_llm_is_registered_and_default():
    from tuner.cli import DEFAULT_STRATEGY

    assert DEFAULT_STRATEGY == "llm" and "llm" in STRATEGIES


def test_llm_proposes_top_k_then_refines_and_stops(hw, model_kernel):
    space = model_kernel.space(model_kernel.workloads[1].shape, hw)
    s = make_strategy("llm", space, 0, kernel=model_kernel)
    assert isinstance(s, LLMStrategy) and s.fallback is None
    assert s.proposer.m.info.sha256[:12] in s.version  # results are keyed by the model
    first = s.ask(2)
    assert len(first) >= 5 and all(space.is_valid(c) for c in first)  # the top-K as one batch
    for i, c in enumerate(first):
        s.tell(c, Measurement(ok=True, ms=1.0 + 0.01 * i))
    asked = 0
    for _ in range(40):  # refinement around the winner, then it stops on its own (patience)
        more = s.ask(2)
        if not more:
            break
        for c in more:
            assert config_key(c) not in {config_key(x) for x in first}
            s.tell(c, Measurement(ok=True, ms=2.0))
            asked += 1
    assert 0 < asked <= 8


def test_llm_widens_when_proposals_measure_far_apart(hw, model_kernel):
    space = model_kernel.space(model_kernel.workloads[0].shape, hw)
    s = LLMStrategy(space, 0, kernel=model_kernel)
    first = s.ask(2)
    for i, c in enumerate(first):  # the model's first pick is 10x the best: its ranking is off here
        s.tell(c, Measurement(ok=True, ms=10.0 if i == 0 else 1.0))
    more = s.ask(2)
    assert s.widened and len(more) >= 2
    assert not {config_key(c) for c in more} & {config_key(c) for c in first}


def test_llm_session_real_compile(hw, runner, tmp_path, model_kernel):
    spec = model_kernel
    wl = min(spec.workloads, key=lambda w: spec.flops(w.shape))
    db = ResultsDB(tmp_path / "r.db")
    res = Session(db, runner, hw).tune(spec, wl, strategy="llm", budget=Budget(evals=12))
    assert res.strategy == "llm" and res.evals <= 12 and res.ms > 0 and res.speedup is not None
    info = db.session_info(res.session_id)
    assert info["strategy_version"].startswith("1-") and "anneal-fallback" not in info["strategy_version"]
    first = [m["config"] for m in db.measurements(res.session_id, "search")[:5]]
    assert first == [p.config for p in _PROPOSERS[str(default_model_path())].propose(
        spec.name, spec.space(wl.shape, hw), 5).proposals][:len(first)]


def test_a_model_older_than_the_kernel_falls_back_to_anneal(hw, caplog):
    """A kernel whose knobs changed since the model was trained is searched by anneal, with the reason logged."""
    import dataclasses

    from kernels.space import enum

    spec = dataclasses.replace(GEMM, params=GEMM.params + (enum("newknob", 1, 2),),
                               default={**GEMM.default, "newknob": 1})
    with caplog.at_level(logging.WARNING):
        s = LLMStrategy(spec.space(FC.shape, hw), 0, kernel=spec)
    assert s.fallback is not None and "anneal-fallback" in s.version
    assert "knobs changed since it was trained" in caplog.text
    assert s.ask(2)  # and it tunes


@pytest.mark.parametrize("damage", ["truncated", "random-bytes", "missing"])
def test_damaged_model_falls_back_to_anneal_and_tuning_completes(damage, tmp_path, monkeypatch, caplog, hw, runner):
    bad = tmp_path / "tuner.Q8_0.gguf"
    data = default_model_path().read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) * 2 // 3])
    elif damage == "random-bytes":
        bad.write_bytes(b"GGUF" + os.urandom(len(data) - 4))  # right magic, garbage after it
    monkeypatch.setenv("EDGETUNE_MODEL", str(bad))
    with caplog.at_level(logging.WARNING, logger="tuner.strategies.llm"):
        s = make_strategy("llm", GEMM.space(FC.shape, hw), 0, kernel=GEMM)
    assert s.fallback is not None and "anneal-fallback" in s.version
    assert any(str(bad) in r.getMessage() and "falls back to anneal" in r.getMessage() for r in caplog.records)
    res = Session(ResultsDB(tmp_path / "r.db"), runner, hw).tune(GEMM, FC, strategy="llm", budget=Budget(evals=4),
                                                                 strategy_obj=s)
    assert res.evals == 4 and res.ms > 0


def test_cli_tune_with_damaged_model_warns_and_completes(tmp_path):
    bad = tmp_path / "broken.Q8_0.gguf"
    bad.write_bytes(default_model_path().read_bytes()[:5000])
    env = dict(os.environ, EDGETUNE_MODEL=str(bad))
    p = subprocess.run([sys.executable, "-m", "edgetune.main", "tune", "--kernel", "gemm", "--workload",
                        "kws_dscnn.fc", "--budget", "3", "--json"], capture_output=True, text=True, timeout=180,
                       env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert str(bad) in p.stderr and "anneal" in p.stderr
    assert json.loads(p.stdout)["results"][0]["strategy"] == "llm"


def test_train_from_records_jsonl(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sentencepiece")
    pytest.importorskip("gguf")
    from tuner.train import data as D

    cases = D.load_collector(D.DEFAULT_DATA)
    recs = []
    for c in list(cases.values())[:6]:
        recs.append({"kernel": c.kernel, "workload": c.workload, "shape": c.shape, "isa": c.isa,
                     "hw_fingerprint": "x", "strategy": "anneal", "measurements": [
                         {"phase": "search", "seq": i, "config": c.configs[k], "ok": True, "reason": "", "ms": ms,
                          "cv": 0.01, "stats": {}} for i, (k, ms) in enumerate(list(c.table().items())[:20])]})
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "model"
    p = subprocess.run([sys.executable, "-m", "edgetune.main", "train", "--records", str(path), "--no-base",
                        "--out", str(out), "--steps", "3", "--json"], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    model = Path(d["model"])
    assert model.exists() and model.stat().st_size < 5 * 1024 * 1024
    from tuner.model.proposer import Proposer

    prop = Proposer(path=model)
    from hwprobe import probe

    trained = get_spec(recs[0]["kernel"])  # a kernel of the records (the model names only those in its spaces)
    assert set(prop.m.info.spaces()) == {r["kernel"] for r in recs}
    res = prop.propose(trained.name, trained.space(recs[0]["shape"], probe(measure_bandwidth=False)), 3)
    assert len(res.proposals) == 3
