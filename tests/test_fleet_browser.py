"""The dashboard in a real browser: headless Chromium (the system's, driven by Playwright) against a real
`fleet serve`, a real mosquitto, one real daemon that tunes and answers retunes, and contract publishers for the
other states (offline, lost, stale) and for devices whose names and fields hold HTML. Screenshots of the overview
and a device page go to tests/artifacts/."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.broker import Mosquitto
from tests.fleet_server import FleetServer
from tests.test_daemon_support import DaemonProc, daemon_config, env_for
from tests.test_fleet import HW, Device

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
DAEMON = "dev-test"
# Device ids follow the protocol's id rule (edgetune.protocol.ID_RULE), so an id holding HTML is refused at the
# receiver; the HTML rides in every other field a device sends instead.
HTML_IDS = ("<img src=x onerror=window.__pwned=1>", "<script>window.__pwned=2;")
XSS_ID, SCRIPT_ID = "dev-xss-img", "dev-xss-script"
XSS_CPU = "<script>window.__pwned=3</script>"
XSS_WORKLOAD = "</td><script>window.__pwned=4</script>"
OWN_COMMAND = "firmware-hook-0123456789ab"  # a command a device started itself, with a note saying why

playwright_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install chromium)")


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleetui")
    cache = tmp_path_factory.getbasetemp() / "cache"
    broker = Mosquitto(tmp / "broker").start()
    server = FleetServer(broker, env_for(tmp / "fleet", cache)).start()
    tokens = {"operator": server.token("operator", "op"), "viewer": server.token("viewer", "view")}
    daemon = DaemonProc(daemon_config(tmp, broker, telemetry_interval_s=0.5), env=env_for(tmp / "dev", cache)).start()
    now = time.time()
    for name, state, ts in (("dev-off", "offline", now), ("dev-lost", "lost", now), ("dev-stale", "online", now - 3600),
                            (XSS_ID, "online", now), (SCRIPT_ID, "online", now)):
        dev = Device(broker, name)
        if name == "dev-off":  # first, on this client: the receiver has refused them before it counts dev-off
            for bad in HTML_IDS:
                dev.device = bad
                dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": ts}, retain=True)
            dev.device = name
        dev.pub("status", {"state": state, "session": 1, "version": "0.1.0", "ts": ts}, retain=True)
        if name in (XSS_ID, SCRIPT_ID):
            dev.pub("info", {"hw": {**HW, "cpu_model": XSS_CPU}, "hw_fingerprint": "hw-x"}, retain=True)
            dev.pub("config/active", {"kernels": {f"gemm/{XSS_WORKLOAD}": {"config": {"tile": XSS_CPU}, "ms": 1.0,
                                                                            "default_ms": 2.0, "strategy": XSS_CPU}}},
                    retain=True)
            dev.pub("telemetry", {"seq": 1, "boot_id": XSS_CPU, "ts": now, "cpu_percent": 5.0, "state": XSS_CPU})
            dev.pub(f"cmd/res/{OWN_COMMAND}", {"id": OWN_COMMAND, "op": "retune", "origin": "firmware-hook",
                                               "status": "succeeded", "note": XSS_CPU, "ts": now})
        dev.close()
    v = tokens["viewer"]
    server.wait_json("/api/v1/overview", v, lambda o: o["devices"] == 6, 60)
    for name in (XSS_ID, SCRIPT_ID):
        server.wait_json(f"/api/v1/devices/{name}/commands", v, lambda c: len(c) == 1, 60)
    # the daemon's start-up tune is reported and it has sent telemetry
    server.wait_json(f"/api/v1/devices/{DAEMON}", v, lambda d: d["active"] and d["status"] == "online", 180)
    server.wait_json(f"/api/v1/devices/{DAEMON}/telemetry", v, lambda t: len(t) >= 3, 60)
    pw = playwright_api.sync_playwright().start()
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
    ARTIFACTS.mkdir(exist_ok=True)
    yield server, tokens, browser
    browser.close()
    pw.stop()
    daemon.stop()
    server.stop()
    broker.stop()


def page_for(rig, role: str, **context: str):
    """A fresh browser context (`context`: Playwright's options, e.g. timezone_id) logged in with a `role` token
    through the login form. Any dialog (an alert from injected script) or page error fails the test."""
    server, tokens, browser = rig
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, **context)
    page = ctx.new_page()
    problems: list[str] = []
    page.on("dialog", lambda d: problems.append(f"dialog: {d.message}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(server.base + "/")
    assert page.url.startswith(server.base + "/login")
    page.fill("#token", tokens[role])
    page.click("#login")
    page.wait_for_url(server.base + "/")
    assert page.text_content("#whoami").endswith(role)
    return page, problems


def test_overview_shows_the_counts_and_links_to_the_list(rig):
    page, problems = page_for(rig, "viewer")
    counts = {s: int(page.text_content(f"#count-{s} .n")) for s in ("online", "stale", "offline", "lost", "unknown")}
    assert counts == {"online": 3, "stale": 1, "offline": 1, "lost": 1, "unknown": 0}
    page.screenshot(path=str(ARTIFACTS / "overview.png"), full_page=True)
    page.click("#count-lost")
    assert page.locator("a.device-link").all_text_contents() == ["dev-lost"]
    cpu = rig[0].get(f"/api/v1/devices/{DAEMON}", rig[1]["viewer"]).doc["cpu_model"]
    page.goto(rig[0].base + "/")
    page.locator("#by-cpu_model a", has_text=cpu).click()
    assert page.locator("a.device-link").all_text_contents() == [DAEMON]
    assert not problems


def test_device_page_shows_configs_and_a_telemetry_plot_with_points(rig):
    page, problems = page_for(rig, "viewer")
    page.goto(f"{rig[0].base}/devices/{DAEMON}")
    assert page.text_content("#device-id") == DAEMON
    slots = page.locator("#active-configs tr.active-config td:first-child").all_text_contents()
    assert "gemm/kws_dscnn.fc" in slots
    page.wait_for_function("() => window.etPlots.cpu_percent && window.etPlots.cpu_percent.data[0].length >= 3")
    points = page.evaluate("() => Object.fromEntries(Object.entries(window.etPlots).map(([k, u]) => [k, u.data[1].length]))")
    assert points["cpu_percent"] >= 3 and points["rss"] >= 3, points
    assert page.locator("#plots canvas").count() == 5
    assert page.locator("#records tr.record").count() >= 1
    page.screenshot(path=str(ARTIFACTS / "device.png"), full_page=True)
    assert not problems


def test_retune_button_on_a_real_daemon_runs_to_succeeded(rig):
    page, problems = page_for(rig, "operator")
    page.goto(f"{rig[0].base}/devices/{DAEMON}")
    page.fill("#retune-form input[name=budget]", "2")
    page.click("#retune")
    page.wait_for_url(f"{rig[0].base}/devices/{DAEMON}?sent=*")
    sent = page.url.split("sent=")[1]
    row = page.locator(f"#command-log tr[data-command='{sent}']")
    # the page updates itself: accepted, in_progress, then succeeded, without a reload
    row.locator(".badge:text-is('succeeded')").wait_for(timeout=180_000)
    assert row.locator("td").nth(1).text_content() == "retune"
    assert row.locator("td").nth(2).text_content() == "fleet"
    assert row.locator("progress").get_attribute("value") == "1"
    page.screenshot(path=str(ARTIFACTS / "device-retuned.png"), full_page=True)
    assert not problems


def test_viewer_sees_no_retune_controls_and_a_forged_post_gets_403(rig):
    server, tokens, _ = rig
    page, problems = page_for(rig, "viewer")
    page.goto(f"{server.base}/devices/{DAEMON}")
    assert page.locator("#retune").count() == 0 and page.locator("#retune-form").count() == 0
    page.goto(f"{server.base}/devices")
    assert page.locator("input.pick").count() == 0 and page.locator("#retune-selected").count() == 0
    before = len(server.get(f"/api/v1/devices/{DAEMON}/commands", tokens["viewer"]).doc)
    csrf = page.get_attribute("meta[name=csrf-token]", "content")
    r = page.request.post(f"{server.base}/devices/{DAEMON}/retune", form={"csrf": csrf, "budget": "1"})
    assert r.status == 403
    r = page.request.post(f"{server.base}/api/v1/devices/{DAEMON}/retune", data=json.dumps({"budget": 1}),
                          headers={"Content-Type": "application/json", "X-CSRF-Token": csrf})
    assert r.status == 403
    assert len(server.get(f"/api/v1/devices/{DAEMON}/commands", tokens["viewer"]).doc) == before
    assert not problems


def test_html_in_device_names_and_fields_is_shown_escaped(rig):
    server, _, _ = rig
    page, problems = page_for(rig, "operator")
    for path in ("/", "/devices", "/speedups"):
        page.goto(server.base + path)
        assert page.evaluate("() => window.__pwned") is None, path
    assert f"gemm/{XSS_WORKLOAD}" in page.text_content("#speedup-table")
    page.goto(server.base + "/devices")
    listed = set(page.locator("a.device-link").all_text_contents())
    assert {XSS_ID, SCRIPT_ID} <= listed and not listed & set(HTML_IDS)  # ids breaking the id rule are refused
    for device in (XSS_ID, SCRIPT_ID):
        page.locator("a.device-link", has_text=device).click()
        page.wait_for_function("() => window.etPlots.cpu_percent")
        assert page.text_content("#device-id") == device
        assert XSS_CPU in page.text_content("#descriptor")
        assert f"gemm/{XSS_WORKLOAD}" in page.text_content("#active-configs")
        own = page.locator(f"#command-log tr[data-command='{OWN_COMMAND}'] td")
        assert own.nth(0).text_content() == OWN_COMMAND[-8:] and own.nth(1).text_content() == "retune"
        assert own.nth(2).text_content() == f"firmware-hook: {XSS_CPU}"  # who started it and why, as text
        assert page.evaluate("() => window.__pwned") is None
        assert page.locator("img[src=x]").count() == 0
        assert page.locator("script").count() == 2  # only our two, uPlot and app.js
        page.goto(server.base + "/devices")
    assert not problems


def test_times_the_page_polls_read_as_the_server_rendered_them_in_utc(rig):
    """A browser in another zone than the server: the command log, rendered by the server and then re-rendered
    by the page's script as it polls, shows one time, in UTC, saying so."""
    from fleet.web.filters import when

    server, tokens, _ = rig
    command = f"ping-{time.time_ns()}"
    dev = Device(server.broker, "dev-off")
    dev.pub("cmd/req", {"id": command, "op": "ping", "args": {}, "expires_at": time.time() + 600})
    dev.close()
    log = server.wait_json("/api/v1/devices/dev-off/commands", tokens["viewer"],
                           lambda cs: any(c["id"] == command for c in cs))
    expected = when(next(c for c in log if c["id"] == command)["requested_at"])
    assert expected.endswith(" UTC")
    page, problems = page_for(rig, "viewer", timezone_id="Asia/Kolkata")  # UTC+5:30
    page.goto(f"{server.base}/devices/dev-off")
    cell = f"#command-log tr[data-command='{command}'] td:nth-child(7)"
    assert page.text_content(cell) == expected
    page.evaluate("sel => { document.querySelector(sel).textContent = ''; }", cell)
    page.wait_for_function("([sel, want]) => document.querySelector(sel)?.textContent === want", arg=[cell, expected])
    assert not problems
