"""Shared fixtures: isolated state/runtime dirs per test, one build cache per session, the real machine's probe."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, build_cache, monkeypatch):
    """Each test gets its own state and runtime dirs; compiled kernels are shared across the session."""
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "run"))
    monkeypatch.setenv("CACHE_DIRECTORY", str(build_cache))
    monkeypatch.setenv("CONFIGURATION_DIRECTORY", str(tmp_path / "etc"))
    yield


@pytest.fixture(scope="session")
def hw():
    from hwprobe import probe

    return probe(measure_bandwidth=False)


@pytest.fixture(scope="session")
def runner():
    from kernels.worker import Runner

    with Runner() as r:
        yield r


@pytest.fixture
def mosquitto(tmp_path):
    """A real broker on a free port, stopped at the end of the test."""
    from tests.broker import Mosquitto

    b = Mosquitto(tmp_path / "broker").start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def pg_cluster():
    """A throwaway PostgreSQL cluster for the session (tests/pg.py); skipped when no server is installed."""
    from tests.pg import PgCluster, missing_reason

    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = PgCluster().init()
    yield cluster
    cluster.destroy()


@pytest.fixture
def pg_url(pg_cluster) -> str:
    """A fresh, empty database on the session's cluster."""
    return pg_cluster.create_db()


def model_kernels() -> list:
    """The kernels (specs) whose knobs and values are exactly those the bundled tuner model was trained on. The
    model also ranks a kernel whose knobs changed since (tuner.model.proposer.unknown_knobs), but the exactness
    tests of its search need the space it learned; after a re-collect and retrain (`make model`) that is every
    kernel."""
    from kernels.registry import all_specs
    from tuner.model.inference import check_gguf, default_model_path

    spaces = check_gguf(default_model_path()).spaces()
    return [s for s in all_specs().values()
            if spaces.get(s.name) == {p.name: [str(v) for v in p.values] for p in s.params}]
