"""`edgetune config check` and config loading: every problem with its file and key; conf.d merges in order."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from edgetune import config
from tests.test_daemon_support import REPO, DaemonProc


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_check_reports_every_problem_with_file_and_key(tmp_path):
    etc = tmp_path / "etc"
    cert = write(tmp_path / "client.pem", "not checked beyond being readable")
    main = write(etc / "edgetune.toml", 'device_id = "a/b"\nbogus = 1\n[mqtt]\nhost = "h"\nport = "1883"\n'
                                        f'keepalive = 0\n[mqtt.tls]\nca = "/nonexistent.pem"\ncert = "{cert}"\n'
                                        '[tuning]\nstrategy = "nope"\nbudget = true\nworkloads = ["/no/such.toml"]\n')
    broken = write(etc / "conf.d" / "20-broken.toml", "[outbox\nmax_bytes = 1\n")
    write(etc / "conf.d" / "10-ok.toml", "[outbox]\nmax_bytes = 10\n")
    r = DaemonProc(tmp_path / "unused.toml").cli("config", "check", "--json")
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    got = {(p["file"], p["key"]) for p in doc["problems"]}
    m = str(main)
    assert {(m, "device_id"), (m, "bogus"), (m, "mqtt.port"), (m, "mqtt.keepalive"), (m, "mqtt.tls.ca"),
            (m, "mqtt.tls.key"), (m, "tuning.strategy"), (m, "tuning.budget"), (m, "tuning.workloads"),
            (str(etc / "conf.d" / "10-ok.toml"), "outbox.max_bytes"), (str(broken), "")} == got
    toml_err = next(p["message"] for p in doc["problems"] if p["file"] == str(broken))
    assert re.search(r"line [0-9]+", toml_err)
    assert doc["ok"] is False and doc["files"][0] == m

    r = DaemonProc(tmp_path / "unused.toml").cli("config", "check")
    assert r.returncode == 2 and f"{m}: mqtt.port: must be an integer" in r.stdout


def test_conf_d_merges_in_name_order_and_config_flag_reads_one_file(tmp_path):
    etc = tmp_path / "etc"
    write(etc / "edgetune.toml", '[mqtt]\nhost = "broker.local"\nkeepalive = 30\n[tuning]\nbudget = 10\n')
    write(etc / "conf.d" / "20-b.toml", "[tuning]\nbudget = 30\n")
    write(etc / "conf.d" / "10-a.toml", "[tuning]\nbudget = 20\nworkloads = [\"bundled\"]\n")
    loaded = config.load()
    assert not loaded.problems, loaded.problems
    cfg = loaded.config
    assert cfg.tuning.budget == 30 and cfg.tuning.workloads == ["bundled"]
    assert cfg.mqtt.host == "broker.local" and cfg.mqtt.keepalive == 30 and cfg.mqtt.effective_port == 1883
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]*", cfg.device_id)

    one = write(tmp_path / "one.toml",
                'device_id = "pi-7"\ntelemetry_interval_s = 5\n[tuning]\nworkloads = ["bundled"]\n')
    loaded = config.load(one)
    assert loaded.files == [str(one)] and loaded.config.device_id == "pi-7"
    assert loaded.config.telemetry_interval_s == 5.0 and loaded.config.mqtt.host is None
    r = DaemonProc(one).cli("config", "check", "--config", str(one))
    assert r.returncode == 0 and "config OK" in r.stdout


def test_daemon_refuses_a_bad_config(tmp_path):
    bad = write(tmp_path / "bad.toml", "telemetry_interval_s = -1\n")
    r = DaemonProc(bad).cli("daemon", "--config", str(bad))
    assert r.returncode == 2 and "telemetry_interval_s" in r.stderr


def test_power_is_a_typed_section_checked_by_its_package(tmp_path):
    from hwprobe.power import PowerConfig, RaplMeter, meter_from_config

    ok = write(tmp_path / "ok.toml", '[tuning]\nobjective = "energy"\nworkloads = ["bundled"]\n'
                                     '[power]\nmeter = "rapl"\nzone = "/sys/class/powercap/intel-rapl:0"\nidle_s = 2\n')
    loaded = config.load(ok)
    assert loaded.problems == []
    power = loaded.config.power
    assert isinstance(power, PowerConfig) and (power.meter, power.idle_s, power.port) == ("rapl", 2.0, None)
    assert isinstance(meter_from_config(power), RaplMeter)

    bad = write(tmp_path / "bad.toml", '[tuning]\nobjective = "energy"\nworkloads = ["bundled"]\n'
                                       '[power]\nmeter = "rapl"\nport = "/dev/ttyUSB0"\nidle_s = "long"\n')
    got = {(p.key, p.message) for p in config.load(bad).problems}
    assert got == {("power.idle_s", "must be a number, not 'long'"),
                   ("power", "power: unknown key(s) for meter 'rapl': port")}  # not also "needs a power meter"

    none = write(tmp_path / "none.toml", '[tuning]\nobjective = "edp"\nworkloads = ["bundled"]\n')
    assert [(p.key, p.message) for p in config.load(none).problems] == [
        ("tuning.objective", "'edp' needs a power meter: set [power] meter (text, um or rapl)")]


def test_an_isa_cap_names_a_level_of_this_device(tmp_path):
    """`isa = "armv8-a"` on x86_64 passed `config check` (every arch's levels counted), then the daemon exited 2
    naming the CLI flag --isa instead of the config key."""
    from hwprobe import cpuinfo
    from hwprobe.isa import LADDERS

    arch = cpuinfo.host_arch()
    if arch not in LADDERS:
        pytest.skip(f"no ISA ladder for {arch}")
    own, other = LADDERS[arch][0].name, next(lad[-1].name for a, lad in LADDERS.items() if a != arch)
    cfg = write(tmp_path / "e.toml", f'isa = "{other}"\n')
    problems = {p.key: p.message for p in config.load(cfg).problems}
    assert f"{other!r} is not an ISA level of this {arch} device" in problems["isa"] and own in problems["isa"]
    r = subprocess.run([sys.executable, "-m", "edgetune.main", "config", "check", "--config", str(cfg)], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "isa: " in r.stdout + r.stderr and "--isa" not in r.stdout + r.stderr
    write(cfg, f'isa = "{own}"\n')
    assert config.load(cfg).problems == [] and config.load(cfg).config.isa == own
