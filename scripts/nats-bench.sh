#!/usr/bin/env bash
# The NATS sink's benchmark: a three-node JetStream cluster on loopback (nats-server from
# scripts/nats-server.sh), then `kvbridge bench` three times at the same offered rate in one go:
#   1. the gRPC path alone (baseline);
#   2. the floor: the gRPC path, and beside it a bare async-nats JetStream publisher (no kvbridge
#      in its path; same payloads, headers incl. Nats-Msg-Id, in-flight bound and rate) into the
#      same 3-replica stream: its publish lag is what the cluster on this machine costs any
#      publisher, and its gRPC rows show what the loaded cluster alone does to subscribers;
#   3. the sink publishing every record to the 3-replica stream.
# Compare the gRPC rows (subscriber p99 alone / with the loaded cluster / with the sink) and the
# floor's lag with the sink's row: published/s, publish lag p50/p99 (commit in the ring →
# JetStream ack) and the bridge's CPU per published batch.
#
#   scripts/nats-bench.sh [RATE [SECONDS [SUBSCRIBERS]]]      # default 10000 10 1
#   FLOOR_R1=1 scripts/nats-bench.sh ...    # also the floor into a 1-replica stream (what
#                                           # the replication itself costs)
#   BEFORE=/path/to/old/kvbridge scripts/nats-bench.sh ...
#                                           # also that build's sink, same cluster and load,
#                                           # before and after this one's (an A/B of a change)
#
# Route ports are taken from the kernel (bind port 0, release) because every node's --routes must
# name them before it starts; client ports are chosen by nats-server (-p -1) and read from its log.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-10000}
SECS=${2:-10}
SUBS=${3:-1}
TARGET=${CARGO_TARGET_DIR:-$(pwd)/target}
NATS=$(bash scripts/nats-server.sh | tail -1)
cargo build --release --quiet
KVB="$TARGET/release/kvbridge"
DIR=$(mktemp -d /tmp/kvbridge-nats-bench.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
R=("$(free_port)" "$(free_port)" "$(free_port)")
ROUTES="nats://127.0.0.1:${R[0]},nats://127.0.0.1:${R[1]},nats://127.0.0.1:${R[2]}"
for i in 0 1 2; do
    "$NATS" -a 127.0.0.1 --no_advertise -p -1 -js -n "n$i" -sd "$DIR/s$i" -l "$DIR/n$i.log" \
        --cluster_name bench --cluster "nats://127.0.0.1:${R[$i]}" --routes "$ROUTES" &
    PIDS+=($!)
done
URLS=""
for i in 0 1 2; do
    for _ in $(seq 200); do
        p=$(sed -n 's/.*Listening for client connections on 127.0.0.1:\([0-9]*\).*/\1/p' "$DIR/n$i.log" 2>/dev/null | head -1 || true)
        [ -n "$p" ] && grep -q "Server is ready" "$DIR/n$i.log" 2>/dev/null && break
        sleep 0.1
    done
    [ -n "$p" ] || { echo "nats-server n$i did not start:"; cat "$DIR/n$i.log"; exit 1; }
    URLS="${URLS:+$URLS,}nats://127.0.0.1:$p"
done
# Wait for the JetStream meta leader.
for _ in $(seq 100); do grep -q "JetStream cluster new metadata leader\|Self is new JetStream cluster metadata leader" "$DIR"/n*.log && break; sleep 0.2; done

echo "== gRPC path alone: $RATE batches/s, $SECS s, $SUBS subscriber(s)"
"$KVB" bench --rate "$RATE" --duration "$SECS" --subscribers "$SUBS" --shm-readers 0
echo
echo "== floor: bare async-nats publisher into the same 3-replica stream (no sink), same load"
"$KVB" bench --rate "$RATE" --duration "$SECS" --subscribers "$SUBS" --shm-readers 0 \
    --nats "$URLS" --nats-replicas 3 --nats-floor
if [ -n "${FLOOR_R1:-}" ]; then
    echo
    echo "== floor into a 1-replica stream (no replication), same load"
    "$KVB" bench --rate "$RATE" --duration "$SECS" --subscribers "$SUBS" --shm-readers 0 \
        --nats "$URLS" --nats-replicas 1 --nats-floor
fi
sink_row() { # LABEL BINARY
    echo
    echo "== $1 (3-replica stream on a 3-node cluster): same load"
    "$2" bench --rate "$RATE" --duration "$SECS" --subscribers "$SUBS" --shm-readers 0 \
        --nats "$URLS" --nats-replicas 3
}
if [ -n "${BEFORE:-}" ]; then sink_row "BEFORE: the NATS sink of $BEFORE" "$BEFORE"; fi
sink_row "with the NATS sink" "$KVB"
if [ -n "${BEFORE:-}" ]; then sink_row "BEFORE again: the NATS sink of $BEFORE" "$BEFORE"; fi
