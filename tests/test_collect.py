"""The dataset collector: a kill -9 at any point loses at most the measurement in flight, and a rerun resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tuner.collect import data_card, read_rows

REPO = Path(__file__).resolve().parent.parent
ARGS = ["--kernel", "gru", "--isa", "x86-64-v2", "--configs", "3", "--shapes", "4", "--heldout", "1",
        "--extra-shapes", "1", "--refine", "2", "--refine-heldout", "3", "--min-time", "0.002", "--max-reps", "3"]


def _collect(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tuner.collect", "--out", str(out), *ARGS, *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _measurements(path: Path) -> list[dict]:
    return [r for r in read_rows(path) if r.get("kind") == "m"]


def test_collector_survives_kill_9_and_resumes_without_duplicates(tmp_path):
    out = tmp_path / "runs.jsonl"
    dry = _collect(out, "--dry-run")
    planned = int(dry.communicate(timeout=120)[0].strip().splitlines()[-1].split(":")[1])
    assert planned > 0 and not out.exists()

    p = _collect(out)
    deadline = time.monotonic() + 120
    while not out.exists() or len(_measurements(out)) < 3:  # await the event: 3 journaled measurements
        assert p.poll() is None, p.stdout.read()
        assert time.monotonic() < deadline, "the collector journaled nothing in 120 s"
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    before = _measurements(out)
    assert 3 <= len(before) < planned

    again = _collect(out)
    log = again.communicate(timeout=300)[0]
    assert again.returncode == 0, log
    rows = _measurements(out)
    keys = [(r["kernel"], r["isa"], r["shape_key"], r["config_key"]) for r in rows]
    assert len(keys) == len(set(keys)), "a measurement was repeated after the resume"
    assert rows[:len(before)] == before  # nothing finished before the kill was lost or rewritten
    assert sum(r["phase"] != "refine" for r in rows) == planned
    refine: dict[tuple, int] = {}
    for r in rows:
        if r["phase"] == "refine":
            refine[(r["shape_key"], r["split"])] = refine.get((r["shape_key"], r["split"]), 0) + 1
    assert sorted(refine.values()) == [2, 2, 2, 2, 3]  # 4 training cases x 2 evals, 1 held-out case x 3
    assert all(r["ok"] and r["ms"] > 0 and r["wall_ms"] and r["load1"] is not None for r in rows)
    settings = [r for r in read_rows(out) if r.get("kind") == "run"]
    assert len(settings) == 2 and settings[-1]["refine_heldout"] == 3

    card = data_card(out)
    assert f"{len(rows)} measurements ({len(rows)} ok" in card
    assert "5 cases (kernel x ISA x shape): 4 train, 1 held-out." in card
    assert "refine_heldout" not in card and "3 evals for a held-out case" in card
    assert "min in 2 runs (" in card  # the killed run and its resume: wall time summed per run, not first-to-last
