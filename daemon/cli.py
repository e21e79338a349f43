"""Verbs `daemon`, `status`, `retune`, `ping`, `config check` and `notify firmware-changed`.

All but `daemon` and `config check` talk to a running daemon over the control socket; when it is down, or does not
answer (a timeout, a connection closed without a reply, an unreadable reply), they say so and exit 1 (`status`,
`ping` and `retune` with `--json` as a JSON object on stdout, `running` false or, when something holds the socket
but does not answer, null; `notify` instead leaves a marker the daemon reads at its next start). A running daemon
that answers with an error is not "down": that is its error, exit 1 (2 for bad input).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import stat
import time
from typing import Any, Callable

from edgetune import config as config_mod
from daemon import control, firmware
from edgetune.errors import BadInput, EdgetuneError
from edgetune.protocol import TERMINAL_STATES
from edgetune.sqlite import DBError, DBFull
from edgetune.output import emit, fmt, fmt_ms, json_flag, progress, say, table


log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("daemon", help="run the tuning daemon (systemd runs this; logs go to stderr)")
    p.add_argument("--config", metavar="FILE", help="one TOML file instead of /etc/edgetune/edgetune.toml + conf.d")
    p.add_argument("--reset", action="store_true",
                   help="move a corrupt results DB aside first (renamed, never deleted) and start a fresh one")
    json_flag(p)
    p.set_defaults(func=cmd_daemon)

    p = sub.add_parser("status", help="what the daemon is doing: state, job, queue, broker, outbox, last tune")
    json_flag(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("retune", help="ask the daemon to retune (all configured workloads, or some)")
    p.add_argument("--kernel", action="append", metavar="K", help="only this kernel (repeatable)")
    p.add_argument("--workload", action="append", metavar="W",
                   help="only this workload, or KERNEL/WORKLOAD (repeatable)")
    p.add_argument("--strategy", help="search strategy (default: the config's)")
    p.add_argument("--budget", type=int, metavar="N", help="evals per workload (default: the config's)")
    p.add_argument("--force", action="store_true", help="tune again even where a current result exists")
    p.add_argument("--wait", action="store_true", help="follow the progress until it finishes")
    json_flag(p)
    p.set_defaults(func=cmd_retune)

    p = sub.add_parser("ping", help="is the daemon running and answering?")
    json_flag(p)
    p.set_defaults(func=cmd_ping)

    p = sub.add_parser("config", help="daemon configuration")
    actions = p.add_subparsers(dest="action", required=True)
    q = actions.add_parser("check", help="report every problem in the config, with its file and key (exit 2 if any)")
    q.add_argument("--config", metavar="FILE", help="check this file instead of /etc/edgetune/edgetune.toml + conf.d")
    json_flag(q)
    q.set_defaults(func=cmd_config_check)

    p = sub.add_parser("notify", help="tell the daemon about an event (firmware update hooks call this)")
    events = p.add_subparsers(dest="event", required=True)
    q = events.add_parser("firmware-changed", help="the firmware changed: retune everything")
    q.add_argument("--source", required=True, choices=firmware.SOURCES, help="the update framework")
    q.add_argument("--next-boot", action="store_true",
                   help="the new firmware runs after the next reboot (a hook on the old system, before it): only "
                        "leave the marker, so the daemon retunes the new image when it starts there")
    json_flag(q)
    q.set_defaults(func=cmd_notify_firmware)


class CannotStart(EdgetuneError):
    """A DB the daemon must not replace by itself is unusable: exit 78 (EX_CONFIG), which the systemd unit does
    not restart (RestartPreventExitStatus), since restarting cannot help; the message names the fix."""

    exit_code = 78


def cmd_daemon(args: argparse.Namespace) -> int:
    from daemon.service import Daemon  # the heavy imports only for the daemon itself
    from tuner.db import ResultsDB

    cfg = config_mod.load_or_raise(args.config)
    if args.reset:
        aside = ResultsDB.reset()
        if aside:
            log.warning("--reset: moved the results DB aside to %s; starting a fresh one", aside)
    try:
        return Daemon(cfg, args.config).run()
    except DBError as e:
        if isinstance(e, DBFull):
            raise
        raise CannotStart(str(e)) from e


def _checked(reply: dict) -> dict:
    """`reply` if ok; else the daemon's own error. The daemon is up, so not DaemonDown: its "not running" would
    be wrong, and `notify` would leave a marker for a daemon that is there (and refused it)."""
    if reply.get("ok"):
        return reply
    why = reply.get("error") or "no reason given"
    if reply.get("exit") == 2:
        raise BadInput(why)
    raise EdgetuneError(f"the daemon replied with an error: {why}")


def _one(req: dict) -> dict:
    return _checked(next(control.request(req)))


def _json_when_down(cmd: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """With --json, a daemon that is down is an answer on stdout, not only a message on stderr: a script reading
    stdout gets JSON it can parse, not an empty string; the exit code still says it."""
    @functools.wraps(cmd)
    def run(args: argparse.Namespace) -> int:
        try:
            return cmd(args)
        except (control.NotListening, control.NoReply) as e:
            if not args.json:
                raise
            running = False if isinstance(e, control.NotListening) else None
            emit({"running": running, "socket": str(e.path), "reason": e.reason, "error": str(e),
                  "exit_code": e.exit_code}, True)
            return e.exit_code
    return run


@_json_when_down
def cmd_status(args: argparse.Namespace) -> int:
    emit(_one({"op": "status"}), args.json, _render_status)
    return 0


def _ago(ts: float | None) -> str:
    return "-" if not ts else f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))}"


def _render_status(st: dict) -> None:
    job = st.get("job")
    broker = st.get("broker") or {}
    if not broker:
        link = "-"
    elif not broker.get("configured"):
        link = "none configured (results kept locally)"
    else:
        link = (f"{broker['host']}:{broker['port']} {'connected' if broker['connected'] else 'disconnected'}"
                f" (MQTT {broker['protocol']}{', TLS' if broker['tls'] else ''})"
                + (f": {broker['last_error']}" if broker.get("last_error") else ""))
    ob = st.get("outbox") or {}
    last = st.get("last_tune")
    queue = st.get("queue") or {}
    rows = [
        ["state", st["state"]],
        ["device", f"{st['device_id']} (session {st.get('session', '-')}, pid {st['pid']}, up {st['uptime_s']:.0f} s)"],
        ["job", f"{job['message'] or ', '.join(job['targets'])} ({job['progress']:.0%}, {job['origin']})"
                if job else "-"],
        ["queue", f"{queue.get('jobs', 0)} job(s), {queue.get('targets', 0)} workload(s)"],
        ["broker", link],
        ["outbox", f"{ob.get('messages', 0)} message(s), {ob.get('bytes', 0)} B, {ob.get('dropped', 0)} dropped"],
        ["last tune", f"{last['target']} {fmt_ms(last['ms'])} ms, speedup {fmt(last['speedup'], 2)}x "
                      f"at {_ago(last['tuned_at'])}" if last else "-"],
        ["model", _model_line(st.get("model"), st.get("model_update"))],
    ]
    table(f"edgetune daemon {st['version']}", ["", ""], rows)


def _model_line(m: dict | None, up: dict | None) -> str:
    """The tuner model in use, where it came from, and the last release's state."""
    if not m:
        return "-"
    line = f"{m.get('name')} {m.get('version')}"
    if up:
        line += f", release v{up['release']} (slot {up['slot']})" if up.get("release") is not None else ", bundled"
        last = up.get("state")
        if last:
            line += f"; last release v{last.get('version')}: {last.get('state')}" + (
                f" ({last['reason']})" if last.get("reason") else "")
    return line


@_json_when_down
def cmd_ping(args: argparse.Namespace) -> int:
    t = time.perf_counter()
    reply = _one({"op": "ping"})
    reply["rtt_ms"] = round((time.perf_counter() - t) * 1000, 2)
    emit(reply, args.json, lambda r: say(f"pong: daemon {r['version']} is {r['state']} ({r['rtt_ms']} ms)"))
    return 0


@_json_when_down
def cmd_retune(args: argparse.Namespace) -> int:
    req: dict[str, Any] = {"op": "retune", "kernels": args.kernel, "workloads": args.workload,
                           "strategy": args.strategy, "budget": args.budget, "force": args.force, "wait": args.wait}
    last: dict = {}
    with progress(args.wait and not args.json) as bar:
        task = bar.add_task("retune", total=1.0) if bar else None
        for reply in control.request(req, timeout=None if args.wait else 10.0):
            last = _checked(reply)
            if bar and task is not None:
                bar.update(task, completed=reply.get("progress") or 0, description=reply.get("message") or "retune")
    if args.wait and last.get("status") not in TERMINAL_STATES:  # the daemon stopped or died meanwhile
        raise control.NoReply(control.socket_path(), f"connection closed before a final status (last: "
                              f"{last.get('status')}, command {last.get('id')})")
    emit(last, args.json, lambda r: say(
        f"retune {r['id']}: {r['status']}" + (f" ({r['reason']})" if r.get("reason") else "")))
    return {"rejected": 2, "failed": 1}.get(last.get("status", ""), 0)


def cmd_config_check(args: argparse.Namespace) -> int:
    loaded = config_mod.load(args.config)
    cfg = dataclasses.asdict(loaded.config)
    if cfg["mqtt"]["password"] is not None:
        cfg["mqtt"]["password"] = "***"
    warnings = secret_warnings(loaded.config, loaded.files)
    doc = {"ok": not loaded.problems, "files": loaded.files, "config": cfg,
           "problems": [dataclasses.asdict(p) for p in loaded.problems], "warnings": warnings}

    def render(d: dict) -> None:
        where = ", ".join(d["files"]) or "no config files (defaults)"
        for w in d["warnings"]:
            say(w, "warning:", "yellow")
        if d["ok"]:
            say(f"{where}; device id {cfg['device_id']}", "config OK:", "green")
            return
        say(f"in {where}:", f"{len(loaded.problems)} problem(s)", "red")
        for p in loaded.problems:
            say(f"  {p}")

    emit(doc, args.json, render)
    return 2 if loaded.problems else 0


def secret_warnings(cfg: Any, files: list[str]) -> list[str]:
    """What is valid but exposes the broker password: sent without TLS, or stored where every user can read it."""
    if cfg.mqtt.password is None:
        return []
    out = []
    if not cfg.mqtt.tls.enabled:
        out.append(f"mqtt.password goes to {cfg.mqtt.label} in clear text: enable TLS ([mqtt.tls] ca, or "
                   "enabled = true)")
    for f in files:
        try:
            mode, text = os.stat(f).st_mode, open(f).read()
        except OSError:
            continue
        if mode & stat.S_IROTH and "password" in text:
            out.append(f"{f} holds mqtt.password and is readable by every user (mode {stat.S_IMODE(mode):o}): "
                       f"chmod 600 {f} (or 640 with the daemon's group)")
    return out


def cmd_notify_firmware(args: argparse.Namespace) -> int:
    """A running daemon retunes now (the new firmware runs already); with --next-boot, or with the daemon down,
    the marker waits for the daemon's next start."""
    doc: dict[str, Any] = {"delivered": False}
    if not args.next_boot:
        try:
            reply = _one({"op": "notify", "event": "firmware-changed", "source": args.source})
            doc = {"delivered": True, "command_id": reply.get("id")}
        except control.DaemonDown:
            pass
    if not doc["delivered"]:
        doc["marker"] = str(firmware.write_marker(args.source))
    emit(doc, args.json, lambda d: say(
        f"daemon notified: retune {d['command_id']}" if d["delivered"]
        else f"left {d['marker']} for the daemon's next start"))
    return 0
