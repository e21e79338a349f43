"""The rollouts page in a real browser: headless Chromium (the system's, through Playwright) against a real
`fleet serve` and mosquitto. A rollout is published with the real CLI to devices that speak the contract: they
receive the retained releases the server's controller publishes and report model states. An operator pauses,
resumes and aborts from the page (the controller then sends the signed rollback); a viewer sees no controls, and
a forged form or API post gets 403 and changes nothing. Screenshots go to tests/artifacts/. (Real daemons
following rollouts: tests/test_rollout_e2e.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.broker import Mosquitto
from tests.fleet_server import FleetServer
from tests.test_daemon_support import Bus, env_for
from tests.test_fleet import HW, Device
from tuner.model.inference import bundled_model_path

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
DEVICES = ("dev-1", "dev-2", "dev-3", "dev-4")
T = 60.0

playwright_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install chromium)")


@pytest.fixture
def rig(tmp_path, build_cache):
    broker = Mosquitto(tmp_path / "broker").start()
    server = FleetServer(broker, env_for(tmp_path / "fleet", build_cache)).start()
    tokens = {"operator": server.token("operator", "op"), "viewer": server.token("viewer", "view")}
    for d in DEVICES:
        dev = Device(broker, d)
        dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0", "ts": time.time()}, retain=True)
        dev.pub("info", {"hw": HW, "hw_fingerprint": f"hw-{d}"}, retain=True)
        dev.close()
    server.wait_json("/api/v1/overview", tokens["viewer"], lambda o: o["devices"] == len(DEVICES), T)
    key = tmp_path / "keys" / "release.key"
    model = tmp_path / "v2.gguf"
    model.write_bytes(bundled_model_path().read_bytes() + b"\0" * 32)
    for args in (("key", "create", "--out", str(key)), ("model", "add", str(model))):
        r = server.cli("fleet", *args)
        assert r.returncode == 0, r.stderr
    r = server.cli("fleet", "model", "publish", "2", "--key", str(key), "--phases", "50,100", "--min-dwell", "1h",
                   "--abort-after", "10", "--json")
    assert r.returncode == 0, r.stderr
    rid = json.loads(r.stdout)["rollout"]
    path = f"/api/v1/rollouts/{rid}"
    doc = server.wait_json(path, tokens["viewer"], lambda r: sum(1 for t in r["devices"] if t["sent_at"]) == 2, T)
    first = [t["device_id"] for t in doc["devices"] if t["phase"] == 0]
    # the first phase's devices got the release and report: one committed it, one refused the file
    for device, state, reason in ((first[0], "committed", None), (first[1], "rejected", "checksum")):
        dev = Device(broker, device)
        dev.pub("model/state", {"state": state, "rollout_id": rid, "phase": "50%", "version": 2, "reason": reason,
                                "detail": "test", "current": None, "previous": None, "ts": time.time()},
                retain=True)
        dev.close()
    server.wait_json(path, tokens["viewer"], lambda r: r["totals"]["committed"] == 1 and r["totals"]["failed"] == 1,
                     T)
    pw = playwright_api.sync_playwright().start()
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
    ARTIFACTS.mkdir(exist_ok=True)
    yield server, tokens, browser, rid, first, broker
    browser.close()
    pw.stop()
    server.stop()
    broker.stop()


def page_for(rig, role: str):
    server, tokens, browser, *_ = rig
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(server.base + "/login")
    page.fill("#token", tokens[role])
    page.click("#login")
    page.wait_for_url(server.base + "/")
    return page, problems


def test_operator_pauses_resumes_and_aborts_from_the_page_and_a_viewer_cannot(rig):
    server, tokens, _, rid, first, broker = rig
    api = f"/api/v1/rollouts/{rid}"

    # a viewer: the page shows the progress but no controls, and a forged post changes nothing
    page, problems = page_for(rig, "viewer")
    page.click("nav a:text-is('Rollouts')")
    page.click(f"#rollout-table a:text-is('{rid}')")
    assert page.locator("#rollout-actions").count() == 0 and page.locator("#viewer-note").count() == 1
    csrf = page.get_attribute("meta[name=csrf-token]", "content")
    assert page.request.post(f"{server.base}/rollouts/{rid}/abort", form={"csrf": csrf}).status == 403
    r = page.request.post(server.base + api + "/pause", data="{}",
                          headers={"Content-Type": "application/json", "X-CSRF-Token": csrf})
    assert r.status == 403
    assert server.get(api, tokens["viewer"]).doc["state"] == "active"
    assert not problems

    # an operator: per-phase counts and reasons, then pause, resume, abort with a reason
    page, problems = page_for(rig, "operator")
    page.goto(f"{server.base}/rollouts/{rid}")
    phase = page.locator("#phase-table tr[data-phase='50%']")
    assert phase.locator("td.bucket-committed").text_content() == "1"
    assert phase.locator("td.bucket-failed").text_content() == "1"
    assert "rejected: checksum ×1" in phase.text_content()
    assert page.locator("#phase-table tr[data-phase='100%'] td.bucket-pending").text_content() == "2"
    assert page.locator(f"#target-table tr[data-device='{first[1]}']").get_attribute("data-bucket") == "failed"
    page.screenshot(path=str(ARTIFACTS / "rollout.png"), full_page=True)
    # a form post without its CSRF token is refused even for an operator
    assert page.request.post(f"{server.base}/rollouts/{rid}/pause", form={}).status == 403
    assert server.get(api, tokens["viewer"]).doc["state"] == "active"
    page.click("#pause-button")
    assert page.text_content("#rollout-state") == "paused" and page.locator("#pause-button").count() == 0
    page.click("#resume-button")
    assert page.text_content("#rollout-state") == "active"
    page.fill("#abort-form input[name=reason]", "checksum failures in the first phase")
    page.click("#abort-button")
    assert page.text_content("#rollout-state") == "aborted"
    assert page.text_content("#rollout-reason") == "checksum failures in the first phase"
    assert page.locator("#rollout-actions form").count() == 0
    # the controller sends the pre-signed rollback to the two devices that got the release, and to no one else
    done = server.wait_json(api, tokens["viewer"], lambda r: all(
        bool(t["rollback_sent_at"]) == (t["phase"] == 0) for t in r["devices"]), T)
    assert [e["kind"] for e in done["events"]][::-1] == ["published", "paused", "active", "aborted"]
    assert [e["actor"] for e in done["events"]][0] == "op"
    bus = Bus(broker, (f"edgetune/v1/{first[0]}/model/release",))
    try:
        msg = bus.wait(lambda m: m.retain, T, "the retained rollback").doc
        assert msg["phase"] == "rollback" and msg["manifest"]["rollback"] and msg["manifest"]["version"] == 1
    finally:
        bus.close()
    page.reload()
    assert page.locator(f"#target-table tr[data-device='{first[0]}'] td").nth(6).text_content() == "sent"
    page.screenshot(path=str(ARTIFACTS / "rollout-aborted.png"), full_page=True)
    page.goto(f"{server.base}/rollouts")
    assert page.locator(f"tr[data-rollout='{rid}'] .badge").text_content() == "aborted"
    page.goto(f"{server.base}/devices/{first[1]}")  # the device page names its last release and links the rollout
    assert "v2" in page.text_content("#model-state") and "rejected checksum" in page.text_content("#model-state")
    page.click(f"#model-state a:text-is('{rid}')")
    assert page.text_content("#rollout-state") == "aborted"
    assert not problems
