#!/usr/bin/env bash
# Creates (once) the venv tests/it/zmq_publish_dynamo.rs runs Dynamo's standalone KV indexer in
# (`python -m dynamo.indexer`, PyPI `ai-dynamo-runtime`), and prints its python on the last line.
#
#   scripts/dynamo-venv.sh     # -> .../target/dynamo-venv/bin/python
#
# The indexer is Dynamo's own (a Rust extension in the wheel; CPU only, no etcd or NATS in its
# HTTP-only mode): the test registers kvbridge's and the engine's ZMQ endpoints with it and
# compares the routing scores. Exact pins, transitive ones included. Needs a Python >= 3.10 with
# pip and PyPI (75 MB once). Idempotent (scripts/lib-venv.sh). Set PYTHON to choose the
# interpreter, DYNAMO_VENV to move the venv.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
VENV=${DYNAMO_VENV:-$TARGET/dynamo-venv}
PINS=(
    "ai-dynamo-runtime==1.6.1"
    "pydantic==2.13.5"
    "pydantic_core==2.46.5"
    "annotated-types==0.8.0"
    "typing-inspection==0.4.5"
    "typing_extensions==4.16.0"
    "uvloop==0.23.0"
)

. scripts/lib-venv.sh
ensure_venv "$VENV" 'from dynamo.llm import run_kv_indexer' "${PINS[@]}"
echo "$VENV/bin/python"
