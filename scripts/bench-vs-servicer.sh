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
# PERF_OUT=docs/perf/NAME.json also writes the summary table as data (scripts/perf-tables.py
# renders the pages' tables from those files).
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

"$PY" - "$OUT" "$RUNS" "${PERF_OUT:-}" "$0 $*" <<'EOF'
import importlib.util, json, os, platform, statistics, sys, time
out, runs, perf_out, command = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
spec = importlib.util.spec_from_file_location("perf_tables", "scripts/perf-tables.py")
perf_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(perf_tables)
def load(name):
    return [json.load(open(f"{out}/{name}-{i}.json")) for i in range(1, runs + 1)]
def med(rs, f):
    v = [f(r) for r in rs if f(r) is not None]
    return statistics.median(v) if v else float("nan")
names = ["kvbridge", "servicer"] + (["baseline"] if os.path.exists(f"{out}/baseline-1.json") else [])
rows = {n: load(n) for n in names}
r0 = rows["kvbridge"][0]
print(f"\n{r0['subscribers']} subscribers over {r0['connections']} connections, {r0['rate']} batches/s, medians of {runs} runs")
table = []
for name, rs in rows.items():
    n = rs[0]["subscribers"]
    table.append([
        {"servicer": "SMG servicer", "baseline": "kvbridge (baseline binary)"}.get(name, name),
        [med(rs, lambda r: r['grpc']['delivered']), med(rs, lambda r: r['published'] * n)],
        max(r['grpc']['lost'] + r['grpc']['errors'] for r in rs),
        [med(rs, lambda r: r['grpc_latency'][k]) for k in ("p50_us", "p99_us", "p999_us")],
        med(rs, lambda r: r['bridge_cpu_percent']),
        med(rs, lambda r: r['cpu_us_per_delivered_batch']),
        med(rs, lambda r: r.get('syscalls_per_delivered_batch')),
    ])
for i, sender in enumerate(["blocking", "tokio"]):
    fs = [r["floor"][i] for r in rows["kvbridge"] if len(r.get("floor", [])) > i]
    if not fs:
        continue
    n = rows["kvbridge"][0]["subscribers"]
    table.append([
        f"floor, {sender} sender ({fs[0]['message_bytes']} B writes)",
        [med(fs, lambda f: f['delivered_batches']), med(fs, lambda f: f['rate'] * f['seconds'] * n)],
        max(f['lost'] for f in fs),
        [med(fs, lambda f: f['latency'][k]) for k in ("p50_us", "p99_us", "p999_us")],
        med(fs, lambda f: f['sender_cpu_percent']),
        med(fs, lambda f: f['cpu_us_per_delivered_batch']),
        med(fs, lambda f: f.get('syscalls_per_delivered_batch')),
    ])
load_avg = os.getloadavg()[0]
data = {
    "title": f"{r0['subscribers']} subscribers over {r0['connections']} connections, {r0['rate']} batches/s, medians of {runs} runs",
    "command": command,
    "machine": f"{os.cpu_count()} CPUs, Linux {platform.release()}, load average {load_avg:.1f} at the end",
    "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "columns": [
        {"name": "server"},
        {"name": "delivered / published×N", "format": "{:.0f} / {:.0f}"},
        {"name": "lost", "format": "{:.0f}"},
        {"name": "gRPC p50 / p99 / p99.9 µs", "format": "{:.0f} / {:.0f} / {:.0f}"},
        {"name": "CPU %", "format": "{:.1f}"},
        {"name": "CPU µs / delivered batch", "format": "{:.2f}"},
        {"name": "syscalls / delivered batch", "format": "{:.2f}"},
    ],
    "rows": table,
}
print(perf_tables.render(data, perf_out or "(stdout)"))
if perf_out:
    with open(perf_out, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {perf_out}; render the pages with scripts/perf-tables.py")
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
