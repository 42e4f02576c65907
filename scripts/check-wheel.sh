#!/usr/bin/env bash
# Builds the wheel (scripts/build-wheel.sh), installs it with `pip install --no-index` into a
# fresh venv and uses it as a user would: `kvbridge --version`, `kvbridge demo --duration 5`, and
# the demo's ring read with the installed `kvbridge_shm`. Fails if the wheel lacks the binary or
# the module, or if either does not work. Run by scripts/test.sh.
#
#   scripts/check-wheel.sh [OUT_DIR]     # the wheel is left in OUT_DIR (default: a temp dir)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=$(mktemp -d /tmp/kvbridge-wheel-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
OUT=${1:-$WORK/dist}

whl=$(bash scripts/build-wheel.sh "$OUT" | tail -1)
echo "check-wheel: installing $(basename "$whl") into a fresh venv (--no-index)"
VENV="$WORK/venv"
PY=${PYTHON:-python3}
if "$PY" -m venv "$VENV" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q --no-index "$whl"
else
    # No ensurepip: a venv without pip, installed into by the build venv's pip.
    rm -rf "$VENV"
    "$PY" -m venv --without-pip "$VENV"
    "${WHEEL_VENV:-$TARGET/wheel-venv}/bin/python" -m pip --python "$VENV/bin/python" \
        install --disable-pip-version-check --no-input -q --no-index "$whl"
fi

# Only the venv's bin/ and the system's: the kvbridge found must be the wheel's.
export PATH="$VENV/bin:/usr/bin:/bin"
test "$(command -v kvbridge)" = "$VENV/bin/kvbridge" \
    || { echo "check-wheel: the wheel put no kvbridge on PATH ($(command -v kvbridge || echo none))" >&2; exit 1; }
kvbridge --version
cd "$WORK"
python - <<'PY'
"""kvbridge demo --duration 5, its ring read by the installed kvbridge_shm meanwhile."""
import subprocess, sys, time

import kvbridge_shm

demo = subprocess.Popen(["kvbridge", "demo", "--duration", "5", "--rate", "200"],
                        stdout=subprocess.PIPE, text=True)
ring = None
for line in demo.stdout:
    sys.stdout.write(line)
    if line.startswith("ring ") and "kvbridge-demo-" in line:
        ring = line.split()[-1]
        break
if ring is None:
    sys.exit("check-wheel: the demo printed no ring path")
reader = None
deadline = time.monotonic() + 30
while reader is None:
    try:
        reader = kvbridge_shm.Reader(ring)
    except (OSError, kvbridge_shm.RingError):
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
records = []
while len(records) < 50 and time.monotonic() < deadline:
    rec = reader.next(timeout=1.0)
    if rec is not None:
        records.append(rec)
rest = demo.stdout.read()
sys.stdout.write(rest)
if demo.wait() != 0:
    sys.exit(f"check-wheel: kvbridge demo exited with {demo.returncode}")
if len(records) < 50:
    sys.exit(f"check-wheel: read {len(records)} records from {ring}, wanted 50")
seqs = [r.sequence for r in records]
assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "records in order, none missing"
assert all(r.payload for r in records), "every record has its KvEventBatch"
print(f"check-wheel: read records {seqs[0]}..{seqs[-1]} of {ring} with the installed kvbridge_shm")
PY
echo "check-wheel: ok"
