"""The README's bench scripts, each run for real at its smallest setting: they start, finish, and refuse a value
they cannot use by name before measuring (not with a traceback once minutes of results are in)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL = str(REPO / "quantized_models" / "edgetune-tuner.Q8_0.gguf")


def bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"bench/{script}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


# each script at its quickest, so that without the check it would run, then fail to write
QUICK = {
    "kernels_vs_peers.py": ("--kernels", "gemm", "--workloads", "kws_dscnn.fc", "--threads", "1", "--rounds", "1",
                            "--tune-evals", "0"),
    "compare_tuners.py": ("--real-layers", "--names", "ds_cnn_m.dw2", "--strategies", "anneal", "--budget", "2",
                          "--rounds", "1", "--ref-evals", "2"),
    "unseen_hw.py": ("--per-kernel", "1", "--k", "1", "--no-measure"),
    "model_ab.py": (f"a={MODEL}", "--cases", "1", "--rounds", "1", "-k", "1"),
    "finals_study.py": ("--cases", "1"),
    "fleet_loop.py": ("--refs-only", "--held", "1", "--kernels", "gemm", "--ref-evals", "1", "--other-isa", "none"),
}
REFS = ("compare_tuners.py", "fleet_loop.py")  # they also write a reference cache: not the user's in a test


@pytest.mark.parametrize("script", QUICK)
def test_an_unwritable_json_path_is_refused_before_measuring(script, tmp_path):
    out = tmp_path / "no-such-dir" / "out.json"
    refs = ("--refs", str(tmp_path / "refs.json")) if script in REFS else ()
    p = bench(script, *QUICK[script], *refs, "--json", str(out))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    message = f"argument --json: cannot write {out}: directory {out.parent} does not exist"
    assert message in " ".join(p.stderr.split()), p.stderr  # the verbs' parser wraps stderr at 200 columns
    assert p.stdout == ""  # refused while parsing: nothing was measured


@pytest.mark.parametrize("script", REFS)
def test_an_unwritable_refs_path_is_refused_before_the_reference_search(script, tmp_path):
    refs = tmp_path / "no-such-dir" / "refs.json"
    p = bench(script, *QUICK[script], "--refs", str(refs))
    assert p.returncode == 2 and f"argument --refs: cannot write {refs}" in p.stderr, p.stderr[-2000:]


def test_compare_tuners_help_lists_the_real_layer_run():
    """The README's `compare_tuners.py --real-layers`: its --help said nothing of it."""
    p = bench("compare_tuners.py", "--help")
    assert p.returncode == 0 and "--real-layers" in p.stdout and "`--real-layers --help`" in p.stdout, p.stdout


def test_strategies_bench_exhaustive_case_fits_the_strategy_limit(hw):
    """The bench walked gemm/mobilenetv2.b2.expand exhaustively: 442368 configs, which the strategy refuses over
    5000, so the script died at its first case."""
    sys.path.insert(0, str(REPO / "bench"))
    import strategies as S

    from kernels.registry import get_spec
    from tuner.strategies.registry import make_strategy

    kernel, workload = S.EXHAUSTIVE_CASE
    spec = get_spec(kernel)
    space = spec.space(spec.workload(workload).shape, hw)
    assert space.size() <= S.EXHAUSTIVE_LIMIT
    assert make_strategy("exhaustive", space, 0, kernel=spec).ask(1)  # no BadInput: the walk starts


def test_strategies_bench_runs_through(tmp_path):
    p = bench("strategies.py", "--budget", "1", "--seeds", "1", "--no-exhaustive")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("best known") == 5 and "random" in p.stdout and "anneal" in p.stdout, p.stdout


@pytest.mark.skipif(not (shutil.which("mosquitto") or Path("/usr/sbin/mosquitto").exists()),
                    reason="mosquitto is not installed")
def test_daemon_load_bench_settles_with_records_awaiting_the_fleet():
    """The daemon keeps its tuning record in the outbox until a fleet acknowledges it (end-to-end delivery); the
    bench, which runs no fleet, waited for an empty outbox and gave up after 300 s."""
    p = bench("daemon_load.py", "--idle-s", "1", "--messages", "20", timeout=200)
    assert p.returncode == 0, p.stderr[-2000:]
    figures = json.loads(p.stdout.strip().splitlines()[-1])
    assert figures["idle"]["rss_mb"] > 0 and figures["outbox"]["messages"] == 20


@pytest.mark.parametrize("script, args, message", [
    ("noise.py", ("--kernel", "nope"), "error: unknown kernel 'nope'"),
    ("noise.py", ("--workload", "nope"), "error: unknown workload 'nope' for kernel gemm"),
    ("noise.py", ("--runs", "0"), "argument --runs: 0 is below the minimum of 1"),
    ("strategies.py", ("--budget", "0"), "argument --budget: 0 is below the minimum of 1"),
    ("compile_time.py", ("--configs", "0"), "argument --configs: 0 is below the minimum of 1"),
    ("compile_time.py", ("--isa", "bogus"), "error: --isa 'bogus' is not available on this"),
    ("kernels_vs_peers.py", ("--rounds", "0"), "argument --rounds: 0 is below the minimum of 1"),
    ("kernels_vs_peers.py", ("--threads", "1,0"), "error: --threads '1,0': every thread count must be at least 1"),
    ("kernels_vs_peers.py", ("--min-time", "0"), "argument --min-time: 0 is not a positive number of seconds"),
    ("finals_study.py", ("--load", "/nonexistent/study.json"), "--load /nonexistent/study.json: cannot read"),
])
def test_bad_values_are_named_not_tracebacks(script, args, message):
    p = bench(script, *args, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert message in " ".join(p.stderr.split()), p.stderr
