"""`edgetune fleet …`: see and steer devices from the fleet side.

  edgetune fleet listen  --broker HOST[:PORT] [--db F|URL] [--share G]  store what devices publish (until stopped)
  edgetune fleet devices [--db F] [--json]                      state, last seen, hw, tuned workloads, mean speedup
  edgetune fleet show DEVICE [--db F] [--json]                  one device: info, active configs, records, status log
  edgetune fleet retune  DEVICE --broker … [--db F] [--any-device] [--wait]  send a retune, follow its progress
  edgetune fleet export-records -o FILE [--db F] [--json]       tuning records as JSONL training data
  edgetune fleet serve --broker … [--config F] [--port P]       receiver + web dashboard and JSON API (fleet/serve.py)
  edgetune fleet token create --role viewer|operator | list | revoke   API tokens of `fleet serve`
  edgetune fleet key create | model build|add|list|publish | rollout list|show|pause|resume|abort   (model_cli)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from edgetune.errors import BadInput, EdgetuneError
from edgetune.output import console, emit, err_console, fmt, json_flag, say, table
from edgetune.protocol import check_id
from fleet.mqtt import add_broker_args, broker_settings
from fleet.db import is_postgres
from fleet.store import FleetStore, default_path, open_fleet_store

if TYPE_CHECKING:
    from fleet.commands import CommandRun

log = logging.getLogger("fleet.cli")

# sends the command and waits, calling its argument on each response of the device
Send = Callable[[Callable[[dict], None]], "CommandRun"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fleet", help="fleet receiver: collect device reports over MQTT, list devices, send retunes",
                       description=__doc__.splitlines()[0])
    fs = p.add_subparsers(dest="fleet_verb", required=True,
                          metavar="{listen,serve,devices,show,retune,export-records,token,key,model,rollout}")

    q = fs.add_parser("listen", help="subscribe to every device and store what they publish (until SIGINT/SIGTERM)")
    add_broker_args(q)
    _db_arg(q)
    q.add_argument("--client-id", help="MQTT client id of the persistent session (default edgetune-fleet-<hostname>)")
    q.add_argument("--session-expiry", type=int, default=7 * 24 * 3600, metavar="S",
                   help="how long the broker keeps queueing for us while we are down (MQTT 5; default 7 days)")
    q.add_argument("--share", metavar="GROUP",
                   help="share the subscription with the other receivers of GROUP ($share/GROUP/…): each message "
                        "goes to one of them; give each its own --client-id")
    q.add_argument("--retention-days", type=float, metavar="D",
                   help="delete telemetry received more than D days ago, hourly (default: keep it all)")
    json_flag(q)
    q.set_defaults(func=cmd_listen)

    q = fs.add_parser("devices", help="devices: online state, last seen, hw summary, tuned workloads, mean speedup")
    _db_arg(q)
    json_flag(q)
    q.set_defaults(func=cmd_devices)

    q = fs.add_parser("show", help="one device: hw, active configs, tuning records, status history, commands")
    q.add_argument("device", help="device id")
    _db_arg(q)
    json_flag(q)
    q.set_defaults(func=cmd_show)

    q = fs.add_parser("retune", help="ask a device to retune (cmd/req op=retune) and follow its responses")
    q.add_argument("device", help="device id (as in edgetune/v1/<device>/…)")
    q.add_argument("--kernel", action="append", metavar="K", help="only this kernel (repeatable)")
    q.add_argument("--workload", action="append", metavar="W", help="only this workload (repeatable)")
    q.add_argument("--strategy", help="search strategy on the device, e.g. anneal, random, llm")
    q.add_argument("--budget", type=int, metavar="N", help="evaluations per workload")
    q.add_argument("--force", action="store_true", help="retune even when a result for this hw/fw/model exists")
    q.add_argument("--wait", action="store_true", help="follow the responses until succeeded, failed or rejected")
    q.add_argument("--timeout", type=float, default=900.0, metavar="S",
                   help="with --wait: give up after S seconds (default 900; exit 1)")
    q.add_argument("--ttl", type=float, default=600.0, metavar="S",
                   help="the device rejects the command if it reaches it more than S seconds from now (default 600)")
    q.add_argument("--any-device", action="store_true",
                   help="send even to a device the fleet DB has never heard from (e.g. one not yet connected)")
    add_broker_args(q)
    _db_arg(q)
    json_flag(q)
    q.set_defaults(func=cmd_retune)

    q = fs.add_parser("export-records", help="write the tuning records as JSONL for `edgetune train --records FILE`")
    q.add_argument("-o", "--output", required=True, metavar="FILE", help="JSONL file to write ('-': stdout)")
    q.add_argument("--device", help="only this device's records")
    _db_arg(q)
    json_flag(q)
    q.set_defaults(func=cmd_export_records)

    from fleet import model_cli, serve

    serve.register(fs)
    model_cli.register(fs, _open_existing, _db_arg)


def _db_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", metavar="FILE|URL",
                   help="fleet DB: a SQLite file or postgresql://USER@HOST/DB (default <state dir>/fleet.db)")


def _open_existing(db: str | None) -> FleetStore:
    if is_postgres(db):
        return open_fleet_store(db)
    path = Path(db) if db else default_path()
    if not path.exists():
        raise EdgetuneError(f"no fleet DB at {path}; run `edgetune fleet listen --broker …` first (or pass --db)")
    return FleetStore(path)


# ---- listen ----------------------------------------------------------------------------------------------------

def cmd_listen(args: argparse.Namespace) -> int:
    from edgetune.protocol import ProtocolError, topic_filter
    from fleet.listener import Listener
    from fleet.retention import Pruner

    if args.session_expiry < 0:
        raise BadInput(f"--session-expiry {args.session_expiry}: must be >= 0 seconds")
    if args.retention_days is not None and not args.retention_days > 0:
        raise BadInput(f"--retention-days {args.retention_days:g}: must be > 0")
    try:
        topic_filter(share=args.share)
    except ProtocolError as e:
        raise BadInput(f"--share: {e}") from None
    listener = Listener(broker_settings(args), args.db, client_id=args.client_id, session_expiry_s=args.session_expiry,
                        share=args.share)
    pruner = Pruner(args.db, args.retention_days).start() if args.retention_days else None

    def on_signal(signum: int, frame: Any) -> None:
        log.info("got %s, stopping", signal.Signals(signum).name)
        listener.request_stop()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        listener.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if pruner is not None:
            pruner.stop()
        counts = listener.store.counts() if listener.alarm is None else {"devices": "?", "records": "?"}
        listener.store.close()
    emit({"db": str(listener.store.path), "messages": dict(listener.counts), "batches": listener.stats(),
          "stored": counts, "alarm": listener.alarm}, args.json,
         lambda d: err_console.print(f"stopped; {d['messages'].get('messages', 0)} messages this run, "
                                     f"{counts['devices']} devices and {counts['records']} records in {d['db']}"
                                     + (f"; the fleet DB was failing: {d['alarm']}" if d["alarm"] else "")))
    return 1 if listener.alarm else 0


# ---- devices ---------------------------------------------------------------------------------------------------

def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def cmd_devices(args: argparse.Namespace) -> int:
    with _open_existing(args.db) as store:
        store.expire_commands(time.time())
        gaps = store.telemetry_gaps()
        devices = [{**d, "telemetry_gaps": gaps.get(d["id"])} for d in store.devices()]

    def render(ds: list[dict]) -> None:
        if not ds:
            console.print("no devices yet")
            return
        rows = [[d["id"], d["state"], _ago(d["last_seen_ago_s"]),
                 d["cpu_model"] or "?", d["isa"] or "?", d["cores"] if d["cores"] is not None else "?",
                 d["tuned_workloads"], fmt(d["mean_speedup"], 2) + ("x" if d["mean_speedup"] else ""), d["records"],
                 _gaps(d["telemetry_gaps"])]
                for d in ds]
        table("fleet devices", ["device", "state", "last seen", "cpu", "isa", "cores", "tuned", "speedup (geomean)",
                                "records", "telemetry (missing)"], rows)

    emit(devices, args.json, render)
    return 0


def _gaps(g: dict | None) -> str:
    return "-" if not g else f"{g['received']} ({g['missing']} missing)"


def _started_by(c: dict) -> str:
    """Who started a command and, for a device's own, why: "firmware-hook: firmware changed (rauc)"."""
    return (c.get("origin") or "-") + (f": {c['note']}" if c.get("note") else "")


def cmd_show(args: argparse.Namespace) -> int:
    with _open_existing(args.db) as store:
        summary = next(iter(store.devices(device=args.device)), None)
        if summary is None:
            raise BadInput(f"no device {args.device!r} in {store.path}; see `edgetune fleet devices`")
        store.expire_commands(time.time())
        detail = store.device(args.device) or {}
        data = {**summary, "info": detail.get("info"), "active": store.active_configs(args.device),
                "telemetry_gaps": store.telemetry_gaps().get(args.device),
                "records": [{k: r[k] for k in ("session_id", "kernel", "workload", "strategy", "state",
                                               "n_measurements", "copies", "received_at")}
                            for r in store.records(args.device)],
                "status_history": store.status_history(args.device)[-20:],
                "commands": store.commands(args.device)[-20:]}

    def render(d: dict) -> None:
        table(f"device {d['id']}", ["field", "value"], [
            ["state", f"{d['state']} (last seen {_ago(d['last_seen_ago_s'])})"], ["version", d["version"]],
            ["cpu", d["cpu_model"]], ["isa", d["isa"]], ["cores", d["cores"]],
            ["hw_fingerprint", d["hw_fingerprint"]], ["fw_fingerprint", d["fw_fingerprint"]],
            ["model", d["model_version"]], ["telemetry", _gaps(d["telemetry_gaps"])]])
        table("active configs", ["kernel/workload", "config", "ms", "default ms", "speedup", "strategy"], [
            [slot, json.dumps(e.get("config"), sort_keys=True), e.get("ms"), e.get("default_ms"),
             fmt(e["speedup"], 2) + "x" if isinstance(e.get("speedup"), (int, float)) else "-", e.get("strategy")]
            for slot, e in d["active"].items()])
        table("tuning records", ["id", "kernel/workload", "strategy", "state", "measurements"], [
            [r["session_id"], f"{r['kernel']}/{r['workload']}", r["strategy"], r["state"], r["n_measurements"]]
            for r in d["records"]])
        table("commands", ["id", "op", "started by", "status", "reason"], [
            [c["id"], c["op"], _started_by(c), c["status"] or "sent", c["reason"] or ""] for c in d["commands"]])

    emit(data, args.json, render)
    return 0


# ---- retune ----------------------------------------------------------------------------------------------------

def cmd_retune(args: argparse.Namespace) -> int:
    from fleet.commands import new_command, send_command

    cargs = _retune_args(args)
    known = _known_device(args.db, args.device)
    if known is False and not args.any_device:
        raise BadInput(f"no device {args.device!r} in the fleet DB, so nothing was sent; check the id with `edgetune "
                       "fleet devices`, or send anyway with --any-device")
    if known is None and not args.json:
        say(f"{args.device} is not checked against the devices the fleet knows (pass --db)",
            f"no fleet DB at {default_path()}:", "yellow", err=True)
    opts = broker_settings(args)
    command = new_command("retune", cargs, ttl_s=args.ttl)
    if not args.wait:
        run = send_command(opts, args.device, command, wait=False, timeout_s=args.timeout)
        emit({**run.to_dict(), "known": known}, args.json,
             lambda d: console.print(f"sent retune {d['id']} to {d['device']} (expires "
                                     f"{time.strftime('%H:%M:%S', time.localtime(d['expires_at']))})"))
        return 0

    def on_status(state: str, status: dict) -> None:
        if state != "online" and not args.json:
            say(f"the command reaches it only if it reconnects before "
                f"{time.strftime('%H:%M:%S', time.localtime(command['expires_at']))}",
                f"device {args.device} is {state}:", "yellow", err=True)

    follow = _follow_with_bar if sys.stderr.isatty() and not args.json else _follow_plain
    run = follow(args, lambda on_response: send_command(opts, args.device, command, wait=True,
                                                         timeout_s=args.timeout, on_response=on_response,
                                                         on_status=on_status), command["id"][:8])
    emit({**run.to_dict(), "known": known}, args.json, lambda d: _render_retune(d, args.timeout))
    return 0 if run.status == "succeeded" else 1


def _retune_args(args: argparse.Namespace) -> dict[str, Any]:
    """The retune command's arguments, every flag checked before anything is sent."""
    from fleet.commands import MAX_TTL_S

    check_id(args.device, "device id")
    if args.budget is not None and args.budget <= 0:
        raise BadInput(f"--budget {args.budget}: must be a positive number of evaluations")
    if not args.timeout > 0:
        raise BadInput(f"--timeout {args.timeout}: must be > 0 seconds")
    if not 0 < args.ttl <= MAX_TTL_S:
        raise BadInput(f"--ttl {args.ttl:g}: must be > 0 and at most {MAX_TTL_S:.0f} seconds (a device's broker "
                       "session keeps queued commands that long)")
    for flag in ("kernel", "workload"):
        for v in getattr(args, flag) or []:
            if not v.strip():
                raise BadInput(f"--{flag}: empty name")
    if args.strategy is not None and not args.strategy.strip():
        raise BadInput("--strategy: empty name")
    cargs: dict[str, Any] = {}
    if args.kernel:
        cargs["kernels"] = args.kernel
    if args.workload:
        cargs["workloads"] = args.workload
    if args.strategy:
        cargs["strategy"] = args.strategy
    if args.budget is not None:
        cargs["budget"] = args.budget
    if args.force:
        cargs["force"] = True
    return cargs


def _follow_with_bar(args: argparse.Namespace, send: Send, short: str) -> CommandRun:
    """Send and follow the device's responses on a progress bar (a terminal)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from fleet.commands import describe_progress, progress_parts

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                  TimeElapsedColumn(), console=err_console, transient=False) as bar:
        task = bar.add_task(f"{args.device} retune: sent", total=None, count="")

        def on_response(r: dict) -> None:
            done, total, text = progress_parts(r.get("progress"))
            desc = f"{args.device} retune: {r['status']}" + (f" {text}" if text else "")
            if r["status"] in ("failed", "rejected") and r.get("reason"):
                desc += f" ({r['reason']})"
            kw: dict[str, Any] = {"description": desc}
            if done is not None and total:
                kw.update(total=total, completed=done, count=describe_progress(r.get("progress")).split(" ")[0])
            if r["status"] == "succeeded" and bar.tasks[0].total:
                kw["completed"] = bar.tasks[0].total
            bar.update(task, **kw)

        return send(on_response)


def _follow_plain(args: argparse.Namespace, send: Send, short: str) -> CommandRun:
    """Send and follow the device's responses as lines on stderr (none with --json)."""
    from fleet.commands import describe_progress

    def on_response(r: dict) -> None:
        if args.json:
            return
        p = describe_progress(r.get("progress"))
        reason = f" reason: {r['reason']}" if r.get("reason") else ""
        say(f"{args.device} retune {short} {r['status']}" + (f" {p}" if p else "") + reason, err=True)

    return send(on_response)


def _render_retune(d: dict, timeout_s: float) -> None:
    if d["status"] == "succeeded":
        say("", f"retune on {d['device']} succeeded", "green")
        if d["result"] not in (None, {}, []):
            console.print_json(json.dumps(d["result"], default=str))
    elif d["status"] == "timeout":
        last = d["responses"][-1]["status"] if d["responses"] else "no response"
        say(f"(last: {last}; device state: {d['device_state'] or 'unknown'})",
            f"no final response from {d['device']} within {timeout_s:g} s", "red", err=True)
    else:
        say(d["reason"] or "", f"retune on {d['device']} {d['status']}" + (":" if d["reason"] else ""), "red",
            err=True)


def _known_device(db: str | None, device: str) -> bool | None:
    """Whether the fleet DB has heard from `device` (as the API's retune checks); None when there is no fleet DB
    here to ask: `fleet retune` needs only the broker."""
    if db is None and not default_path().exists():
        return None
    with _open_existing(db) as store:
        return store.device(device) is not None


# ---- export-records --------------------------------------------------------------------------------------------

def cmd_export_records(args: argparse.Namespace) -> int:
    n, devices = 0, set()
    with _open_existing(args.db) as store:
        if args.device and not store.devices(device=args.device):  # a typo would export nothing, silently
            raise BadInput(f"--device {args.device!r}: no such device in {store.path}; see `edgetune fleet devices`")
        if args.output == "-":
            for rec in store.iter_export(args.device):
                sys.stdout.write(json.dumps(rec, default=str) + "\n")
                n += 1
                devices.add(rec.get("device_id"))
            sys.stdout.flush()
            summary = {"path": "-", "records": n, "devices": len(devices)}
            if args.json:
                err_console.print_json(json.dumps(summary))
            return 0
        out = Path(args.output)
        if out.is_dir():
            raise BadInput(f"-o {out}: is a directory")
        if not out.parent.exists():
            raise BadInput(f"-o {out}: directory {out.parent} does not exist")
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
        try:
            with os.fdopen(fd, "w") as f:
                for rec in store.iter_export(args.device):
                    f.write(json.dumps(rec, default=str) + "\n")
                    n += 1
                    devices.add(rec.get("device_id"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)  # never a half-written training file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    summary = {"path": str(out), "records": n, "devices": len(devices)}
    emit(summary, args.json,
         lambda d: console.print(f"wrote {d['records']} records from {d['devices']} devices to {d['path']}"))
    return 0
