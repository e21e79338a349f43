"""`edgetune fleet serve`: the receiver, the dashboard/API, the model files (/releases/ over HTTP, model/chunk over
MQTT: fleet.chunk_server) and the rollout controller in one process, and `edgetune fleet token …`.

The receiver (fleet.listener) runs in a thread and owns its store connection; the ASGI app runs under uvicorn in
the main thread, which also takes SIGINT/SIGTERM, and reads the same DB through its own connections (SQLite in WAL
mode: readers never block the writer; or PostgreSQL). A retention thread (fleet.retention) prunes old telemetry.
Several servers on one PostgreSQL share the receiving with `[fleet] share_group` (or --share). Starlette, Jinja2
and uvicorn are imported only when serving, so the other verbs do not need them.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from edgetune.errors import BadInput, EdgetuneError
from edgetune.output import console, emit, json_flag, table
from fleet.config import FleetConfig, load_fleet_config
from fleet.mqtt import add_broker_args, broker_settings
from fleet.store import FleetStore
from fleet.tokens import ROLES, TokenStore

log = logging.getLogger("fleet.serve")


def register(fs: argparse._SubParsersAction) -> None:
    q = fs.add_parser("serve", help="receiver + web dashboard and JSON API (/api/v1/) in one process",
                      description="Store what devices publish and serve the fleet dashboard and API. Binds "
                                  "127.0.0.1 by default: put TLS in a reverse proxy in front (see README).")
    _config_arg(q)
    q.add_argument("--host", help="bind address (default [fleet] host, 127.0.0.1)")
    q.add_argument("--port", type=int, help="HTTP port (default [fleet] port, 8080)")
    q.add_argument("--client-id", help="MQTT client id of the receiver (default edgetune-fleet-<hostname>)")
    q.add_argument("--share", metavar="GROUP", help="shared-subscription group (default [fleet] share_group): "
                                                   "receivers of one group split the messages")
    add_broker_args(q)
    json_flag(q)
    q.set_defaults(func=cmd_serve)

    t = fs.add_parser("token", help="API tokens of the fleet server: create, list, revoke")
    ts = t.add_subparsers(dest="token_verb", required=True, metavar="{create,list,revoke}")

    def verb(name: str, help: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        q = ts.add_parser(name, help=help)
        _config_arg(q)
        json_flag(q)
        q.set_defaults(func=func)
        return q

    q = verb("create", "a new token, printed once (only its hash is kept)", cmd_token_create)
    q.add_argument("--role", required=True, choices=ROLES, help="viewer: read; operator: read and act")
    q.add_argument("--name", help="a name to tell it by (default <role>-<id>)")
    verb("list", "tokens with role, creation and last use (never the secret)", cmd_token_list)
    q = verb("revoke", "revoke a token by id or name; its browser sessions end too", cmd_token_revoke)
    q.add_argument("token", help="token id or name (see `fleet token list`)")


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="config file with a [fleet] section (default <config dir>/edgetune.toml and conf.d/)")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from fleet.chunk_server import ChunkServer
    from fleet.commands import send_command
    from fleet.listener import Listener
    from fleet.retention import Pruner
    from fleet.rollout_controller import RolloutController
    from fleet.store import open_fleet_store
    from fleet.web.server import create_app
    from fleet.web.auth import Auth
    from fleet.web.views import Limits

    cfg = load_fleet_config(args.config, host=args.host, port=args.port, share_group=args.share)
    opts = broker_settings(args)
    db = cfg.db
    sock = listen_socket(cfg.host, cfg.port)
    listener = Listener(opts, db, client_id=args.client_id, share=cfg.share_group)  # opens (and migrates) the DB
    _register_bundled(listener.store)
    auth = Auth(cfg.auth_path, session_s=cfg.session_hours * 3600, secure_cookies=cfg.secure_cookies,
                anonymous_read=cfg.anonymous_read)

    def send(device: str, command: dict) -> None:
        send_command(opts, device, command, wait=False, timeout_s=10.0)

    def health() -> dict:
        """Healthy while the receiver is connected and its fleet DB stores: without either, no device report
        reaches the fleet DB. `db` names the DB's error when it is the cause: the receiver then drops its broker
        connection to be sent the unstored messages again, so the broker alone would be blamed."""
        stores = listener.alarm is None
        return {"ok": listener.connected.is_set() and stores,
                "listener": {"connected": listener.connected.is_set(), "subscribed": listener.subscribed.is_set(),
                             "messages": listener.counts["messages"], "broker": opts.label,
                             "disconnected_since": listener.disconnected_since},
                "db": {"ok": stores, "path": str(listener.store.path), "error": listener.alarm}}

    app = create_app(lambda: open_fleet_store(db, threads=True), auth,
                     Limits(cfg.stale_minutes * 60, cfg.retention_days * 86400), send, health)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None, access_log=False,
                                           server_header=False))
    def stop(signum: int, frame: object) -> None:
        """uvicorn takes SIGINT/SIGTERM while serving and re-raises them once it has stopped: this then stops the
        receiver cleanly instead of killing the process before it can. A signal before uvicorn took over (say from
        a supervisor acting on the --json announcement at once) must stop uvicorn too, or it would serve on."""
        server.should_exit = True
        listener.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    listener.start()
    pruner = Pruner(db, cfg.retention_days).start()
    rollouts = RolloutController(opts, db).start()
    chunks = ChunkServer(opts, db, share=cfg.share_group or None).start()
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    emit({"url": f"http://{host}:{cfg.port}", "broker": opts.label, "db": str(listener.store.path),
          "pid": os.getpid()}, args.json,
         lambda d: log.info("fleet server on %s, db %s, broker %s", d["url"], d["db"], d["broker"]))
    try:
        server.run(sockets=[sock])  # returns after a signal, once the open requests finished
    finally:
        chunks.stop()
        rollouts.stop()
        pruner.stop()
        listener.stop()
        sock.close()
    return 0 if server.started else 1


def _register_bundled(store: FleetStore) -> None:
    """Register v1, the bundled model, so the Rollouts page and API list the fleet's baseline from the start
    rather than after the first `fleet model` verb; a server without the file still serves."""
    from fleet import models as registry

    try:
        registry.ensure_bundled(store)
    except EdgetuneError as e:
        log.warning("the model registry lacks the bundled model v1: %s", e)


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound and listening before anything else starts. A second server on a port in use must
    stop here: its receiver, under the same default client id, would otherwise take over the running server's
    broker session before the HTTP server found the port taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise BadInput(f"port {port} is in use ({host}:{port}: another fleet server or program listens there); "
                           "pick another with --port") from None
        raise BadInput(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --host or --port") from None


def _tokens(args: argparse.Namespace) -> tuple[FleetConfig, TokenStore]:
    cfg = load_fleet_config(args.config)
    return cfg, TokenStore(cfg.auth_path)


def cmd_token_create(args: argparse.Namespace) -> int:
    cfg, store = _tokens(args)
    with store:
        token, secret = store.create(args.role, args.name)
    emit({"id": token.id, "name": token.name, "role": token.role, "token": secret}, args.json,
         lambda d: console.print(f"{d['role']} token {d['name']!r} (id {d['id']}), shown only now:\n{d['token']}",
                                 highlight=False, markup=False, soft_wrap=True))
    return 0


def cmd_token_list(args: argparse.Namespace) -> int:
    cfg, store = _tokens(args)
    with store:
        tokens = [asdict(t) for t in store.list()]
    from fleet.web.filters import ago, when

    emit(tokens, args.json, lambda ts: table(f"tokens in {cfg.auth_path}", ["id", "name", "role", "created",
                                                                             "last used", "revoked"],
                                             [[t["id"], t["name"], t["role"], when(t["created_at"]),
                                               ago(t["last_used_at"]), when(t["revoked_at"])] for t in ts]))
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    if not args.token.strip():
        raise BadInput("token: empty; give an id or a name from `edgetune fleet token list`")
    cfg, store = _tokens(args)
    with store:
        token = store.revoke(args.token.strip())
    emit(asdict(token), args.json, lambda d: console.print(f"revoked token {d['name']!r} (id {d['id']})", markup=False))
    return 0

