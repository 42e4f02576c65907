#!/usr/bin/env bash
# Creates (once) the venv the tests/it/zmq_publish_*.rs modules decode kvbridge's engine-wire
# output in, with vLLM's own event classes, and prints on its last line the directory that holds
# the wheel's `vllm/distributed/kv_events.py` (the venv's python is `../bin/python` from there).
#
#   scripts/vllm-events-venv.sh     # -> .../target/vllm-events-venv/vllm-0.33.0
#
# The classes are the engine's: the vLLM wheel is downloaded (--no-deps, so no torch) and only
# `vllm/distributed/kv_events.py` and `vllm/v1/core/kv_cache_utils.py` are kept, beside the venv;
# nothing of vLLM is copied into the repository. The venv holds msgspec alone, at the version
# pinned here (tests/zmq_publish/vllm_decode.py stubs the publisher's other imports).
#
# Needs a Python >= 3.10 with pip and access to PyPI (336 MB once, for the wheel). Idempotent
# (scripts/lib-venv.sh). Set PYTHON to choose the interpreter, VLLM_EVENTS_VENV to move the venv.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
VENV=${VLLM_EVENTS_VENV:-$TARGET/vllm-events-venv}
# vLLM 0.33.0: the newest layout docs/engine-wire.md describes (map events, V12).
VLLM=0.33.0
PINS=("msgspec==0.22.0")

. scripts/lib-venv.sh
ensure_venv "$VENV" 'import msgspec' "${PINS[@]}"
SRC="$VENV/vllm-$VLLM"
if [ ! -f "$SRC/vllm/distributed/kv_events.py" ] || [ ! -f "$SRC/vllm/v1/core/kv_cache_utils.py" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    venv_log "$VENV" "downloading vllm==$VLLM (no dependencies) for its kv_events.py"
    "$VENV/bin/python" -m pip download --disable-pip-version-check --no-input -q --no-deps \
        --only-binary=:all: -d "$tmp" "vllm==$VLLM" >&2
    "$VENV/bin/python" - "$tmp" "$SRC" <<'PY'
import glob, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
(whl,) = glob.glob(f"{tmp}/vllm-*.whl")
with zipfile.ZipFile(whl) as z:
    for name in ("vllm/distributed/kv_events.py", "vllm/v1/core/kv_cache_utils.py"):
        z.extract(name, dest)
PY
fi
echo "$SRC"
