"""The dataset collector: a kill -9 at any point loses at most the measurement in flight, and a rerun resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.space import config_key
from tests.polling import wait_until
from tuner.collect import data_card, leaders_id, read_rows, shape_key
from tuner.train.data import add_measurement, load_collector, load_records

REPO = Path(__file__).resolve().parent.parent
ARGS = ["--kernel", "gru", "--isa", "x86-64-v2", "--configs", "3", "--shapes", "4", "--heldout", "1",
        "--extra-shapes", "1", "--arch-layers", "1", "--refine", "2", "--refine-heldout", "3", "--confirm-top", "2", "--confirm-rounds", "2",
        "--min-time", "0.002", "--max-reps", "3"]


def _collect(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tuner.collect", "--out", str(out), *ARGS, *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _measurements(path: Path) -> list[dict]:
    return [r for r in read_rows(path) if r.get("kind") == "m"]


def _run_until(out: Path, enough) -> list[dict]:
    """Start the collector, SIGKILL it once the journal satisfies `enough` (awaited, not slept), return the rows."""
    p = _collect(out)

    def there() -> bool:
        if out.exists() and enough(_measurements(out)):
            return True
        assert p.poll() is None, p.stdout.read()  # the collector died: fail now, with what it said
        return False

    wait_until(there, "the collector to get there", 240, interval=0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    return _measurements(out)


def test_collector_survives_kill_9_and_resumes_without_duplicates(tmp_path):
    out = tmp_path / "runs.jsonl"
    dry = _collect(out, "--dry-run")
    planned = int(dry.communicate(timeout=120)[0].strip().splitlines()[-1].split(":")[1])
    assert planned > 0 and not out.exists()

    before = _run_until(out, lambda rows: len(rows) >= 3)
    assert 3 <= len(before) < planned
    # killed again in the confirmation phase, after its first measurement
    mid = _run_until(out, lambda rows: any(r["phase"] == "confirm" for r in rows))
    assert mid[:len(before)] == before

    again = _collect(out)
    log = again.communicate(timeout=300)[0]
    assert again.returncode == 0, log
    rows = _measurements(out)
    assert rows[:len(mid)] == mid  # nothing finished before a kill was lost or rewritten
    first = [r for r in rows if r["phase"] != "confirm"]
    keys = [(r["kernel"], r["isa"], r["shape_key"], r["config_key"]) for r in first]
    assert len(keys) == len(set(keys)), "a measurement was repeated after the resume"
    assert sum(r["phase"] != "refine" for r in first) == planned
    refine: dict[tuple, int] = {}
    for r in rows:
        if r["phase"] == "refine":
            refine[(r["shape_key"], r["split"])] = refine.get((r["shape_key"], r["split"]), 0) + 1
    # 5 training cases (3 bundled + 1 synthetic, and 1 real-architecture layer) x 2 evals, 1 held-out case x 3
    assert sorted(refine.values()) == [2, 2, 2, 2, 2, 3]
    assert sum(1 for r in first if r["workload"] == "hello_edge_gru_s") > 0  # the layer, from arch_layers.toml
    # each training case's 2 fastest configs, measured 2 more times each, across both kills
    for sk in {r["shape_key"] for r in first if r["split"] == "train"}:
        case = sorted((r for r in first if r["shape_key"] == sk and r["ok"]), key=lambda r: r["ms"])
        confirmed = [r["config_key"] for r in rows if r["shape_key"] == sk and r["phase"] == "confirm"]
        assert sorted(confirmed) == sorted([case[0]["config_key"], case[1]["config_key"]] * 2), sk
    assert not any(r["phase"] == "confirm" and r["split"] != "train" for r in rows)
    assert all(r["ok"] and r["ms"] > 0 and r["wall_ms"] and r["load1"] is not None for r in rows)
    settings = [r for r in read_rows(out) if r.get("kind") == "run"]
    assert len(settings) == 3 and settings[-1]["refine_heldout"] == 3 and settings[-1]["confirm_rounds"] == 2

    card = data_card(out)
    assert f"{len(rows)} measurements ({len(rows)} ok" in card
    assert "6 cases (kernel x ISA x shape): 5 train, 1 held-out." in card
    assert "refine_heldout" not in card and "3 evals for a held-out case" in card
    assert "min in 3 runs (" in card  # the killed runs and the resume: wall time summed per run, not first-to-last


def _confirm_top(args: list[str], n: int) -> list[str]:
    return [str(n) if args[i - 1] == "--confirm-top" else a for i, a in enumerate(args)]


def test_changed_leaders_are_confirmed_again_side_by_side(tmp_path):
    """A later run with other leaders (here 3 per case instead of 2; a grown sample does the same) measures all of
    them again in fresh rounds, not only the newcomers, and training ranks each case by that confirmation alone."""
    out = tmp_path / "runs.jsonl"
    for top in (2, 3, 3):  # the last run has nothing left to do
        p = subprocess.run([sys.executable, "-m", "tuner.collect", "--out", str(out), *_confirm_top(ARGS, top)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
    rows = _measurements(out)
    cases = load_collector(out)
    trained = 0
    for sk in {r["shape_key"] for r in rows if r["split"] == "train"}:
        first: dict[str, float] = {}
        for r in rows:
            if r["shape_key"] == sk and r["ok"] and r["phase"] != "confirm":
                first.setdefault(r["config_key"], r["ms"])
        leaders = [k for k, _ in sorted(first.items(), key=lambda kv: kv[1])]
        old, new = leaders_id(leaders[:2]), leaders_id(leaders[:3])
        confirm = [r for r in rows if r["shape_key"] == sk and r["phase"] == "confirm"]
        assert sorted(r["config_key"] for r in confirm if r["leaders"] == old) == sorted(leaders[:2] * 2)
        fresh = [r for r in confirm if r["leaders"] == new]
        assert sorted(r["config_key"] for r in fresh) == sorted(leaders[:3] * 2), sk
        assert confirm[-len(fresh):] == fresh  # the fresh rounds came after the first confirmation
        (case,) = [c for c in cases.values() if c.split == "train" and shape_key(c.shape) == sk]
        by_new = {k: sorted(r["ms"] for r in fresh if r["config_key"] == k) for k in leaders[:3]}
        assert {k: sorted(v) for k, v in case.confirm_ms.items()} == by_new  # the earlier rounds are not pooled in
        assert {config_key(c) for c, _ in case.ranked()[:3]} == set(leaders[:3])
        trained += 1
    assert trained == 5  # 3 bundled, 1 synthetic and 1 real-architecture training shape


def test_sweep_measures_every_joint_setting_from_each_training_case_best(tmp_path):
    """`--sweep unroll,layout`: each training case gets every valid (unroll, layout) of its fastest config before
    the sweep, the other knobs held, before its leaders are confirmed; held-out cases get none; a rerun adds
    nothing. A group no selected kernel has is refused with the kernels' knobs named."""
    from hwprobe import probe
    from kernels.registry import get_spec
    from tuner.collect import sweep_configs

    out = tmp_path / "runs.jsonl"
    runs = []
    for _ in range(2):  # the second run has nothing left to measure
        p = subprocess.run([sys.executable, "-m", "tuner.collect", "--out", str(out), *ARGS, "--sweep", "unroll,layout"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        runs.append(_measurements(out))
    rows = runs[0]
    assert runs[1] == rows
    spec, hw = get_spec("gru"), probe(isa_cap="x86-64-v2", measure_bandwidth=False)
    swept = 0
    for sk in {r["shape_key"] for r in rows}:
        case = [r for r in rows if r["shape_key"] == sk]
        sweep = [r for r in case if r["phase"] == "sweep"]
        if case[0]["split"] == "heldout":
            assert not sweep
            continue
        base = min((r for r in case if r["ok"] and r["phase"] not in ("sweep", "confirm")), key=lambda r: r["ms"])
        want = {config_key(c) for c in sweep_configs(spec.space(case[0]["shape"], hw), base["config"],
                                                      [("unroll", "layout")])}
        measured = {r["config_key"] for r in case if r["phase"] != "confirm"}
        assert want and want <= measured, sk  # every joint setting, whether sampled, refined or swept
        assert {r["config_key"] for r in sweep} <= want
        assert all({k: v for k, v in r["config"].items() if k not in ("unroll", "layout")}
                   == {k: v for k, v in base["config"].items() if k not in ("unroll", "layout")} for r in sweep)
        assert all(case.index(r) < case.index(c) for r in sweep for c in case if c["phase"] == "confirm")
        swept += bool(sweep)
    assert swept >= 3
    assert [r for r in read_rows(out) if r.get("kind") == "run"][-1]["sweep"] == [["unroll", "layout"]]
    card = data_card(out)
    n_sweep = sum(r["phase"] == "sweep" for r in rows)
    assert "`--sweep` groups (unroll,layout)" in card and f"| {n_sweep} | " in card.split("| confirm |")[1]

    bad = subprocess.run([sys.executable, "-m", "tuner.collect", "--out", str(tmp_path / "x.jsonl"), *ARGS,
                          "--sweep", "mr,nv"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--sweep 'mr,nv'" in bad.stderr and "gru vec,ut" in bad.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_training_ranks_confirmed_leaders_by_their_rounds_alone():
    """The confirmation rounds ran on a slower host: pooled with the first pass, an unconfirmed config's single
    fast first measurement would outrank every confirmed leader."""
    from kernels.registry import get_spec

    cfg = {name: get_spec("gemm").default | {"mr": mr} for name, mr in (("a", 1), ("b", 2), ("c", 4))}
    cases: dict = {}
    first = {"a": 1.0, "b": 1.2, "c": 1.1}  # c was not among the leaders confirmed
    for name, ms in first.items():
        add_measurement(cases, "gemm", "x86-64-v3", {"M": 8}, "w", "train", {}, cfg[name], True, ms, "sample")
    for name, rounds in {"a": [2.1, 2.0], "b": [1.9, 1.8]}.items():
        for ms in rounds:
            add_measurement(cases, "gemm", "x86-64-v3", {"M": 8}, "w", "train", {}, cfg[name], True, ms, "confirm")
    (case,) = cases.values()
    assert [c["mr"] for c, _ in case.ranked()] == [2, 1, 4]
    assert case.table() == {config_key(cfg[k]): ms for k, ms in first.items()}  # the replay's table: first pass


def test_records_of_another_device_are_cases_of_their_own(tmp_path):
    """The fleet loop: the same problem tuned on a second device becomes a second case, prompted with that device's
    descriptor; merged into the collection host's case, its timings would be trained under the other host's
    descriptor and drowned by that host's confirmed leaders. A held-out problem is skipped on every device."""
    import json

    from kernels.registry import get_spec

    a, b = (get_spec("gemm").default | {"mr": mr} for mr in (1, 2))
    host = {"hw_fingerprint": "xeon", "isa": "x86-64-v3", "vector_bits": 256, "cores": 2, "l2": 2 << 20}
    device = {"hw_fingerprint": "epyc", "isa": "x86-64-v3", "vector_bits": 256, "cores": 2, "l2": 1 << 20}
    cases: dict = {}
    for m, split in ((8, "train"), (9, "heldout")):
        add_measurement(cases, "gemm", "x86-64-v3", {"M": m}, "w", split, host, a, True, 1.0, "sample")
    recs = [{"kernel": "gemm", "isa": "x86-64-v3", "shape": {"M": m}, "workload": "w", "hw": device,
             "measurements": [{"phase": "search", "seq": 0, "config": b, "ok": True, "ms": 0.5}]}
            for m in (8, 9)]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    _, sessions = load_records(path, cases, {c.problem for c in cases.values() if c.split == "heldout"})
    assert sessions == 2 and len(cases) == 3
    by = {(c.hw["hw_fingerprint"], c.shape["M"]): c for c in cases.values()}
    assert set(by) == {("xeon", 8), ("xeon", 9), ("epyc", 8)}
    assert by["epyc", 8].hw == device and by["epyc", 8].table() == {config_key(b): 0.5}
    assert by["xeon", 8].table() == {config_key(a): 1.0}
    assert by["epyc", 8].problem == by["xeon", 8].problem and by["epyc", 8].key != by["xeon", 8].key


def test_records_of_another_kernel_version_are_left_out_of_training(tmp_path):
    """A record times the kernel its device ran: another C source (an older edgetune, data from before a kernel
    changed) or a config of other knobs describes no kernel this edgetune builds, so training leaves it out."""
    from kernels.registry import get_spec

    spec = get_spec("gru")
    shape = {"T": 20, "I": 16, "H": 16}
    cfg = spec.default
    rec = {"kernel": "gru", "workload": "w", "isa": "x86-64-v2", "measurements": [{"config": cfg, "ok": True, "ms": 1.0}]}
    recs = [rec | {"shape": shape | {"T": 21}, "source_hash": spec.source_hash()},  # kept
            rec | {"shape": shape | {"T": 22}},  # no source recorded: taken at its word, kept
            rec | {"shape": shape | {"T": 23}, "source_hash": "0123456789abcdef"},  # another kernel source
            rec | {"shape": shape | {"T": 24}, "measurements": [{"config": {k: v for k, v in cfg.items() if k != "mt"}, "ok": True,
                                                         "ms": 1.0}]},  # from before gru gained knob mt
            rec | {"shape": shape | {"T": 25}, "measurements": [{"config": cfg | {"ut": 3}, "ok": True, "ms": 1.0}]},  # no such value
            rec | {"kernel": "fft9", "shape": shape | {"T": 26}}]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cases, n = load_records(path)
    assert n == len(recs) and sorted(c.shape["T"] for c in cases.values()) == [21, 22]
    rows = [r for r in read_rows(REPO / "quantized_models" / "data" / "runs.jsonl.gz") if r.get("kind") == "m"][:1]
    assert rows[0]["source_hash"] == get_spec(rows[0]["kernel"]).source_hash()  # the committed journal: kept


def test_rows_of_an_earlier_source_with_the_same_generic_code_stay_in_training():
    """dwconv_3x3's source changed only for builds that bake a workload's dims; the collector's builds bake none and
    compile to the same code, so the committed journal's dwconv rows (recorded under the earlier hash) still count,
    and every bundled kernel keeps its cases. The alias is keyed by the current source: another change drops it."""
    from kernels.registry import all_specs
    from tuner.train.data import DEFAULT_DATA, SAME_GENERIC_CODE, current_kernel, load_collector

    dw = all_specs()["dwconv_3x3"]
    (old,) = SAME_GENERIC_CODE[dw.source_hash()]
    assert old != dw.source_hash() and current_kernel("dwconv_3x3", old, dw.default)
    assert not current_kernel("gemm", old, all_specs()["gemm"].default)  # an alias of one kernel's source only
    assert {c.kernel for c in load_collector(DEFAULT_DATA).values()} == set(all_specs())


def test_the_cases_a_focus_records_file_measures_are_marked_focus_and_keep_their_descriptor(tmp_path):
    """`edgetune train --records` and `fleet model build` train for the devices whose records they name: the cases
    those records measure (new ones, and a base case one of them joins) are focus cases, drawn more often and never
    under a redrawn descriptor; the base records' other cases are not."""
    from kernels.registry import get_spec
    from tuner.train.data import load_cases
    from tuner.train.train import Recipe, focus_repeats, redrawn_descriptors

    cfg = get_spec("gemm").default
    epyc = {"hw_fingerprint": "epyc", "isa": "x86-64-v4", "vector_bits": 512, "cores": 2, "l2": 1 << 20}
    xeon = {"hw_fingerprint": "xeon", "isa": "x86-64-v4", "vector_bits": 512, "cores": 2, "l2": 2 << 20}

    def write(name: str, sessions: list[tuple[dict, int]]) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"kernel": "gemm", "isa": "x86-64-v4", "shape": {"M": m}, "workload": "w",
                                            "hw": hw, "measurements": [{"config": cfg, "ok": True, "ms": 1.0}]}) + "\n"
                                for hw, m in sessions))
        return path

    base = write("base.jsonl", [(epyc, 8), (epyc, 12)])
    mine = write("mine.jsonl", [(xeon, 8), (xeon, 16), (epyc, 12)])
    cases = load_cases([], [base, mine], frozenset({mine}))[0]
    focus = {(c.hw["hw_fingerprint"], c.shape["M"]): c.focus for c in cases.values()}
    assert focus == {("epyc", 8): False, ("epyc", 12): True, ("xeon", 8): True, ("xeon", 16): True}
    assert not any(c.focus for c in load_cases([], [base, mine])[0].values())
    variants = redrawn_descriptors(list(cases.values()), Recipe())
    assert {cases[k].hw["hw_fingerprint"] + str(cases[k].shape["M"]) for k in cases if id(cases[k]) in variants} \
        == {"epyc8"}
    assert focus_repeats(48, 930, 0.25) == 6  # 288 of 1218 draws, 24%
    assert focus_repeats(3, 930, 0.25) == 103 and focus_repeats(48, 930, 0.0) == focus_repeats(0, 930, 0.25) == 1
    assert focus_repeats(500, 100, 0.25) == 1  # already more than the share: never drawn less than once


def test_a_device_sessions_final_rounds_rank_its_leaders_and_set_the_time_scale(tmp_path):
    """A session's final rounds measure its leaders side by side, maybe at another speed than its search (here 2x
    slower: another daemon was busy): the leaders are ranked by those rounds alone, the configs searched only
    follow in the same time scale, so no search-only time outweighs the best leader in the training targets; a
    later session of the same case replaces the earlier one's final rounds."""
    from kernels.registry import get_spec
    from tuner.train.data import targets

    cfg = {n: get_spec("gemm").default | {"mr": mr} for n, mr in (("a", 1), ("b", 2), ("c", 4))}

    def session(sid: int, search: dict, final: dict) -> dict:
        rows = [{"phase": "search", "config": cfg[n], "ok": True, "ms": ms} for n, ms in search.items()]
        rows += [{"phase": "final", "config": cfg[n], "ok": True, "ms": ms} for n, v in final.items() for ms in v]
        return {"kernel": "gemm", "isa": "x86-64-v4", "shape": {"M": 8}, "workload": "w", "id": sid,
                "device_id": "d", "hw": {"hw_fingerprint": "d"}, "measurements": rows}

    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(session(1, {"a": 1.0, "b": 1.1, "c": 1.05}, {"a": [2.2, 2.1], "b": [2.0, 2.05]}))
                    + "\n")
    (case,) = load_records(path)[0].values()
    # c, searched only, at the leaders' scale: faster than the slower leader (a session's finals always hold the
    # slow default), never faster than the fastest
    assert [(c["mr"], round(ms, 3)) for c, ms in case.ranked()] == [(2, 2.025), (1, 2.15), (4, 2.095)]
    assert case.confirm_scale() == pytest.approx((2.15 / 1.0 + 2.025 / 1.1) / 2)
    weights = [w for _, w in targets(case, 10, 0.08)]
    assert weights[0] == max(weights) and sum(weights) == pytest.approx(1.0)
    later = session(2, {"c": 1.0}, {"c": [1.0], "a": [1.2]})
    path.write_text(path.read_text() + json.dumps(later) + "\n")
    (case,) = load_records(path)[0].values()
    assert [c["mr"] for c, _ in case.ranked()] == [4, 1, 2]  # the later final rounds alone rank the leaders
