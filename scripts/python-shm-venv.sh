#!/usr/bin/env bash
# Creates (once) the venv the Python ring-reader tests and bench run in, builds the `kvbridge_shm`
# wheel from python/ into it, and prints the venv's python on the last line.
#
#   scripts/python-shm-venv.sh        # -> .../target/pyshm-venv/bin/python
#
# The package is installed the way users install it, `pip install ./python` (maturin, pinned in
# python/pyproject.toml), except that the pinned maturin is preinstalled in the venv and used
# with --no-build-isolation, so a rebuild downloads nothing. The wheel is rebuilt only when a
# source it is built from changed (stamp: hash of python/ and shm/ sources). smg-grpc-proto and
# grpcio are there for `kvbridge_shm.parse_batch` and for the gRPC subscriber of the bench.
#
# Needs a Python >= 3.10 with pip, PyPI and crates.io. Set PYTHON to choose the interpreter,
# PYSHM_VENV to move the venv.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
VENV=${PYSHM_VENV:-$TARGET/pyshm-venv}

. scripts/lib-venv.sh
# The interop venv's pins (SMG_PROTO_PINS, scripts/lib-venv.sh) plus the build backend.
PINS=("maturin==1.16.0" "${SMG_PROTO_PINS[@]}")
ensure_venv "$VENV" 'import smg_grpc_proto.generated.common_pb2, grpc, maturin' "${PINS[@]}"

# Still under ensure_venv's flock (fd 9): one build at a time per venv.
src_hash=$(cd "$ROOT" && find python shm -type f \
        \( -name '*.rs' -o -name '*.toml' -o -name '*.py' -o -name '*.pyi' -o -name 'Cargo.lock' \) \
        -not -path 'python/bench/*' -not -path 'python/tests/*' -print0 \
    | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-64)
stamp="$VENV/.kvbridge-shm-wheel"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$src_hash" ] \
    && "$VENV/bin/python" -c 'import kvbridge_shm' 2>/dev/null; then
    echo "$VENV/bin/python"
    exit 0
fi
venv_log "$VENV" "building and installing ./python (maturin, release)"
rm -f "$stamp"
# The venv on PATH: the build backend runs the `maturin` executable. Its own cargo target directory: the calling `cargo test` holds the lock of $TARGET/release.
PATH="$VENV/bin:$PATH" CARGO_TARGET_DIR="$TARGET/pyshm-build" CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2} \
    "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q \
    --no-build-isolation --no-deps --force-reinstall ./python >&2
"$VENV/bin/python" -c 'import kvbridge_shm'
printf '%s\n' "$src_hash" >"$stamp"
echo "$VENV/bin/python"
