"""Broker options shared by the fleet verbs, and paho client construction (paho-mqtt 2.x, callback API v2).

paho is imported only when a client is made, so registering the verbs costs every `edgetune` run nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgetune.errors import BadInput

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt

PASSWORD_ENV = "EDGETUNE_MQTT_PASSWORD"
PROTOCOLS = ("5", "3.1.1")


@dataclass(frozen=True)
class BrokerOpts:
    host: str
    port: int
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    protocol: str = "5"  # "5" or "3.1.1"
    keepalive: int = 30

    @property
    def label(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'mqtts' if self.tls else 'mqtt'}://{host}:{self.port}"

    @property
    def v5(self) -> bool:
        return self.protocol == "5"


_HOSTPORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^\s:/\[\]]+))(?::(?P<port>[^:]*))?$")


def parse_broker(text: str, tls: bool = False) -> tuple[str, int]:
    """`HOST`, `HOST:PORT`, `[V6ADDR]:PORT`, optionally prefixed mqtt:// or mqtts://."""
    s = (text or "").strip()
    for scheme in ("mqtt://", "mqtts://", "tcp://", "ssl://"):
        if s.lower().startswith(scheme):
            s = s[len(scheme):].rstrip("/")
            tls = tls or scheme in ("mqtts://", "ssl://")
            break
    m = _HOSTPORT.match(s)
    if not m:
        raise BadInput(f"--broker {text!r}: expected HOST[:PORT], e.g. broker.local:1883 or [::1]:1883")
    host = m.group("v6") or m.group("host")
    port_s = m.group("port")
    if port_s is None or port_s == "":
        return host, 8883 if tls else 1883
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise BadInput(f"--broker {text!r}: port {port_s!r} is not a number in 1..65535")
    return host, int(port_s)


def add_broker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("broker")
    g.add_argument("--broker", required=True, metavar="HOST[:PORT]", help="MQTT broker (port 1883, 8883 with TLS)")
    g.add_argument("--username", help="broker user name")
    g.add_argument("--password", help=f"broker password (better: set ${PASSWORD_ENV}, which stays out of `ps`)")
    g.add_argument("--tls", action="store_true", help="TLS with the system CA store (implied by --ca/--cert)")
    g.add_argument("--ca", metavar="FILE", help="CA certificate (PEM) that signed the broker's certificate")
    g.add_argument("--cert", metavar="FILE", help="client certificate (PEM)")
    g.add_argument("--key", metavar="FILE", help="client key (PEM)")
    g.add_argument("--mqtt-version", choices=PROTOCOLS, default="5",
                   help="MQTT protocol (default 5; a 3.1.1-only broker is detected and used too)")


def broker_opts(args: argparse.Namespace) -> BrokerOpts:
    for flag in ("ca", "cert", "key"):
        f = getattr(args, flag)
        if f and not Path(f).is_file():
            raise BadInput(f"--{flag} {f}: no such file")
    if args.key and not args.cert:
        raise BadInput("--key needs --cert")
    tls = bool(args.tls or args.ca or args.cert)
    host, port = parse_broker(args.broker, tls)
    tls = tls or args.broker.strip().lower().startswith(("mqtts://", "ssl://"))
    password = args.password if args.password is not None else os.environ.get(PASSWORD_ENV)
    if password is not None and not args.username:
        raise BadInput("--password (or $EDGETUNE_MQTT_PASSWORD) needs --username")
    return BrokerOpts(host=host, port=port, username=args.username, password=password, tls=tls, ca=args.ca,
                      cert=args.cert, key=args.key, protocol=args.mqtt_version)


def make_client(opts: BrokerOpts, client_id: str, *, persistent: bool, manual_ack: bool = False) -> mqtt.Client:
    """A paho client for `opts`. `persistent`: the broker keeps our subscriptions and queues QoS 1 messages
    while we are away (MQTT 5 clean_start=False + session expiry; MQTT 3.1.1 clean_session=False)."""
    import paho.mqtt.client as mqtt

    protocol = mqtt.MQTTv5 if opts.v5 else mqtt.MQTTv311
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol,
                    clean_session=None if opts.v5 else not persistent, manual_ack=manual_ack)
    if opts.username:
        c.username_pw_set(opts.username, opts.password)
    if opts.tls:
        try:
            c.tls_set(ca_certs=opts.ca, certfile=opts.cert, keyfile=opts.key)
        except (OSError, ValueError) as e:
            raise BadInput(f"TLS setup failed ({e}); check --ca/--cert/--key") from e
    return c


def connect_kwargs(opts: BrokerOpts, *, persistent: bool, session_expiry_s: int) -> dict[str, Any]:
    if not opts.v5:
        return {}
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.CONNECT)
    if persistent:
        props.SessionExpiryInterval = session_expiry_s
    return {"clean_start": not persistent, "properties": props}


def unsupported_protocol(reason_code: Any) -> bool:
    return getattr(reason_code, "getName", lambda: str(reason_code))().lower() == "unsupported protocol version"


def hostname() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname() or "host")[:64]


def jitter(delay: float) -> float:
    """Full jitter on a backoff delay, so a fleet of clients does not reconnect in lockstep."""
    return random.uniform(delay / 2, delay)
