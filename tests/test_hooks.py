"""Firmware-update hooks (Mender, RAUC, SWUpdate) run as the update frameworks run them: with the daemon down,
with the CLI missing, failing or hanging, with an unwritable state dir, and with the daemon up. Every run must
exit 0, and leave exactly one valid marker whenever the daemon could not be told."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.polling import wait_until

REPO = Path(__file__).resolve().parent.parent
HOOKS_DIR = REPO / "systemd" / "hooks"
HOOKS = {"ArtifactCommit_Leave_50_edgetune": "mender", "rauc-post-install.sh": "rauc",
         "swupdate-postupdate.sh": "swupdate"}
EDGETUNE = Path(sys.executable).parent / "edgetune"
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
BODY_MARK = "# --- common body"


def run_hook(name: str, state: Path, **env: str) -> subprocess.CompletedProcess:
    """Run a hook through its shebang with a minimal environment, as an update client would."""
    base = {"PATH": SYSTEM_PATH, "EDGETUNE_STATE_DIR": str(state), "EDGETUNE_RUNTIME_DIR": str(state.parent / "run")}
    return subprocess.run([str(HOOKS_DIR / name)], env=base | env, capture_output=True, text=True, timeout=60)


def assert_one_marker(state: Path, source: str) -> dict:
    assert sorted(os.listdir(state)) == ["firmware-changed"]  # no temp files left behind
    doc = json.loads((state / "firmware-changed").read_text())
    assert doc["source"] == source and isinstance(doc["ts"], (int, float)) and doc["ts"] > 1.6e9
    return doc


def fake_edgetune(tmp_path: Path, body: str) -> str:
    """A broken `edgetune` first on PATH; returns that PATH."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    exe = bindir / "edgetune"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    return f"{bindir}:{SYSTEM_PATH}"


def test_hooks_are_executable_and_share_one_body() -> None:
    bodies = set()
    for name, source in HOOKS.items():
        path = HOOKS_DIR / name
        assert os.access(path, os.X_OK), f"{name} is not executable"
        text = path.read_text()
        assert text.startswith("#!/bin/sh\n") and f"\nSOURCE={source}\n" in text
        bodies.add(text[text.index(BODY_MARK):])
    assert len(bodies) == 1, "the hooks' common bodies have drifted apart"


@pytest.mark.parametrize("hook", HOOKS)
def test_daemon_down_leaves_one_marker_idempotently(tmp_path, hook) -> None:
    state = tmp_path / "state"
    for _ in range(2):  # Mender repeats ArtifactCommit_Leave after a power loss
        r = run_hook(hook, state, EDGETUNE_BIN=str(EDGETUNE))
        assert r.returncode == 0, r.stderr
    print(r.stderr.strip())
    assert_one_marker(state, HOOKS[hook])


@pytest.mark.parametrize("hook", HOOKS)
def test_missing_cli_hook_writes_marker_itself(tmp_path, hook) -> None:
    state = tmp_path / "state"
    r = run_hook(hook, state, EDGETUNE_BIN=str(tmp_path / "no" / "edgetune"))
    assert r.returncode == 0 and "no edgetune CLI" in r.stderr
    assert_one_marker(state, HOOKS[hook])


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("kind,body", [
    ("fails", 'echo "Traceback (most recent call last): boom" >&2; exit 1'),
    ("hangs", "exec sleep 60"),
])
def test_broken_cli_on_path(tmp_path, hook, kind, body) -> None:
    state = tmp_path / "state"
    t0 = time.monotonic()
    r = run_hook(hook, state, PATH=fake_edgetune(tmp_path, body), EDGETUNE_NOTIFY_TIMEOUT="1")
    took = time.monotonic() - t0
    print(f"{hook} with a CLI that {kind}: exit {r.returncode} in {took:.1f} s; {r.stderr.strip()!r}")
    assert r.returncode == 0 and "edgetune notify failed" in r.stderr
    assert took < 10  # bounded by the timeout (1 s, then KILL 2 s later), not by the hanging CLI
    assert_one_marker(state, HOOKS[hook])


@pytest.mark.parametrize("hook", HOOKS)
def test_unwritable_state_dir_still_exits_0(hook) -> None:
    r = run_hook(hook, Path("/proc/edgetune-no-such-dir"), EDGETUNE_BIN="/nonexistent/edgetune")
    assert r.returncode == 0 and "could not write" in r.stderr


def _notify_verb() -> bool:
    r = subprocess.run([str(EDGETUNE), "notify", "firmware-changed", "--help"], capture_output=True, text=True)
    return r.returncode == 0 and (REPO / "daemon" / "service.py").exists()


@pytest.mark.skipif(not _notify_verb(), reason="`edgetune daemon` / `edgetune notify firmware-changed` not there yet")
def test_daemon_up_mender_retunes_now_rauc_and_swupdate_leave_the_marker_for_the_next_boot(tmp_path) -> None:
    """RAUC and SWUpdate run their hooks in the old system before the reboot: telling the running daemon retuned
    the old image and left no marker, so the new image was never retuned. Mender's runs in the new system."""
    from tests.test_daemon_support import DaemonProc, daemon_config

    d = DaemonProc(daemon_config(tmp_path, None)).start()
    try:
        d.wait_status(lambda s: "session" in s, timeout=120)  # ready: the control socket takes notifies
        run_dir = Path(d.env["RUNTIME_DIRECTORY"])
        marker = d.state_dir / "firmware-changed"
        for hook, source in HOOKS.items():
            r = run_hook(hook, d.state_dir, EDGETUNE_BIN=str(EDGETUNE), EDGETUNE_RUNTIME_DIR=str(run_dir))
            print(r.stderr.strip())
            assert r.returncode == 0 and "notify firmware-changed succeeded" in r.stderr
            if source == "mender":
                wait_until(lambda: f"firmware changed ({source})" in d.log,
                           lambda: f"the daemon to log the {source} notify:\n{d.log[-3000:]}", 30)
                wait_until(lambda: not marker.exists(), "the mender retune to finish and clear its marker", 60)
            else:
                doc = json.loads(marker.read_text())
                assert doc["source"] == source and "command" not in doc  # for the next boot, no retune queued
        assert d.signal(signal.SIGTERM) == 0
        assert "firmware changed (rauc)" not in d.log and "firmware changed (swupdate)" not in d.log
        assert json.loads(marker.read_text())["source"] == "swupdate"  # still there for the next start
    finally:
        d.stop()
