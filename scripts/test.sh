#!/usr/bin/env bash
# Everything CI checks. The README's test command is the first step.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

echo "== cargo test --release --workspace"
cargo test --release --workspace

# The loom model of the ring protocol builds the shm crate with --cfg loom, in its own target
# directory so that it does not invalidate the main build.
echo "== loom model of the shm ring protocol"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --release -p kvbridge-shm --test loom
