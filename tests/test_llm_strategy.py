"""Strategy `llm`: real model, real compiler; fallbacks when the model file is missing or damaged."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.measure import Measurement
from kernels.registry import get_spec
from kernels.space import config_key
from tuner.db import ResultsDB
from tuner.strategies.llm import (
    ALWAYS_HEDGE, DEFAULT_K, EXPLORE_AWAY, FAR_HEDGE, PATIENCE, RETEST_WITHIN, SETTLE, STRATEGY_VERSION, WARM, LLMStrategy, _PROPOSERS,
    evidence_bias, hedged, shape_distance,
)
from tuner.model.inference import default_model_path
from tuner.session import Budget, Session
from tuner.strategies import STRATEGIES, make_strategy

REPO = Path(__file__).resolve().parent.parent
GEMM = get_spec("gemm")
FC = GEMM.workload("kws_dscnn.fc")


def test_llm_is_registered_and_default():
    from tuner.cli import DEFAULT_STRATEGY

    assert DEFAULT_STRATEGY == "llm" and "llm" in STRATEGIES


def test_llm_hedges_then_steers_by_what_it_measured_and_stops(hw):
    space = GEMM.space(GEMM.workload("mobilenetv2.b6.project").shape, hw)
    s = make_strategy("llm", space, 0, kernel=GEMM)
    assert isinstance(s, LLMStrategy) and s.fallback is None
    assert s.proposer.m.info.sha256[:12] in s.version  # results are keyed by the model
    first = s.ask(2)
    assert len(first) == DEFAULT_K and all(space.is_valid(c) for c in first)  # the hedged top-K as one batch
    assert len({config_key(c) for c in first}) == DEFAULT_K
    for i, c in enumerate(first):
        s.tell(c, Measurement(ok=True, ms=1.0 + 0.01 * i))
    seen = {config_key(c) for c in first}
    asked, at = 0, None
    for _ in range(40):  # steered proposals, never a measured config; converged once nothing improves for `patience`
        if at is None and s.converged():
            at = asked
        more = s.ask(2)
        assert more and not {config_key(c) for c in more} & seen and all(space.is_valid(c) for c in more)
        if at is not None:  # converged: each batch opens with an exploration step away from the incumbent
            assert space.distance(more[0], first[0]) >= EXPLORE_AWAY
        seen |= {config_key(c) for c in more}
        for c in more:
            s.tell(c, Measurement(ok=True, ms=2.0))
            asked += 1
    assert at is not None and PATIENCE <= at <= PATIENCE + 1  # the first batch measured close: patience not doubled
    assert asked >= 40  # past convergence it goes on, exploring (an explicit budget is spent whole)
    assert s.history[0] == (first[0], 1.0)


def test_the_model_is_prompted_with_what_was_measured(hw):
    space = GEMM.space(GEMM.workload("mobilenetv2.b2.expand").shape, hw)
    prop = _PROPOSERS.get(str(default_model_path())) or LLMStrategy(space, 0, kernel=GEMM).proposer
    top = prop.propose("gemm", space, 8)
    measured = [(p.config, 1.0 + i) for i, p in enumerate(top.proposals[:3])]
    res = prop.propose("gemm", space, 5, history=measured, exclude={config_key(c) for c, _ in measured})
    assert res.prompt.startswith(top.prompt) and res.prompt.count(" h ") == 3 and " t0 ;" in res.prompt
    assert not {config_key(p.config) for p in res.proposals} & {config_key(c) for c, _ in measured}
    # without a history, excluding the top 3 yields the next best, in order (up to batching's float noise)
    nxt = prop.propose("gemm", space, 5, exclude={config_key(c) for c, _ in measured})
    assert [p.logprob for p in nxt.proposals] == pytest.approx([p.logprob for p in top.proposals[3:8]], abs=1e-2)


def test_evidence_bias_is_exact_and_steers_away_from_what_measured_slow(hw):
    """The bias re-ranks the model's configs by logprob + bias, exactly: the biased top-5 is the top-5 of the
    unbiased top-80 re-scored, whenever that re-scored fifth beats every config outside the top-80."""
    space = GEMM.space(GEMM.workload("mobilenetv2.b6.project").shape, hw)
    prop = LLMStrategy(space, 0, kernel=GEMM).proposer
    wide = prop.propose("gemm", space, 80).proposals
    bias = {"threads": {2: -0.8}, "vec": {8: -0.4}}
    rescored = sorted(((p.logprob + bias.get("threads", {}).get(p.config["threads"], 0.0)
                        + bias["vec"].get(p.config["vec"], 0.0), config_key(p.config)) for p in wide), reverse=True)
    assert rescored[4][0] > wide[-1].logprob  # the condition under which the check below is exact
    got = prop.propose("gemm", space, 5, bias=bias).proposals
    assert [p.logprob for p in got] == pytest.approx([lp for lp, _ in rescored[:5]], abs=1e-2)
    with pytest.raises(ValueError):
        prop.propose("gemm", space, 5, bias={"threads": {1: 0.5}})
    # from measurements: a value whose best time is 2x the best is down-weighted by weight * log 2
    d = space.valid_default()
    hist = [(d | {"threads": 1, "vec": 16}, 1.0), (d | {"threads": 2, "vec": 16}, 2.0), (d | {"threads": 2, "vec": 8}, 3.0)]
    eb = evidence_bias(space, hist, weight=1.5)
    assert eb == {"threads": {2: pytest.approx(-1.5 * math.log(2))}, "vec": {8: pytest.approx(-1.5 * math.log(3))}}


def test_hedging_covers_the_knobs_the_model_doubts(hw):
    """A top list that puts 70% of its mass on threads=2 gets a threads=1 config into the first batch; a knob the
    model is sure of is not hedged."""
    space = GEMM.space(GEMM.workload("mobilenetv2.b6.project").shape, hw)
    base = space.valid_default()
    ranked = []
    for i, (threads, vec, lp) in enumerate([(2, 16, -0.5), (2, 16, -1.0), (2, 16, -1.2), (1, 16, -1.3),
                                            (2, 16, -1.5), (1, 16, -2.5), (2, 8, -6.0)]):
        ranked.append(({**base, "threads": threads, "vec": vec, "mr": [1, 2, 4, 8][i % 4],
                        "unroll_k": [1, 2, 4, 8][i // 4]}, lp))
    picked = hedged(ranked, 3, space)
    assert picked[0] == ranked[0][0] and ranked[3][0] in picked  # the best threads=1 config is in the batch
    assert all(c["vec"] == 16 for c in picked)  # 99.6% of the mass says vec=16: not hedged
    assert len({config_key(c) for c in picked}) == 3


def test_an_older_model_proposes_the_knobs_it_knows_when_a_kernel_gained_one(hw, monkeypatch):
    """A kernel that gained a knob since the model was trained (here the model's metadata forgets `prefetch`, as a
    model trained before it existed would) still gets the model's ranking over the knobs it knows: the new knob at
    the incumbent's value (the default at first), never decoded nor in the prompt; the neighbour steps explore it."""
    space = GEMM.space(GEMM.workload("mobilenetv2.b6.project").shape, hw)
    prop = LLMStrategy(space, 0, kernel=GEMM).proposer
    meta = prop.m.info.meta
    spaces = json.loads(meta["edgetune.spaces"])
    del spaces["gemm"]["prefetch"]
    monkeypatch.setitem(meta, "edgetune.spaces", json.dumps(spaces))
    got = prop.propose("gemm", space, 5, history=[(space.valid_default(), 1.0)])
    assert len(got.proposals) == 5 and all(space.is_valid(p.config) for p in got.proposals)
    assert {p.config["prefetch"] for p in got.proposals} == {space.default["prefetch"]}
    assert "prefetch" not in got.prompt
    s = LLMStrategy(space, 0, kernel=GEMM, proposer=prop)
    unknown = sorted(p.name for p in space.params if p.name not in spaces["gemm"])  # prefetch, and any newer knob
    assert s.fallback is None and "prefetch" in unknown and s.mapped == unknown and s.version.endswith("-mapped")
    asked = s.ask(2)
    for i in range(4):
        for j, c in enumerate(asked):
            s.tell(c, Measurement(ok=True, ms=2.0 - 0.1 * i - 0.01 * j))
        asked = s.ask(2)
        if any(c["prefetch"] != space.default["prefetch"] for c in asked):
            break
    else:
        pytest.fail("the new knob was never explored")


def test_llm_session_real_compile(hw, runner, tmp_path):
    db = ResultsDB(tmp_path / "r.db")
    wl = GEMM.workload("kws_dscnn.pw4")
    res = Session(db, runner, hw).tune(GEMM, wl, strategy="llm", budget=Budget(evals=12))
    assert res.strategy == "llm" and res.evals <= 12 and res.ms > 0 and res.speedup is not None
    info = db.session_info(res.session_id)
    assert info["strategy_version"].startswith(f"{STRATEGY_VERSION}-") and "anneal-fallback" not in info["strategy_version"]
    first = [m["config"] for m in db.measurements(res.session_id, "search")[:DEFAULT_K]]
    assert first == LLMStrategy(GEMM.space(wl.shape, hw), 0, kernel=GEMM).ask(2)[:len(first)]


def test_the_thread_count_is_hedged_on_request(hw):
    """Threads are not hedged by default (only where the model is unsure); asked to, the first batch holds a config
    with another thread count when the constraints allow one, and none where two threads are not valid."""
    for wl in ("mobilenetv2.b2.expand", "mobilenetv2.b6.project"):
        space = GEMM.space(GEMM.workload(wl).shape, hw)
        first = LLMStrategy(space, 0, kernel=GEMM, always_hedge=("threads",)).ask(2)
        assert len({c["threads"] for c in first}) == 2, first
    tiny = GEMM.space(FC.shape, hw)  # too little work for two threads: nothing to hedge
    assert {c["threads"] for c in LLMStrategy(tiny, 0, kernel=GEMM, always_hedge=("threads",)).ask(2)} == {1}
    assert "threads" not in ALWAYS_HEDGE


def test_each_always_hedged_knob_keeps_its_own_slot(hw):
    """Hedging two knobs takes two slots from the end: the second hedge does not replace the first, and the model's
    top pick stays."""
    space = GEMM.space(GEMM.workload("mobilenetv2.b2.expand").shape, hw)
    top = LLMStrategy(space, 0, kernel=GEMM, always_hedge=()).ask(DEFAULT_K)
    both = LLMStrategy(space, 0, kernel=GEMM, always_hedge=("threads", "vec")).ask(DEFAULT_K)
    assert len(both) == DEFAULT_K and both[0] == top[0]
    assert len({c["threads"] for c in both}) == 2 and len({c["vec"] for c in both}) >= 2, both
    assert len({config_key(c) for c in both}) == DEFAULT_K


@pytest.mark.parametrize("kernel,workload", [("gru", "rnnoise.gru"), ("conv2d_3x3", "mobilenetv2.stem"),
                                             ("dwconv_3x3", "mobilenetv2.b2.dw"), ("logmel", "kws.logmel")])
def test_first_batch_holds_two_values_of_each_always_hedged_knob(kernel, workload, hw):
    """A sure model can be far wrong on the vector width, gru's parallel split or the register tile's width: the
    default first batch holds two values of each knob of ALWAYS_HEDGE that the space has."""
    spec = get_spec(kernel)
    space = spec.space(spec.workload(workload).shape, hw)
    first = LLMStrategy(space, 0, kernel=spec).ask(DEFAULT_K)
    assert len({config_key(c) for c in first}) == len(first) == DEFAULT_K
    hedged_here = [knob for knob in ALWAYS_HEDGE if knob in space.names]
    assert hedged_here, space.names
    for knob in hedged_here:
        assert len({c[knob] for c in first}) >= 2, (knob, first)


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
    kernel = "logmel"  # its space is small enough for a 3-step model, near uniform, to find valid configs in
    for c in [c for c in cases.values() if c.kernel == kernel][:6]:
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
    n = sum(len(r["measurements"]) for r in recs)
    assert f"6 record sessions ({n} measurements; 6 new cases)" in p.stdout + p.stderr
    d = json.loads(p.stdout)
    model = Path(d["model"])
    assert model.exists() and model.stat().st_size < 5 * 1024 * 1024
    from tuner.model.proposer import Proposer

    prop = Proposer(path=model)
    from hwprobe import probe

    spec = get_spec(kernel)
    res = prop.propose(kernel, spec.space(spec.workloads[0].shape, probe(measure_bandwidth=False)), 3)
    assert len(res.proposals) == 3


@pytest.mark.parametrize("records, args, needle", [
    (b"garbage\n", (), "holds no tuning sessions"),
    (bytes(range(256)) * 8, (), "cannot be read as records"),  # a binary file that is not SQLite
    (b'{"kernel": "gemm", "measurements": []}\n', ("--steps", "0"), "--steps 0: give a positive number"),
    (b'{"kernel": "gemm", "measurements": []}\n', ("--max-minutes", "-1"), "--max-minutes -1"),
    (b'{"kernel": "gemm", "measurements": []}\n', ("--focus-share", "1"), "--focus-share 1: must be at least 0 and below"),
    (b'{"kernel": "gemm", "measurements": []}\n', ("--out", "FILE"), "is a file"),
])
def test_train_refuses_bad_input_before_training(tmp_path, records, args, needle):
    """Minutes of training are not spent on a wrong file or a nonsense setting: exit 2, the value named."""
    path = tmp_path / "records.jsonl"
    path.write_bytes(records)
    args = tuple(str(path) if a == "FILE" else a for a in args)
    p = subprocess.run([sys.executable, "-m", "edgetune.main", "train", "--records", str(path), "--no-base", *args],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2 and needle in " ".join(p.stderr.split()) and "Traceback" not in p.stderr, p.stderr


def test_when_the_model_has_nothing_left_local_search_takes_over_and_stops(hw):
    """Over a space of 7 configs the model runs out of unmeasured proposals; the strategy goes on from the
    incumbent by local search (never a config twice) and stops on its own."""
    from tuner.evaluate import TableSpace

    base = GEMM.space(GEMM.workload("kws_dscnn.pw4").shape, hw)
    table = list(base.enumerate())[::40][:7]
    space = TableSpace.over(base, table)
    s = LLMStrategy(space, 0, kernel=GEMM, patience=20)
    seen: list[str] = []
    for step in range(30):
        asked = s.ask(2)
        if not asked:
            break
        for c in asked:
            seen.append(config_key(c))
            s.tell(c, Measurement(ok=True, ms=1.0 + 0.1 * len(seen)))
    assert len(seen) == len(set(seen)) and set(seen) == {config_key(c) for c in table}
    assert s.refiner is not None and s.fallback is None


def test_the_tune_table_and_report_say_when_llm_fell_back_to_anneal(tmp_path):
    """A session that ran anneal for want of a model must not read as the model's work."""
    env = {**os.environ, "EDGETUNE_MODEL": str(tmp_path / "missing.gguf")}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgetune.main", *args], capture_output=True, text=True,
                              timeout=300, env=env)

    p = cli("tune", "--kernel", "gemm", "--workload", "kws_dscnn.fc", "--budget", "2")
    assert p.returncode == 0 and "fell back to anneal" in " ".join(p.stdout.split()), p.stdout + p.stderr
    p = cli("report")
    assert "fell back to anneal" in " ".join(p.stdout.split()), p.stdout
    (row,) = json.loads(cli("report", "--json").stdout)
    assert row["strategy"] == "llm" and row["strategy_version"].endswith("-anneal-fallback")


def _far_apart(space, taken: list, n: int, vec: int) -> list:
    """n sampled configs with this vector width, each four or more knob steps from `taken` and from each other."""
    far: list = []
    for c in space.sample(400, random.Random(1)):
        if c["vec"] == vec and all(space.distance(c, o) >= 4 for o in [*taken, *far]):
            far.append(c)
        if len(far) == n:
            break
    return far


def test_a_hedge_gives_up_a_near_duplicate_rather_than_a_diverse_pick(hw):
    """The config an always-hedged knob's swap costs is the one nearest another config of the batch (a
    near-duplicate of the top pick tells little), so the diverse picks stay, the last one included."""
    space = GEMM.space(GEMM.workload("mobilenetv2.b2.expand").shape, hw)
    s = LLMStrategy(space, 0, kernel=GEMM, always_hedge=("vec",))
    top = s._propose(1)[0][0]
    twin = next(c for c in space.neighbours(top) if c["vec"] == top["vec"])
    far = _far_apart(space, [top, twin], 2, vec=top["vec"])
    batch = [top, far[0], twin, far[1]]
    out = s._always_hedged(batch, {0})
    assert out[0] == top and len(out) == 4 and len({c["vec"] for c in out}) == 2, out
    assert [c for c in batch if c not in out] == [twin]


def test_the_tile_width_hedge_reaches_two_steps_from_the_top_pick(hw):
    """nv (FAR_HEDGE) gets a hedge two or more steps from the top pick's value even where the batch already holds
    an adjacent one, in place of a near-duplicate; where the constraints allow no such value, the adjacent one;
    with `far=()` an adjacent value in the batch is hedge enough."""
    space = GEMM.space(GEMM.workload("mobilenetv2.b2.expand").shape, hw)
    s = LLMStrategy(space, 0, kernel=GEMM, always_hedge=("nv",))
    top = s._propose(1)[0][0]
    values = space.param("nv").values

    def steps(c: dict) -> int:
        return abs(values.index(c["nv"]) - values.index(top["nv"]))

    twin = next(c for c in space.neighbours(top) if steps(c) == 1)
    rest = [c for c in space.sample(400, random.Random(1))
            if steps(c) == 0 and all(space.distance(c, o) >= 4 for o in (top, twin))][:2]
    batch = [top, twin, *rest]
    assert FAR_HEDGE == ("nv",) and len(rest) == 2 and max(map(steps, batch)) == 1
    out = s._always_hedged(batch, {0})
    assert out[0] == top and len(out) == len(batch) and max(map(steps, out)) >= 2, out
    assert LLMStrategy(space, 0, kernel=GEMM, always_hedge=("nv",), far=())._always_hedged(batch, {0}) == batch

    narrow = GEMM.space({"M": 64, "N": 8, "K": 64}, hw)  # (nv - 1) * vec < N with vec >= 4: nv is 1 or 2
    s = LLMStrategy(narrow, 0, kernel=GEMM, always_hedge=("nv",))
    top = s._propose(1)[0][0]
    same = [c for c in narrow.sample(200, random.Random(2)) if c["nv"] == top["nv"] and c != top][:3]
    assert {c["nv"] for c in s._always_hedged([top, *same], {0})} == {1, 2}


def test_the_first_batch_holds_one_of_the_devices_earlier_winners(hw):
    """One slot of the first batch goes to a winner the device tuned before (valid here, not already in the batch),
    in place of a near-duplicate: the top pick and the hedges stay. By default the model picks among them; with
    `warm="nearest"` the nearest shape's; with `warm="off"` none. A winner the space cannot take (unknown knob, a
    value out of range, a broken constraint) is passed over."""
    wl = GEMM.workload("mobilenetv2.b2.expand")
    space = GEMM.space(wl.shape, hw)
    plain = LLMStrategy(space, 0, kernel=GEMM).ask(DEFAULT_K)
    others = [c for c in space.sample(300, random.Random(3)) if c not in plain]
    near, far = others[0], others[1]
    bad_knob = {**near, "nosuch": 1}
    bad_value = {**near, "vec": 3}
    rng = random.Random(5)
    broken = next(c for c in ({p.name: rng.choice(p.values) for p in space.params} for _ in range(5000))
                  if not space.is_valid(c))
    known = [({**wl.shape, "M": wl.shape["M"] * 8}, far), ({**wl.shape, "M": wl.shape["M"] * 2}, near),
             (wl.shape, bad_knob), (wl.shape, bad_value), (wl.shape, broken)]

    def first(warm: str, known=known):
        s = LLMStrategy(space, 0, kernel=GEMM, warm=warm)
        s.warm_start(known)
        return s.ask(DEFAULT_K)

    got = first("nearest")
    assert len(got) == DEFAULT_K and got[0] == plain[0] and near in got and far not in got, got
    assert len([c for c in plain if c not in got]) == 1
    assert sum(len({c[k] for c in got}) >= 2 for k in ALWAYS_HEDGE if k in space.names) \
        == sum(len({c[k] for c in plain}) >= 2 for k in ALWAYS_HEDGE if k in space.names)
    assert first("off") == plain
    assert first("nearest", known=[(wl.shape, plain[2]), (wl.shape, bad_value)]) == plain  # nothing new to add
    by_model = first(WARM)
    assert WARM == "model" and len(by_model) == DEFAULT_K and by_model[0] == plain[0]
    assert len({config_key(c) for c in by_model} & {config_key(near), config_key(far)}) == 1
    with pytest.raises(ValueError, match="warm='sideways'"):
        LLMStrategy(space, 0, kernel=GEMM, warm="sideways")


def test_the_devices_winner_never_takes_the_slot_of_a_hedge(hw):
    """The known winner replaces a near-duplicate, but not the one config that holds the other value of an
    always-hedged knob, even when that config is the batch's nearest to another."""
    space = GEMM.space(GEMM.workload("mobilenetv2.b2.expand").shape, hw)
    s = LLMStrategy(space, 0, kernel=GEMM, always_hedge=("vec",), warm="nearest")
    top = s._propose(1)[0][0]
    alt = next(c for c in space.neighbours(top) if c["vec"] != top["vec"])  # one step away: the nearest pair
    far = _far_apart(space, [top, alt], 3, vec=top["vec"])
    batch = [top, alt, *far[:2]]
    s.warm_start([(space.shape, far[2])])
    out = s._with_known_winner(batch, {0})
    assert out[0] == top and alt in out and far[2] in out and len(out) == 4, out


def test_the_devices_winners_settle_a_hedge(hw):
    """Where `settle` or more of the device's earlier winners of the kernel all hold the top pick's value of an
    always-hedged knob, the first batch holds no other value of it: the model's own next config keeps that slot.
    Fewer winners than `settle`, one winner with another value, or `settle=0` keep the hedge."""
    space = GEMM.space(GEMM.workload("mobilenetv2.b2.expand").shape, hw)
    sure = LLMStrategy(space, 0, kernel=GEMM, always_hedge=(), warm="off").ask(DEFAULT_K)
    top = sure[0]
    assert len({c["vec"] for c in sure}) == 1  # the model alone would not hedge vec on this shape
    sample = space.sample(300, random.Random(3))
    agree = [c for c in sample if c["vec"] == top["vec"] and c not in sure][:SETTLE]
    other = next(c for c in sample if c["vec"] != top["vec"])

    def widths(known: list, settle: int = SETTLE) -> set:
        s = LLMStrategy(space, 0, kernel=GEMM, always_hedge=("vec",), settle=settle)
        s.warm_start([(space.shape, c) for c in known])
        got = s.ask(DEFAULT_K)
        assert got[0] == top and len(got) == DEFAULT_K
        return {c["vec"] for c in got}

    assert SETTLE >= 2 and widths(agree) == {top["vec"]}
    kept = [widths([]), widths(agree[:SETTLE - 1]), widths(agree + [other]), widths(agree, settle=0)]
    assert all(len(w) >= 2 for w in kept), kept  # the hedge (and a dissenting winner may add its own width)


def test_shape_distance_is_the_sum_of_log_size_ratios():
    assert shape_distance({"M": 4, "N": 8}, {"M": 4, "N": 8}) == 0
    assert shape_distance({"M": 2, "N": 8}, {"M": 8, "N": 2}) == pytest.approx(2 * math.log(4))
    assert shape_distance({"M": 2, "act": "relu"}, {"M": 2, "act": "none"}) == 1.0
    assert shape_distance({"M": 2}, {"M": 2, "K": 3}) == 1.0


@pytest.mark.parametrize("kernel, workload", [("logmel", "kws.logmel"), ("gemm", "mobilenetv2.b2.expand")])
def test_a_hedged_value_gets_one_clean_test_on_the_incumbent(kernel, workload, hw):
    """A hedge config differs from the incumbent in several knobs, so its time does not say whether the hedged value
    itself lost. The local step first tries the incumbent with just that value (once per value, and only for a
    hedge that came within RETEST_WITHIN); with `retest` off it does not."""
    spec = get_spec(kernel)
    space = spec.space(spec.workload(workload).shape, hw)
    for retest in (True, False):
        s = LLMStrategy(space, 0, kernel=spec, retest=retest)
        first = s.ask(2)
        inc = first[0]
        hedges = [c for c in first[1:] if any(c[n] != inc[n] for n in ALWAYS_HEDGE if n in space.names)]
        close = hedges[0]
        for c in first:  # the top pick leads, one hedge is close behind, the others beyond RETEST_WITHIN
            s.tell(c, Measurement(ok=True, ms=1.0 if c is inc else 1.2 if c is close else RETEST_WITHIN + 1.0))
        clean = [{**inc, n: close[n]} for n in ALWAYS_HEDGE if n in space.names and close[n] != inc[n]]
        wanted = {config_key(c) for c in clean if space.is_valid(c)} - s.seen
        if retest:
            assert wanted and {config_key(c) for c in s._retests()} == wanted
        else:
            assert not s._retests()
        steps = []
        for _ in range(len(wanted) + 1):
            more = s.ask(2)
            steps.append(config_key(more[-1]))
            for c in more:  # beyond RETEST_WITHIN: a step holding another hedged value asks no retest of its own
                s.tell(c, Measurement(ok=True, ms=RETEST_WITHIN + 1.0))
        if retest:  # the clean tests come first, each once; then the ordinary steps
            assert set(steps[:len(wanted)]) <= wanted and wanted <= s.seen and not s._retests(), (wanted, steps)
            assert s.retested and all(close[n] == v for n, v in s.retested)  # not the far hedges' values
        else:
            assert not s.retested
