#!/usr/bin/env bash
# Builds the `kvbridge` wheel (pyproject.toml at the root) into OUT_DIR and prints its path on the
# last line:
#
#   scripts/build-wheel.sh [OUT_DIR]     # default dist/ (relative to the current directory)
#
# One wheel, kvbridge-<version>-cp39-abi3-manylinux_2_28_x86_64.whl, holding
#   - the `kvbridge` binary, stripped, as wheel data (`<name>.data/scripts/`: pip puts it in the
#     environment's bin/, on PATH), and
#   - the Python ring reader `kvbridge_shm` (the PyO3 extension module of python/, abi3).
# Both are linked against glibc 2.28 with zig (PyPI `ziglang`, driven by `cargo-zigbuild` for the
# binary and by maturin's --zig for the module), so the wheel runs on any manylinux_2_28 system
# (RHEL 8, Debian 10, Ubuntu 18.10 and later); `auditwheel show` must report that tag, or the
# build fails. The build tools are pinned and installed into a venv by this script
# (scripts/lib-venv.sh; once). Both builds use CARGO_TARGET_DIR (default target/): the binary in
# its x86_64-unknown-linux-gnu/ subfolder (a build of its own, which leaves the host build and the
# tests' artifacts untouched), the module in pyshm-build/ as scripts/python-shm-venv.sh does.
#
# Needs Python >= 3.10 with pip, PyPI and crates.io. WHEEL_VENV moves the venv.
set -euo pipefail

OUT=${1:-dist}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
mkdir -p "$TARGET"
TARGET=$(cd "$TARGET" && pwd)
VENV=${WHEEL_VENV:-$TARGET/wheel-venv}
GLIBC=2.28
TRIPLE=x86_64-unknown-linux-gnu

# Exact pins, transitive ones included (auditwheel needs pyelftools and packaging).
PINS=(
    "maturin==1.16.0"
    "ziglang==0.17.0"
    "cargo-zigbuild==0.24.0"
    "auditwheel==6.8.2"
    "pyelftools==0.33"
    "packaging==26.3"
)
. scripts/lib-venv.sh
ensure_venv "$VENV" 'import maturin, ziglang, auditwheel' "${PINS[@]}"
# Still under ensure_venv's flock (fd 9): one wheel build at a time per venv.
export PATH="$VENV/bin:$PATH"
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
wheel_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
[ "$version" = "$wheel_version" ] \
    || { echo "pyproject.toml version $wheel_version differs from Cargo.toml's $version" >&2; exit 1; }

t0=$(date +%s)
echo "build-wheel: kvbridge $version for $TRIPLE, glibc $GLIBC (cargo zigbuild)" >&2
CARGO_TARGET_DIR="$TARGET" cargo zigbuild --release --locked --bin kvbridge \
    --target "$TRIPLE.$GLIBC" >&2
BIN="$TARGET/$TRIPLE/release/kvbridge"
DATA=python/wheel-data
rm -rf "$DATA"
mkdir -p "$DATA/scripts"
cp "$BIN" "$DATA/scripts/kvbridge"
# Stripped: no symbol table either (panic messages still name the panic's place).
strip --strip-all "$DATA/scripts/kvbridge" 2>/dev/null \
    || python -m ziglang objcopy --strip-all "$DATA/scripts/kvbridge"
stripped_kib=$(( $(stat -c %s "$DATA/scripts/kvbridge") / 1024 ))
t1=$(date +%s)

echo "build-wheel: the kvbridge_shm module and the wheel (maturin --zig)" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
CARGO_TARGET_DIR="$TARGET/pyshm-build" maturin build --release --locked --zig \
    --target "$TRIPLE" --compatibility "manylinux_$(tr . _ <<<"$GLIBC")" \
    --interpreter "$VENV/bin/python" --out "$tmp" >&2
rm -rf "$DATA"
whl=$(ls "$tmp"/kvbridge-"$version"-*.whl)
t2=$(date +%s)

# auditwheel looks at every ELF file in the wheel, the binary included.
show=$(auditwheel show "$whl")
echo "$show" >&2
# The tag auditwheel finds the wheel consistent with: manylinux_2_28 or older.
tag=$(grep -o 'manylinux_2_[0-9]*_x86_64' <<<"$show" | head -1)
minor=${tag#manylinux_2_}
minor=${minor%_x86_64}
[ -n "$tag" ] && [ "$minor" -le "${GLIBC#2.}" ] \
    || { echo "build-wheel: auditwheel reports ${tag:-no manylinux tag} for $whl, not manylinux_2_${GLIBC#2.} or older" >&2; exit 1; }
python - "$whl" <<'PY' >&2
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert any(n.endswith(".data/scripts/kvbridge") for n in names), f"no kvbridge binary in {names}"
assert any(n.startswith("kvbridge_shm/_native") for n in names), f"no kvbridge_shm module in {names}"
PY
rm -f "$OUT"/kvbridge-"$version"-*.whl
mv "$whl" "$OUT/"
whl="$OUT/$(basename "$whl")"
echo "build-wheel: $(basename "$whl"): $(du -k "$whl" | cut -f1) KiB (kvbridge $(( $(stat -c %s "$BIN") / 1024 )) KiB as linked, $stripped_kib KiB stripped); binary $((t1 - t0)) s, module and wheel $((t2 - t1)) s" >&2
echo "$whl"
