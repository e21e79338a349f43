"""`edgetune fleet serve`'s API, auth and config, against the real process with a real mosquitto; devices are
contract publishers (tests/test_fleet.Device), and a real subscriber sees what the server publishes. The browser
and a real daemon are in test_fleet_browser.py."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from tests.broker import Mosquitto, free_port
from tests.fleet_server import REPO, FleetServer, form
from tests.polling import wait_until
from tests.test_daemon_support import Bus, env_for
from tests.test_fleet import ACTIVE, HW, Device, record

ONE = "/api/v1/devices/dev-1"
FORM_TYPE = "application/x-www-form-urlencoded"


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
    server.wait_json("/api/v1/devices", tokens["viewer"],
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
    (b'{"ttl_s": 604800}', "application/json", "ttl_s: must be 1-86400 seconds"),  # longer than a device session
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
    body = doc["paths"]["/api/v1/devices/{device}/retune"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["properties"]["ttl_s"]["maximum"] == 86400  # fleet.commands.MAX_TTL_S


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


# ---- audit fixes: robustness of pages, API errors, rollouts, releases and the serve verb -------------------------

def _publish_from(broker, topic_payloads: list[tuple[str, dict | bytes]]) -> None:
    """Publish on other devices' topics from one client, in order: the receiver gets them in this order, so the last
    one having arrived means the others were handled."""
    client = Device(broker, f"pub-{uuid.uuid4().hex[:6]}")
    for topic, payload in topic_payloads:
        info = client.c.publish(topic, payload if isinstance(payload, bytes) else json.dumps(payload), qos=1)
        info.wait_for_publish(15)
    client.close()


def _online(device: str) -> tuple[str, dict]:
    return f"edgetune/v1/{device}/status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()}


def _device_known(server: FleetServer, token: str, device: str) -> dict:
    return server.wait_json(f"/api/v1/devices/{device}", token, lambda d: True)


def test_a_model_state_without_current_still_renders_the_device_page(rig):
    server, tokens, _ = rig
    name = f"ms-{uuid.uuid4().hex[:6]}"
    # docs/protocol.md: only `state` is required; `current` may be null or absent
    _publish_from(server.broker, [(f"edgetune/v1/{name}/model/state", {"state": "committed", "rollout_id": 7}),
                                  _online(name)])
    server.wait_json(f"/api/v1/devices/{name}", tokens["viewer"], lambda d: d["model_state"] is not None)
    d = server.get(f"/api/v1/devices/{name}", tokens["viewer"]).doc
    assert d["model_state"]["current"] is None and d["model_state"]["rollout_id"] == "7"
    r = server.get(f"/devices/{name}", tokens["viewer"])
    assert r.status == 200, r.text
    assert "tuner model: ?" in r.text


def test_absurd_speedups_are_stored_as_unknown_and_the_speedups_page_renders(rig):
    server, tokens, _ = rig
    name = f"huge-{uuid.uuid4().hex[:6]}"
    active = {"kernels": {"gemm/pw1": {"config": {}, "ms": 0.5, "default_ms": 1.0, "speedup": 1e308},
                          "conv1d/ds1": {"config": {}, "ms": 1e-300, "default_ms": 1.0}}}
    _publish_from(server.broker, [(f"edgetune/v1/{name}/config/active", active), _online(name)])
    d = server.wait_json(f"/api/v1/devices/{name}", tokens["viewer"], lambda d: len(d["active"]) == 2)
    assert [a["speedup"] for a in d["active"]] == [None, None]
    r = server.get("/speedups", tokens["viewer"])
    assert r.status == 200, r.text
    assert name not in json.dumps(server.get("/api/v1/speedups", tokens["viewer"]).doc)


def test_speedups_stored_before_the_check_stay_off_the_plot_scale(tmp_path):
    from fleet.store import FleetStore
    from fleet.web import views

    with FleetStore(tmp_path / "f.db") as store:
        for device, speedup in (("old", 1e308), ("inf", float("inf")), ("ok", 2.0)):
            store.put_active(device, {}, {}, [{"slot": "gemm/pw1", "kernel": "gemm", "workload": "pw1", "config": {},
                                               "ms": 1.0, "default_ms": 1.0, "speedup": speedup, "evals": None,
                                               "tuning_s": None, "strategy": None, "tuned_at": None, "entry": {}}],
                             time.time(), None)
        rows = views.speedups(store)
    assert [p["device_id"] for p in rows[0]["points"]] == ["ok"]
    assert views.strip_scale(rows)["hi"] == 1


def test_a_second_server_on_a_port_in_use_fails_before_touching_the_broker(rig):
    server, tokens, _ = rig
    broker_log = server.broker.workdir / "mosquitto.log"
    takeovers = broker_log.read_text().count("already connected")
    r = server.cli("fleet", "serve", "--broker", f"{server.broker.host}:{server.broker.port}",
                   "--port", str(server.port))
    assert r.returncode == 2, r.stderr
    assert f"error: port {server.port} is in use" in r.stderr and "--port" in r.stderr
    assert "Traceback" not in r.stderr
    assert broker_log.read_text().count("already connected") == takeovers  # the receiver was never started
    assert server.get("/healthz").doc["listener"]["connected"]


@pytest.mark.parametrize("digits", ["%C2%B2", "%D9%A1", "%2B5", "1_0"])
def test_telemetry_limit_takes_ascii_digits_only(rig, digits):
    server, tokens, _ = rig
    r = server.get(f"{ONE}/telemetry?limit={digits}", tokens["viewer"])
    assert r.status == 400 and "limit" in r.doc["error"], r.text
    r = server.get(f"/api/v1/devices?limit={digits}", tokens["viewer"])
    assert r.status == 400 and "limit" in r.doc["error"], r.text


def test_retune_form_with_a_unicode_budget_is_a_400_and_sends_nothing(rig):
    server, tokens, bus = rig
    since = len(bus.msgs)
    session, csrf = _login(server, tokens["operator"])
    r = server.request("POST", "/devices/dev-1/retune", form({"budget": "²", "csrf": csrf}),
                       headers={"Content-Type": "application/x-www-form-urlencoded", "Cookie": session})
    assert r.status == 400 and "budget" in r.text, r.text
    barrier(server, bus, tokens["operator"], since)


def test_unicode_digits_in_cli_arguments_are_refused_cleanly(rig):
    server, _, _ = rig
    r = server.cli("fleet", "token", "revoke", "²")
    assert r.returncode == 2 and "no token" in r.stderr and "Traceback" not in r.stderr
    r = server.cli("fleet", "retune", "dev-1", "--broker", "127.0.0.1:²")
    assert r.returncode == 2 and "port" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("verb", [("fleet", "serve", "--broker", "127.0.0.1:1"), ("fleet", "token", "list", "--json")])
def test_an_unusable_state_dir_is_a_clean_error_naming_it(tmp_path, verb):
    env = os.environ | {"STATE_DIRECTORY": "/proc/nope"}
    r = FleetServer(Mosquitto(tmp_path / "unused"), env).cli(*verb)
    assert r.returncode in (1, 2), r.stderr
    assert r.stderr.startswith("error: ") and "/proc/nope" in r.stderr and "STATE_DIRECTORY" in r.stderr
    assert "Traceback" not in r.stderr


def test_unmatched_api_paths_answer_json_like_other_api_errors(rig):
    server, tokens, _ = rig
    r = server.get("/api/v1/nope", tokens["viewer"])
    assert r.status == 404 and r.headers["Content-Type"] == "application/json" and "/api/v1/nope" in r.doc["error"]
    r = server.request("DELETE", "/api/v1/overview", token=tokens["viewer"])
    assert r.status == 405 and "GET" in r.doc["error"] and "GET" in r.headers["Allow"]
    r = server.get("/nope", tokens["viewer"])
    assert r.status == 404 and r.headers["Content-Type"].startswith("text/plain")


def test_a_rejected_status_creates_no_device(rig):
    server, tokens, _ = rig
    bad, good = f"bad-{uuid.uuid4().hex[:6]}", f"good-{uuid.uuid4().hex[:6]}"
    _publish_from(server.broker, [(f"edgetune/v1/{bad}/status", {"state": "exploded", "ts": time.time()}),
                                  _online(good)])
    _device_known(server, tokens["viewer"], good)
    assert server.get(f"/api/v1/devices/{bad}", tokens["viewer"]).status == 404
    assert server.get("/api/v1/overview", tokens["viewer"]).doc["statuses"]["unknown"] == 0


def test_the_registry_lists_the_bundled_model_from_the_start(rig):
    server, tokens, _ = rig
    r = server.get("/api/v1/rollouts", tokens["viewer"]).doc
    assert r["baseline"] == 1 and [m["version"] for m in r["models"]][:1] == [1]
    page = server.get("/rollouts", tokens["viewer"]).text
    table = page.split('id="model-table"')[1]
    assert "<td>v1 <span class=\"badge\">baseline</span>" in table and "no-models" not in table


def _release(server: FleetServer, token: str) -> tuple[str, int]:
    m = server.get("/api/v1/rollouts", token).doc["models"][0]
    return m["sha256"], m["size"]


def test_release_answers_304_to_its_etag(rig):
    server, tokens, _ = rig
    sha, size = _release(server, tokens["viewer"])
    for tag in (f'"{sha}"', f'W/"{sha}"', f'"other", "{sha}"', "*"):
        r = server.request("GET", f"/releases/{sha}", headers={"If-None-Match": tag})
        assert r.status == 304 and r.body == b"" and r.headers["ETag"] == f'"{sha}"', tag
    r = server.request("GET", f"/releases/{sha}", headers={"If-None-Match": '"other"'})
    assert r.status == 200 and len(r.body) == size


def test_release_ignores_a_range_it_cannot_use_and_refuses_one_past_the_end(rig):
    server, tokens, _ = rig
    sha, size = _release(server, tokens["viewer"])
    whole = server.get(f"/releases/{sha}").body
    for bad in ("bytes=100-50", "bytes=abc", "bytes=", "items=0-1", "nonsense"):
        r = server.request("GET", f"/releases/{sha}", headers={"Range": bad})
        assert r.status == 200 and r.body == whole, bad
    r = server.request("GET", f"/releases/{sha}", headers={"Range": "bytes=10-19"})
    assert r.status == 206 and r.body == whole[10:20]
    r = server.request("GET", f"/releases/{sha}", headers={"Range": f"bytes={size}-"})
    assert r.status == 416 and r.headers["Content-Range"] == f"bytes */{size}"


@pytest.fixture(scope="module")
def rollout_id(rig, tmp_path_factory) -> str:
    """A rollout of a second model to the rig's devices, published by the real CLI."""
    from tests.test_rollout import model_file

    server, _, _ = rig
    tmp = tmp_path_factory.mktemp("rollout")
    key = tmp / "keys" / "release.key"
    assert server.cli("fleet", "key", "create", "--out", str(key)).returncode == 0
    r = server.cli("fleet", "model", "add", str(model_file(tmp, 16)), "--json")
    assert r.returncode == 0, r.stderr
    r = server.cli("fleet", "model", "publish", str(json.loads(r.stdout)["version"]), "--key", str(key),
                   "--devices", "dev-1,dev-2", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["rollout"]


@pytest.mark.parametrize("action", ["pause", "retry"])
@pytest.mark.parametrize("body,ctype", [(b"{not json", "application/json"), (b"reason=x", FORM_TYPE),
                                        (b'{"colour": 1}', "application/json")])
def test_rollout_action_with_a_bad_body_is_a_400(rig, rollout_id, action, body, ctype):
    server, tokens, _ = rig
    r = server.request("POST", f"/api/v1/rollouts/{rollout_id}/{action}", body, token=tokens["operator"],
                       headers={"Content-Type": ctype})
    assert r.status == 400, r.text
    assert server.get(f"/api/v1/rollouts/{rollout_id}", tokens["viewer"]).doc["state"] == "active"


def test_rollout_retry_of_a_device_it_does_not_target_is_a_404(rig, rollout_id):
    server, tokens, _ = rig
    r = server.post_json(f"/api/v1/rollouts/{rollout_id}/retry", {"devices": ["nope", "dev-1"]}, tokens["operator"])
    assert r.status == 404 and "'nope'" in r.doc["error"] and "'dev-1'" not in r.doc["error"], r.text
    r = server.post_json("/api/v1/rollouts/nope/retry", {}, tokens["operator"])
    assert r.status == 404 and "nope" in r.doc["error"]


def test_rollout_forms_answer_400_for_a_bad_reason_and_404_for_no_rollout(rig, rollout_id):
    server, tokens, _ = rig
    session, csrf = _login(server, tokens["operator"])
    post = lambda path, fields: server.request(  # noqa: E731
        "POST", path, form({**fields, "csrf": csrf}), headers={"Content-Type": FORM_TYPE, "Cookie": session})
    r = post(f"/rollouts/{rollout_id}/pause", {"reason": "x" * 501})
    assert r.status == 400 and "reason" in r.text, r.text
    for action in ("retry", "abort", "pause"):
        r = post(f"/rollouts/nope/{action}", {})
        assert r.status == 404 and "nope" in r.text, (action, r.text)


def test_rollout_state_conflicts_say_what_the_action_needs(rig, rollout_id):
    server, tokens, _ = rig
    op = tokens["operator"]
    act = lambda a: server.post_json(f"/api/v1/rollouts/{rollout_id}/{a}", {}, op)  # noqa: E731
    r = act("resume")
    assert r.status == 409 and r.doc["error"].endswith("is active: only a paused rollout can be resumed"), r.text
    assert act("pause").status == 200
    r = act("pause")
    assert r.status == 409 and r.doc["error"].endswith("is paused: only an active rollout can be paused"), r.text
    assert act("resume").status == 200 and act("abort").status == 200
    r = act("abort")
    assert r.status == 409 and r.doc["error"].endswith("only an active or paused rollout can be aborted"), r.text


def test_healthz_and_every_page_tell_when_the_broker_is_gone(tmp_path):
    broker = Mosquitto(tmp_path / "broker").start()
    server = FleetServer(broker, env_for(tmp_path, tmp_path / "cache")).start()
    try:
        token = server.token("viewer")
        ok = server.get("/healthz")
        assert ok.status == 200 and ok.doc["ok"] and "broker-down" not in server.get("/", token).text
        broker.stop()
        h = wait_until(lambda: (r := server.get("/healthz")).status == 503 and r,  # the receiver noticing
                       lambda: f"/healthz to answer 503 (it says {server.get('/healthz').text})", 30)
        assert h.doc["ok"] is False and h.doc["listener"]["disconnected_since"] <= time.time()
        for page in ("/", "/devices"):
            html = server.get(page, token).text
            assert f"Not connected to the MQTT broker mqtt://{broker.host}:{broker.port} since" in html, page
            assert "device reports are not being received" in html
        broker.start()
        wait_until(lambda: server.get("/healthz").status == 200,  # the receiver reconnecting
                   lambda: f"/healthz to answer 200 (it says {server.get('/healthz').text})", 60)
        assert "broker-down" not in server.get("/", token).text
    finally:
        server.stop()
        broker.stop()


def _serve_json(env: dict[str, str], broker: Mosquitto, port: int) -> tuple[subprocess.Popen, dict]:
    """`fleet serve --json` and its announcement (one JSON object, read up to its closing brace)."""
    proc = subprocess.Popen([sys.executable, "-m", "edgetune.main", "fleet", "serve", "--json", "--broker",
                             f"{broker.host}:{broker.port}", "--port", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.rstrip() == "}":
            break
    return proc, json.loads("".join(lines))


def _stop(proc: subprocess.Popen) -> str:
    """SIGTERM, and the exit it must lead to (killed if it does not come); its stderr."""
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"fleet serve did not stop on SIGTERM:\n{proc.communicate()[1]}") from None
    assert proc.returncode == 0, err
    return err


def test_serve_json_announces_where_it_serves_on_stdout(tmp_path, mosquitto):
    port = free_port()
    env = env_for(tmp_path, tmp_path / "cache")
    proc, ready = _serve_json(env, mosquitto, port)
    try:
        assert ready == {"url": f"http://127.0.0.1:{port}", "broker": f"mqtt://{mosquitto.host}:{mosquitto.port}",
                         "db": str(Path(env["STATE_DIRECTORY"]) / "fleet.db"), "pid": proc.pid}
        s = FleetServer(mosquitto, env, port=port)
        assert s.get("/healthz").doc["time"] > 0
    finally:
        _stop(proc)


def test_serve_stops_on_a_signal_right_after_its_announcement(tmp_path, mosquitto):
    proc, _ = _serve_json(env_for(tmp_path, tmp_path / "cache"), mosquitto, free_port())
    _stop(proc)  # at once: before uvicorn may have taken over the signal handling



# ---- audit fixes: device times, DB outages, logout, uploads ----------------------------------------------------

def test_device_times_out_of_range_are_unknown_and_every_page_renders(rig):
    server, tokens, _ = rig
    v = tokens["viewer"]
    name, huge = f"neg-lost-{uuid.uuid4().hex[:6]}", f"ts-huge-{uuid.uuid4().hex[:6]}"
    active = json.loads(json.dumps(ACTIVE))
    active["kernels"]["gemm/pw1"]["tuned_at"] = 1e20
    _publish_from(server.broker, [
        (f"edgetune/v1/{name}/status", {"state": "lost", "session": 1, "version": "1", "ts": -1e20}),
        (f"edgetune/v1/{name}/config/active", active),
        (f"edgetune/v1/{name}/tuning/record", {**record(1), "record_id": "neg", "started_at": -1e20}),
        (f"edgetune/v1/{huge}/status", {"state": "online", "session": 1, "version": "1", "ts": 1e20})])
    d = server.wait_json(f"/api/v1/devices/{name}", v, lambda d: d["tuned_workloads"] == 2 and d["records"] == 1)
    assert time.time() - 60 < d["last_seen"] <= time.time()  # when the live config/active came, not -1e20
    assert d["status_history"][0]["ts"] is None
    assert [a["tuned_at"] for a in d["active"] if a["slot"] == "gemm/pw1"] == [None]
    assert server.get(f"/api/v1/devices/{name}/records", v).doc[0]["started_at"] is None
    h = server.wait_json(f"/api/v1/devices/{huge}", v, lambda d: True)
    assert h["status_history"][0]["ts"] is None and h["last_seen"] <= time.time()  # live: seen when received
    for page in ("/devices", "/devices?status=lost", f"/devices/{name}", f"/devices/{huge}", "/"):
        r = server.get(page, v)
        assert r.status == 200, (page, r.text)


@pytest.mark.parametrize("ts", [-1e20, 1e20, 2.0**63, float("nan"), None, "x"])
def test_a_time_that_cannot_be_shown_renders_as_a_dash(ts):
    from fleet.web.filters import when

    assert when(ts) == "-"  # times stored before ingestion checked them


def test_times_are_rendered_in_utc_and_say_so():
    from fleet.web.filters import when

    assert when(1700000000.5) == "2023-11-14 22:13:20 UTC"


def test_logout_ends_the_session_for_every_copy_of_its_cookie(rig):
    server, tokens, bus = rig
    since = len(bus.msgs)
    session, csrf = _login(server, tokens["operator"])
    other, _ = _login(server, tokens["operator"])
    r = server.request("POST", "/logout", form({"csrf": csrf}), headers={"Content-Type": FORM_TYPE, "Cookie": session})
    assert r.status == 303 and r.headers["Location"] == "/login"
    attrs = [a.strip().lower() for a in r.headers["Set-Cookie"].split(";")]
    assert "httponly" in attrs and "samesite=strict" in attrs and "path=/" in attrs
    assert server.request("GET", "/devices", headers={"Cookie": session}).status == 303
    assert server.request("GET", "/api/v1/me", headers={"Cookie": session}).status == 401
    r = server.request("POST", "/devices/dev-1/retune", form({"budget": "1", "csrf": csrf}),
                       headers={"Content-Type": FORM_TYPE, "Cookie": session})
    assert r.status == 401, r.text
    r = server.request("POST", f"{ONE}/retune", "{}", headers={"Content-Type": "application/json", "Cookie": session,
                                                               "X-CSRF-Token": csrf})
    assert r.status == 401, r.text
    barrier(server, bus, tokens["operator"], since)  # nothing was sent
    assert server.request("GET", "/api/v1/me", headers={"Cookie": other}).doc["via"] == "session"  # only that one


def _multipart(fields: dict[str, str | bytes]) -> tuple[bytes, str]:
    """A multipart/form-data body; bytes values go as uploaded files."""
    boundary = uuid.uuid4().hex
    out = b""
    for name, value in fields.items():
        disposition = f'form-data; name="{name}"' + ('; filename="hostname"' if isinstance(value, bytes) else "")
        data = value if isinstance(value, bytes) else value.encode()
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize("path,fields,field", [
    ("/devices/dev-1/retune", {"strategy": b"anneal\n", "budget": "1"}, "strategy"),
    ("/devices/retune", {"device": b"dev-1\n"}, "device"),
    ("/rollouts/nope/pause", {"reason": b"because\n"}, "reason"),
])
def test_a_file_uploaded_in_a_form_is_a_400_naming_the_field(rig, path, fields, field):
    server, tokens, bus = rig
    since = len(bus.msgs)
    body, ctype = _multipart(fields)
    r = server.request("POST", path, body, token=tokens["operator"], headers={"Content-Type": ctype})
    assert r.status == 400 and f"{field}: a file was uploaded" in r.text and "UploadFile" not in r.text, r.text
    barrier(server, bus, tokens["operator"], since)


def test_a_token_uploaded_as_a_file_on_the_login_form_is_a_400(rig):
    server, tokens, _ = rig
    r = server.get("/login")
    cookie, csrf = r.headers["Set-Cookie"].split(";")[0], r.text.split('name="csrf-token" content="')[1].split('"')[0]
    body, ctype = _multipart({"csrf": csrf, "token": tokens["operator"].encode()})
    r = server.request("POST", "/login", body, headers={"Content-Type": ctype, "Cookie": cookie})
    assert r.status == 400 and "token: a file was uploaded" in r.text, r.text


def test_an_unexpected_error_is_a_500_that_leaks_nothing_and_keeps_the_api_json(tmp_path):
    """The real app under uvicorn, with a store that fails as no handler expects."""
    import threading

    import uvicorn

    from fleet.tokens import TokenStore
    from fleet.web.auth import Auth
    from fleet.web.server import create_app
    from fleet.web.views import Limits

    def broken_store():
        raise RuntimeError("secret-internal-detail")

    auth = Auth(tmp_path / "auth.db", session_s=3600, secure_cookies=False, anonymous_read=False)
    with TokenStore(tmp_path / "auth.db") as s:
        _, token = s.create("viewer")
    app = create_app(broken_store, auth, Limits(600, 86400), lambda device, command: None)
    web = FleetServer(None, {})
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=web.port, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "uvicorn to start")
        r = web.get("/api/v1/devices", token)
        assert r.status == 500 and r.headers["Content-Type"] == "application/json"
        assert "internal error" in r.doc["error"] and "secret" not in r.text
        r = web.get("/devices", token)
        assert r.status == 500 and "internal error" in r.text.lower()
        assert "secret" not in r.text and "Traceback" not in r.text
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def immutable(*paths: Path) -> Iterator[None]:
    """The files made unwritable even for root (chattr +i), as a read-only or failing disk makes them."""
    r = subprocess.run(["chattr", "+i", *map(str, paths)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"chattr +i does not work here: {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, paths)], check=True)


def _db_files(path: Path) -> list[Path]:
    return [p for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists()]


def test_an_auth_db_that_cannot_be_written_still_lets_tokens_in(tmp_path, mosquitto):
    server = FleetServer(mosquitto, env_for(tmp_path, tmp_path / "cache")).start()
    try:
        token = server.token("viewer")  # never used: the first request writes its last_used_at
        with immutable(*_db_files(Path(server.env["STATE_DIRECTORY"]) / "fleet-auth.db")):
            for path in ("/api/v1/me", "/api/v1/overview", "/"):
                r = server.get(path, token)
                assert r.status == 200, (path, r.text)
        assert server.log.count("recording when tokens were last used stopped") == 1, server.log
    finally:
        server.stop()


def test_an_unwritable_sqlite_fleet_db_is_named_by_healthz_and_on_every_page(tmp_path, mosquitto):
    server = FleetServer(mosquitto, env_for(tmp_path, tmp_path / "cache")).start()
    try:
        token = server.token("viewer")
        db = Path(server.env["STATE_DIRECTORY"]) / "fleet.db"
        with immutable(*_db_files(db)):
            _publish_from(mosquitto, [_online("dev-ro")])  # the receiver tries to store it
            h = wait_until(lambda: (r := server.get("/healthz")).status == 503 and r.doc["db"]["error"] and r,
                           lambda: f"/healthz to name the DB (it says {server.get('/healthz').text})")
            assert h.doc["ok"] is False and h.doc["db"]["path"] == str(db) and str(db) in h.doc["db"]["error"]
            for page in ("/", "/devices"):
                html = server.get(page, token).text
                assert f"The fleet DB {db} cannot store device reports" in html, page
                assert "Not connected to the MQTT broker" not in html, page
        wait_until(lambda: server.get("/healthz").status == 200,  # the receiver stores it once the DB works
                   lambda: f"/healthz to answer 200 (it says {server.get('/healthz').text})", 60)
        assert "db-down" not in server.get("/", token).text
    finally:
        server.stop()


def test_a_postgresql_fleet_db_that_goes_away_is_a_503_naming_it_and_healthz_says_so(tmp_path, mosquitto):
    from tests.pg import PgCluster, missing_reason

    if missing_reason():
        pytest.skip(missing_reason())
    cluster = PgCluster().init()
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(f'[fleet]\ndatabase = "{cluster.create_db()}"\n')
    server = FleetServer(mosquitto, env_for(tmp_path, tmp_path / "cache"), config=cfg).start()
    try:
        view, op = server.token("viewer"), server.token("operator")
        session, csrf = _login(server, op)
        cluster.stop()
        _publish_from(mosquitto, [_online("dev-pg")])  # the receiver tries to store it
        h = wait_until(lambda: (r := server.get("/healthz")).status == 503 and r.doc["db"]["error"] and r,
                       lambda: f"/healthz to name the DB (it says {server.get('/healthz').text})")
        assert "cannot be reached" in h.doc["db"]["error"]
        for page in ("/", "/devices", "/rollouts"):
            r = server.get(page, view)
            assert r.status == 503 and r.headers["Content-Type"].startswith("text/html"), (page, r.text)
            assert "cannot be reached" in r.text and "retries by itself" in r.text and "Traceback" not in r.text
            assert "The fleet DB" in r.text and "Not connected to the MQTT broker" not in r.text
        for r in (server.get("/api/v1/devices", view), server.post_json("/api/v1/rollouts/r1/pause", {}, op)):
            assert r.status == 503 and "cannot be reached" in r.doc["error"] and r.headers["Retry-After"], r.text
        r = server.request("POST", "/rollouts/r1/pause", form({"csrf": csrf}),
                           headers={"Content-Type": FORM_TYPE, "Cookie": session})
        assert r.status == 503 and "cannot be reached" in r.text and "set-cookie" not in r.headers, r.text
        cluster.start()
        wait_until(lambda: server.get("/healthz").status == 200,  # the receiver stores it once the DB is back
                   lambda: f"/healthz to answer 200 (it says {server.get('/healthz').text})", 60)
        assert server.get("/devices", view).status == 200
        assert server.request("GET", "/devices", headers={"Cookie": session}).status == 200  # still logged in
    finally:
        server.stop()
        cluster.destroy()
