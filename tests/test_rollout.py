"""Issue 27, fleet side, without devices: the cohort draw and the abort/advance rule, the rollout tables on SQLite
and PostgreSQL, and the key/model/publish/rollout verbs through the real CLI (their errors name the fix). The loop
with real daemons is tests/test_rollout_e2e.py; the page in a browser tests/test_rollout_browser.py."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgetune import release as rel
from edgetune.errors import BadInput
from fleet import models as registry
from fleet import rollout_store as rs
from fleet.rollout import Policy, cohorts, decide, phases_from, plan, rollout_summary, select_devices
from fleet.signing import create_key, load_private_key
from fleet.store import open_fleet_store
from tests.polling import wait_until
from tests.test_fleet import db  # noqa: F401  (the SQLite / PostgreSQL fixture)
from tuner.model.inference import bundled_model_path

REPO = Path(__file__).resolve().parent.parent
BUNDLED = bundled_model_path().read_bytes()


def edgetune(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgetune.main", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env or dict(os.environ))


def model_file(tmp_path: Path, pad: int, name: str = "m") -> Path:
    """A loadable model file other than the bundled one: llama.cpp ignores bytes after the tensor data."""
    p = tmp_path / f"{name}{pad}.gguf"
    p.write_bytes(BUNDLED + b"\0" * pad)
    return p


def target(phase: int, state: str | None = None, reason: str | None = None) -> dict:
    return {"phase": phase, "state": state, "reason": reason, "rollback_state": None}


ROLLOUT = {"id": "r", "version": 2, "state": "active", "phases": [5.0, 25.0, 100.0], "phase": 0,
           "phase_started_at": 1000.0, "min_dwell_s": 60.0, "advance_pct": 100.0, "abort_pct": 10.0, "abort_min": 2}


# ---- the cohort draw and the rule ---------------------------------------------------------------------------------

def test_cohorts_are_reproducible_sized_by_phase_and_independent_between_rollouts():
    devices = [f"dev-{i}" for i in range(40)]
    a = cohorts("r1", devices, (5.0, 25.0, 100.0))
    assert a == cohorts("r1", list(reversed(devices)), (5.0, 25.0, 100.0))  # the order given does not matter
    by_phase = [sorted(d for d, _, p in a if p == i) for i in range(3)]
    assert [len(x) for x in by_phase] == [2, 8, 30]  # ceil(5% of 40), ceil(25%) - 2, the rest
    assert [r for _, r, _ in a] == list(range(40))
    first = {d for d, _, p in cohorts("r2", devices, (5.0, 25.0, 100.0)) if p == 0}
    assert first != set(by_phase[0])  # another rollout draws other devices (2 of 40: a clash is a 1/780 chance)
    assert [p for _, _, p in cohorts("r1", ["only"], (5.0, 100.0))] == [0]  # a phase never releases nobody
    assert phases_from("5%", None) == (5.0, 25.0, 100.0) and phases_from("50", None) == (50.0, 100.0)
    assert phases_from(None, "10,100") == (10.0, 100.0) and phases_from("100%", None) == (100.0,)
    for bad in ((5.0, 50.0), (50.0, 5.0, 100.0), (0.0, 100.0), ()):
        with pytest.raises(BadInput, match="phases"):
            Policy(bad).check()


def test_the_rule_aborts_on_the_failure_share_once_enough_reported_and_advances_after_the_dwell():
    t = [target(0, "committed"), target(0, "rejected", "checksum"), target(1), target(2)]
    d = decide(ROLLOUT, t, 2000.0)
    assert d.action == "abort" and "1 of 2" in d.detail and "checksum" in d.detail
    assert decide(ROLLOUT, [target(0, "rolled_back", "regression"), target(0, "downloading")], 2000.0) is None  # 1 < N
    ok = [target(0, "committed"), target(0, "committed"), target(1), target(2)]
    assert decide(ROLLOUT, ok, 1059.0) is None  # healthy, but has not dwelt its minute
    assert decide(ROLLOUT, ok, 1060.0).action == "advance"
    assert decide({**ROLLOUT, "state": "paused"}, ok, 1060.0) is None  # paused: no advance
    waiting = [target(0, "committed"), target(0, "evaluating"), target(1)]
    assert decide(ROLLOUT, waiting, 5000.0) is None  # not every released device reported yet
    assert decide({**ROLLOUT, "advance_pct": 50.0}, waiting, 5000.0).action == "advance"
    last = {**ROLLOUT, "phase": 2}
    assert decide(last, [target(0, "committed"), target(2, "committed")], 5000.0).action == "complete"
    # the abort rule holds for a paused rollout too; exactly at the threshold is not over it
    assert decide({**ROLLOUT, "state": "paused"}, t, 2000.0).action == "abort"
    ten = [target(0, "committed")] * 9 + [target(0, "failed", "disk_full")]
    assert decide({**ROLLOUT, "abort_min": 1}, ten, 1000.0) is None
    # a device that never reported counts as a failure once the controller timed it out
    silent = [target(0, "committed"), target(0, "timed_out", "report_timeout"), target(1)]
    d = decide(ROLLOUT, silent, 2000.0)
    assert d.action == "abort" and "report_timeout x1" in d.detail
    assert rollout_summary({**ROLLOUT, "id": "r", "rollback_version": 1, "report_timeout_s": 60.0, "selector": {},
                            "reason": None, "created_at": 0, "updated_at": 0, "ended_at": None},
                           [{**t, "rollback_state": None} for t in silent])["phases"][0]["reasons"] == {
        "timed_out: report_timeout": 1}


# ---- the tables, on both backends ---------------------------------------------------------------------------------

def seed_devices(store, n: int, isa: str = "x86-64-v3") -> list[str]:
    now = time.time()
    ids = [f"dev-{i}" for i in range(n)]
    for i, d in enumerate(ids):
        store.put_status(d, "online", 1, "0.1.0", now, False, now, now)
        store.put_info(d, {}, {"isa": isa if i % 2 == 0 else "x86-64-v2", "cpu_model": "cpu"}, now, now)
    return ids


def test_registry_rollouts_reports_and_state_changes_on_sqlite_and_postgresql(db, tmp_path):  # noqa: F811
    key = create_key(tmp_path / "keys" / "k.key")
    signer = load_private_key(key.private)
    with open_fleet_store(db) as store:
        assert store.schema_version == 5  # with the rollout tables (v3, v4)
        seed_devices(store, 6)
        v1 = registry.ensure_bundled(store)
        assert (v1["version"], v1["source"], v1["sha256"]) == (1, "bundled", hashlib.sha256(BUNDLED).hexdigest())
        v2 = registry.add(store, model_file(tmp_path, 8), note="padded")
        assert v2["version"] == 2 and rs.model_data(store, v2["sha256"]) == BUNDLED + b"\0" * 8
        with pytest.raises(BadInput, match="is model v2 already"):
            registry.add(store, model_file(tmp_path, 8))
        bad = tmp_path / "cut.gguf"
        bad.write_bytes(BUNDLED[: len(BUNDLED) // 2])
        with pytest.raises(BadInput, match="truncated"):
            registry.add(store, bad)
        assert [m["version"] for m in rs.models(store)] == [1, 2]

        v2_targets = select_devices(store, None, {"isa": "x86-64-v2"})
        assert v2_targets == ["dev-1", "dev-3", "dev-5"]
        row, cohort = plan(v2, v1, signer, Policy((34.0, 100.0), 0.0, 100.0, 0.0, 1), v2_targets,
                           expires_at=time.time() + 60, selector={"where": {"isa": "x86-64-v2"}})
        rs.create_rollout(store, row, cohort, time.time(), "test")
        r = rs.rollout(store, row["id"])
        trusted = {key.key_id: signer.public_key()}
        assert rel.verify(r["manifest"], r["signature"], trusted).version == 2
        back = rel.verify(r["rollback_manifest"], r["rollback_signature"], trusted)
        assert back.rollback and back.version == 1 and back.sha256 == v1["sha256"]
        with pytest.raises(BadInput, match="finish or abort it first"):
            rs.create_rollout(store, {**row, "id": "other"}, cohort, time.time(), "test")

        first = next(d for d, _, p in cohort if p == 0)
        doc = {"state": "downloading", "rollout_id": r["id"], "phase": "34%", "version": 2, "ts": 100.0}
        fields = {"state": "downloading", "rollout_id": r["id"], "phase": "34%", "version": 2, "reason": None,
                  "detail": "1 MB", "ts": 100.0}
        assert rs.put_model_state(store, first, doc, fields, time.time())
        assert rs.put_model_state(store, first, doc, {**fields, "state": "committed", "ts": 200.0}, time.time())
        assert not rs.put_model_state(store, first, doc, {**fields, "state": "verifying", "ts": 150.0},
                                      time.time())  # an older report, seen again on reconnect, changes nothing
        assert not rs.put_model_state(store, "dev-0", doc, fields, time.time())  # not a target of that rollout
        assert rs.model_state(store, first)["state"] == "downloading"  # the stored document is the newest by ts
        summary = rollout_summary(r, rs.targets(store, r["id"]))
        assert summary["phases"][0]["counts"]["committed"] == 1 and summary["totals"]["pending"] == 2
        assert rollout_summary(r, rs.targets(store, r["id"]))["phases"][1]["released"] is False

        # a failed download is retried under the next attempt's rollout_id; a report on the old attempt is stale
        second = next(d for d, _, p in cohort if p == 1)
        rs.advance(store, r["id"], 0, time.time(), "test")
        assert rs.put_model_state(store, second, doc, {**fields, "state": "failed", "reason": "disk_full"}, 0.0)
        assert rs.retry(store, r["id"], None, time.time(), "op") == [second]
        assert rs.retry(store, r["id"], None, time.time(), "op") == []  # nothing failed any more
        assert not rs.put_model_state(store, second, doc, {**fields, "state": "failed", "ts": 300.0}, 0.0)
        assert rs.put_model_state(store, second, doc, {**fields, "rollout_id": r["id"] + ":retry1",
                                                       "state": "committed", "ts": 300.0}, 0.0)
        t = {x["device_id"]: x for x in rs.targets(store, r["id"])}[second]
        assert (t["attempt"], t["state"], t["sent_at"]) == (1, "committed", None)

        now = time.time()
        assert rs.act(store, r["id"], "pause", now, "op", "looking")["state"] == "paused"
        assert rs.act(store, r["id"], "resume", now, "op", None)["state"] == "active"
        with pytest.raises(BadInput, match="only a paused rollout can be resumed"):
            rs.act(store, r["id"], "resume", now, "op", None)
        assert rs.act(store, "nope", "abort", now, "op", None) is None
        rs.mark_sent(store, r["id"], first, now)
        assert rs.pending_rollbacks(store) == []
        assert rs.act(store, r["id"], "abort", now, "op", "bad")["state"] == "aborted"
        assert [x["id"] for x in rs.pending_rollbacks(store)] == [r["id"]]
        rs.mark_sent(store, r["id"], first, now, rollback=True)
        assert rs.pending_rollbacks(store) == [] and rs.baseline_version(store) == 1
        assert [e["kind"] for e in rs.events(store, r["id"])] == ["published", "advanced", "retried", "paused",
                                                                  "active", "aborted"]


# ---- the verbs ----------------------------------------------------------------------------------------------------

def test_key_create_is_private_refuses_to_overwrite_and_stays_out_of_the_state_dir(tmp_path):
    r = edgetune("fleet", "key", "create", "--out", str(tmp_path / "k" / "release.key"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    priv, pub = Path(out["private_key"]), Path(out["public_key"])
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600 and pub.name == "release.key.pub"
    key = rel.public_key_from_text(pub.read_text())
    assert rel.key_id(rel.raw_public(key)) == out["key_id"]
    before = priv.read_bytes()
    again = edgetune("fleet", "key", "create", "--out", str(priv))
    assert again.returncode == 2 and "never overwritten" in again.stderr and priv.read_bytes() == before
    inside = edgetune("fleet", "key", "create", "--out", os.environ["STATE_DIRECTORY"] + "/k.key")
    assert inside.returncode == 2 and "outside the state dir" in inside.stderr
    default = edgetune("fleet", "key", "create", "--json")  # the default: under the config dir
    assert default.returncode == 0 and json.loads(default.stdout)["private_key"].startswith(
        os.environ["CONFIGURATION_DIRECTORY"])
    priv.chmod(0o644)
    with pytest.raises(BadInput, match="chmod 600"):
        load_private_key(priv)


def test_model_and_publish_verbs_refuse_bad_input_with_the_fix(tmp_path):
    dbf = tmp_path / "fleet.db"
    with open_fleet_store(dbf) as store:
        seed_devices(store, 3)
    key = tmp_path / "keys" / "k.key"
    assert edgetune("fleet", "key", "create", "--out", str(key)).returncode == 0
    base = ("--db", str(dbf))
    r = edgetune("fleet", "model", "add", str(tmp_path / "missing.gguf"), *base)
    assert r.returncode == 2 and "no such file" in r.stderr
    r = edgetune("fleet", "model", "add", str(model_file(tmp_path, 16)), *base, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["version"] == 2, r.stderr
    listed = json.loads(edgetune("fleet", "model", "list", *base, "--json").stdout)
    assert [(m["version"], m["baseline"]) for m in listed] == [(1, True), (2, False)]
    cases = [  # (extra args, what the error says)
        (("1",), "not newer than the fleet's baseline v1"),
        (("9",), "no model v9"),
        (("2", "--where", "isa=armv9-a"), "no device matches"),
        (("2", "--where", "colour=red"), "FIELD=VALUE with FIELD one of"),
        (("2", "--devices", "dev-0,ghost"), "no device 'ghost'"),
        (("2", "--cohort", "lots"), "a percentage such as 5%"),
        (("2", "--phases", "50,20,100"), "rising percentages"),
        (("2", "--expires-in", "soon"), "a duration such as"),
        (("2", "--report-timeout", "0"), "--report-timeout 0s: must be > 0"),
        (("2", "--key", str(tmp_path / "nokey")), "create one with `edgetune fleet key create`"),
    ]
    for extra, message in cases:
        r = edgetune("fleet", "model", "publish", *extra, *base, *([] if "--key" in extra else ["--key", str(key)]))
        assert r.returncode == 2 and message in r.stderr, (extra, r.stderr)
    r = edgetune("fleet", "model", "publish", "2", "--key", str(key), "--devices", "dev-0,dev-2", *base, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["targets"] == 2 and out["first_phase"] == 1 and out["rollback_version"] == 1
    shown = json.loads(edgetune("fleet", "rollout", "show", out["rollout"], *base, "--json").stdout)
    assert sorted(t["device_id"] for t in shown["devices"]) == ["dev-0", "dev-2"]
    r = edgetune("fleet", "rollout", "resume", out["rollout"], *base)
    assert r.returncode == 2 and "only a paused rollout" in r.stderr
    r = edgetune("fleet", "rollout", "abort", out["rollout"], "--reason", "test", *base, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "aborted"
    listed = json.loads(edgetune("fleet", "rollout", "list", *base, "--json").stdout)
    assert [(x["state"], x["reason"]) for x in listed] == [("aborted", "test")]


def test_model_build_retrains_on_the_selected_devices_records_and_registers_the_model(tmp_path):
    pytest.importorskip("torch")
    import gzip

    from fleet.ingest import ingest

    dbf = tmp_path / "fleet.db"
    from kernels.registry import get_spec

    def of_this_kernel(line: str) -> str:
        """A device record as this edgetune's kernels would write it: the committed records predate the kernels'
        redesign, and training leaves out records of another kernel source or other knobs."""
        rec = json.loads(line)
        spec = get_spec(rec["kernel"])
        rec["source_hash"] = spec.source_hash()
        for i, m in enumerate(rec["measurements"]):
            m["config"] = spec.default | {"threads": 1 + i % 2}
        return json.dumps(rec)

    lines = [of_this_kernel(x) for x in gzip.open(REPO / "quantized_models/data/records.amd-epyc.jsonl.gz", "rt")]
    with open_fleet_store(dbf) as store:
        for device, isa, recs in (("dev-big", "x86-64-v4", lines[:4]), ("dev-small", "x86-64-v2", lines[4:10])):
            ingest(store, f"edgetune/v1/{device}/info", json.dumps({"hw": {"isa": isa, "cpu_model": "c"}}).encode())
            for line in recs:
                assert ingest(store, f"edgetune/v1/{device}/tuning/record", line.encode()).detail == "new"
    out = tmp_path / "built"
    r = edgetune("fleet", "model", "build", "--db", str(dbf), "--where", "isa=x86-64-v2", "--out", str(out),
                 "--no-base", "--steps", "3", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    built = json.loads(r.stdout)
    assert (built["version"], built["source"], built["records"], built["devices"]) == (2, "built", 6, 1)
    exported = [json.loads(x) for x in (out / "fleet-records.jsonl").read_text().splitlines()]
    assert {x["device_id"] for x in exported} == {"dev-small"} and len(exported) == 6
    card = json.loads((out / "edgetune-tuner.card.json").read_text())
    assert str(out / "fleet-records.jsonl") in card["dataset_files"] and card["training"]["steps"] == 3
    assert card["cases"]["focus"] == card["cases"]["train"] == 6 and card["training"]["focus_share"] == 0.25
    assert built["card"] == card  # `--json` carries the card (bench/fleet_loop.py reads it there)
    with open_fleet_store(dbf) as store:
        m = rs.model(store, 2)
        assert m["card"]["dataset_sha256"] == card["dataset_sha256"] and m["sha256"] == card["sha256"]
        assert rs.model_data(store, m["sha256"]) == Path(built["file"]).read_bytes()
        bundled = rs.model(store, 1)["spaces"]  # per kernel, the hash of its knob domains: the trained kernels'
        assert set(m["spaces"]) == {x["kernel"] for x in exported}
        assert all(bundled[k] == h for k, h in m["spaces"].items())
    r = edgetune("fleet", "model", "build", "--db", str(dbf), "--where", "isa=armv8-a")
    assert r.returncode == 2 and "no device matches" in r.stderr


def test_model_state_reports_are_stored_and_a_malformed_one_is_logged_and_skipped(tmp_path):
    from fleet.ingest import ingest

    with open_fleet_store(tmp_path / "fleet.db") as store:
        topic = "edgetune/v1/dev-1/model/state"
        good = {"state": "committed", "current": {"version": 2}, "previous": None, "rollout_id": "r1", "phase": "5%",
                "version": 2, "reason": None, "detail": "ok", "ts": 10.0}
        assert ingest(store, topic, json.dumps(good).encode(), True).kind == "model_state"
        assert rs.model_state(store, "dev-1")["current"] == {"version": 2}
        for bad in (b"{", json.dumps({**good, "state": "exploded"}).encode(), json.dumps([1]).encode()):
            assert ingest(store, topic, bad).kind == "malformed"
        assert [m["topic"] for m in store.malformed()] == [topic] * 3
        assert "exploded" in store.malformed()[1]["error"]
        assert ingest(store, topic, b"", True).detail == "cleared" and rs.model_state(store, "dev-1")["state"] == \
            "committed"


# ---- the model file over MQTT --------------------------------------------------------------------------------------

def test_the_chunk_server_sends_what_a_device_asks_for_and_refuses_what_it_cannot_serve(mosquitto, tmp_path):
    from fleet.chunk_server import ChunkServer
    from tests.test_daemon_support import Bus
    from tests.test_fleet import opts

    db = tmp_path / "fleet.db"
    with open_fleet_store(db) as store:
        sha = registry.add(store, model_file(tmp_path, 8))["sha256"]
    data, cs = BUNDLED + b"\0" * 8, 65536
    n = -(-len(data) // cs)
    server = ChunkServer(opts(mosquitto), db).start()
    bus = Bus(mosquitto, ("edgetune/v1/dev-c/model/chunk",))

    def ask(payload: dict | bytes) -> int:
        since = len(bus.msgs)
        bus.publish("edgetune/v1/dev-c/model/chunk/req", payload if isinstance(payload, bytes) else json.dumps(
            {"sha256": sha, "chunk_size": cs, "first": n - 2, "count": 2, "ts": time.time(), **payload}))
        return since

    def answers(since: int, k: int) -> list[dict]:
        bus.wait(lambda m: len(bus.msgs) >= since + k, 60, f"{k} chunk message(s)", since=since)
        return [m.doc for m in bus.msgs[since:since + k]]

    try:
        server.client.wait_ready(30)
        # the last two chunks, as asked: the last one shorter, each one message, nothing retained
        got = answers(ask({}), 2)
        assert [g["index"] for g in got] == [n - 2, n - 1] and all(g["error"] is None for g in got)
        assert [base64.b64decode(g["data"]) for g in got] == [data[(n - 2) * cs:(n - 1) * cs], data[(n - 1) * cs:]]
        assert not any(m.retain for m in bus.msgs)
        # what it cannot serve gets one answer with the reason; a malformed request none (it is only logged)
        assert "no model with sha256" in answers(ask({"sha256": "0" * 64}), 1)[0]["error"]
        assert f"the file has {n} of {cs} bytes" in answers(ask({"first": n - 1}), 1)[0]["error"]
        since = ask(b"{not json")
        ask({"count": 17})  # over the window a request may ask for
        ask({"chunk_size": 10})
        assert [g["index"] for g in answers(ask({"first": 0, "count": 1}), 1)] == [0]  # the next answer is this
        assert len(bus.msgs) == since + 1
    finally:
        bus.close()
        server.stop()


def test_a_released_device_that_never_reports_is_timed_out_and_trips_the_abort_rule(db, mosquitto,  # noqa: F811
                                                                                    tmp_path):
    from fleet.rollout_controller import RolloutController
    from tests.test_daemon_support import retained
    from tests.test_fleet import opts

    signer = load_private_key(create_key(tmp_path / "keys" / "k.key").private)
    with open_fleet_store(db) as store:
        seed_devices(store, 2)
        v1, v2 = registry.ensure_bundled(store), registry.add(store, model_file(tmp_path, 8))
        row, cohort = plan(v2, v1, signer, Policy((100.0,), 0.0, 100.0, 0.0, 1, report_timeout_s=1.0),
                           ["dev-0", "dev-1"], expires_at=time.time() + 600, selector={})
        rs.create_rollout(store, row, cohort, time.time(), "test")
    controller = RolloutController(opts(mosquitto), db, interval_s=0.1).start()
    try:
        with open_fleet_store(db) as store:
            # dev-0 reports at once (committed); dev-1, sent the release too, says nothing
            deadline = time.monotonic() + 60  # one budget for the three waits
            wait_until(lambda: all(t["sent_at"] for t in rs.targets(store, row["id"])), "the release to be sent", 60)
            rs.put_model_state(store, "dev-0", {}, {"state": "committed", "rollout_id": row["id"], "phase": "100%",
                                                     "version": 2, "reason": None, "detail": "", "ts": time.time()},
                               time.time())
            wait_until(lambda: rs.rollout(store, row["id"])["state"] == "aborted",
                       lambda: f"the rollout to abort (targets: {rs.targets(store, row['id'])})",
                       deadline - time.monotonic())
            r = rs.rollout(store, row["id"])
            silent = {t["device_id"]: t for t in rs.targets(store, row["id"])}["dev-1"]
            assert (silent["state"], silent["reason"]) == ("timed_out", "report_timeout")
            assert "no model/state within 1 s" in silent["detail"]
            assert "report_timeout x1" in r["reason"] and r["report_timeout_s"] == 1.0
            kinds = [e["kind"] for e in rs.events(store, row["id"])]
            assert kinds == ["published", "timed_out", "aborted"], kinds
            summary = rollout_summary(r, rs.targets(store, row["id"]))
            assert summary["totals"]["timed_out"] == 1 and summary["report_timeout_s"] == 1.0
            # the signed rollback goes to both (dev-1 may yet have received the release)
            wait_until(lambda: retained(mosquitto, "edgetune/v1/dev-1/model/release")["phase"] == "rollback",
                       "a rollback for the silent device", deadline - time.monotonic(), interval=0)
            # a late report still counts: the verdict was the fleet's, not the device's
            rs.put_model_state(store, "dev-1", {}, {"state": "failed", "rollout_id": row["id"], "phase": "100%",
                                                     "version": 2, "reason": "disk_full", "detail": "",
                                                     "ts": time.time()}, time.time())
            late = {t["device_id"]: t for t in rs.targets(store, row["id"])}["dev-1"]
            assert (late["state"], late["reason"]) == ("failed", "disk_full")
    finally:
        controller.stop()


def rollout_log(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fleet.rollouts"]


def test_the_rollout_controller_logs_a_fleet_db_outage_once_not_every_turn(mosquitto, caplog):
    """It logged an error on every turn (every second) while PostgreSQL was down."""
    from fleet.rollout_controller import RolloutController
    from tests.pg import PgCluster, missing_reason
    from tests.test_fleet import opts

    if missing_reason():
        pytest.skip(missing_reason())
    caplog.set_level(logging.INFO, logger="fleet.rollouts")
    cluster = PgCluster().init()
    try:
        url = cluster.create_db()
        controller = RolloutController(opts(mosquitto), url, interval_s=0.02).start()
        try:
            cluster.stop()
            wait_until(lambda: controller.db_down.failures >= 20, "20 turns failing with the DB down", 60)
            cluster.start()
            wait_until(lambda: controller.db_down.failures == 0, "a turn with the DB back", 60)
        finally:
            controller.stop()
    finally:
        cluster.destroy()
    lines = rollout_log(caplog)
    assert len(lines) == 2, lines  # the outage was far shorter than a reminder's minute
    db = url.split("@")[-1]
    assert lines[0].startswith("rollouts stopped: the fleet DB ") and db in lines[0], lines
    assert lines[1].startswith("rollouts resumed: the fleet DB ") and db in lines[1] and "works again" in lines[1]


def test_a_long_fleet_db_outage_is_logged_again_at_most_once_a_minute(caplog):
    from edgetune.sqlite import DBError
    from fleet.downlog import DownLog

    caplog.set_level(logging.INFO, logger="fleet.rollouts")
    now = [0.0]
    down = DownLog("the fleet DB x", "rollouts", logging.getLogger("fleet.rollouts"), clock=lambda: now[0])
    for second in range(150):  # a failed turn a second for 150 s
        now[0] = float(second)
        down.failed(DBError("cannot be reached", Path("x")))
    down.ok()
    down.ok()  # a second good turn says nothing
    lines = rollout_log(caplog)
    assert [line.split(":")[0] for line in lines] == ["rollouts stopped", "rollouts still stopped",
                                                      "rollouts still stopped", "rollouts resumed"], lines
    assert "failed for 60 s (61 turns)" in lines[1] and "failed for 120 s (121 turns)" in lines[2]
    assert "works again after 149 s (150 failed turns)" in lines[3]


def test_key_create_tells_where_the_public_key_goes_verbatim(tmp_path):
    """`[model_update]` is a TOML table, not rich markup: the instruction must print whole."""
    p = edgetune("fleet", "key", "create", "--out", str(tmp_path / "keys" / "fleet"))
    assert p.returncode == 0, p.stderr
    assert "[model_update] trusted_keys" in " ".join(p.stdout.split()), p.stdout
