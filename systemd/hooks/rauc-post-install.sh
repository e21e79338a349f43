#!/bin/sh
# RAUC post-install handler: tell edgetune the firmware changed, so it retunes every kernel for the new image.
#
# Enable it in /etc/rauc/system.conf:
#   [handlers]
#   post-install=/opt/edgetune/hooks/rauc-post-install.sh
# (RAUC allows one post-install handler: if you already have one, call this script from it.) It runs on the
# old system after the slots are written, before the reboot: the marker lands in the shared state dir and is
# read when the new image boots. A non-zero exit would fail the installation, so this script exits 0.
SOURCE=rauc

# --- common body: identical in every edgetune hook (tests/test_hooks.py checks) ------------------------------
# A retune problem must never block or roll back an update: no `set -e`, every step guarded, always exit 0.
# Idempotent (the marker is replaced, never appended) and offline-safe (nothing here needs the network).
# Messages go to stderr, which Mender keeps in its deployment log and RAUC/SWUpdate pass to their logs.
#   EDGETUNE_STATE_DIR       the daemon's state dir (default /var/lib/edgetune; on A/B systems it must be on
#                            the shared data partition so the marker survives the slot switch)
#   EDGETUNE_RUNTIME_DIR     where its control socket lives (default /run/edgetune)
#   EDGETUNE_BIN             the edgetune CLI (default: edgetune on PATH, else the installed venv's)
#   EDGETUNE_NOTIFY_TIMEOUT  seconds the CLI may take (default 10: Python start-up on a slow ARM core takes
#                            seconds); past it, the marker covers for the CLI
umask 022
STATE_DIR=${EDGETUNE_STATE_DIR:-/var/lib/edgetune}
RUNTIME_DIR=${EDGETUNE_RUNTIME_DIR:-/run/edgetune}
INSTALLED_BIN=/opt/edgetune/venv/bin/edgetune
NOTIFY_TIMEOUT=${EDGETUNE_NOTIFY_TIMEOUT:-10}

log() { echo "edgetune $SOURCE hook: $*" >&2; }

edgetune_bin() {
    if [ -n "${EDGETUNE_BIN:-}" ]; then
        echo "$EDGETUNE_BIN"
    else
        command -v edgetune 2>/dev/null || echo "$INSTALLED_BIN"
    fi
}

# Run "$@" with a time limit, with whichever timeout(1) this system has (coreutils, or old/new busybox).
bounded() {
    if timeout -k 2 1 true 2>/dev/null; then
        timeout -k 2 "$NOTIFY_TIMEOUT" "$@"
    elif timeout -t 1 true 2>/dev/null; then
        timeout -t "$NOTIFY_TIMEOUT" "$@"
    else
        "$@"
    fi
}

# Mender's hook runs in the new system after the reboot: the CLI tells a running daemon to retune now, or
# leaves the marker itself when it is down. RAUC's and SWUpdate's run in the old system before the reboot: a
# running daemon would retune the old image, so the CLI only leaves the marker for the next boot (--next-boot).
notify() {
    bin=$(edgetune_bin)
    if [ ! -x "$bin" ]; then
        log "no edgetune CLI at $bin"
        return 1
    fi
    case $SOURCE in
        mender) when= ;;
        *) when=--next-boot ;;
    esac
    STATE_DIRECTORY=$STATE_DIR RUNTIME_DIRECTORY=$RUNTIME_DIR \
        bounded "$bin" notify firmware-changed --source "$SOURCE" $when >/dev/null 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || log "edgetune notify failed (exit $rc)"
    return "$rc"
}

# Atomic: readers see the old marker or the new one, never a partial file (write, fsync, rename, fsync dir).
write_marker() {
    marker=$STATE_DIR/firmware-changed
    tmp=$STATE_DIR/.firmware-changed.$$
    mkdir -p "$STATE_DIR" 2>/dev/null
    if printf '{"source": "%s", "ts": %s}\n' "$SOURCE" "$(date +%s)" 2>/dev/null >"$tmp" \
        && { sync "$tmp" 2>/dev/null; mv -f "$tmp" "$marker" 2>/dev/null; }; then
        sync "$STATE_DIR" 2>/dev/null
        log "left $marker for the daemon"
    else
        rm -f "$tmp" 2>/dev/null
        log "could not write $marker; the daemon still notices the new firmware by its fingerprint"
    fi
}

if notify; then
    log "edgetune notify firmware-changed succeeded (daemon told, or marker left by the CLI for its next start)"
else
    write_marker
fi
exit 0
