#!/usr/bin/env bash
# Everything CI checks, fast gates first. Run from anywhere: `bash scripts/test.sh`.
#
#   1. formatting, lints (-D warnings), docs (-D warnings)     — seconds to minutes, fail early
#   2. the repository stands alone: no file outside it is read or pointed at; the tables of
#      measurements in the docs are rendered from their data files (docs/perf/); the Prometheus
#      alert rules in ops/prometheus/ check and pass their unit tests (promtool)
#   3. the real vLLM and SGLang engines' venvs (cached per machine), then the README's test command,
#      `cargo test --release --workspace`, in a copy of the checkout that has no sibling folders
#      (a test reading a file beside the repository fails to build)
#   4. the wheel: built, installed --no-index into a fresh venv, its binary and module used
#   5. the shm crate's tests in the debug profile (debug_asserts, overflow checks), the fuzz
#      target's build, and the loom model of the shm ring protocol
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export CARGO_TERM_COLOR=never
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}

echo "== cargo fmt --all --check"
cargo fmt --all --check

echo "== cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

# python/ (the PyO3 extension module) is outside the workspace (see python/Cargo.toml): its own
# fmt and clippy, configured against the pinned venv's interpreter.
echo "== python/: cargo fmt --check, cargo clippy -D warnings"
cargo fmt --manifest-path python/Cargo.toml --check
PYSHM_PY=$(bash scripts/python-shm-venv.sh | tail -1)
PYO3_PYTHON="$PYSHM_PY" CARGO_TARGET_DIR="$CARGO_TARGET_DIR/pyshm-build" \
    cargo clippy --manifest-path python/Cargo.toml --release -- -D warnings

echo "== cargo doc --workspace --no-deps (RUSTDOCFLAGS=-D warnings)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps

echo "== standalone: nothing points outside the repository"
bash scripts/check-standalone.sh

echo "== docs: the measurement tables are what their data files (docs/perf/*.json) say"
python3 scripts/perf-tables.py --check

echo "== ops/prometheus: promtool check rules, promtool test rules"
PROMTOOL=$(bash scripts/promtool.sh | tail -1)
"$PROMTOOL" check rules ops/prometheus/kvbridge-rules.yml
(cd ops/prometheus && "$PROMTOOL" test rules kvbridge-rules.test.yml)

# The real vLLM engine's venv (tests/it/real_engine.rs, real_hybrid.rs, smg_real_engine.rs): ~6 GiB, a few minutes the first time on
# a machine, cached after that (~/.cache/kvbridge). Installed here, before the tests, so that a
# failed install is one clear error early instead of a test failure deep in the run.
echo "== the real vLLM engine's venv: scripts/vllm-engine-venv.sh"
venv_t0=$(date +%s)
bash scripts/vllm-engine-venv.sh
echo "== the real-engine venv step took $(( $(date +%s) - venv_t0 )) s"

# The real SGLang engine's venv (tests/it/real_engine.rs's sglang_* timelines, tests/it/campaign.rs):
# ~7 GiB, ~3 minutes the first time on a machine, cached after that.
echo "== the real SGLang engine's venv: scripts/sglang-engine-venv.sh"
venv_t0=$(date +%s)
bash scripts/sglang-engine-venv.sh
echo "== the SGLang venv step took $(( $(date +%s) - venv_t0 )) s"

echo "== standalone copy: cargo test --release --workspace"
# A copy of the tracked files (as a clone would have them) in a folder with no siblings. The
# target directory is shared with the checkout so dependencies are not built twice; `--touch`
# gives the copies fresh mtimes, so cargo rebuilds the workspace crates from the copy instead of
# taking the checkout's artifacts as up to date.
ALONE=$(mktemp -d /tmp/kvbridge-alone.XXXXXX)
trap 'rm -rf "$ALONE"' EXIT
git ls-files -z --cached --others --exclude-standard | (cd "$ROOT" && xargs -0 tar cf -) | tar xf - --touch -C "$ALONE"
# The reference folder developers have beside their checkout must not be beside the copy.
sibling=shar
sibling="$(dirname "$ALONE")/${sibling}ed"
test ! -e "$sibling" || { echo "$sibling exists beside the standalone copy"; exit 1; }
(cd "$ALONE" && cargo test --release --workspace)

# The wheel a user installs: built (its own target triple, x86_64-unknown-linux-gnu/, in the same
# target directory), installed with --no-index into a fresh venv, `kvbridge --version`,
# `kvbridge demo` and the installed kvbridge_shm reading the demo's ring.
echo "== the wheel: scripts/check-wheel.sh"
wheel_t0=$(date +%s)
bash scripts/check-wheel.sh
echo "== the wheel step took $(( $(date +%s) - wheel_t0 )) s"

# The ring crate's tests once more in the debug profile: its debug_asserts and integer overflow
# checks run only there (the suite above is --release).
echo "== shm crate, debug profile: cargo test -p kvbridge-shm"
cargo test -p kvbridge-shm

# The decoder's fuzz target must keep building (running it needs a nightly toolchain and
# cargo-fuzz; the corpus it found is replayed by tests/it/decode_fuzz_corpus.rs). Not --locked:
# fuzz/Cargo.lock keeps its pins, and only what the main crate added since is resolved.
echo "== fuzz target: cargo check --manifest-path fuzz/Cargo.toml"
cargo check --manifest-path fuzz/Cargo.toml

# The loom model builds the shm crate with --cfg loom, in its own target directory so that it
# does not invalidate the main build.
echo "== loom model of the shm ring protocol"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="$CARGO_TARGET_DIR/loom" \
    cargo test --release -p kvbridge-shm --test loom
