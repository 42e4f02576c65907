#!/usr/bin/env bash
# Creates (once) the venv with SMG's published gateway wheel, PyPI `smg` (the `smg` command:
# the gateway, and `smg.servicer`, SMG's own Rust engine servicer), and prints its python on the
# last line. Tests that run the real gateway and benchmarks that measure the servicer use it.
#
#   scripts/smg-venv.sh               # -> .../target/smg-venv/bin/python (the `smg` CLI beside it)
#
# Test-only and pinned exactly (transitive pins included); nothing of the wheel is copied into the
# repository. Idempotent (scripts/lib-venv.sh). SMG_VENV moves the venv.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
VENV=${SMG_VENV:-$TARGET/smg-venv}

# smg 1.13.0 requires grpcio, grpcio-health-checking, pyyaml, setproctitle (unversioned); these
# are the versions that resolved on 2026-11-30. Change them together.
PINS=(
    "smg==1.13.0"
    "grpcio==1.85.3"
    "grpcio-health-checking==1.85.1"
    "protobuf==7.36.2"
    "PyYAML==6.0.4"
    "setproctitle==1.3.8"
    "typing_extensions==4.16.0"
)

. scripts/lib-venv.sh
ensure_venv "$VENV" 'import smg, grpc' "${PINS[@]}"
echo "$VENV/bin/python"
