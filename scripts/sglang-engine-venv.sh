#!/usr/bin/env bash
# Creates (once) the venv with the real SGLang engine that the real-engine tests run on this CPU
# (PyPI `sglang` 0.5.23), and prints the venv's python on its last line.
#
#   scripts/sglang-engine-venv.sh     # -> ~/.cache/kvbridge/sglang-0.5.23/bin/python
#
# The venv is ~7 GiB and takes a few minutes to install, so it lives outside the target
# directory and is shared by every checkout and CI run on the machine:
# ${KVBRIDGE_CACHE:-$HOME/.cache/kvbridge}/sglang-0.5.23, or SGLANG_ENGINE_VENV.
#
# Every package is pinned (tests/real_engine/sglang-requirements.txt, transitive ones included)
# and installed with --no-deps, wheels only: sglang's own requirements include CUDA-only packages
# that have no place (nor, for some, a wheel) on a CPU machine, so the pins are its requirements
# less those, with PyPI's `torch==2.14.1` it pins (its CUDA build runs on the CPU). Its kernel
# package `sglang-kernel` (module `sgl_kernel`) is one of them: PyPI has it only as a CUDA build,
# yet SGLang imports it on the CPU too, so the venv gets the torch stand-in of
# tests/real_engine/sgl_kernel_cpu instead, copied into site-packages (re-copied whenever the
# checkout's copy differs). torch, transformers, tokenizers and safetensors, which
# tests/real_engine/make_model.py builds the test model with, are among the pins, so this venv can
# build it as well as the vLLM one.
#
# Needs Python 3.11 - 3.13 (sglang 0.5.23 has wheels for cp311 - cp313, x86_64, glibc >= 2.34; the
# pins were resolved on 3.11) with pip and access to PyPI. Idempotent (scripts/lib-venv.sh: a stamp
# of the pins, flock against concurrent callers). PYTHON chooses the interpreter. Fails with one
# clear message when it cannot install.
set -Eeuo pipefail

cd "$(dirname "$0")/.."
SGLANG=0.5.23
VENV=${SGLANG_ENGINE_VENV:-${KVBRIDGE_CACHE:-$HOME/.cache/kvbridge}/sglang-$SGLANG}
REQS=tests/real_engine/sglang-requirements.txt
STANDIN=tests/real_engine/sgl_kernel_cpu/sgl_kernel

fail() {
    echo "scripts/sglang-engine-venv.sh: cannot install the real SGLang engine (sglang==$SGLANG) into $VENV: $1" >&2
    echo "  it needs Python 3.11 - 3.13 with pip (PYTHON=...), access to PyPI and ~7 GiB of disk" >&2
    exit 1
}
trap 'fail "a step above failed (see its output)"' ERR

py=${PYTHON:-python3}
command -v "$py" >/dev/null 2>&1 || fail "no '$py' on PATH"
"$py" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 13) else 1)' \
    || fail "$("$py" --version 2>&1) cannot run sglang $SGLANG (wheels for Python 3.11 - 3.13 only)"

mapfile -t PINS < <(grep -Ev '^[[:space:]]*(#|$)' "$REQS")
[ "${#PINS[@]}" -gt 100 ] || fail "$REQS lists only ${#PINS[@]} packages"

# The pip cache would keep a second copy of the ~4 GiB of wheels.
export PIP_NO_CACHE_DIR=1
. scripts/lib-venv.sh
# The check is cheap (no torch import): the stamp is written only after a whole install passed it.
ensure_venv "$VENV" "import importlib.metadata as m, importlib.util as u; assert m.version('sglang') == '$SGLANG' and m.version('torch') == '2.14.1'; assert all(u.find_spec(p) for p in ('sglang', 'torch', 'transformers', 'tokenizers', 'safetensors', 'zmq', 'msgspec', 'IPython', 'torchvision', 'dill'))" \
    --no-deps --only-binary=:all: "${PINS[@]}" "sglang==$SGLANG"

# Still under ensure_venv's lock (fd 9 stays open until the script exits), so two callers never
# copy at once.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! diff -rq -x __pycache__ "$STANDIN" "$site/sgl_kernel" >/dev/null 2>&1; then
    venv_log "$VENV" "installing the sgl_kernel stand-in from $STANDIN"
    rm -rf "$site/sgl_kernel"
    cp -r "$STANDIN" "$site/sgl_kernel"
    rm -rf "$site/sgl_kernel/__pycache__"
fi
"$VENV/bin/python" -c "import importlib.util as u, os; s = u.find_spec('sgl_kernel'); assert s and os.path.dirname(s.origin) == '$site/sgl_kernel', s" \
    || fail "sgl_kernel does not resolve to the stand-in in $site"
echo "$VENV/bin/python"
