"""The systemd integration: the unit verifies cleanly and is hardened (exposure <= 4.0), sysusers creates the
user in dialout, the example config is valid, install.sh lays out the tree, and the stack (the daemon included)
really runs under the unit's syscall filter and without writable+executable memory."""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "edgetune.service"
INSTALLED_EXE = "/opt/edgetune/venv/bin/edgetune"
CHECKOUT_EXE = Path(sys.executable).parent / "edgetune"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


FLEET_UNIT = SYSTEMD / "edgetune-fleet.service"
UNITS = [UNIT, FLEET_UNIT]


@pytest.fixture(params=UNITS, ids=lambda u: u.name)
def unit_copy(request, tmp_path) -> Path:
    """The unit with ExecStart= pointing at this checkout's real `edgetune` instead of the not-yet-installed
    /opt one: verify checks that the binary exists, and that is the only line changed."""
    assert CHECKOUT_EXE.exists()
    text, n = re.subn(rf"^ExecStart={re.escape(INSTALLED_EXE)}", f"ExecStart={CHECKOUT_EXE}",
                      request.param.read_text(), flags=re.M)
    assert n == 1
    copy = tmp_path / request.param.name
    copy.write_text(text)
    return copy


@needs_analyze
def test_unit_verifies_without_warnings(unit_copy) -> None:
    r = subprocess.run([ANALYZE, "verify", str(unit_copy)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr


@needs_analyze
def test_unit_exposure_at_most_4(unit_copy) -> None:
    r = subprocess.run([ANALYZE, "security", "--offline=yes", "--no-pager", str(unit_copy)],
                       capture_output=True, text=True)
    m = re.search(rf"Overall exposure level for {re.escape(unit_copy.name)}: (\d+\.\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    print("\n".join(ln.rstrip() for ln in r.stdout.splitlines() if ln.startswith("✗")))
    print(f"exposure: {m.group(1)}")
    assert float(m.group(1)) <= 4.0


def test_unit_contract() -> None:
    """What the daemon and the issue rely on, in case an edit drops it."""
    text = UNIT.read_text()
    for line in ["Type=notify", "NotifyAccess=main", f"ExecStart={INSTALLED_EXE} daemon",
                 "ExecReload=/bin/kill -HUP $MAINPID", "Restart=on-failure", "User=edgetune",
                 "SupplementaryGroups=dialout", "StateDirectory=edgetune", "CacheDirectory=edgetune",
                 "RuntimeDirectory=edgetune", "ConfigurationDirectory=edgetune", "UMask=0027",
                 "DeviceAllow=char-ttyUSB rw", "DeviceAllow=char-ttyACM rw", "CapabilityBoundingSet="]:
        assert f"\n{line}\n" in text, line
    assert re.search(r"\nWatchdogSec=\d+", text) and re.search(r"\nMemoryMax=\d+", text)
    for absent in ("CPUQuota=", "PrivateDevices=yes", "ProcSubset=pid"):  # benchmarks, meters, hwprobe
        assert f"\n{absent}" not in text


def test_fleet_unit_contract() -> None:
    """The fleet server: its own unit, the device unit's user and state dir, hardened further (no devices,
    no privileges), serving on loopback by default (the flags leave --host alone)."""
    text = FLEET_UNIT.read_text()
    for line in ["Type=exec", f"ExecStart={INSTALLED_EXE} fleet serve --broker localhost:1883", "Restart=on-failure",
                 "User=edgetune", "StateDirectory=edgetune", "ConfigurationDirectory=edgetune", "UMask=0077",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateDevices=yes", "MemoryDenyWriteExecute=yes",
                 "CapabilityBoundingSet=", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
                 "SystemCallFilter=@system-service"]:
        assert f"\n{line}\n" in text, line
    assert "--host" not in text and re.search(r"\nMemoryMax=\d+", text)


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_sysusers_creates_user_in_dialout(tmp_path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (etc / "group").write_text("root:x:0:\n")
    conf = SYSTEMD / "sysusers.d" / "edgetune.conf"
    for _ in range(2):  # idempotent, as at every boot
        r = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(conf)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    user = next(ln.split(":") for ln in (etc / "passwd").read_text().splitlines() if ln.startswith("edgetune:"))
    assert user[5] == "/var/lib/edgetune" and user[6].endswith("nologin")
    groups = {ln.split(":")[0]: ln.split(":")[3] for ln in (etc / "group").read_text().splitlines()}
    assert "edgetune" in groups and groups["dialout"] == "edgetune"


def test_example_config_is_valid() -> None:
    """Uncommenting every "# key = value" line must give a config the daemon and the power module accept."""
    from edgetune.config import load
    from hwprobe.power import TextMeter, meter_from_config

    text = (SYSTEMD / "edgetune.toml.example").read_text()
    uncommented = "\n".join(ln[2:] if ln.startswith("# ") else ln for ln in text.splitlines())
    doc = tomllib.loads(uncommented)
    assert {"mqtt", "outbox", "tuning", "power"} <= doc.keys()
    assert isinstance(meter_from_config(doc["power"]), TextMeter)
    path = Path(os.environ["CONFIGURATION_DIRECTORY"]) / "example.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(uncommented)
    assert load(path).problems == []


# --- install.sh ---------------------------------------------------------------------------------------------


def install(destdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(SYSTEMD / "install.sh"), *args], env=os.environ | {"DESTDIR": str(destdir)},
                          capture_output=True, text=True, timeout=120)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_install_tree_into_destdir(tmp_path) -> None:
    dest = tmp_path / "root"
    for _ in range(2):  # re-running an install is fine
        r = install(dest, "--no-venv")
        assert r.returncode == 0, r.stderr
    print(r.stdout)
    expected = {
        "usr/lib/systemd/system/edgetune.service": 0o644,
        "usr/lib/systemd/system/edgetune-fleet.service": 0o644,
        "usr/lib/sysusers.d/edgetune.conf": 0o644,
        "etc/edgetune/edgetune.toml.example": 0o640,
        "opt/edgetune/hooks/ArtifactCommit_Leave_50_edgetune": 0o755,
        "opt/edgetune/hooks/rauc-post-install.sh": 0o755,
        "opt/edgetune/hooks/swupdate-postupdate.sh": 0o755,
    }
    files = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}
    assert files == set(expected)
    for rel, m in expected.items():
        assert mode(dest / rel) == m, f"{rel}: {oct(mode(dest / rel))}"
    assert (dest / "usr/lib/systemd/system/edgetune.service").read_text() == UNIT.read_text()
    assert (dest / "usr/lib/systemd/system/edgetune-fleet.service").read_text() == FLEET_UNIT.read_text()
    assert not (dest / "opt/edgetune/venv").exists()
    for step in ("systemd-sysusers", "systemctl daemon-reload", "systemctl enable --now edgetune",
                 "systemctl enable --now edgetune-fleet", "[fleet]",
                 "mender-artifact write", "post-install=", "postupdatecmd"):
        assert step in r.stdout
    assert str(dest) not in r.stdout.split("\n", 1)[1]  # instructions name the target paths, not the stage


def test_install_prefix_is_followed_everywhere(tmp_path) -> None:
    dest = tmp_path / "root"
    assert install(dest, "--no-venv", "--prefix", "/srv/et").returncode == 0
    unit = (dest / "usr/lib/systemd/system/edgetune.service").read_text()
    assert "ExecStart=/srv/et/venv/bin/edgetune daemon" in unit and "/opt/edgetune" not in unit
    fleet = (dest / "usr/lib/systemd/system/edgetune-fleet.service").read_text()
    assert "ExecStart=/srv/et/venv/bin/edgetune fleet serve" in fleet and "/opt/edgetune" not in fleet
    for hook in (dest / "srv/et/hooks").iterdir():
        assert "INSTALLED_BIN=/srv/et/venv/bin/edgetune" in hook.read_text() and mode(hook) == 0o755


@pytest.mark.parametrize("args,msg", [
    ((), "venv cannot be staged"),  # a venv built under DESTDIR would point into it
    (("--no-venv", "--prefix", "relative"), "absolute path"),
    (("--bogus",), "unknown argument"),
])
def test_install_refuses_bad_input(tmp_path, args, msg) -> None:
    r = install(tmp_path / "root", *args)
    assert r.returncode == 2 and msg in r.stderr
    assert not (tmp_path / "root").exists()


# --- the unit's confinement, applied without systemd -----------------------------------------------------------

# Applies what the unit's SystemCallFilter= (a seccomp allow-list, EPERM for the rest), NoNewPrivileges= and
# MemoryDenyWriteExecute= enforce, then execs the command, which inherits all three (workers and cc included).
# MemoryDenyWriteExecute= is applied with the kernel's own W^X switch, PR_SET_MDWE (Linux 6.3+).
CONFINE = r"""
import ctypes, errno, json, os, sys
allowed, argv = json.loads(sys.argv[1]), sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
sc = ctypes.CDLL("libseccomp.so.2")
sc.seccomp_init.restype = ctypes.c_void_p
sc.seccomp_init.argtypes = [ctypes.c_uint32]
sc.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
sc.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
sc.seccomp_load.argtypes = [ctypes.c_void_p]
ctx = sc.seccomp_init(0x00050000 | errno.EPERM)  # SCMP_ACT_ERRNO(EPERM), as SystemCallErrorNumber=EPERM
for name in allowed:
    nr = sc.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0:  # negative: not a syscall on this architecture
        assert sc.seccomp_rule_add(ctx, 0x7fff0000, nr, 0) == 0, name  # SCMP_ACT_ALLOW
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(65, 1, 0, 0, 0) == 0, ctypes.get_errno()  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
assert sc.seccomp_load(ctx) == 0
os.execv(argv[0], argv)
"""
CHECK_INSIDE = r"""
import ctypes, mmap, os
assert ctypes.CDLL(None).prctl(66, 0, 0, 0, 0) == 1  # PR_GET_MDWE: W^X is on
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    raise SystemExit("W+X mapping allowed")
except PermissionError:
    pass
try:
    os.chown(".", -1, -1)
    raise SystemExit("chown allowed (not in the unit's syscall filter)")
except PermissionError:
    pass
from tuner.model.inference import silence_llama
silence_llama()  # llama.cpp loaded, with a ctypes (libffi) log callback installed
print("confined: W^X on, chown refused, llama.cpp loaded with a callback")
"""


def _syscalls(name: str, cache: dict[str, frozenset[str]] = {}) -> frozenset[str]:
    """A syscall or @group, expanded by systemd-analyze (groups nest)."""
    if not name.startswith("@"):
        return frozenset([name])
    if name not in cache:
        out = subprocess.run([ANALYZE, "syscall-filter", name], capture_output=True, text=True, check=True).stdout
        items = [ln.strip() for ln in out.splitlines()[1:] if ln.strip() and not ln.strip().startswith("#")]
        cache[name] = frozenset().union(*(_syscalls(i) for i in items))
    return cache[name]


def unit_syscall_allowlist(unit: Path = UNIT) -> list[str]:
    allow: set[str] = set()
    deny: set[str] = set()
    for m in re.finditer(r"^SystemCallFilter=(~?)(.+)$", unit.read_text(), re.M):
        (deny if m.group(1) else allow).update(*(_syscalls(n) for n in m.group(2).split()))
    return sorted(allow - deny)


def _confinement_available() -> str | None:
    if ANALYZE is None:
        return "systemd-analyze is not installed (it expands the syscall groups)"
    try:
        ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return "libseccomp is not installed"
    probe = subprocess.run([sys.executable, "-c", "import ctypes; exit(ctypes.CDLL(None).prctl(65, 1, 0, 0, 0))"])
    return None if probe.returncode == 0 else "kernel without PR_SET_MDWE (Linux < 6.3)"


def _confined(unit: Path) -> list[str]:
    """A command prefix that runs what follows under the unit's syscall filter and W^X."""
    reason = _confinement_available()
    if reason:
        pytest.skip(reason)
    return [sys.executable, "-c", CONFINE, json.dumps(unit_syscall_allowlist(unit))]


@pytest.fixture(scope="module")
def confined() -> list[str]:
    return _confined(UNIT)


def test_stack_runs_under_the_units_confinement(confined) -> None:
    """llama.cpp with a ctypes callback, a freshly compiled OpenMP kernel dlopened in a worker, and onnxruntime,
    all under the syscall filter and W^X: MemoryDenyWriteExecute=yes and @system-service do not break them."""
    env = os.environ | {"CACHE_DIRECTORY": os.environ["STATE_DIRECTORY"] + "-cache"}  # a cold cache: cc runs
    r = subprocess.run([*confined, sys.executable, "-c", CHECK_INSIDE], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout.strip())
    # a workload big enough for 2 threads (9.6 Mflops: the space refuses threads=2 below 2e5)
    r = subprocess.run([*confined, sys.executable, "-m", "edgetune.main", "bench", "gemm", "--workload",
                        "mobilenetv2.b6.project", "--ort", "--json", "--config", '{"threads": 2}'], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    print(f"confined bench: ok={doc['ok']} {doc['ms']:.4f} ms, onnxruntime {doc['ort_ms']:.4f} ms")
    assert doc["ok"] and doc["ort_ms"] > 0


@pytest.mark.skipif(not (REPO / "daemon" / "service.py").exists(), reason="the daemon (daemon/service.py) is not there yet")
def test_daemon_tunes_under_the_units_confinement(confined, tmp_path) -> None:
    from tests.test_daemon_support import DaemonProc, daemon_config

    d = DaemonProc(daemon_config(tmp_path, None))  # no broker; tunes its one small workload at once
    d.log_path = tmp_path / "daemon.log"
    d.proc = subprocess.Popen([*confined, sys.executable, "-m", "edgetune.main", "daemon", "--config", str(d.config)],
                              cwd=REPO, env=d.env, stdout=subprocess.DEVNULL, stderr=open(d.log_path, "wb"))
    try:
        st = d.wait_status(lambda s: s.get("last_tune") is not None and s["state"] == "idle", timeout=180)
        print(f"confined daemon tuned: {st['last_tune']}")
        assert d.signal(signal.SIGTERM) == 0
        assert "Traceback" not in d.log and "Operation not permitted" not in d.log, d.log[-3000:]
    finally:
        d.stop()


def test_fleet_server_serves_under_its_units_confinement(tmp_path, mosquitto) -> None:
    """`fleet serve` (uvicorn, the receiver thread, SQLite) under the fleet unit's syscall filter and W^X: it
    answers, stores what a device publishes, and stops cleanly on SIGTERM."""
    from tests.fleet_server import FleetServer
    from tests.test_fleet import Device

    server = FleetServer(mosquitto, dict(os.environ))
    token = server.token("viewer")
    server.start(prefix=_confined(FLEET_UNIT))
    try:
        dev = Device(mosquitto, "confined-1")
        dev.pub("status", {"state": "online", "session": 1, "version": "0.1.0"})
        dev.close()
        server.wait_json("/api/v1/overview", token, lambda o: o["statuses"]["online"] == 1)
        assert server.get("/", token).status == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log
        assert "Traceback" not in server.log and "Operation not permitted" not in server.log, server.log[-3000:]
    finally:
        server.stop()


@pytest.mark.parametrize("args,code", [(("--help",), 0), (("--bogus",), 2)])
def test_install_usage_is_the_whole_header(tmp_path, args, code) -> None:
    """The usage text is the script's header comment: all of it (it was cut mid-sentence, before 'requires
    --no-venv'), and nothing of the code below it."""
    r = install(tmp_path / "root", *args)
    lines = (SYSTEMD / "install.sh").read_text().splitlines()[5:]  # from line 6, the usage part of the header
    comment = itertools.takewhile(lambda ln: ln.startswith("#"), lines)
    header = [ln.removeprefix("#").removeprefix(" ") for ln in comment]
    assert r.returncode == code and r.stderr.endswith("\n".join(header) + "\n"), r.stderr
    assert header[-1].strip() == "requires --no-venv." and "set -eu" not in r.stderr
