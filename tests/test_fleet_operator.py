"""The operator's path through the README's fleet sections, through the real CLI: what a first-time operator types
(and mistypes) gets the table, or an error that names the value and the fix, never a traceback; and two servers
starting together on one PostgreSQL both find the bundled model."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from edgetune.errors import BadInput
from fleet import models as registry
from fleet.store import open_fleet_store
from tests.broker import free_port
from tests.polling import wait_until
from tests.test_rollout import edgetune, model_file



def fleet_db(tmp_path: Path, isa: str = "x86-64-v4") -> Path:
    """A SQLite fleet DB that has heard from two devices."""
    path, now = tmp_path / "fleet.db", time.time()
    with open_fleet_store(path) as store:
        for d in ("dev-a", "dev-b"):
            store.put_status(d, "online", 1, "0.1.0", now, False, now, now)
            store.put_info(d, {}, {"isa": isa, "cpu_model": "cpu"}, now, now)
    return path


def test_devices_table_shows_each_state_as_a_word_not_markup(tmp_path):
    r = edgetune("fleet", "devices", "--db", str(fleet_db(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert "online" in r.stdout and "[green]" not in r.stdout and "[/]" not in r.stdout


def test_key_create_where_it_cannot_write_names_the_path_and_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = edgetune("fleet", "key", "create", "--out", str(blocker / "release.key"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot write the signing key to {blocker / 'release.key'}: a parent is not a directory" in r.stderr
    assert "pick another --out" in r.stderr
    r = edgetune("fleet", "key", "create", env={**os.environ, "CONFIGURATION_DIRECTORY": str(blocker)})  # the default place
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "set CONFIGURATION_DIRECTORY" in " ".join(r.stderr.split())  # stderr wraps at 200 columns


def test_model_build_refuses_a_zero_time_limit_or_a_bad_focus_share_and_names_the_selection_as_typed(tmp_path):
    db = str(fleet_db(tmp_path))
    t = time.monotonic()
    r = edgetune("fleet", "model", "build", "--max-minutes", "0", "--db", db)
    assert r.returncode == 2 and "--max-minutes 0: must be > 0" in r.stderr, r.stderr
    assert time.monotonic() - t < 60  # refused, not trained without a limit
    for share in ("1", "-0.1", "nan"):
        r = edgetune("fleet", "model", "build", "--focus-share", share, "--db", db)
        assert r.returncode == 2 and f"--focus-share {share}: must be at least 0 and below 1" in r.stderr, r.stderr
    r = edgetune("fleet", "model", "build", "--where", "isa=x86-64-v2", "--db", db)
    assert r.returncode == 2 and "no device matches --where isa=x86-64-v2: nothing to train on" in r.stderr, r.stderr


def test_publish_refuses_a_first_cohort_over_100_percent_and_starts_no_rollout(tmp_path):
    db = str(fleet_db(tmp_path))
    key = tmp_path / "keys" / "release.key"
    assert edgetune("fleet", "key", "create", "--out", str(key)).returncode == 0
    model = tmp_path / "m.gguf"
    from tuner.model.inference import bundled_model_path

    model.write_bytes(bundled_model_path().read_bytes() + b"\0" * 16)  # another file, the same model
    assert edgetune("fleet", "model", "add", str(model), "--db", db).returncode == 0
    for cohort in ("150", "150%", "0%"):
        r = edgetune("fleet", "model", "publish", "2", "--cohort", cohort, "--key", str(key), "--db", db)
        assert r.returncode == 2 and f"--cohort {cohort}:" in r.stderr and "at most 100%" in r.stderr, r.stderr
    listed = edgetune("fleet", "rollout", "list", "--db", db, "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == []


def test_publish_names_the_flag_and_the_value_a_bad_policy_came_from(tmp_path):
    """The rollout policy's errors named its fields ("abort after 0 reports"), not the flags the operator typed."""
    db = str(fleet_db(tmp_path))
    for flag, value, message in (("--phases", "50,20,100", "--phases 50,20,100: rising percentages"),
                                 ("--advance-at", "150%", "--advance-at 150%: must be 0-100%, e.g. 100%"),
                                 ("--abort-above", "101", "--abort-above 101%: must be 0-100%, e.g. 10%"),
                                 ("--abort-after", "0", "--abort-after 0: must be at least 1 device, e.g. 1"),
                                 ("--report-timeout", "0m", "--report-timeout 0s: must be > 0, e.g. 1h")):
        r = edgetune("fleet", "model", "publish", "2", flag, value, "--db", db)
        assert r.returncode == 2 and message in r.stderr, (flag, r.stderr)


def test_retune_names_the_ttl_flag_when_it_outlives_a_device_session(tmp_path):
    r = edgetune("fleet", "retune", "dev-a", "--broker", f"127.0.0.1:{free_port()}", "--ttl", "999999",
                 "--db", str(fleet_db(tmp_path)))
    assert r.returncode == 2 and "--ttl 999999: must be > 0 and at most 86400 seconds" in r.stderr, r.stderr


LOCK_WAITERS = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"


def race(pg_url: str, first, mine: Callable[[], Any], theirs: Callable[[], Any], what: str) -> tuple[Any, Any]:
    """`mine` in a transaction of `first`, held uncommitted until `theirs` (in a thread, on another connection)
    waits on its row, then committed: (mine's result, theirs' result or the exception it raised)."""
    import psycopg

    got: list = []

    def other() -> None:
        try:
            got.append(theirs())
        except Exception as e:  # noqa: BLE001 (the test reports what the other side met)
            got.append(e)

    with psycopg.connect(pg_url, autocommit=True) as watch, first.tx():
        result = mine()
        t = threading.Thread(target=other)
        t.start()
        wait_until(lambda: watch.execute(LOCK_WAITERS).fetchone()[0] or got, what, timeout=30)
    t.join(30)
    assert len(got) == 1, got
    return result, got[0]


def test_two_servers_registering_the_bundled_model_at_once_on_postgresql_both_get_it(pg_url):
    """`fleet serve` registers v1 at start; the second of two servers started together used to log that the
    registry lacks it (its insert failed on the first one's uncommitted row), though it was there."""
    with open_fleet_store(pg_url) as first, open_fleet_store(pg_url) as second:
        mine, theirs = race(pg_url, first, lambda: registry.ensure_bundled(first),
                            lambda: registry.ensure_bundled(second), "the second server's insert waiting")
        assert isinstance(theirs, dict), theirs
        assert (theirs["version"], theirs["sha256"]) == (1, mine["sha256"])


def test_two_model_adds_at_once_on_postgresql_take_the_next_two_versions(pg_url, tmp_path):
    """Both read the same next version; the second insert failed on the first one's uncommitted row with a raw
    duplicate-key error. It now reads again and takes the version after; the same file twice is named as such."""
    with open_fleet_store(pg_url) as first, open_fleet_store(pg_url) as second:
        registry.ensure_bundled(first)

        def adds(a: Path, b: Path) -> tuple[Any, Any]:
            return race(pg_url, first, lambda: registry.add(first, a), lambda: registry.add(second, b),
                        "the second add's insert waiting")

        mine, theirs = adds(model_file(tmp_path, 16), model_file(tmp_path, 24))
        assert mine["version"] == 2 and isinstance(theirs, dict), theirs
        assert theirs["version"] == 3 and theirs["sha256"] != mine["sha256"]
        same = model_file(tmp_path, 32)
        mine, theirs = adds(same, same)
        assert mine["version"] == 4 and isinstance(theirs, BadInput), theirs
        assert "is model v4 already" in str(theirs)


def test_show_and_export_records_name_an_unknown_device_as_a_usage_error(tmp_path):
    db = str(fleet_db(tmp_path))
    r = edgetune("fleet", "show", "ghost", "--db", db)
    assert r.returncode == 2 and "no device 'ghost'" in r.stderr, r.stderr
    out = tmp_path / "records.jsonl"
    r = edgetune("fleet", "export-records", "-o", str(out), "--device", "ghost", "--db", db)
    assert r.returncode == 2 and "--device 'ghost': no such device" in r.stderr, r.stderr
    assert not out.exists()
    r = edgetune("fleet", "export-records", "-o", str(out), "--device", "dev-a", "--db", db)
    assert r.returncode == 0 and out.exists(), r.stderr  # a known device without records: an empty file
