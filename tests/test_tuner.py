"""Tuning engine: search space, strategies, sessions (resume after SIGKILL), cache keys, DB faults, CLI, export."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

from edgetune.errors import BadInput
from kernels import build as build_mod
from kernels.build import build, prune_builds
from kernels.measure import Measurement
from kernels.registry import get_spec
from kernels.space import config_key
from kernels.spec import C_DIR
from edgetune.sqlite import DBError
from hwprobe.compiler import CompilerMissing
from tuner.db import ResultsDB, default_path
from tuner.evaluate import interleave_plan
from tuner.grammar import GrammarError, export_grammar, validate
from tuner.resultkey import ResultKey, result_key
from tuner.session import Budget, Session, interleave_seed
from tuner.strategies import Anneal, Exhaustive, RandomSearch, Strategy, make_strategy

GEMM = get_spec("gemm")
SMALL = GEMM.workload("kws_dscnn.fc")


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgetune.main", *args], capture_output=True, text=True,
                          timeout=300, **kw)


# ---- search space ------------------------------------------------------------------------------------------

def test_space_validation_names_the_knob(hw):
    space = GEMM.space(SMALL.shape, hw)
    assert space.validate({"vec": "4", "nv": "1"})["vec"] == 4  # CLI/JSON strings coerce (4 fits every x86 ISA)
    # N=12 rules out the default's 2-vector panel: missing knobs come from this shape's valid default
    assert space.validate({"prefetch": 2}) == {**space.valid_default(), "prefetch": 2} != {**GEMM.default, "prefetch": 2}
    with pytest.raises(BadInput, match="flops"):  # 1.5 kflops: a second thread costs more than the whole product
        space.validate({"threads": 2})
    with pytest.raises(BadInput, match="knob vec=3 is not allowed; allowed values: 4, 8, 16"):
        space.validate({"vec": 3})
    with pytest.raises(BadInput, match="unknown knob"):
        space.validate({"tile": 4})
    with pytest.raises(BadInput, match="accumulators"):  # 32 of the 16 vector registers of AVX2 (AVX-512 has 32)
        GEMM.space(SMALL.shape, dataclasses.replace(hw, vector_bits=256)).validate({"mr": 8, "nv": 4, "vec": 8})
    with pytest.raises(BadInput, match="missing knob"):
        space.validate({"vec": 8}, complete=True)


def test_space_enumerate_sample_neighbours(hw):
    space = GEMM.space(SMALL.shape, hw)
    every = list(space.enumerate())
    assert len(every) == space.size() and all(space.is_valid(c) for c in every)
    assert len({config_key(c) for c in every}) == len(every)
    assert space.size() < space.cardinality()  # constraints really prune
    s1 = space.sample(20, random.Random(3))
    assert s1 == space.sample(20, random.Random(3)) and all(space.is_valid(c) for c in s1)
    for n in space.neighbours(space.default):
        assert space.distance(n, space.default) == 1 and space.is_valid(n)


def test_isa_cap_shrinks_space(hw):
    if hw.vector_bits < 512:
        pytest.skip("needs a 512-bit machine to cap")
    from hwprobe import probe

    v3 = probe(isa_cap="x86-64-v3", measure_bandwidth=False)
    assert all(c["vec"] <= 8 for c in GEMM.space(SMALL.shape, v3).enumerate())
    with pytest.raises(BadInput, match="ISA"):
        GEMM.space(SMALL.shape, v3).validate({"vec": 16})


def test_grammar_is_valid_for_llama_cpp(hw):
    for name in ("gemm",):
        g = export_grammar(get_spec(name).space(SMALL.shape, hw))
        assert g.startswith("root ::=") and '" vec=" ("4" | "8" | "16")' in g
    with pytest.raises(GrammarError):
        validate('root ::= " a=" ("1" | ')  # would crash llama.cpp in-process


# ---- strategies --------------------------------------------------------------------------------------------

def _fake_measure(cfg) -> Measurement:
    """A deterministic synthetic objective: only for checking strategy mechanics, not kernels."""
    return Measurement(ok=True, ms=1.0 + abs(cfg["mr"] - 2) + abs(cfg["kc"] - 64) / 64 + (cfg["vec"] == 4))


@pytest.mark.parametrize("name", ["random", "anneal"])
def test_strategies_are_deterministic_under_seed(name, hw):
    space = GEMM.space(SMALL.shape, hw)

    def run(seed):
        s, seen = make_strategy(name, space, seed), []
        for _ in range(8):
            for c in s.ask(2):
                s.tell(c, _fake_measure(c))
                seen.append(config_key(c))
        return seen

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert len(set(run(1))) == len(run(1))  # never re-asks a measured config


def test_exhaustive_refuses_big_spaces(hw):
    from kernels.space import Constraint

    full = GEMM.space(SMALL.shape, hw)
    with pytest.raises(BadInput, match="over the limit of 5000"):
        Exhaustive(full)
    # the knobs that matter on M=1 (tile width, vector width, threads) left free: a space exhaustive takes
    fixed = {"mr": 1, "kc": 64, "mb": 1, "nb": 1, "order": "panels", "prefetch": 0}
    space = dataclasses.replace(full, constraints=full.constraints + (
        Constraint("pinned", lambda c, s, h: all(c[k] == v for k, v in fixed.items())),))
    n = space.size()
    assert 10 < n < 5000
    with pytest.raises(BadInput, match=f"over the limit of {n - 1}"):
        Exhaustive(space, limit=n - 1)
    ex = Exhaustive(space)
    assert len(ex.ask(10_000)) == n


def test_anneal_improves_on_synthetic_objective(hw):
    space = GEMM.space(SMALL.shape, hw)
    a = Anneal(space, seed=0)
    for _ in range(30):
        for c in a.ask(1):
            a.tell(c, _fake_measure(c))
    assert a.best[0] <= _fake_measure(space.default).ms


def test_a_strategy_name_is_checked_by_the_registry_everywhere(hw, tmp_path):
    """make_strategy, the config and the daemon's commands all refuse a name with the registry's one message."""
    from daemon.commands import Rejected, check_args
    from edgetune import config
    from tuner.strategies import STRATEGIES, unknown_strategy

    msg = unknown_strategy("magic")
    assert "'magic'" in msg and all(name in msg for name in STRATEGIES) and unknown_strategy("anneal") is None
    with pytest.raises(BadInput) as e:
        make_strategy("magic", GEMM.space(SMALL.shape, hw))
    assert str(e.value) == msg
    with pytest.raises(Rejected) as e:
        check_args("retune", {"strategy": "magic"})
    assert str(e.value) == f"bad args: {msg}"
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tuning]\nstrategy = "magic"\nworkloads = ["bundled"]\n')
    assert [(p.key, p.message) for p in config.load(cfg).problems] == [("tuning.strategy", msg)]


# ---- sessions ----------------------------------------------------------------------------------------------

def test_finals_remeasure_only_plausible_winners_and_the_default(hw, runner):
    """A config measured over FINALIST_MARGIN slower than the best while searching is not re-measured."""
    from tuner.session import FINAL_ROUNDS, FINALIST_MARGIN

    db = ResultsDB()
    wl = GEMM.workload("mobilenetv2.b6.project")
    space = GEMM.space(wl.shape, hw)
    slow = dict(space.valid_default(), mr=1, nv=1, unroll_k=1, threads=1)  # scalar-ish tiles: far off the best
    assert space.is_valid(slow)

    class Fixed(RandomSearch):  # measures exactly these configs, then stops
        todo = [slow] + space.sample(3, random.Random(3))

        def ask(self, n):
            out, self.todo = self.todo, []
            return out

    r = Session(db, runner, hw).tune(GEMM, wl, strategy_obj=Fixed(space), budget=Budget(evals=4))
    search = {config_key(m["config"]): m["stats"]["ms"] for m in db.measurements(r.session_id, "search")}
    best = min(search.values())
    finals = db.measurements(r.session_id, "final")
    final_keys = {config_key(m["config"]) for m in finals}
    default = config_key(space.valid_default())
    assert final_keys and all(k == default or search[k] <= FINALIST_MARGIN * best for k in final_keys)
    assert len(finals) == FINAL_ROUNDS * len(final_keys)  # interleaved rounds over each finalist


def test_final_figures_pool_the_search_measurement_with_the_rounds(hw, runner):
    """A finalist's figure is the median over its interleaved rounds and its own search measurement (same window),
    which measured as good a pick as a round more (bench/finals_study.py); a failed search measurement is left out."""
    import statistics

    db = ResultsDB()
    space = GEMM.space(SMALL.shape, hw)
    default = space.valid_default()

    class Fixed(RandomSearch):
        todo = space.sample(3, random.Random(5), exclude={config_key(default)})

        def ask(self, n):
            out, self.todo = self.todo, []
            return out

    priors: dict[str, Measurement | None] = {}

    class Spy(Session):  # records what the finals are handed to pool
        def remeasure(self, spec, wl, cfgs, session_id, phase, *args, prior=None, **kw):
            priors.update(zip(map(config_key, cfgs), prior))
            return super().remeasure(spec, wl, cfgs, session_id, phase, *args, prior=prior, **kw)

    r = Spy(db, runner, hw).tune(GEMM, SMALL, strategy_obj=Fixed(space), budget=Budget(evals=3))
    search = {config_key(m["config"]): m["stats"]["ms"] for m in db.measurements(r.session_id, "search")}
    finals: dict[str, list[float]] = {}
    for m in db.measurements(r.session_id, "final"):
        finals.setdefault(config_key(m["config"]), []).append(m["stats"]["ms"])
    assert priors.keys() == finals.keys() and priors.pop(config_key(default)) is None  # the default: never searched
    assert priors and all(m.ms == search[k] for k, m in priors.items())  # each searched finalist: its own sample
    won = config_key(r.config)
    assert r.ms == statistics.median(finals[won] + ([search[won]] if won in search else []))
    assert r.default_ms == statistics.median(finals[config_key(default)])

    prior = Measurement(ok=True, ms=1e6, load1=0.0)  # absurdly slow: the median of [1e6, a, b] is max(a, b)
    pooled = Session(db, runner, hw).remeasure(GEMM, SMALL, [default, default], r.session_id, "verify", rounds=2,
                                               prior=[prior, Measurement.failed("crashed")])
    rounds = [m["stats"]["ms"] for m in db.measurements(r.session_id, "verify")]
    assert len(rounds) == 4  # the prior is pooled, not recorded again as a round
    order = interleave_plan(2, 2, interleave_seed(r.session_id, "verify"))  # the config each journaled round measured
    first, second = ([ms for ms, j in zip(rounds, order) if j == i] for i in (0, 1))
    assert pooled[0].ms == statistics.median([1e6, *first]) == max(first)
    assert pooled[1].ms == statistics.median(second)  # the failed prior is left out


def test_budget_and_cache(hw, runner):
    db = ResultsDB()
    s = Session(db, runner, hw)
    r = s.tune(GEMM, SMALL, strategy="random", budget=Budget(evals=5))
    assert r.evals == 5 and not r.cached and r.default_ms and r.speedup
    # where the time went: each part measured once (no phase counted twice), together within the run's wall
    assert set(r.timing) == {"compile_s", "measure_s", "strategy_s"}
    assert r.timing["compile_s"] > 0 and r.timing["measure_s"] > 0 and r.timing["strategy_s"] >= 0
    assert sum(r.timing.values()) <= r.tuning_s
    rows = db.measurements(r.session_id, "search")
    assert len(rows) == 5 and all(row["stats"]["load1"] >= 0 for row in rows)
    assert config_key(rows[0]["config"]) != "" and db.measurements(r.session_id, "final")
    again = s.tune(GEMM, SMALL, strategy="random", budget=Budget(evals=5))
    assert again.cached and again.config == r.config
    forced = s.tune(GEMM, SMALL, strategy="random", budget=Budget(evals=5), force=True)
    assert not forced.cached and forced.session_id != r.session_id
    t = time.monotonic()
    short = s.tune(GEMM, GEMM.workload("kws_dscnn.pw4"), strategy="anneal", budget=Budget(evals=500, seconds=1.5))
    assert short.evals < 500 and time.monotonic() - t < 30


def test_cache_key_misses_on_source_compiler_isa_change(hw, tmp_path):
    strat = RandomSearch(GEMM.space(SMALL.shape, hw))
    base = result_key(GEMM, SMALL, hw, strat)
    src = tmp_path / "gemm.c"
    src.write_text((C_DIR / "gemm.c").read_text() + "\n/* changed */\n")
    assert result_key(dataclasses.replace(GEMM, source=src), SMALL, hw, strat) != base
    other_cc = dataclasses.replace(hw, compiler=dataclasses.replace(hw.compiler, id="clang-17.0.0"))
    assert result_key(GEMM, SMALL, other_cc, strat) != base
    assert result_key(GEMM, SMALL, dataclasses.replace(hw, isa="x86-64-v2"), strat) != base
    assert result_key(GEMM, SMALL, hw, Anneal(GEMM.space(SMALL.shape, hw))) != base
    assert result_key(GEMM, SMALL, hw, strat) == base


def test_the_build_cache_drops_the_least_recently_used_beyond_its_cap(hw, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    cfgs = [{**GEMM.default, "kc": kc} for kc in (32, 64, 128, 256)]
    built = [build(GEMM, c, hw) for c in cfgs]
    now = time.time()
    for age, b in zip((4, 3, 2, 1), built):  # built in this order, an hour apart
        os.utime(b.path, (now - age * 3600,) * 2)
    assert build(GEMM, cfgs[0], hw).cached  # the oldest, used again: now the most recent
    sizes = [b.path.stat().st_size for b in built]
    assert prune_builds(sum(sizes)) == 0  # within the cap: nothing goes
    cap = sum(sizes) - 1
    freed = prune_builds(cap)
    kept = [b.path.exists() for b in built]
    assert freed > 0 and sum(s for s, k in zip(sizes, kept) if k) <= cap * 3 // 4
    assert kept[0] and not kept[1]  # the reused one stays, the least recently used goes first
    assert kept[1:] == sorted(kept[1:])  # and the rest in order of last use
    again = build(GEMM, cfgs[1], hw)  # a removed build is compiled again when asked for
    assert not again.cached and again.path.exists()


def test_pruning_removes_what_killed_compiles_left_but_not_a_live_compiles_output(hw, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    b = build(GEMM, GEMM.default, hw)
    orphan, live = (b.path.with_suffix(f".{pid}-1.tmp.so") for pid in (11, 22))
    for f in (orphan, live):
        f.write_bytes(b"half a shared object")
    old = time.time() - build_mod.ORPHAN_AGE_S - 60
    os.utime(orphan, (old, old))
    prune_builds()
    assert not orphan.exists() and live.exists() and b.path.exists()


def test_a_build_cache_that_refuses_removal_keeps_its_builds(hw, tmp_path, monkeypatch, caplog):
    """As on a read-only cache (root here may remove anything, so the refusal is the OS call's)."""
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    b = build(GEMM, GEMM.default, hw)

    def refuse(path, *a, **kw):
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(os, "unlink", refuse)
    assert prune_builds(1) == 0 and b.path.exists()
    assert "cannot remove" in caplog.text


def test_a_session_leaves_the_build_cache_within_its_cap(hw, runner, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    monkeypatch.setattr(build_mod, "CACHE_MAX_BYTES", 1)
    r = Session(ResultsDB(), runner, hw).tune(GEMM, SMALL, strategy="random", budget=Budget(evals=3))
    assert r.evals == 3 and r.config
    assert not list((tmp_path / "cache" / "builds").glob("*.so"))


class _ListStrategy(Strategy):
    """Asks a fixed list: lets a test put known-bad variants in front of the session."""

    name, version = "list", "1"

    def __init__(self, space, cfgs):
        super().__init__(space)
        self.cfgs = list(cfgs)

    def ask(self, n):
        out, self.cfgs = self.cfgs[:n], self.cfgs[n:]
        return out


def test_failed_variants_recorded_and_never_chosen(hw, runner, tmp_path):
    src = tmp_path / "gemm.c"  # crashes whenever mr == 1, which is otherwise a fine config
    src.write_text("#include <signal.h>\n" + (C_DIR / "gemm.c").read_text().replace(
        "const float *packed, int act) {", "const float *packed, int act) {\n#if ET_MR == 1\nraise(SIGSEGV);\n#endif", 1))
    assert "raise(SIGSEGV)" in src.read_text()
    spec = dataclasses.replace(GEMM, source=src)
    cfgs = [{**GEMM.default, "mr": 1}, {**GEMM.default, "mr": 1, "kc": 32}, {**GEMM.default, "mr": 2}]
    db = ResultsDB()
    r = Session(db, runner, hw).tune(spec, SMALL, strategy_obj=_ListStrategy(spec.space(SMALL.shape, hw), cfgs),
                                     budget=Budget(evals=3))
    assert r.config["mr"] != 1 and r.failed == 2
    failed = [m for m in db.measurements(r.session_id, "search") if not m["ok"]]
    assert len(failed) == 2 and all("SIGSEGV" in m["reason"] for m in failed)


def test_a_session_that_ends_by_an_exception_is_recorded_failed_not_running(hw, runner, tmp_path, monkeypatch):
    """A tune that raised (here the real CompilerMissing of a C compiler that is gone, from the first build) stayed
    `running` in the results DB, as if still in progress, and never went out as a tuning record."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    db = ResultsDB()
    with pytest.raises(CompilerMissing):
        Session(db, runner, hw).tune(GEMM, SMALL, strategy="random", budget=Budget(evals=2))
    (row,) = db.query("SELECT id, state, result_json FROM sessions")
    assert row["state"] == "failed", row["state"]
    assert "CompilerMissing" in json.loads(row["result_json"])["reason"] and "no-such-cc" in row["result_json"]
    assert [s.id for s in db.ended_sessions()] == [row["id"]]  # published as a failed run's record


def test_resume_after_sigkill(tmp_path):
    """kill -9 mid-session; the same command resumes without repeating finished measurements."""
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "edgetune.main", "tune", "--kernel", "gemm", "--workload", "kws_dscnn.pw4",
           "--strategy", "random", "--budget", "10", "--json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    db_path = tmp_path / "state" / "results.db"
    deadline = time.monotonic() + 120
    before = []
    while time.monotonic() < deadline and proc.poll() is None:
        if db_path.exists():
            try:
                con = sqlite3.connect(db_path)
                before = con.execute("SELECT id, seq, ts FROM measurements WHERE phase='search' ORDER BY seq").fetchall()
                con.close()
            except sqlite3.Error:
                before = []
            if len(before) >= 4:
                break
        time.sleep(0.02)
    assert proc.poll() is None, "tune finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    con = sqlite3.connect(db_path)
    before = con.execute("SELECT id, seq, ts FROM measurements WHERE phase='search' ORDER BY seq").fetchall()
    assert con.execute("SELECT state FROM sessions").fetchall() == [("running",)]
    con.close()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    con = sqlite3.connect(db_path)
    after = con.execute("SELECT id, seq, ts FROM measurements WHERE phase='search' ORDER BY seq").fetchall()
    sessions = con.execute("SELECT id, state FROM sessions").fetchall()
    assert sessions == [(1, "done")]  # resumed, not restarted
    assert len(after) == 10 and after[:len(before)] == before  # finished measurements untouched
    assert json.loads(done.stdout)["results"][0]["evals"] == 10


def test_verify_fails_on_a_slower_config_and_reports_a_faster_one():
    assert _cli("pin", "gemm", "M=8,N=8,K=8", "{}", "--json").returncode == 0
    db = ResultsDB()
    slot = ("gemm", "custom.M8-N8-K8")
    entry = db.active_entry(*slot)
    for stored_ms, status, rc in ((1e3, "faster", 0), (1e-9, "slower", 1)):  # far beyond any noise either way
        db.set_active(*slot, {**entry, "ms": stored_ms}, pinned=True)
        v = _cli("verify", "--json")
        assert v.returncode == rc and json.loads(v.stdout)[0]["status"] == status, (status, v.stdout, v.stderr)
    db.close()


@pytest.mark.parametrize("verb", [["tune", "--kernel", "nosuch"], ["bench", "gemm", "--shape", "M=0,N=1,K=1"],
                                  ["propose", "gemm", "--workload", "no.such.layer"], ["unpin", "gemm", "nope"],
                                  ["forget", "gemm", "nope"], ["forget", "nosuch", "w"]])
def test_an_error_under_json_is_a_json_object_on_stdout(verb):
    p = _cli(*verb, "--json")
    assert p.returncode == 2, (verb, p.stderr)
    doc = json.loads(p.stdout)
    assert doc["exit_code"] == 2 and doc["error"] and doc["error"] in " ".join(p.stderr.split()), (verb, p.stdout)


# ---- DB faults ---------------------------------------------------------------------------------------------

def test_corrupt_db_clear_error_and_reset_moves_aside(tmp_path):
    db_path = tmp_path / "state" / "results.db"
    db_path.parent.mkdir(parents=True)
    db_path.write_bytes(b"this is not sqlite" * 100)
    p = _cli("report")
    assert p.returncode == 1 and "corrupt" in p.stderr and "--reset" in p.stderr
    p = _cli("report", "--reset", "--json")
    assert p.returncode == 0, p.stderr
    aside = [f for f in db_path.parent.iterdir() if ".broken-" in f.name]
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not sqlite")
    p = _cli("report", "--reset")  # the fresh DB is healthy: --reset keeps it and says so
    assert p.returncode == 0 and "healthy" in p.stderr and db_path.exists(), p.stderr
    assert len([f for f in db_path.parent.iterdir() if ".broken-" in f.name]) == 1
    db_path.write_bytes(b"corrupt again" * 100)
    p = _cli("verify")
    assert p.returncode == 1 and "edgetune report --reset" in " ".join(p.stderr.split()), p.stderr


def test_damaged_pages_are_a_clear_error_in_every_verb_that_reads_active_configs(tmp_path):
    db_path = tmp_path / "state" / "results.db"
    db = ResultsDB()
    for i in range(60):  # enough rows for the active table to span pages beyond the schema page
        db.set_active("gemm", f"w{i:03d}", {"config": {"mr": 4}, "ms": 1.0, "note": "x" * 400}, pinned=True)
    db.close()
    page = sqlite3.connect(db_path).execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(db_path.read_bytes())
    assert len(data) > 8 * page
    for n in range(2, len(data) // page):  # b-tree page headers become garbage; the file header stays valid
        data[n * page:n * page + 16] = b"\xff" * 16
    db_path.write_bytes(bytes(data))
    for verb in (["report"], ["export"], ["verify"], ["unpin", "gemm", "w001"], ["forget", "gemm", "w001"]):
        p = _cli(*verb)
        assert p.returncode == 1 and "Traceback" not in p.stderr, (verb, p.stderr)
        assert "corrupt" in p.stderr and "edgetune report --reset" in " ".join(p.stderr.split()), (verb, p.stderr)


def test_foreign_sqlite_db_is_refused(tmp_path):
    db_path = tmp_path / "state" / "results.db"
    db_path.parent.mkdir(parents=True)
    con = sqlite3.connect(db_path)
    con.execute("CREATE TABLE photos (id INTEGER)")
    con.commit()
    con.close()
    with pytest.raises(DBError, match="not an edgetune results DB"):
        ResultsDB()


def test_the_devices_winners_are_the_latest_per_shape_of_its_own_kernel_hw_and_objective():
    """`winners` serves the warm start: this kernel's done sessions on this hardware, ISA and objective, the latest
    per shape, newest first, and only those that finished before `before` (a session's start, so a resumed
    session reads the same list)."""
    db = ResultsDB()

    def done(shape: dict, config: dict, kernel: str = "gemm", hw: str = "h", objective: str = "latency",
             state: str = "done") -> float:
        rkey = ResultKey(kernel, "s", "w", json.dumps(shape, sort_keys=True), hw, "i", "c", "random", "1", objective)
        sid = db.open_session(rkey, "f", {}, "test").id
        if state == "done":
            db.finish_session(sid, "done", {"config": config})
        else:
            db.fail_session(sid, "broke")
        return db.session_info(sid)["finished_at"]

    done({"M": 1}, {"vec": 4})
    done({"M": 2}, {"vec": 8})
    t = done({"M": 1}, {"vec": 16})  # a retune of M=1: the newer winner counts
    done({"M": 3}, {"vec": 2}, kernel="conv1d")
    done({"M": 3}, {"vec": 2}, hw="other")
    done({"M": 3}, {"vec": 2}, objective="energy")
    done({"M": 4}, {"vec": 2}, state="failed")
    late = done({"M": 5}, {"vec": 32})
    assert db.winners("gemm", "h", "i", "latency", before=late) == [({"M": 1}, {"vec": 16}), ({"M": 2}, {"vec": 8})]
    assert db.winners("gemm", "h", "i", "latency", before=t) == [({"M": 2}, {"vec": 8}), ({"M": 1}, {"vec": 4})]
    assert db.winners("gemm", "h", "i", "latency", before=late + 1)[0] == ({"M": 5}, {"vec": 32})
    assert db.winners("gemm", "h", "i", "energy", before=late) == [({"M": 3}, {"vec": 2})]


def test_full_disk_keeps_db_intact(hw):
    db = ResultsDB()
    sid = db.open_session(ResultKey("gemm", "s", "w", "{}", "h", "i", "c", "random", "1"), "f", {}, "test").id
    db.add_measurement(sid, "search", 0, {"a": 1}, "a=1", Measurement(ok=True, ms=1.0), None)
    pages = db.conn.execute("PRAGMA page_count").fetchone()[0]
    db.conn.execute(f"PRAGMA max_page_count={pages}")
    big = Measurement(ok=True, ms=1.0, wall_ms=[1.0] * 200_000)
    with pytest.raises(DBError, match="disk full"):
        db.add_measurement(sid, "search", 1, {"a": 2}, "a=2", big, None)
    assert db.conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    assert [m["seq"] for m in db.measurements(sid)] == [0]


# ---- CLI ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["tune", "--kernel", "nosuch"], "unknown kernel 'nosuch'"),
    (["tune", "--kernel", "gemm", "--workload", "nosuch"], "unknown workload 'nosuch'"),
    (["tune", "--strategy", "magic"], "unknown strategy 'magic'"),
    (["tune", "--budget", "0"], "--budget must be a positive"),
    (["tune", "--budget", "-3"], "--budget must be a positive"),
    (["pin", "gemm", "kws_dscnn.fc", '{"vec": 5}'], "vec=5 is not allowed"),
    (["pin", "gemm", "kws_dscnn.fc", "[1]"], "JSON object"),
])
def test_cli_bad_input_exits_2(args, needle):
    p = _cli(*args)
    assert p.returncode == 2, p.stderr
    assert needle in " ".join(p.stderr.split())


def test_tune_report_pin_verify_export_cli(tmp_path):
    p = _cli("tune", "--kernel", "gemm", "--workload", "kws_dscnn.fc", "--budget", "4", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)["results"][0]
    for k in ("config", "ms", "default_ms", "speedup", "evals", "tuning_s", "strategy"):
        assert k in res
    rep = json.loads(_cli("report", "--json").stdout)
    assert rep[0]["kernel"] == "gemm" and rep[0]["tuned_ms"] == pytest.approx(res["ms"]) and rep[0]["ort_ms"] > 0
    pin = {**GEMM.default, "mr": 1, "nv": 1, "kc": 64, "unroll_k": 1}  # M=1: one-row tiles
    assert _cli("pin", "gemm", "kws_dscnn.fc", json.dumps(pin)).returncode == 0
    again = _cli("tune", "--kernel", "gemm", "--workload", "kws_dscnn.fc", "--budget", "4", "--force", "--json")
    assert again.returncode == 0
    rep = json.loads(_cli("report", "--json").stdout)
    assert rep[0]["config"] == pin and rep[0]["pinned"]  # a pin wins over tuning
    assert _cli("unpin").returncode == 0
    rep = json.loads(_cli("report", "--json").stdout)
    assert not rep[0]["pinned"] and rep[0]["strategy"] != "pinned"  # the tuned entry is back
    v = _cli("verify", "--json", "--threshold", "10")
    assert v.returncode == 0, v.stderr
    assert json.loads(v.stdout)[0]["status"] == "ok"
    out = tmp_path / "active.json"
    assert _cli("export", "--format", "json", "-o", str(out)).returncode == 0
    assert "gemm/kws_dscnn.fc" in json.loads(out.read_text())["kernels"]


def test_export_records_carry_this_device_at_each_sessions_isa(tmp_path):
    """`export --format records`: one line per session with its measurements and this device's descriptor at the
    session's ISA (the cap is part of the fingerprint), gzipped for a .gz name, read back by the training loader
    with the session's own descriptor rather than the reading machine's."""
    from tuner.train import data as D

    for extra in ((), ("--isa", "x86-64-v2")):
        p = _cli("tune", "--kernel", "gemm", "--workload", "kws_dscnn.fc", "--budget", "2", "--strategy", "random",
                 *extra, "--json")
        assert p.returncode == 0, p.stderr
    out = tmp_path / "records.jsonl.gz"
    p = _cli("export", "--format", "records", "-o", str(out), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"written": str(out), "format": "records", "entries": 2}
    records = [json.loads(line) for line in gzip.open(out, "rt")]
    assert records[1]["isa"] == "x86-64-v2" and len({r["hw_fingerprint"] for r in records}) == 2
    for r in records:
        assert r["hw"]["hw_fingerprint"] == r["hw_fingerprint"] and r["hw"]["isa"] == r["isa"]
        assert r["state"] == "done" and r["measurements"] and all("config" in m for m in r["measurements"])
    cases, n = D.load_records(out)
    assert n == 2 and {c.isa for c in cases.values()} == {records[0]["isa"], "x86-64-v2"}
    plain = _cli("export", "--format", "records")
    assert plain.returncode == 0 and [json.loads(line) for line in plain.stdout.splitlines()] == records

    with sqlite3.connect(default_path()) as c:  # a session of an ISA this CPU does not offer
        c.execute("UPDATE sessions SET isa='armv8.2-a' WHERE isa='x86-64-v2'")
    p = _cli("export", "--format", "records", "--json")
    assert p.returncode == 0, p.stderr
    assert [r["hw"] is None for r in json.loads(p.stdout)["records"]] == [False, True]

    with sqlite3.connect(default_path()) as c:  # a session still running: exported once it ends, as the daemon does
        c.execute("UPDATE sessions SET state='running' WHERE isa='armv8.2-a'")
    p = _cli("export", "--format", "records", "--json")
    assert p.returncode == 0, p.stderr
    assert [r["isa"] for r in json.loads(p.stdout)["records"]] == [records[0]["isa"]]
    assert D.check_records(default_path()) == (2, 0)  # a trainer reading the DB itself keeps its measurements


def test_c_header_export_compiles_a_kernel(tmp_path, hw, runner):
    cfg = {**GEMM.default, "mr": 2, "nv": 1, "kc": 32, "vec": 4}
    assert _cli("pin", "gemm", "kws_dscnn.pw4", json.dumps(cfg)).returncode == 0
    header = tmp_path / "edgetune_tuned.h"
    assert _cli("export", "--format", "c-header", "-o", str(header)).returncode == 0
    text = header.read_text()
    assert "#define ET_MR 2" in text and "#define ET_VEC 4" in text
    so = tmp_path / "gemm_fw.so"
    subprocess.run(["cc", "-O2", f"-march={hw.march}", "-fPIC", "-shared", "-include", str(header),
                    "-DEDGETUNE_GEMM_KWS_DSCNN_PW4", f"-I{C_DIR}", str(C_DIR / "gemm.c"), "-o", str(so), "-lm"],
                   check=True)
    m = runner.measure(GEMM, GEMM.workload("kws_dscnn.pw4").shape, so, min_time_s=0.01)
    assert m.ok, m.reason


def test_runtime_api_load_tuned(hw, caplog, build_cache):
    import kernels

    shape = GEMM.workload("kws_dscnn.pw4").shape
    inputs = GEMM.make_inputs(shape, np.random.default_rng(1))
    with caplog.at_level(logging.WARNING):
        k = kernels.load_tuned("gemm", "kws_dscnn.pw4")
    assert not k.tuned and "no tuned config" in caplog.text
    np.testing.assert_allclose(k(*inputs)[0], GEMM.reference(shape, inputs)[0], rtol=1e-4, atol=1e-4)
    cfg = {**GEMM.default, "mr": 8, "nv": 1}
    assert _cli("pin", "gemm", "kws_dscnn.pw4", json.dumps(cfg)).returncode == 0
    for so in (build_cache / "builds").glob("gemm-*.so"):  # the cache was wiped: it must rebuild
        so.unlink()
    k = kernels.load_tuned("gemm", "kws_dscnn.pw4")
    assert k.tuned and k.config == cfg
    np.testing.assert_allclose(k(*inputs)[0], GEMM.reference(shape, inputs)[0], rtol=1e-4, atol=1e-4)
    custom = kernels.load_tuned("gemm", shape={"M": 10, "N": 20, "K": 30})
    x = GEMM.make_inputs({"M": 10, "N": 20, "K": 30}, np.random.default_rng(2))
    np.testing.assert_allclose(custom(*x)[0], x[0] @ x[1] + x[2], rtol=1e-4, atol=1e-4)
    # a layer: weights packed once, then calls with the activations only, and a fused relu6
    layer = kernels.load_tuned("gemm", "kws_dscnn.pw4", act="relu6", weights=inputs[1:])
    for seed in (3, 4):
        a = np.random.default_rng(seed).standard_normal(inputs[0].shape).astype(np.float32)
        want = np.clip(GEMM.reference(shape, [a, *inputs[1:]])[0], 0, 6)
        np.testing.assert_allclose(layer(a)[0], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(BadInput, match="takes 1 input"):
        layer(*inputs)
    with pytest.raises(BadInput, match="no fused activation"):
        kernels.load_tuned("gru", "kws_crnn.gru", act="relu")
