#!/usr/bin/env bash
# kvbridge against SMG's own Rust engine servicer (PyPI `smg`, `smg.servicer.VllmGrpcServer`),
# measured by the same `kvbridge bench`, alternately, in the same run: the servicer row of docs/performance.md.
#
#   scripts/bench-vs-servicer.sh [RUNS] [SUBSCRIBERS] [RATE] [SECONDS] [CONNECTIONS]
#   (defaults: 3 runs, 100 subscribers over 100 connections, 1000 batches/s, 6 s)
#
# The servicer runs without an engine attached: it serves SubscribeKvEvents from the engine's
# KV-event PUB socket, which the bench binds (`--engine-bind`) and the servicer connects to.
# Both are measured with `--syscalls` (perf) when perf can trace here; every run prints the
# bench's own table, and the end a summary with kvbridge/servicer ratios. KVBRIDGE_BASE_BIN=PATH
# adds a third row, another kvbridge binary (e.g. a build of an earlier commit), same run.
# kvbridge's runs use `--floor`, so every run also measures the same shape without gRPC (a bare
# sender writing one frame-sized message per connection per batch) and the summary adds those
# rows and the kvbridge/floor ratios.
set -euo pipefail

cd "$(dirname "$0")/.."
RUNS=${1:-3}
SUBS=${2:-100}
RATE=${3:-1000}
SECS=${4:-6}
CONNS=${5:-$SUBS}
TARGET=${CARGO_TARGET_DIR:-$(pwd)/target}
BIN=${KVBRIDGE_BIN:-$TARGET/release/kvbridge}
[ -x "$BIN" ] || cargo build --release --bin kvbridge
PY=$(scripts/smg-venv.sh | tail -1)
OUT=$(mktemp -d)
trap '[ -z "${SERVICER:-}" ] || kill "$SERVICER" 2>/dev/null; rm -rf "$OUT"' EXIT

SYSCALLS=()
if perf stat -e raw_syscalls:sys_enter true >/dev/null 2>&1; then SYSCALLS=(--syscalls); fi

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ENGINE_PORT=$(free_port)

# The servicer: binds an ephemeral gRPC port, connects its KV-event SUB to the bench's PUB.
# Started afresh for every run, as kvbridge is (each bench run's engine numbers from 0 again).
start_servicer() {
    : >"$OUT/servicer.addr"
    "$PY" -u -c '
import sys, time, smg.servicer as s
srv = s.VllmGrpcServer("127.0.0.1:0", "ipc://" + sys.argv[2] + "/ipc", "tcp://127.0.0.1:1",
                       "none", kv_events_endpoint=sys.argv[1])
print(srv.address, flush=True)
while srv.running:
    time.sleep(1)
' "tcp://127.0.0.1:$ENGINE_PORT" "$OUT" >"$OUT/servicer.addr" &
    SERVICER=$!
    for _ in $(seq 100); do [ -s "$OUT/servicer.addr" ] && break; sleep 0.1; done
    ADDR=$(head -1 "$OUT/servicer.addr")
    [ -n "$ADDR" ] || { echo "the servicer did not start" >&2; exit 1; }
    echo "servicer (pid $SERVICER) at $ADDR; engine PUB at tcp://127.0.0.1:$ENGINE_PORT"
}
stop_servicer() {
    kill "$SERVICER" 2>/dev/null || true
    wait "$SERVICER" 2>/dev/null || true
    SERVICER=
}
SERVICER=

COMMON=(--rate "$RATE" --duration "$SECS" --warmup 2 --subscribers "$SUBS" --connections "$CONNS" --shm-readers 0 "${SYSCALLS[@]}")
for i in $(seq "$RUNS"); do
    echo "== run $i: servicer"
    start_servicer
    "$BIN" bench "${COMMON[@]}" --grpc "$ADDR" --engine-bind "tcp://127.0.0.1:$ENGINE_PORT" \
        --serve-pid "$SERVICER" --json "$OUT/servicer-$i.json"
    stop_servicer
    echo "== run $i: kvbridge"
    "$BIN" bench "${COMMON[@]}" --floor --json "$OUT/kvbridge-$i.json"
    if [ -n "${KVBRIDGE_BASE_BIN:-}" ]; then
        echo "== run $i: kvbridge (KVBRIDGE_BASE_BIN)"
        "$KVBRIDGE_BASE_BIN" bench "${COMMON[@]}" --json "$OUT/baseline-$i.json"
    fi
done

"$PY" - "$OUT" "$RUNS" <<'EOF'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
def load(name):
    return [json.load(open(f"{out}/{name}-{i}.json")) for i in range(1, runs + 1)]
def med(rs, f):
    v = [f(r) for r in rs if f(r) is not None]
    return statistics.median(v) if v else float("nan")
import os
names = ["kvbridge", "servicer"] + (["baseline"] if os.path.exists(f"{out}/baseline-1.json") else [])
rows = {n: load(n) for n in names}
r0 = rows["kvbridge"][0]
print(f"\n{r0['subscribers']} subscribers over {r0['connections']} connections, {r0['rate']} batches/s, medians of {runs} runs")
print("| server | delivered / published×N | lost+err | gRPC p50 / p99 / p99.9 µs | CPU % | CPU µs / delivered batch | syscalls / delivered batch |")
print("|---|---|---|---|---|---|---|")
for name, rs in rows.items():
    n = rs[0]["subscribers"]
    print(f"| {name} | {med(rs, lambda r: r['grpc']['delivered']):.0f} / {med(rs, lambda r: r['published'] * n):.0f} "
          f"| {max(r['grpc']['lost'] + r['grpc']['errors'] for r in rs)} "
          f"| {med(rs, lambda r: r['grpc_latency']['p50_us']):.0f} / {med(rs, lambda r: r['grpc_latency']['p99_us']):.0f} / {med(rs, lambda r: r['grpc_latency']['p999_us']):.0f} "
          f"| {med(rs, lambda r: r['bridge_cpu_percent']):.1f} "
          f"| {med(rs, lambda r: r['cpu_us_per_delivered_batch']):.2f} "
          f"| {med(rs, lambda r: r.get('syscalls_per_delivered_batch')):.2f} |")
for i, sender in enumerate(["blocking", "tokio"]):
    fs = [r["floor"][i] for r in rows["kvbridge"] if len(r.get("floor", [])) > i]
    if not fs:
        continue
    n = rows["kvbridge"][0]["subscribers"]
    print(f"| floor, {sender} sender ({fs[0]['message_bytes']} B writes) | {med(fs, lambda f: f['delivered_batches']):.0f} / {med(fs, lambda f: f['rate'] * f['seconds'] * n):.0f} "
          f"| {max(f['lost'] for f in fs)} "
          f"| {med(fs, lambda f: f['latency']['p50_us']):.0f} / {med(fs, lambda f: f['latency']['p99_us']):.0f} / {med(fs, lambda f: f['latency']['p999_us']):.0f} "
          f"| {med(fs, lambda f: f['sender_cpu_percent']):.1f} "
          f"| {med(fs, lambda f: f['cpu_us_per_delivered_batch']):.2f} "
          f"| {med(fs, lambda f: f.get('syscalls_per_delivered_batch')):.2f} |")
for i, sender in enumerate(["blocking", "tokio"]):
    r = [k["cpu_us_per_delivered_batch"] / k["floor"][i]["cpu_us_per_delivered_batch"]
         for k in rows["kvbridge"]
         if len(k.get("floor", [])) > i and k.get("cpu_us_per_delivered_batch") and k["floor"][i].get("cpu_us_per_delivered_batch")]
    if r:
        print(f"kvbridge / floor ({sender} sender) CPU per delivered batch, per run:", " ".join(f"{x:.2f}" for x in r))
ratios = [k["cpu_us_per_delivered_batch"] / s["cpu_us_per_delivered_batch"]
          for k, s in zip(rows["kvbridge"], rows["servicer"])
          if k.get("cpu_us_per_delivered_batch") and s.get("cpu_us_per_delivered_batch")]
print("kvbridge / servicer CPU per delivered batch, per run:", " ".join(f"{x:.2f}" for x in ratios))
if "baseline" in rows:
    r = [k["cpu_us_per_delivered_batch"] / b["cpu_us_per_delivered_batch"]
         for k, b in zip(rows["kvbridge"], rows["baseline"])
         if k.get("cpu_us_per_delivered_batch") and b.get("cpu_us_per_delivered_batch")]
    print("kvbridge / baseline binary CPU per delivered batch, per run:", " ".join(f"{x:.2f}" for x in r))
EOF
