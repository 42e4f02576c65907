#!/usr/bin/env bash
# The fault campaign (tests/it/campaign.rs) beyond what CI runs: seeded random schedules of
# faults against a real engine with kvbridge in front, the invariant checked after every step.
# A failing seed prints its schedule and this script's command that reproduces it.
#
#   scripts/campaign.sh [--engine vllm|sglang] [--seed S | --seeds N [--from F]] [--minutes M]
#                       [--max-steps K]
#
#   --engine   the real engine (default vllm); each is installed by its own venv script
#   --seed S   one schedule, seed S (a failure's reproduction)
#   --seeds N  N schedules, seeds F..F+N (default F = 1)
#   --minutes  stop starting new schedules after M minutes
#   --max-steps cap every schedule at K steps (default 50: the whole 20-50 a seed draws; CI runs 12)
#
# A run of several seeds goes on past a failing one (KVBRIDGE_CAMPAIGN_KEEP_GOING) and lists the
# failed seeds at the end.
#
# The figures of the last long run are in docs/testing.md ("The fault campaign").
set -euo pipefail
cd "$(dirname "$0")/.."
engine=vllm seeds="" from=1 minutes="" max_steps=50
while [[ $# -gt 0 ]]; do
    case "$1" in
        --engine) engine=$2; shift 2 ;;
        --seed) seeds=$2; shift 2 ;;
        --seeds) seeds="$from..$(( from + $2 ))"; shift 2 ;;
        --from) from=$2; shift 2 ;;
        --minutes) minutes=$2; shift 2 ;;
        --max-steps) max_steps=$2; shift 2 ;;
        *) echo "campaign.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
case "$engine" in
    vllm|sglang) ;;
    *) echo "campaign.sh: --engine is vllm or sglang, not $engine" >&2; exit 2 ;;
esac
export KVBRIDGE_CAMPAIGN_MAX_STEPS=$max_steps
[[ -n "$seeds" ]] && export KVBRIDGE_CAMPAIGN_SEEDS=$seeds
[[ -n "$minutes" ]] && export KVBRIDGE_CAMPAIGN_MINUTES=$minutes
export KVBRIDGE_CAMPAIGN_KEEP_GOING=1
exec cargo test --release --test it "campaign::${engine}_seeded_schedules" -- --exact --nocapture
