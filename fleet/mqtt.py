"""The fleet verbs' broker flags (--broker, --username, --tls, …), turned into the shared broker settings."""

from __future__ import annotations

import argparse
import os
import re
import socket
from pathlib import Path

from edgetune.broker import PROTOCOLS, BrokerSettings, TlsSettings
from edgetune.errors import BadInput
from fleet.text import whole_number

PASSWORD_ENV = "EDGETUNE_MQTT_PASSWORD"
KEEPALIVE_S = 30  # the fleet notices a dead broker sooner than a device needs to


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
    port = whole_number(port_s)
    if port is None or not 0 < port < 65536:
        raise BadInput(f"--broker {text!r}: port {port_s!r} is not a number in 1..65535")
    return host, port


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


def broker_settings(args: argparse.Namespace) -> BrokerSettings:
    """The settings the flags describe; BadInput naming the flag when they cannot work (TLS files included)."""
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
    settings = BrokerSettings(host=host, port=port, username=args.username, password=password,
                              tls=TlsSettings(ca=args.ca, cert=args.cert, key=args.key, enabled=tls),
                              protocol=args.mqtt_version, keepalive=KEEPALIVE_S)
    if settings.tls.enabled:
        settings.tls.context()  # unusable certificates are bad input now, not a connection error later
    return settings


def hostname() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname() or "host")[:64]
