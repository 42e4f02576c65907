#!/usr/bin/env bash
# The test command from the README: everything CI checks.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bins
cargo test --release --locked --workspace
