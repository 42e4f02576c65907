#!/usr/bin/env python3
"""Measures `--fanout-linger` (bounded batching on the gRPC edge): one `kvbridge bench` run per
linger, each with its own blocking and tokio floors measured in the same run, and writes the
table as data (docs/perf/fanout-linger.json; rendered into docs/performance.md by
scripts/perf-tables.py).

    scripts/linger-table.py [--kvbridge target/release/kvbridge] [--lingers 0,1ms,2ms,5ms]
                            [--seconds 10] [--out docs/perf/fanout-linger.json]

Rows: 100 subscribers over 100 connections (N gateways) at each linger, then 100 subscribers
multiplexed on one connection at linger 0 and at the default (writes per batch there is the
question). "syscalls / delivery" is every system call of the bridge in the measured window
(`perf stat`) over the batches delivered (a write per delivery is 1); "socket writes / batch" is
its `sendto`s of more than one byte (the gRPC writes) over the batches published: 100 at the
most with 100 connections, 1 for one write per connection per batch.
"""
import argparse, importlib.util, json, os, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("perf_table", os.path.join(HERE, "perf-table.py"))
perf_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(perf_table)

COLUMNS = [
    {"name": "linger"},
    {"name": "connections", "format": "{:.0f}"},
    {"name": "syscalls / delivery", "format": "{:.2f}"},
    {"name": "socket writes / batch", "format": "{:.2f}"},
    {"name": "bridge CPU µs / batch", "format": "{:.2f}"},
    {"name": "÷ blocking floor", "format": "{:.2f}"},
    {"name": "p50 / p99 µs", "format": "{:.0f} / {:.0f}"},
    {"name": "tokio floor p99 µs", "format": "{:.0f}"},
    {"name": "p99 ÷ tokio floor p99", "format": "{:.2f}"},
    {"name": "lost", "format": "{:.0f}"},
]


def run(exe, linger, connections, seconds, floor):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [exe, "bench", "--rate", "1000", "--subscribers", "100", "--connections",
               str(connections), "--shm-readers", "0", "--syscalls", "--duration", str(seconds),
               "--json", f.name]
        if linger is not None:
            cmd += ["--fanout-linger", linger]
        if floor:
            cmd += ["--floor"]
        print("$", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        return json.load(open(f.name))


def row(label, connections, r):
    floors = {f["sender"]: f for f in r.get("floor", [])}
    blocking, tokio = floors.get("blocking"), floors.get("tokio")
    cpu = r["cpu_us_per_delivered_batch"]
    p99 = r["grpc_latency"]["p99_us"]
    return [
        label,
        connections,
        r.get("syscalls_per_delivered_batch"),
        r.get("socket_writes_per_batch"),
        cpu,
        cpu / blocking["cpu_us_per_delivered_batch"] if blocking else None,
        [r["grpc_latency"]["p50_us"], p99],
        tokio["latency"]["p99_us"] if tokio else None,
        p99 / tokio["latency"]["p99_us"] if tokio else None,
        r["grpc"]["lost"],
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvbridge", default=os.path.join(HERE, "..", "target", "release", "kvbridge"))
    ap.add_argument("--lingers", default="0,1ms,2ms,5ms")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "perf", "fanout-linger.json"))
    a = ap.parse_args()
    rows = []
    for linger in a.lingers.split(","):
        rows.append(row(linger, 100, run(a.kvbridge, linger, 100, a.seconds, True)))
    for linger, label in (("0", "0"), (None, "default")):
        rows.append(row(label, 1, run(a.kvbridge, linger, 1, a.seconds, False)))
    data = {
        "title": "--fanout-linger: writes, CPU and latency per delivered batch",
        "command": "scripts/linger-table.py --lingers " + a.lingers
        + " (kvbridge bench --rate 1000 --subscribers 100 --syscalls [--floor] --fanout-linger L)",
        "machine": perf_table.machine(),
        "when": time.strftime("%Y-%m-%d"),
        "columns": COLUMNS,
        "rows": rows,
    }
    with open(a.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
