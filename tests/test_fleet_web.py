"""`edgetune fleet serve`'s API, auth and config, against the real process with a real mosquitto; devices are
contract publishers (tests/test_fleet.Device), and a real subscriber sees what the server publishes. The browser
and a real daemon are in test_fleet_browser.py."""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from pathlib import Path

import pytest

from tests.broker import Mosquitto
from tests.fleet_server import FleetServer, form
from tests.test_daemon_support import Bus, env_for
from tests.test_fleet import ACTIVE, HW, Device, record

ONE = "/api/v1/devices/dev-1"


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleetweb")
    broker = Mosquitto(tmp / "broker").start()
    server = FleetServer(broker, env_for(tmp, tmp / "cache")).start()
    tokens = {"operator": server.token("operator", "op"), "viewer": server.token("viewer", "view")}
    now = time.time()
    for name, state, version, speedup in (("dev-1", "online", "0.1.0", 2.0), ("dev-2", "offline", "0.2.0", 5.0),
                                          ("dev-3", "lost", "0.2.0", 1.0)):
        dev = Device(broker, name)
        dev.pub("status", {"state": state, "session": 1, "version": version, "ts": now}, retain=True)
        dev.pub("info", {"hw": HW, "hw_fingerprint": "hwfp-1", "fw_fingerprint": "fwfp-1",
                         "model": {"version": "m1"}}, retain=True)
        active = json.loads(json.dumps(ACTIVE))
        active["kernels"]["gemm/pw1"].update(speedup=speedup, ort_ms=0.25)
        dev.pub("config/active", active, retain=True)
        dev.pub("tuning/record", record(1))
        dev.close()
    server.wait_json(f"/api/v1/devices", tokens["viewer"],
                     lambda d: len(d["devices"]) == 3 and all(x["tuned_workloads"] == 2 and x["records"] == 1
                                                              for x in d["devices"]))
    bus = Bus(broker, ("edgetune/v1/+/cmd/req",))
    yield server, tokens, bus
    bus.close()
    server.stop()
    broker.stop()


def barrier(server: FleetServer, bus: Bus, token: str, since: int) -> dict:
    """An operator retune of dev-1, and the first cmd/req the broker delivered after `since`: when a request
    before it was refused, that refusal published nothing if this is the first one seen."""
    r = server.post_json(f"{ONE}/retune", {"budget": 1}, token)
    assert r.status == 202, r.text
    cid = r.doc["commands"][0]["id"]
    first = bus.wait(lambda m: True, since=since, what="cmd/req")
    assert first.doc["id"] == cid, f"something else was published first: {first.doc}"
    return first.doc


def test_reads_need_a_token_and_a_wrong_one_is_refused(rig):
    server, tokens, _ = rig
    for path in ("/api/v1/overview", "/api/v1/devices", ONE, f"{ONE}/telemetry", "/api/v1/speedups"):
        r = server.get(path)
        assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer", (path, r.text)
        assert "token" in r.doc["error"]
        assert server.get(path, "et_not-a-real-token").status == 401
        assert server.get(path, tokens["viewer"]).status == 200
    r = server.get("/", None)
    assert r.status == 303 and r.headers["Location"] == "/login?next=%2F"
    me = server.get("/api/v1/me", tokens["viewer"]).doc
    assert (me["name"], me["role"], me["via"]) == ("view", "viewer", "bearer")


def test_overview_counts_and_device_list_filters_and_sorts(rig):
    server, tokens, _ = rig
    v = tokens["viewer"]
    o = server.get("/api/v1/overview", v).doc
    assert o["devices"] == 3
    assert o["statuses"] == {"online": 1, "stale": 0, "offline": 1, "lost": 1, "unknown": 0}
    assert o["breakdowns"]["version"] == [{"value": "0.2.0", "devices": 2}, {"value": "0.1.0", "devices": 1}]
    assert o["breakdowns"]["cpu_model"] == [{"value": "Test CPU 9000", "devices": 3}]

    ids = lambda q: [d["id"] for d in server.get(f"/api/v1/devices?{q}", v).doc["devices"]]  # noqa: E731
    assert ids("version=0.2.0") == ["dev-2", "dev-3"]
    assert ids("status=lost") == ["dev-3"]
    assert ids("sort=mean_speedup&order=desc") == ["dev-2", "dev-1", "dev-3"]
    assert ids("q=DEV-1") == ["dev-1"]
    assert ids("missing=version") == []
    d1 = server.get(f"/api/v1/devices?q=dev-1", v).doc["devices"][0]
    assert d1["mean_speedup"] == pytest.approx((2.0 * 1.5) ** 0.5) and d1["ort_ratio"] == pytest.approx(0.5 / 0.25)
    page = server.get("/api/v1/devices?sort=id&limit=2", v).doc
    assert [d["id"] for d in page["devices"]] == ["dev-1", "dev-2"] and page["total"] == 3 and page["offset"] == 0
    assert ids("sort=id&limit=2&offset=2") == ["dev-3"] and ids("limit=2&offset=3") == []
    assert ids("status=lost&limit=1") == ["dev-3"]  # the filter first, then the page
    html = server.get("/devices?sort=id&limit=2", v).text
    assert "1–2 of 3" in html and "offset=2" in html and 'id="prev"' not in html and ">dev-3<" not in html
    for bad, word in (("sort=bogus", "sort"), ("order=up", "order"), ("colour=red", "colour"),
                      ("missing=nope", "missing"), ("limit=0", "limit"), ("limit=abc", "limit"),
                      ("offset=-1", "offset"), ("limit=100000", "limit")):
        r = server.get(f"/api/v1/devices?{bad}", v)
        assert r.status == 400 and word in r.doc["error"], r.text

    d = server.get(ONE, v).doc
    assert [a["slot"] for a in d["active"]] == ["conv1d/ds1", "gemm/pw1"]
    assert d["descriptor"]["cpu_model"] == "Test CPU 9000" and d["status_history"][0]["state"] == "online"
    recs = server.get(f"{ONE}/records", v).doc
    assert len(recs) == 1 and len(recs[0]["measurements"]) == 3
    assert server.get("/api/v1/devices/nope", v).status == 404
    sp = {r["slot"]: r for r in server.get("/api/v1/speedups", v).doc}
    assert sp["gemm/pw1"]["devices"] == 3 and sp["gemm/pw1"]["median"] == 2.0
    assert sp["gemm/pw1"]["outliers"] == ["dev-2"]  # 5x is over twice the median


def test_viewer_gets_403_on_retune_and_nothing_is_published(rig):
    server, tokens, bus = rig
    since = len(bus.msgs)
    r = server.post_json(f"{ONE}/retune", {"budget": 1}, tokens["viewer"])
    assert r.status == 403 and "operator" in r.doc["error"]
    r = server.post_json("/api/v1/retune", {"devices": ["dev-1"]}, tokens["viewer"])
    assert r.status == 403
    assert server.post_json(f"{ONE}/retune", {}, None).status == 401
    barrier(server, bus, tokens["operator"], since)


def test_operator_retune_publishes_cmd_req_and_the_log_shows_it(rig):
    server, tokens, bus = rig
    since = len(bus.msgs)
    r = server.post_json("/api/v1/retune", {"devices": ["dev-1", "dev-2"], "budget": 5, "force": True,
                                            "workloads": ["pw1"], "strategy": "random", "ttl_s": 60},
                         tokens["operator"])
    assert r.status == 202, r.text
    sent = {c["device"]: c for c in r.doc["commands"]}
    assert set(sent) == {"dev-1", "dev-2"}
    for _ in range(2):
        m = bus.wait(lambda m: True, since=since, what="cmd/req")
        since = bus.msgs.index(m) + 1
        device = m.topic.split("/")[2]
        assert m.doc["id"] == sent[device]["id"] and m.doc["op"] == "retune"
        assert m.doc["args"] == {"budget": 5, "force": True, "workloads": ["pw1"], "strategy": "random"}
        assert 50 < m.doc["expires_at"] - time.time() <= 60
    log = server.wait_json(f"{ONE}/commands", tokens["viewer"], lambda cs: any(c["id"] == sent["dev-1"]["id"]
                                                                              for c in cs))
    assert log[0]["op"] == "retune" and log[0]["open"]
    one = server.get(f"{ONE}/commands/{sent['dev-1']['id']}", tokens["viewer"]).doc
    assert one["args"]["budget"] == 5 and one["responses"] == []


@pytest.mark.parametrize("body,ctype,word", [
    (b"{not json", "application/json", "not valid JSON"),
    (b"\xff\xfe", "application/json", "not valid JSON"),
    (b"[1, 2]", "application/json", "JSON object"),
    (b'{"budget": "lots"}', "application/json", "budget"),
    (b'{"budget": 0}', "application/json", "budget"),
    (b'{"force": "yes"}', "application/json", "force"),
    (b'{"kernels": "gemm"}', "application/json", "kernels"),
    (b'{"colour": 1}', "application/json", "colour"),
    (b'{"ttl_s": -1}', "application/json", "ttl_s"),
    (b'{"budget": 1}', "text/plain", "Content-Type"),
])
def test_bad_bodies_get_400_naming_the_problem_and_send_nothing(rig, body, ctype, word):
    server, tokens, bus = rig
    since = len(bus.msgs)
    r = server.request("POST", f"{ONE}/retune", body, token=tokens["operator"], headers={"Content-Type": ctype})
    assert r.status == 400 and word in r.doc["error"], r.text
    barrier(server, bus, tokens["operator"], since)


def test_bulk_retune_refuses_unknown_devices_and_bad_ids(rig):
    server, tokens, bus = rig
    since = len(bus.msgs)
    op = tokens["operator"]
    r = server.post_json("/api/v1/retune", {"devices": ["dev-1", "ghost"]}, op)
    assert r.status == 404 and "ghost" in r.doc["error"] and "nothing was sent" in r.doc["error"]
    assert server.post_json("/api/v1/retune", {"devices": []}, op).status == 400
    r = server.post_json("/api/v1/retune", {"devices": ["a/b"]}, op)
    assert r.status == 400 and "a/b" in r.doc["error"]
    barrier(server, bus, op, since)


def _login(server: FleetServer, token: str) -> tuple[str, str]:
    """The browser's login, by hand: the login page's session and CSRF token, then the form. Returns the
    session cookie and the CSRF token of the logged-in session (from its page's meta tag)."""
    r = server.get("/login")
    cookie = r.headers["Set-Cookie"].split(";")[0]
    csrf = r.text.split('name="csrf-token" content="')[1].split('"')[0]
    r = server.request("POST", "/login", form({"csrf": csrf, "token": token, "next": "/devices"}),
                       headers={"Content-Type": "application/x-www-form-urlencoded", "Cookie": cookie})
    assert r.status == 303 and r.headers["Location"] == "/devices", r.text
    attrs = [a.strip().lower() for a in r.headers["Set-Cookie"].split(";")]
    assert "httponly" in attrs and "samesite=strict" in attrs and "path=/" in attrs
    session = r.headers["Set-Cookie"].split(";")[0]
    page = server.request("GET", "/devices", headers={"Cookie": session})
    assert page.status == 200
    return session, page.text.split('name="csrf-token" content="')[1].split('"')[0]


def test_forms_need_the_sessions_csrf_token(rig):
    server, tokens, bus = rig
    since = len(bus.msgs)
    session, csrf = _login(server, tokens["operator"])
    post = lambda path, fields, **h: server.request(  # noqa: E731
        "POST", path, form(fields), headers={"Content-Type": "application/x-www-form-urlencoded",
                                             "Cookie": session, **h})
    r = post("/devices/dev-1/retune", {"budget": "1"})
    assert r.status == 403 and "CSRF" in r.text
    assert post("/devices/dev-1/retune", {"budget": "1", "csrf": "forged"}).status == 403
    assert post("/devices/retune", {"device": ["dev-1"]}).status == 403
    # a cookie-authenticated JSON call needs it too (as a header)
    r = server.request("POST", f"{ONE}/retune", "{}", headers={"Content-Type": "application/json", "Cookie": session})
    assert r.status == 403 and "CSRF" in r.doc["error"]
    barrier(server, bus, tokens["operator"], since)

    since = len(bus.msgs)
    r = post("/devices/retune", {"device": ["dev-1", "dev-2"], "budget": "2", "csrf": csrf})
    assert r.status == 303 and r.headers["Location"] == "/devices?sent=2"
    first = bus.wait(lambda m: True, since=since)
    second = bus.wait(lambda m: m is not first, since=since)
    assert {first.topic, second.topic} == {"edgetune/v1/dev-1/cmd/req", "edgetune/v1/dev-2/cmd/req"}
    assert first.doc["args"] == {"budget": 2, "force": False} or first.doc["args"] == {"budget": 2}
    # the login form itself is protected, and a forged or viewer session cannot act
    assert server.request("POST", "/login", form({"token": tokens["operator"]}),
                          headers={"Content-Type": "application/x-www-form-urlencoded"}).status == 403
    forged = session[:-3] + ("AAA" if not session.endswith("AAA") else "BBB")
    assert server.request("GET", "/devices", headers={"Cookie": forged}).status == 303
    r = post("/logout", {"csrf": csrf})
    assert r.status == 303 and r.headers["Location"] == "/login"
    assert server.request("GET", "/devices", headers={"Cookie": r.headers["Set-Cookie"].split(";")[0]}).status == 303
    vsession, vcsrf = _login(server, tokens["viewer"])
    r = server.request("POST", "/devices/dev-1/retune", form({"csrf": vcsrf}),
                       headers={"Content-Type": "application/x-www-form-urlencoded", "Cookie": vsession})
    assert r.status == 403 and "operator" in r.text


def test_openapi_schema_lists_every_api_route():
    from starlette.routing import Route

    from fleet.web import api, pages

    doc_paths = api.schema()["paths"]
    seen = 0
    for route in [*pages.routes(), *api.routes()]:
        assert isinstance(route, Route)
        if route.path.startswith(api.PREFIX):
            for method in route.methods - {"HEAD"}:
                assert method.lower() in doc_paths.get(route.path, {}), f"{method} {route.path} not in the schema"
                seen += 1
    assert seen == sum(len(ops) for ops in doc_paths.values()) >= 12


def test_openapi_is_served(rig):
    server, _, _ = rig
    doc = server.get("/api/v1/openapi.json").doc
    assert doc["openapi"].startswith("3.") and f"{ONE.replace('dev-1', '{device}')}/retune" in doc["paths"]
    assert doc["paths"]["/api/v1/devices/{device}/retune"]["post"]["responses"]["403"]


def test_token_cli_create_list_revoke(rig):
    server, tokens, _ = rig
    secret = server.token("viewer", "short-lived")
    assert server.get("/api/v1/overview", secret).status == 200
    r = server.cli("fleet", "token", "list", "--json")
    listed = {t["name"]: t for t in json.loads(r.stdout)}
    assert {"op", "view", "short-lived"} <= set(listed) and secret not in r.stdout
    assert listed["short-lived"]["role"] == "viewer" and listed["short-lived"]["last_used_at"] is not None
    auth_db = Path(server.env["STATE_DIRECTORY"]) / "fleet-auth.db"
    assert stat.S_IMODE(auth_db.stat().st_mode) == 0o600
    assert secret.encode() not in auth_db.read_bytes()
    r = server.cli("fleet", "token", "revoke", "short-lived", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["revoked_at"] is not None
    assert server.get("/api/v1/overview", secret).status == 401
    r = server.cli("fleet", "token", "revoke", "nobody")
    assert r.returncode == 2 and "nobody" in r.stderr
    r = server.cli("fleet", "token", "create", "--role", "admin")
    assert r.returncode == 2 and "admin" in r.stderr
    r = server.cli("fleet", "token", "create", "--role", "viewer", "--name", "op")
    assert r.returncode == 2 and "exists" in r.stderr


def test_bad_fleet_config_is_refused_with_every_problem(tmp_path):
    cfg = tmp_path / "fleet.toml"
    cfg.write_text('[fleet]\nport = "eighty"\nstale_minutes = -1\nauth_database = "postgresql://db/a"\ncolour = 1\n')
    env = os.environ | {"STATE_DIRECTORY": str(tmp_path / "state")}
    s = FleetServer(Mosquitto(tmp_path / "unused"), env, config=cfg)
    r = s.cli("fleet", "serve", "--broker", "127.0.0.1:1", "--config", str(cfg))
    assert r.returncode == 2
    for key, word in (("fleet.port", "integer"), ("fleet.stale_minutes", "> 0"), ("fleet.auth_database", "SQLite"),
                      ("fleet.colour", "unknown key")):
        assert f"{key}: " in r.stderr and word in r.stderr, r.stderr
    assert s.cli("fleet", "serve", "--broker", "127.0.0.1:1", "--config", str(tmp_path / "none.toml")).returncode == 2


def test_config_file_sets_where_the_server_keeps_its_data(tmp_path, mosquitto):
    db, auth = tmp_path / "data" / "f.db", tmp_path / "data" / "a.db"
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(f'[fleet]\ndatabase = "sqlite://{db}"\nauth_database = "{auth}"\nstale_minutes = 0.01\n'
                   'anonymous_read = true\n')
    env = os.environ | {"STATE_DIRECTORY": str(tmp_path / "state")}
    server = FleetServer(mosquitto, env, config=cfg).start()
    try:
        token = server.token("viewer")
        dev = Device(mosquitto, f"cfg-{uuid.uuid4().hex[:6]}")
        dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time() - 60})
        dev.close()
        o = server.wait_json("/api/v1/overview", token, lambda o: o["devices"] == 1)
        assert o["statuses"]["stale"] == 1 and o["stale_minutes"] == pytest.approx(0.01)  # heard 60 s ago
        assert db.exists() and auth.exists() and not (tmp_path / "state" / "fleet.db").exists()
        # anonymous_read: reading needs no token, acting still does
        assert server.get("/api/v1/overview").doc["devices"] == 1 and server.get("/devices").status == 200
        r = server.post_json(f"/api/v1/devices/{dev.device}/retune", {})
        assert r.status == 403 and "operator" in r.doc["error"]
    finally:
        server.stop()
