#!/bin/sh
# Install edgetune as a systemd service: a venv under the prefix, the units (the device's edgetune.service and
# the fleet server's edgetune-fleet.service, both inert until enabled), the sysusers entry, an example config and
# the firmware-update hooks. It changes nothing outside the files it installs: creating the user,
# reloading systemd and enabling the service are printed for you to run.
#
#   systemd/install.sh [--prefix DIR] [--python PYTHON] [--no-venv]
#
#   --prefix DIR      where edgetune lives (default /opt/edgetune): DIR/venv, DIR/hooks
#   --python PYTHON   interpreter for the venv (default python3; needs 3.11+)
#   --no-venv         install only the file tree (unit, sysusers, config, hooks); no venv, no pip. For image
#                     builds that create the venv elsewhere, and for tests.
#   DESTDIR=/stage    stage the tree under /stage (packaging). A venv is not relocatable, so DESTDIR
#                     requires --no-venv.
set -eu

# the usage text: the header comment from line 6 down to the first line of code, however long it grows
usage() { sed -n '6,/^[^#]/{/^#/s/^# \{0,1\}//p;}' "$0" >&2; exit "${1:-2}"; }

PREFIX=/opt/edgetune
PYTHON=python3
VENV=yes
while [ $# -gt 0 ]; do
    case $1 in
        --prefix) [ $# -ge 2 ] || usage; PREFIX=$2; shift 2 ;;
        --prefix=*) PREFIX=${1#*=}; shift ;;
        --python) [ $# -ge 2 ] || usage; PYTHON=$2; shift 2 ;;
        --python=*) PYTHON=${1#*=}; shift ;;
        --no-venv) VENV=no; shift ;;
        -h|--help) usage 0 ;;
        *) echo "install.sh: unknown argument: $1" >&2; usage ;;
    esac
done
case $PREFIX in
    *[!A-Za-z0-9/._-]*|[!/]*) echo "install.sh: --prefix must be an absolute path of [A-Za-z0-9/._-], not $PREFIX" >&2
        exit 2 ;;
esac
PREFIX=${PREFIX%/}
DESTDIR=${DESTDIR:-}
if [ -n "$DESTDIR" ] && [ "$VENV" = yes ]; then
    echo "install.sh: a venv cannot be staged into DESTDIR (its paths would point into $DESTDIR);" \
        "use --no-venv and create the venv on the target" >&2
    exit 2
fi

SRC=$(cd "$(dirname "$0")/.." && pwd)
UNITDIR=/usr/lib/systemd/system
SYSUSERSDIR=/usr/lib/sysusers.d
CONFDIR=/etc/edgetune
HOOKDIR=$PREFIX/hooks
BIN=$PREFIX/venv/bin/edgetune

# Shipped files name /opt/edgetune; point them at the chosen prefix.
put() {  # put MODE SOURCE TARGET
    mkdir -p "$DESTDIR$(dirname "$3")"
    sed "s#/opt/edgetune#$PREFIX#g" "$2" >"$DESTDIR$3.tmp"
    chmod "$1" "$DESTDIR$3.tmp"
    mv -f "$DESTDIR$3.tmp" "$DESTDIR$3"
}

if [ "$VENV" = yes ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "install.sh: $PYTHON is older than Python 3.11" >&2; exit 1; }
    "$PYTHON" -m venv "$PREFIX/venv"
    "$PREFIX/venv/bin/pip" install --quiet --upgrade pip
    "$PREFIX/venv/bin/pip" install --quiet "$SRC"
fi

put 0644 "$SRC/systemd/edgetune.service" "$UNITDIR/edgetune.service"
put 0644 "$SRC/systemd/edgetune-fleet.service" "$UNITDIR/edgetune-fleet.service"
put 0644 "$SRC/systemd/sysusers.d/edgetune.conf" "$SYSUSERSDIR/edgetune.conf"
put 0640 "$SRC/systemd/edgetune.toml.example" "$CONFDIR/edgetune.toml.example"
for hook in ArtifactCommit_Leave_50_edgetune rauc-post-install.sh swupdate-postupdate.sh; do
    put 0755 "$SRC/systemd/hooks/$hook" "$HOOKDIR/$hook"
done
# The real config may hold the broker password: readable by the service's group only, once it exists.
if [ -z "$DESTDIR" ] && getent group edgetune >/dev/null 2>&1; then
    chgrp edgetune "$CONFDIR/edgetune.toml.example"
fi

if [ "$VENV" = yes ]; then
    NEXT=""
else
    NEXT="
The file tree only: create the venv on the device first:
  $PYTHON -m venv $PREFIX/venv && $PREFIX/venv/bin/pip install <edgetune source>
"
fi
cat <<EOF
edgetune installed under ${DESTDIR}${PREFIX}.
$NEXT
To enable the service (as root on the device):
  systemd-sysusers $SYSUSERSDIR/edgetune.conf     # user edgetune, in group dialout
  install -m 0640 -g edgetune $CONFDIR/edgetune.toml.example $CONFDIR/edgetune.toml   # then edit it
  $BIN config check
  systemctl daemon-reload
  systemctl enable --now edgetune
  journalctl -u edgetune -f

On a fleet server instead (the dashboard, API and receiver; [fleet] in $CONFDIR/edgetune.toml):
  $PREFIX/venv/bin/pip install '<edgetune source>[fleet]'
  systemctl enable --now edgetune-fleet

Firmware-update hooks (each always exits 0, so it can never block or roll back an update):
  Mender:   ship $HOOKDIR/ArtifactCommit_Leave_50_edgetune in your Artifacts:
              mender-artifact write rootfs-image ... -s $HOOKDIR/ArtifactCommit_Leave_50_edgetune
  RAUC:     /etc/rauc/system.conf: [handlers] post-install=$HOOKDIR/rauc-post-install.sh
  SWUpdate: swupdate.cfg: globals: { postupdatecmd = "$HOOKDIR/swupdate-postupdate.sh"; };
EOF
