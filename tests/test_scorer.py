"""The scorer the tuner model's file carries: fitted trees walked by numpy, inside the GGUF, re-ranking the first batch.

Real parts: scikit-learn fits the trees, the gguf package writes the file, llama.cpp loads it, the bundled model
proposes.
"""

from __future__ import annotations

import io
import json
import logging
import math
import random
import shutil

import numpy as np
import pytest

from kernels.registry import get_spec
from kernels.space import config_key
from tuner.model.inference import LlamaModel, bundled_model_path, check_gguf
from tuner.model.proposer import Proposer
from tuner.model.scorer import SPEC_KEY, TREES_KEY, FeatureSpec, Scorer, ScorerError
from tuner.strategies.llm import ALWAYS_HEDGE, HEDGE_POOL, LLMStrategy, hedged
from tuner.train import data as D
from tuner.train import scorer as TS
from tuner.train.gguf_export import rewrite_with_scorer

GEMM = get_spec("gemm")
HW = {"isa": "x86-64-v4", "vector_bits": 512, "cores": 2, "l1d": 32768, "l2": 1 << 20, "l3": 32 << 20,
      "bandwidth_gbps": 20.0}


def synthetic_cases(n: int = 12) -> list[D.Case]:
    """gemm cases whose times follow a known rule: each doubling of mr away from 4 costs 30%, threads=2 halves it."""
    rng = np.random.default_rng(0)
    cases = []
    for i in range(n):
        shape = {d: int(2 ** rng.integers(4, 10)) for d in ("M", "N", "K")}
        c = D.Case("gemm", "x86-64-v4", shape, f"s{i}", "train", HW)
        for mr in (1, 2, 4, 8):
            for threads in (1, 2):
                for order in ("panels", "rows"):
                    cfg = {"mr": mr, "threads": threads, "order": order}
                    ms = 1.3 ** abs(math.log2(mr / 4)) / threads * (1.1 if order == "rows" else 1.0)
                    k = config_key(cfg)
                    c.configs[k], c.ms[k] = cfg, [ms]
        cases.append(c)
    return cases


def test_the_numpy_walk_equals_scikit_learn_and_learns_the_rule():
    from sklearn.ensemble import HistGradientBoostingRegressor

    cases = synthetic_cases()
    meta = TS.fit(cases)
    forest = Scorer.from_meta(meta).forests["gemm"]
    spec = TS.feature_spec(cases)
    X = np.array([spec.row(c.hw, c.shape, cfg) for c in cases for cfg, _ in TS.targets(c)])
    y = np.array([t for c in cases for _, t in TS.targets(c)])
    ref = HistGradientBoostingRegressor(max_iter=TS.TREES, learning_rate=TS.LEARNING_RATE,
                                        max_leaf_nodes=TS.LEAVES, early_stopping=False).fit(X, y)
    assert np.abs(forest.predict(X) - ref.predict(X)).max() < 1e-9
    holes = X.copy()
    holes[::3, len(spec.dims) + 6:] = np.nan  # knobs a config lacks: both send them down the learned side
    assert np.abs(forest.predict(holes) - ref.predict(holes)).max() < 1e-9
    best = {"mr": 4, "threads": 2, "order": "panels"}
    pred = forest.score(HW, {"M": 64, "N": 64, "K": 64}, [best, {**best, "mr": 1}, {**best, "threads": 1}])
    assert pred[0] < pred[1] and pred[0] < pred[2]


def test_a_feature_the_spec_does_not_know_is_missing_not_a_crash():
    spec = FeatureSpec(("K", "M"), ("mr",), {"order": ("panels", "rows")})
    row = spec.row(HW, {"M": 64}, {"mr": "wide", "order": "diagonal"})
    assert len(row) == spec.width
    assert row[:2] == [512.0, 2.0] and math.isnan(row[6])  # K absent; vector bits and cores are as given
    assert all(math.isnan(x) for x in row[-4:])  # mr not a number, order not in the vocabulary, K / mr unknown


def test_the_bundled_model_carries_a_scorer_for_every_kernel_it_knows(hw):
    info = check_gguf(bundled_model_path())
    scorer = Scorer.from_meta(info.meta)
    assert scorer is not None and set(scorer.forests) == set(info.spaces())
    card = json.loads(bundled_model_path().with_name("edgetune-tuner.card.json").read_text())
    assert card["scorer"]["bytes"] == len(info.meta[TREES_KEY]) and set(card["scorer"]["kernels"]) == set(info.spaces())
    space = GEMM.space(GEMM.workload("kws_dscnn.fc").shape, hw)
    configs = space.sample(10, random.Random(0))
    pred = scorer.score("gemm", hw, space.shape, configs)
    assert len(pred) == 10 and all(math.isfinite(p) for p in pred) and len(set(pred)) > 1


@pytest.mark.parametrize("damage, why", [
    (lambda m: m | {TREES_KEY: b"not an npz"}, "malformed"),
    (lambda m: m | {SPEC_KEY: m[SPEC_KEY].replace("edgetune-scorer-1", "edgetune-scorer-9")}, "edgetune-scorer-9"),
    (lambda m: {SPEC_KEY: m[SPEC_KEY]}, "malformed"),
    (lambda m: m | {TREES_KEY: _npz_with(m, "gemm.left", lambda a: a + 10_000)}, "outside their node table"),
    (lambda m: m | {TREES_KEY: _npz_with(m, "gemm.feature", lambda a: a + 10_000)}, "test a feature outside"),
])
def test_malformed_scorer_metadata_is_named(damage, why):
    meta = TS.fit(synthetic_cases(4))
    with pytest.raises(ScorerError, match=why):
        Scorer.from_meta(damage(meta))


def _npz_with(meta: dict, key: str, change) -> bytes:
    with np.load(io.BytesIO(meta[TREES_KEY])) as z:
        arrays = {k: z[k] for k in z.files}
    arrays[key] = change(arrays[key])
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def test_a_model_rewritten_with_a_scorer_keeps_its_weights_and_a_damaged_one_still_proposes(tmp_path, hw, caplog):
    path = tmp_path / "m.Q8_0.gguf"
    shutil.copyfile(bundled_model_path(), path)
    meta = TS.fit(synthetic_cases(4))
    rewrite_with_scorer(path, meta)
    info = check_gguf(path)
    assert info.meta[TREES_KEY] == meta[TREES_KEY] and set(Scorer.from_meta(info.meta).forests) == {"gemm"}
    space = GEMM.space(GEMM.workload("kws_dscnn.fc").shape, hw)
    ours, bundled = Proposer(LlamaModel(path)), Proposer(LlamaModel(bundled_model_path()))
    assert [p.config for p in ours.propose("gemm", space, 5).proposals] == \
        [p.config for p in bundled.propose("gemm", space, 5).proposals]  # the tensors were copied unchanged
    rewrite_with_scorer(path, meta | {TREES_KEY: b"\0" * 64})
    damaged = Proposer(LlamaModel(path))
    with caplog.at_level(logging.WARNING):
        assert damaged.scorer is None  # read on first use
    assert str(path) in caplog.text and "own order" in caplog.text
    assert damaged.propose("gemm", space, 3).proposals


def test_the_first_batch_is_hedged_from_the_models_pool_in_the_scorers_order(hw):
    space = GEMM.space(GEMM.workload("mobilenetv2.b2.expand").shape, hw)
    s = LLMStrategy(space, 0, kernel=GEMM)
    plain = LLMStrategy(space, 0, kernel=GEMM, rescore=False)
    pool = s.proposer.propose("gemm", space, HEDGE_POOL * s.k).proposals
    pred = s.proposer.scorer.score("gemm", hw, space.shape, [p.config for p in pool])
    first, first_plain = s.ask(5), plain.ask(5)
    assert first[0] == pool[int(np.argmin(pred))].config  # the scorer's pick of the model's candidates leads
    assert first_plain[0] == pool[0].config != first[0]  # without it, the model's own top pick
    ranked = [(pool[i].config, pool[i].logprob) for i in np.argsort(pred, kind="stable")]
    plan = hedged(ranked, 5, space)
    kept = [c for c in first if c in plan]
    # the batch is the scorer-ordered plan, less one config per always-hedged knob swapped in
    swaps = sum(knob in space.names for knob in ALWAYS_HEDGE)
    assert kept[0] == plan[0] and len(kept) >= len(first) - swaps
    assert kept == [c for c in plan if c in kept]


def test_the_shipped_scorer_reads_of_a_device_only_what_its_data_varied():
    """The data's descriptors differ only in vector width (one host under three ISA caps), so a device it never
    described is scored as the known one of its vector width: more cores, other caches or bandwidth change nothing."""
    scorer = Scorer.from_meta(check_gguf(bundled_model_path()).meta)
    space = GEMM.space(GEMM.workload("mobilenetv2.b2.expand").shape, None)
    configs = [space.default] + [{**space.default, "threads": 1}, {**space.default, "mr": 2}]
    known = scorer.score("gemm", HW, space.shape, configs)
    gateway = HW | {"cores": 4, "l2": 256 << 10, "l3": None, "bandwidth_gbps": 3.5}
    assert scorer.score("gemm", gateway, space.shape, configs) == known
    assert scorer.score("gemm", HW | {"vector_bits": 128}, space.shape, configs) != known


def test_the_scorer_tool_refits_a_models_trees_in_place_and_its_card_follows(tmp_path):
    import gzip
    import hashlib
    import subprocess
    import sys

    rows = []
    with gzip.open(D.DEFAULT_DATA, "rt") as f:
        for line in f:
            r = json.loads(line)
            if r["kind"] == "hw" or r["kind"] == "m" and r["kernel"] == "logmel" and r["split"] == "train":
                rows.append(line)
            if len(rows) > 600:
                break
    data = tmp_path / "runs.jsonl"
    data.write_text("".join(rows))
    for name in ("edgetune-tuner.Q8_0.gguf", "edgetune-tuner.card.json"):
        shutil.copyfile(bundled_model_path().with_name(name), tmp_path / name)
    tool = [sys.executable, "-m", "tuner.train.scorer"]
    p = subprocess.run(tool + ["--data", str(data), "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    model = tmp_path / "edgetune-tuner.Q8_0.gguf"
    card = json.loads((tmp_path / "edgetune-tuner.card.json").read_text())
    assert card["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert list(card["scorer"]["kernels"]) == ["logmel"]
    assert set(Scorer.from_meta(check_gguf(model).meta).forests) == {"logmel"}
    bad = subprocess.run(tool + ["--out", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nowhere" in bad.stderr and "card" in bad.stderr
