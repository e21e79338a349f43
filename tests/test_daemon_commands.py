"""Remote commands end to end: one daemon process and one real broker for the module, the fleet side played by a
plain MQTT client. Covers the retune round trip, dedupe, expiry, rejections, coalescing, local control and a
hypothesis fuzz of malformed cmd/req payloads."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from edgetune.protocol import OPEN_STATES
from tests.broker import Mosquitto
from tests.test_daemon_support import Bus, DaemonProc, daemon_config, env_for

DEV = "edgetune/v1/dev-test"
REQ = f"{DEV}/cmd/req"


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cmds")
    broker = Mosquitto(tmp / "broker").start()
    d = DaemonProc(daemon_config(tmp, broker), env=env_for(tmp, tmp_path_factory.getbasetemp() / "cache")).start()
    bus = Bus(broker)
    bus.on("/config/active", lambda a: "gemm/kws_dscnn.fc" in a["kernels"], 120)  # the start-up tune is done
    yield d, bus
    d.stop()
    bus.close()
    broker.stop()


def send(bus: Bus, doc: dict | bytes) -> None:
    bus.publish(REQ, doc if isinstance(doc, bytes) else json.dumps(doc))


def sessions(d: DaemonProc) -> int:
    with sqlite3.connect(d.state_dir / "results.db") as db:
        return db.execute("SELECT count(*) FROM sessions").fetchone()[0]


def statuses(bus: Bus, cid: str) -> list[dict]:
    return bus.docs(f"/cmd/res/{cid}")


def barrier(bus: Bus, name: str) -> None:
    """Commands are handled in arrival order: once this ping is answered, everything sent before it was too."""
    send(bus, {"id": name, "op": "ping"})
    bus.on(f"/cmd/res/{name}", lambda c: c["status"] == "succeeded")


def test_retune_round_trip_with_progress(rig):
    d, bus = rig
    send(bus, {"id": "rt-1", "op": "retune", "args": {"force": True, "budget": 6, "workloads": ["kws_dscnn.fc"]}})
    done = bus.on("/cmd/res/rt-1", lambda c: c["status"] in ("succeeded", "failed"), 60)
    assert done["status"] == "succeeded", done
    seen = statuses(bus, "rt-1")
    order = [s["status"] for s in seen]
    # an open status is replaceable (docs/protocol.md): a progress tick may supersede an `accepted` not yet sent
    assert order[-1] == "succeeded" and "in_progress" in order and order.count("succeeded") == 1
    assert order[:-1] == sorted(order[:-1], key=OPEN_STATES.index), order
    prog = [s["progress"] for s in seen if s["status"] == "in_progress"]
    assert prog == sorted(prog) and all(0 <= p <= 1 for p in prog)
    assert all(s["origin"] == "fleet" and s["op"] == "retune" for s in seen)
    tuned = done["result"]["tuned"]
    assert [t["target"] for t in tuned] == ["gemm/kws_dscnn.fc"] and tuned[0]["evals"] == 6 and not tuned[0]["cached"]
    assert done["progress"] == 1.0


def test_duplicate_ids_resend_recorded_state_and_never_run_twice(rig):
    d, bus = rig
    send(bus, {"id": "dup-rt", "op": "retune", "args": {"force": True, "budget": 2}})
    first = bus.on("/cmd/res/dup-rt", lambda c: c["status"] == "succeeded", 60)
    n_sessions, n_msgs = sessions(d), len(statuses(bus, "dup-rt"))

    send(bus, {"id": "dup-rt", "op": "retune", "args": {"force": True, "budget": 2}})
    send(bus, {"id": "dup-rt", "op": "ping"})  # same id, other content: still the recorded state
    barrier(bus, "dup-barrier")
    again = statuses(bus, "dup-rt")[n_msgs:]
    assert again == [first, first]
    assert sessions(d) == n_sessions


def test_duplicate_while_running_reports_current_state(rig):
    d, bus = rig
    send(bus, {"id": "dup-run", "op": "retune", "args": {"force": True, "budget": 8}})
    bus.on("/cmd/res/dup-run", lambda c: c["status"] == "in_progress", 60)
    send(bus, {"id": "dup-run", "op": "retune", "args": {"force": True, "budget": 8}})
    bus.on("/cmd/res/dup-run", lambda c: c["status"] == "succeeded", 60)
    barrier(bus, "dup-run-barrier")
    order = [s["status"] for s in statuses(bus, "dup-run")]
    assert order.count("accepted") <= 1 and order.count("succeeded") == 1  # started once (accepted may be superseded)


def test_expired_unknown_and_invalid_are_rejected_with_reasons(rig):
    d, bus = rig
    cases = {
        "exp-epoch": ({"id": "exp-epoch", "op": "ping", "expires_at": time.time() - 5}, "expired"),
        "exp-iso": ({"id": "exp-iso", "op": "ping", "expires_at": "2001-01-01T00:00:00Z"}, "expired"),
        "bad-op": ({"id": "bad-op", "op": "reboot"}, "unknown op"),
        "bad-args": ({"id": "bad-args", "op": "retune", "args": {"budget": "lots"}}, "bad args"),
        "bad-kernel": ({"id": "bad-kernel", "op": "retune", "args": {"kernels": ["nope"]}}, "unknown kernel"),
        "bad-extra": ({"id": "bad-extra", "op": "ping", "args": {"x": 1}}, "bad args"),
        "bad-path": ({"id": "bad-path", "op": "retune", "args": {"workloads": ["../../etc/passwd"]}},
                     "unknown workload '../../etc/passwd'"),
    }
    for doc, _ in cases.values():
        send(bus, doc)
    for cid, (doc, why) in cases.items():
        res = bus.on(f"/cmd/res/{cid}")
        assert res["status"] == "rejected" and why in res["reason"], res
        assert res["op"] == (doc["op"] if cid != "bad-op" else None), res  # the record says what was refused
    send(bus, {"id": "fresh", "op": "ping", "expires_at": time.time() + 600})
    assert bus.on("/cmd/res/fresh", lambda c: c["status"] != "accepted")["status"] == "succeeded"

    for payload, why in ((b"\xff\xfe not json", "not JSON"), (b"[1, 2]", "not a JSON object"),
                         (json.dumps({"id": "x" * 20000, "op": "ping"}).encode(), "oversized"),
                         (b'{"op": "ping"}', "id"), (b'{"id": "a/b#", "op": "ping"}', "id"),
                         (b'{"id": "invalid", "op": "ping"}', "reserved")):
        sha = hashlib.sha256(payload).hexdigest()
        send(bus, payload)
        res = bus.on("/cmd/res/invalid", lambda c, sha=sha: c["request_sha256"] == sha)
        assert res["status"] == "rejected" and why in res["reason"] and res["id"] is None
    assert "rejected cmd/req" in d.log


def test_retunes_arriving_while_one_runs_are_coalesced(rig):
    d, bus = rig
    before = sessions(d)
    send(bus, {"id": "co-1", "op": "retune", "args": {"force": True, "budget": 6}})
    bus.on("/cmd/res/co-1", lambda c: c["status"] == "in_progress", 60)
    for cid in ("co-2", "co-3", "co-4"):
        send(bus, {"id": cid, "op": "retune", "args": {"force": True, "budget": 2}})
    for cid in ("co-1", "co-2", "co-3", "co-4"):
        assert bus.on(f"/cmd/res/{cid}", lambda c: c["status"] in ("succeeded", "failed"), 60)["status"] == "succeeded"
    assert sessions(d) - before == 2  # the running one, then one run for the three that queued behind it
    runs = {bus.docs(f"/cmd/res/{c}")[-1]["result"]["tuned"][0]["session_id"] for c in ("co-2", "co-3", "co-4")}
    assert len(runs) == 1


def test_queued_requests_keep_their_own_budget_and_strategy(rig):
    """A local `retune --budget 3` merged with a fleet retune of budget 7 ran both at 7 evals (and without the
    fleet command's time cap): a merge took the later request's settings for both."""
    d, bus = rig
    fc = {"force": True, "strategy": "random", "workloads": ["kws_dscnn.fc"]}
    send(bus, {"id": "own-a", "op": "retune", "args": fc | {"budget": 7}})
    bus.on("/cmd/res/own-a", lambda c: c["status"] == "in_progress", 60)
    local = d.request({"op": "retune", **fc, "budget": 3})["id"]  # both queue behind own-a
    send(bus, {"id": "own-c", "op": "retune", "args": fc | {"budget": 7}})
    evals = {}
    for cid in (local, "own-c"):
        res = bus.on(f"/cmd/res/{cid}", lambda c: c["status"] in ("succeeded", "failed"), 60)
        assert res["status"] == "succeeded", res
        evals[cid] = res["result"]["tuned"][0]["evals"]
    assert evals == {local: 3, "own-c": 7}


def test_huge_numbers_and_long_names_are_rejected_naming_the_field(rig):
    """A 400-digit expires_at or shape dimension was `internal error: OverflowError` on cmd/res/invalid, the id
    lost; a 16 KB kernel name was echoed back whole in the reason."""
    d, bus = rig
    huge = "9" * 400
    send(bus, f'{{"id": "ov1", "op": "ping", "expires_at": {huge}}}'.encode())
    res = bus.on("/cmd/res/ov1")
    assert res["status"] == "rejected" and "bad expires_at" in res["reason"], res
    send(bus, {"id": "ov2", "op": "retune", "args": {"workloads": [f"gemm/custom.M1-N1-K{huge}"]}})
    res = bus.on("/cmd/res/ov2")
    assert res["status"] == "rejected" and "shape dimension is far too large" in res["reason"], res
    send(bus, {"id": "ov3", "op": "retune", "args": {"kernels": ["k" * 12000]}})
    res = bus.on("/cmd/res/ov3")
    assert res["status"] == "rejected" and "unknown kernel" in res["reason"] and len(res["reason"]) <= 300, res
    r = d.cli("retune", "--workload", f"gemm/custom.M1-N1-K{huge}", "--json")  # the control socket alike
    assert r.returncode == 2 and "shape dimension is far too large" in r.stderr, (r.stdout, r.stderr)
    assert not bus.docs("/cmd/res/invalid") or all("internal error" not in c["reason"]
                                                   for c in bus.docs("/cmd/res/invalid"))


def test_probe_report_ping_ops(rig):
    d, bus = rig
    for op in ("probe", "report", "ping"):
        send(bus, {"id": f"op-{op}", "op": op})
    probe = bus.on("/cmd/res/op-probe", lambda c: c["status"] == "succeeded", 30)["result"]
    assert probe["hw_fingerprint"] and probe["fw_changed"] is False
    report = bus.on("/cmd/res/op-report", lambda c: c["status"] == "succeeded", 30)["result"]
    assert "gemm/kws_dscnn.fc" in report["config_active"]["kernels"]
    assert bus.on("/cmd/res/op-ping", lambda c: c["status"] == "succeeded")["result"]["pong"] is True


def test_local_retune_wait_and_bad_input(rig):
    d, bus = rig
    r = d.cli("retune", "--kernel", "gemm", "--force", "--budget", "2", "--wait", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["status"] == "succeeded" and res["origin"] == "local"
    bus.on(f"/cmd/res/{res['id']}", lambda c: c["status"] == "succeeded")  # reported to the fleet as well
    r = d.cli("retune", "--kernel", "nope")
    assert r.returncode == 2 and "unknown kernel" in r.stderr
    r = d.cli("retune", "--kernel", "gemm", "--budget", "0")  # checked like any budget, not dropped as falsy
    assert r.returncode == 2 and "budget 0 must be an integer 1-100000" in r.stderr, r.stderr
    st = json.loads(d.cli("status", "--json").stdout)
    assert st["queue"] == {"jobs": 0, "targets": 0} and st["state"] == "idle"


ids = st.one_of(st.none(), st.integers(), st.text(max_size=20), st.text(alphabet="ab1-/+#", max_size=6),
                st.just("x" * 200), st.lists(st.integers(), max_size=2))
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                         max_size=3), max_leaves=8)
requests = st.fixed_dictionaries({}, optional={
    "id": ids,
    "op": st.sampled_from(["retune", "probe", "report", "ping", "reboot", "", "RETUNE"]) | json_values,
    "args": st.one_of(json_values, st.fixed_dictionaries({}, optional={
        "kernels": st.lists(st.sampled_from(["gemm", "nope", ""]), max_size=2) | json_values,
        "strategy": st.sampled_from(["anneal", "random", "bogus"]) | json_values,
        "budget": st.integers(-5, 100_001) | json_values,
        "force": json_values, "bogus": json_values})),
    "expires_at": st.one_of(st.none(), st.floats(), st.integers(), st.text(max_size=25)),
})
payloads = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=100).map(str.encode),
    json_values.map(lambda v: json.dumps(v).encode()),
    requests.map(lambda r: json.dumps(r).encode()),
    st.integers(16 * 1024 - 40, 18 * 1024).map(lambda n: b'{"id":"big","op":"ping","pad":"' + b"x" * n + b'"}'),
)


def test_fuzz_malformed_requests_each_get_an_answer(rig):
    d, bus = rig
    count = {"n": 0}

    # no shrinking: each shrink step of a missed answer would wait out the timeout
    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.explicit, Phase.generate))
    @given(payloads)
    @example(b'{"id": "ex-op", "op": ["retune"]}')  # unhashable where a name is expected
    @example(b'{"id": "ex-strategy", "op": "retune", "args": {"strategy": {"a": 1}}}')
    @example(b'{"id": "ex-expiry", "op": "ping", "expires_at": "0001-01-01T00:30:00+01:00"}')
    def one(payload: bytes) -> None:
        count["n"] += 1
        mark = len(bus.msgs)
        sha = hashlib.sha256(payload).hexdigest()
        try:
            doc = json.loads(payload)
            cid = doc.get("id") if isinstance(doc, dict) and isinstance(doc.get("id"), str) else None
        except ValueError:
            cid = None
        bus.publish(REQ, payload)

        def answered(m) -> bool:
            if m.topic == f"{DEV}/cmd/res/invalid":
                return json.loads(m.payload).get("request_sha256") == sha
            return cid is not None and m.topic == f"{DEV}/cmd/res/{cid}"

        try:
            bus.wait(answered, 15, what=f"an answer to {payload[:80]!r}", since=mark)
        except AssertionError as e:
            raise AssertionError(f"{e}\ndaemon log:\n{d.log[-3000:]}") from None

    one()
    assert count["n"] >= 200
    assert d.proc.poll() is None
    barrier(bus, "after-fuzz")
