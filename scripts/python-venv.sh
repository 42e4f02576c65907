#!/usr/bin/env bash
# Creates (once) the Python venv the interop test runs in, and prints its python on the last line.
#
#   scripts/python-venv.sh            # -> .../target/interop-venv/bin/python
#
# The interop test (tests/it/interop.rs, tests/interop/smg_stubs.py) talks to kvbridge with SMG's
# *published* Python stubs, PyPI `smg-grpc-proto`, so it checks our wire against theirs rather than
# against our own generated code. docs/smg-api.md §8: test-only, exact version pins, never vendored —
# so the package is installed here, from PyPI, and nothing of it is copied into the repo.
#
# Needs only a Python >= 3.10 with pip (the package requires 3.10) and access to PyPI. Idempotent
# (scripts/lib-venv.sh). Set PYTHON to choose the interpreter, INTEROP_VENV to move the venv.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
VENV=${INTEROP_VENV:-$TARGET/interop-venv}

. scripts/lib-venv.sh
ensure_venv "$VENV" 'import smg_grpc_proto.generated.common_pb2, grpc, grpc_tools.protoc' "${SMG_PROTO_PINS[@]}"
echo "$VENV/bin/python"
