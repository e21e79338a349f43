"""`edgetune fleet key|model|rollout …`: the signing key, the model registry and staged rollouts.

  edgetune fleet key create [--out FILE]                         ed25519 key pair (private 0600, public <FILE>.pub)
  edgetune fleet model build [--where isa=…] [--device D]        retrain on the fleet's records; registers the model
  edgetune fleet model add FILE [--note TEXT]                    register a GGUF under the next version
  edgetune fleet model list                                      the registry (v1: the bundled model)
  edgetune fleet model publish VERSION --key FILE [--cohort 5%]  sign and start a staged rollout
  edgetune fleet rollout list | show ID | pause ID | resume ID | abort ID | retry ID [--device D]

Publishing writes the rollout to the fleet DB; the running `edgetune fleet serve` publishes the retained
releases, serves the file at /releases/{sha256}, advances the phases and applies the abort rule.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

from edgetune.errors import BadInput
from edgetune.output import console, emit, err_console, json_flag, table
from fleet import models as registry
from fleet import rollout_store as rs
from fleet.rollout import (BUCKETS, Policy, duration, parse_where, percent, phases_from, plan, rollout_summary,
                           select_devices)
from fleet.signing import create_key, default_key_path, load_private_key
from fleet.store import FleetStore
from tuner.train import FOCUS_SHARE, check_focus_share

Opener = Callable[[str | None], FleetStore]


def register(fs: argparse._SubParsersAction, open_store: Opener, db_arg: Callable) -> None:
    def verb(group: argparse._SubParsersAction, name: str, help: str, func: Callable, db: bool = True
             ) -> argparse.ArgumentParser:
        q = group.add_parser(name, help=help)
        if db:
            db_arg(q)
        json_flag(q)
        q.set_defaults(func=lambda a: func(a, open_store))
        return q

    k = fs.add_parser("key", help="the release-signing key").add_subparsers(dest="key_verb", required=True,
                                                                           metavar="{create}")
    q = verb(k, "create", "a new ed25519 key pair for signing model releases", cmd_key_create, db=False)
    q.add_argument("--out", type=Path, help=f"private key file (default {default_key_path()}); never overwritten")

    m = fs.add_parser("model", help="tuner models: build, add, list, publish").add_subparsers(
        dest="model_verb", required=True, metavar="{build,add,list,publish}")
    q = verb(m, "build", "retrain the tuner model on the fleet's tuning records (needs the [train] extra)",
             cmd_model_build)
    _selection(q)
    q.add_argument("--out", type=Path, help="where the GGUF and card go (default <state dir>/fleet-models/build-…)")
    q.add_argument("--steps", type=int, help="training steps (default: the shipped model's recipe)")
    q.add_argument("--max-minutes", type=float, default=30.0, help="stop training after this long (default 30)")
    q.add_argument("--no-base", action="store_true", help="train on the fleet's records only, not the committed data")
    q.add_argument("--focus-share", type=float, metavar="S",
                   help=f"share of the training draws given to the fleet's records (0 to below 1; default "
                        f"{FOCUS_SHARE}): a few dozen records beside the ~900 committed cases would barely move the "
                        "model")
    q = verb(m, "add", "register a GGUF model file under the next version", cmd_model_add)
    q.add_argument("file", type=Path)
    q.add_argument("--note", help="a note shown in the list")
    verb(m, "list", "the registered models", cmd_model_list)
    q = verb(m, "publish", "sign a model and start a staged rollout", cmd_model_publish)
    q.add_argument("version", type=int, help="model version (see `fleet model list`)")
    q.add_argument("--key", type=Path, help=f"private signing key (default {default_key_path()})")
    _selection(q)
    q.add_argument("--cohort", help="share of the targets in the first phase (default 5%%; then 25%%, 100%%)")
    q.add_argument("--phases", help="all phases as cumulative percentages, e.g. 5,25,100")
    q.add_argument("--min-dwell", default="10m", help="a phase runs at least this long before the next (default 10m)")
    q.add_argument("--advance-at", default="100%",
                   help="share of a phase's devices with a final report before the next phase (default 100%%)")
    q.add_argument("--abort-above", default="10%",
                   help="abort when the failure share of reporting devices is above this (default 10%%)")
    q.add_argument("--abort-after", type=int, default=1, metavar="N",
                   help="apply the abort rule once at least N devices reported a final state (default 1)")
    q.add_argument("--report-timeout", default="1h",
                   help="a device sent the release that reports nothing for this long counts as timed out, a "
                        "failure for the abort rule (default 1h)")
    q.add_argument("--expires-in", default="30d", help="the signed release's lifetime (default 30d)")
    q.add_argument("--target-isa", action="append", metavar="ISA",
                   help="devices of other ISAs refuse the manifest itself (repeatable; default: the --where isa, "
                        "else any)")

    r = fs.add_parser("rollout", help="staged rollouts: list, show, pause, resume, abort, retry").add_subparsers(
        dest="rollout_verb", required=True, metavar="{list,show,pause,resume,abort,retry}")
    verb(r, "list", "rollouts, newest first", cmd_rollout_list)
    for name, help in (("show", "one rollout: phases, devices, events"), ("pause", "stop releasing further phases"),
                       ("resume", "continue a paused rollout"),
                       ("abort", "stop it and send the signed rollback to the devices that got the release")):
        q = verb(r, name, help, cmd_rollout_show if name == "show" else cmd_rollout_action)
        q.add_argument("rollout", help="rollout id (see `fleet rollout list`)")
        if name != "show":
            q.add_argument("--reason", help="why (kept in the rollout's events)")
    q = verb(r, "retry", "send the release again to devices whose download or staging failed, or that timed out",
             cmd_rollout_retry)
    q.add_argument("rollout", help="rollout id")
    q.add_argument("--device", "--devices", dest="devices", action="append", metavar="D[,D…]",
                   help="only these devices (default: every failed one)")


def _selection(q: argparse.ArgumentParser) -> None:
    q.add_argument("--device", "--devices", dest="devices", action="append", metavar="D[,D…]",
                   help="only these devices (repeatable or comma-separated)")
    q.add_argument("--where", action="append", metavar="FIELD=VALUE",
                   help="only devices whose FIELD is VALUE, e.g. isa=x86-64-v2 (repeatable)")


def _devices(args: argparse.Namespace, store: FleetStore) -> tuple[list[str] | None, dict]:
    named = [d.strip() for item in args.devices or [] for d in item.split(",") if d.strip()] or None
    where = parse_where(args.where)
    selector = {"devices": named, "where": where}
    if named is None and not where:
        return None, selector
    return select_devices(store, named, where), selector


def _describe(selector: dict) -> str:
    """The selection as the operator typed it (`--devices a,b --where isa=x86-64-v2`), not a Python dict."""
    parts = [f"--devices {','.join(selector['devices'])}"] if selector["devices"] else []
    return " ".join(parts + [f"--where {k}={v}" for k, v in selector["where"].items()])


# ---- key ---------------------------------------------------------------------------------------------------------

def cmd_key_create(args: argparse.Namespace, open_store: Opener) -> int:
    k = create_key(args.out)
    emit({"private_key": str(k.private), "public_key": str(k.public), "key_id": k.key_id}, args.json,
         lambda d: console.print(f"key {d['key_id']}: private {d['private_key']} (mode 600, keep it off the "
                                 f"devices and out of backups of the state dir)\npublic {d['public_key']}: add it "
                                 "to the devices' [model_update] trusted_keys", highlight=False, markup=False))
    return 0


# ---- model -------------------------------------------------------------------------------------------------------

def _model_row(m: dict) -> list:
    return [f"v{m['version']}", m["name"], m["sha256"][:12], m["size"], m["model_version"] or "-", m["source"],
            time.strftime("%Y-%m-%d %H:%M", time.localtime(m["created_at"])), m["note"] or ""]


MODEL_COLUMNS = ["version", "name", "sha256", "bytes", "model version", "source", "added", "note"]


def cmd_model_build(args: argparse.Namespace, open_store: Opener) -> int:
    if args.steps is not None and args.steps < 1:
        raise BadInput(f"--steps {args.steps}: must be >= 1")
    if args.focus_share is not None:
        check_focus_share(args.focus_share)
    if not args.max_minutes > 0:  # 0 was no limit at all: a full training run
        raise BadInput(f"--max-minutes {args.max_minutes:g}: must be > 0 (default 30)")
    with open_store(args.db) as store:
        devices, selector = _devices(args, store)
        if devices == []:
            raise BadInput(f"no device matches {_describe(selector)}: nothing to train on (see `edgetune fleet "
                           "devices`)")
        err_console.print(f"training on the base data plus the records of "
                          f"{'every device' if devices is None else f'{len(devices)} device(s)'}; this takes minutes")
        m = registry.build(store, devices, args.out, steps=args.steps, max_minutes=args.max_minutes,
                           no_base=args.no_base, focus_share=args.focus_share)
    emit(m, args.json, lambda d: console.print(
        f"built v{d['version']} ({d['size']} bytes) from {d['records']} records of {d['devices']} device(s) in "
        f"{d['seconds']:.0f} s: {d['file']}; publish it with `edgetune fleet model publish {d['version']}`",
        highlight=False, markup=False))
    return 0


def cmd_model_add(args: argparse.Namespace, open_store: Opener) -> int:
    with open_store(args.db) as store:
        m = registry.add(store, args.file, note=args.note)
    emit({k: v for k, v in m.items() if k != "card"}, args.json,
         lambda d: console.print(f"added {args.file} as v{d['version']} (sha256 {d['sha256'][:16]}…)",
                                 highlight=False, markup=False))
    return 0


def cmd_model_list(args: argparse.Namespace, open_store: Opener) -> int:
    with open_store(args.db) as store:
        registry.ensure_bundled(store)
        ms = [{k: v for k, v in m.items() if k != "card"} for m in rs.models(store)]
        baseline = rs.baseline_version(store)
    for m in ms:
        m["baseline"] = m["version"] == baseline
    emit(ms, args.json, lambda d: table("tuner models (* the fleet's baseline)", MODEL_COLUMNS,
                                        [[("*" if m["baseline"] else "") + _model_row(m)[0], *_model_row(m)[1:]]
                                         for m in d]))
    return 0


def cmd_model_publish(args: argparse.Namespace, open_store: Opener) -> int:
    policy = Policy(phases_from(args.cohort, args.phases), duration(args.min_dwell, "--min-dwell"),
                    percent(args.advance_at, "--advance-at"), percent(args.abort_above, "--abort-above"),
                    args.abort_after, duration(args.report_timeout, "--report-timeout")).check()
    lifetime = duration(args.expires_in, "--expires-in")
    key = load_private_key(args.key or default_key_path())
    now = time.time()
    with open_store(args.db) as store:
        registry.ensure_bundled(store)
        model = rs.model(store, args.version)
        if model is None:
            raise BadInput(f"no model v{args.version}; see `edgetune fleet model list`")
        previous = rs.model(store, rs.baseline_version(store))
        if model["version"] <= previous["version"]:
            raise BadInput(f"v{model['version']} is not newer than the fleet's baseline v{previous['version']}: "
                           "devices refuse a downgrade (an abort sends the signed rollback)")
        devices, selector = _devices(args, store)
        targets = devices if devices is not None else select_devices(store, None, {})
        target_isa = args.target_isa or ([selector["where"]["isa"]] if "isa" in selector["where"] else None)
        row, cohort = plan(model, previous, key, policy, targets, expires_at=now + lifetime, target_isa=target_isa,
                           selector=selector, now=now)
        rs.create_rollout(store, row, cohort, now, "cli")
        r = rs.rollout(store, row["id"])
    first = sum(1 for _, _, p in cohort if p == 0)
    out = {"rollout": r["id"], "version": r["version"], "rollback_version": r["rollback_version"],
           "phases": r["phases"], "targets": len(cohort), "first_phase": first,
           "expires_at": r["manifest"]["expires_at"], "key_id": r["manifest"]["key_id"]}
    emit(out, args.json, lambda d: console.print(
        f"rollout {d['rollout']}: v{d['version']} to {d['targets']} device(s) in phases "
        f"{' → '.join(f'{p:g}%' for p in d['phases'])} ({d['first_phase']} in the first); abort returns them to "
        f"v{d['rollback_version']}. `edgetune fleet serve` publishes it.", highlight=False, markup=False))
    return 0


# ---- rollout -----------------------------------------------------------------------------------------------------

def summary(store: FleetStore, r: dict) -> dict:
    return rollout_summary(r, rs.targets(store, r["id"]))


def cmd_rollout_list(args: argparse.Namespace, open_store: Opener) -> int:
    with open_store(args.db) as store:
        out = [summary(store, r) for r in rs.rollouts(store)]
    emit(out, args.json, lambda d: table("rollouts", ["id", "version", "state", "phase", "targets", *BUCKETS], [
        [x["id"], f"v{x['version']}", x["state"], x["phase_label"], x["targets"],
         *(x["totals"][b] for b in BUCKETS)] for x in d]) if d else console.print("no rollouts yet"))
    return 0


def _get(store: FleetStore, rid: str) -> dict:
    r = rs.rollout(store, rid)
    if r is None:
        raise BadInput(f"no rollout {rid!r}; see `edgetune fleet rollout list`")
    return r


def cmd_rollout_show(args: argparse.Namespace, open_store: Opener) -> int:
    with open_store(args.db) as store:
        r = _get(store, args.rollout)
        out = {**summary(store, r), "devices": rs.targets(store, r["id"]), "events": rs.events(store, r["id"])}

    def render(d: dict) -> None:
        console.print(f"rollout {d['id']}: v{d['version']} {d['state']} at phase {d['phase_label']}"
                      + (f" ({d['reason']})" if d["reason"] else ""), highlight=False, markup=False)
        table("phases", ["phase", "released", "devices", *BUCKETS, "reasons"], [
            [p["label"], "yes" if p["released"] else "no", p["devices"], *(p["counts"][b] for b in BUCKETS),
             "; ".join(f"{k} x{n}" for k, n in p["reasons"].items())] for p in d["phases"]])
        table("devices", ["device", "phase", "sent", "state", "reason", "rollback"], [
            [t["device_id"], f"{d['phases'][t['phase']]['label']}", "yes" if t["sent_at"] else "no",
             t["state"] or "-", t["reason"] or "", t["rollback_state"] or ("sent" if t["rollback_sent_at"] else "")]
            for t in d["devices"]])
        table("events", ["when", "what", "by", "detail"], [
            [time.strftime("%H:%M:%S", time.localtime(e["ts"])), e["kind"], e["actor"] or "", e["detail"]]
            for e in d["events"]])

    emit(out, args.json, render)
    return 0


def cmd_rollout_action(args: argparse.Namespace, open_store: Opener) -> int:
    with open_store(args.db) as store:
        r = rs.act(store, args.rollout, args.rollout_verb, time.time(), "cli", args.reason)
        if r is None:
            raise BadInput(f"no rollout {args.rollout!r}; see `edgetune fleet rollout list`")
    emit({"rollout": r["id"], "state": r["state"]}, args.json,
         lambda d: console.print(f"rollout {d['rollout']} is {d['state']}" + (
             "; `fleet serve` sends the signed rollback" if d["state"] == "aborted" else ""),
             highlight=False, markup=False))
    return 0


def cmd_rollout_retry(args: argparse.Namespace, open_store: Opener) -> int:
    named = [d.strip() for item in args.devices or [] for d in item.split(",") if d.strip()] or None
    with open_store(args.db) as store:
        retried = rs.retry(store, args.rollout, named, time.time(), "cli")
    emit({"rollout": args.rollout, "retried": retried}, args.json, lambda d: console.print(
        f"retrying {', '.join(d['retried'])}: `fleet serve` sends the release again" if d["retried"] else
        "no device of that rollout has failed or timed out (rejected and rolled back are final)",
        highlight=False, markup=False))
    return 0
