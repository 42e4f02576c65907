#!/usr/bin/env python3
"""Runs the `--publish-zmq` rows of docs/dynamo-llm-d.md with `kvbridge bench` and writes them as data
(docs/perf/zmq-vs-floor.json, docs/perf/zmq-grpc-alternation.json) for scripts/perf-tables.py.

    scripts/zmq-perf.py [--runs 3] [--seconds 10] [--pairs 4] [--binary target/release/kvbridge] [--out-dir docs/perf]

Each run is two benches, each starting its own bridge:
  * the ZMQ column: 10 SUBs on the bridge's --publish-zmq and, in the same run, 10 SUBs on a bare
    ZMQ relay process of the same engine messages (the floor); commit → subscriber latency of
    both, and the CPU per record of each whole process;
  * the alternation (--zmq-alternate PAIRS): the gRPC column (one subscriber on one connection:
    one gateway) in 2 × PAIRS windows, alternately with no ZMQ subscriber and with 10 reading.
    Per run: the medians with / without, and the noise: how far apart the windows *without* ZMQ
    subscribers are from each other (max / min of each quantile), the yardstick for "unchanged".
The 1-minute load average is recorded before each bench: the machine may be shared.
"""
import argparse, importlib.util, json, os, subprocess, sys, tempfile, time
from statistics import median

_spec = importlib.util.spec_from_file_location("perf_table", os.path.join(os.path.dirname(__file__), "perf-table.py"))
perf_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(perf_table)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


# The column: no gRPC subscriber, so that the bridge's CPU is ingest, ring and this edge, as the
# relay's is a SUB and a PUB; one shm reader for the `ring` row (commit -> a reader asleep on the
# ring's futex: the wake-up the edge's publisher thread also takes).
COLUMN = ["--subscribers", "0", "--shm-readers", "1"]
# The alternation: one gRPC subscriber on one connection (one gateway).
ALTERNATION = ["--subscribers", "1", "--shm-readers", "0", "--zmq-alternate"]


def bench(binary, seconds, extra):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        load = os.getloadavg()[0]
        cmd = [binary, "bench", "--rate", "1000", "--duration", str(seconds), "--warmup", "2",
               "--zmq-subscribers", "10", "--json", f.name] + extra
        print("+", " ".join(cmd), f"(load {load:.1f})", file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        return load, json.load(open(f.name))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "kvbridge"))
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "docs", "perf"))
    a = ap.parse_args()
    column, alternation = [], []
    for run in range(1, a.runs + 1):
        load, r = bench(a.binary, a.seconds, COLUMN)
        z = r["zmq"]
        b, f = z["bridge"], z["floor"]
        bc, fc = z["bridge_cpu_us_per_record"], z["floor_cpu_us_per_record"]
        column.append([str(run), load,
                       [b["latency"]["p50_us"], b["latency"]["p99_us"]],
                       [f["latency"]["p50_us"], f["latency"]["p99_us"]],
                       [b["latency"]["p50_us"] / f["latency"]["p50_us"], b["latency"]["p99_us"] / f["latency"]["p99_us"]],
                       [bc, fc, bc / fc],
                       r["shm_ring_latency"]["p50_us"],
                       [b["delivery"]["delivered"], b["delivery"]["lost"], f["delivery"]["lost"]]])
        load, r = bench(a.binary, a.seconds, ALTERNATION + [str(a.pairs)])
        ws = r["zmq_alternation"]
        for i, w in enumerate(ws):
            alternation.append([f"{run}.{i + 1}", load, w["zmq_subscribers"],
                                [w["grpc_latency"]["p50_us"], w["grpc_latency"]["p99_us"], w["grpc_latency"]["p999_us"]],
                                [w["grpc"]["delivered"], w["grpc"]["lost"]],
                                w["zmq"]["delivered"] if w["zmq_subscribers"] else None,
                                w["bridge_cpu_percent"]])
        kind = lambda with_, key: [w["grpc_latency"][key] for w in ws if (w["zmq_subscribers"] > 0) == with_]
        keys = ("p50_us", "p99_us", "p999_us")
        alternation.append([f"{run}: with / without (medians)", None, None,
                            {"format": "**{:.2f}× / {:.2f}×** / {:.2f}×",
                             "values": [median(kind(True, k)) / median(kind(False, k)) for k in keys]},
                            None, None, None])
        alternation.append([f"{run}: noise (max / min without)", None, None,
                            {"format": "{:.2f}× / {:.2f}× / {:.2f}×",
                             "values": [max(kind(False, k)) / min(kind(False, k)) for k in keys]},
                            None, None, None])
    when = time.strftime("%Y-%m-%d")
    common = {"machine": perf_table.machine().rsplit(",", 1)[0], "when": when}
    out = {
        "zmq-vs-floor.json": dict(
            title="commit → ZMQ subscriber latency, kvbridge --publish-zmq vs a bare ZMQ relay (same run)",
            command=f"scripts/zmq-perf.py --runs {a.runs} --seconds {a.seconds} (kvbridge bench --rate 1000 "
                    f"--duration {a.seconds} --zmq-subscribers 10 {' '.join(COLUMN)})",
            columns=[{"name": "run"}, {"name": "load average", "format": "{:.1f}"},
                     {"name": "zmq p50 / p99 µs", "format": "{:.0f} / {:.0f}"},
                     {"name": "floor p50 / p99 µs", "format": "{:.0f} / {:.0f}"},
                     {"name": "ratio p50 / p99", "format": "{:.2f}× / {:.2f}×"},
                     {"name": "CPU µs per record: bridge / relay (ratio)", "format": "{:.0f} / {:.0f} ({:.2f}×)"},
                     {"name": "ring wake p50 µs", "format": "{:.0f}"},
                     {"name": "zmq delivered / lost / floor lost", "format": "{:,} / {} / {}"}],
            rows=column, **common),
        "zmq-grpc-alternation.json": dict(
            title="gRPC subscriber latency without and with 10 ZMQ subscribers, alternating windows (same run)",
            command=f"scripts/zmq-perf.py --runs {a.runs} --seconds {a.seconds} (kvbridge bench --rate 1000 "
                    f"--duration {a.seconds} --zmq-subscribers 10 {' '.join(ALTERNATION)} {a.pairs})",
            columns=[{"name": "run.window"}, {"name": "load average", "format": "{:.1f}"},
                     {"name": "ZMQ SUBs", "format": "{}"},
                     {"name": "gRPC p50 / p99 / p99.9 µs", "format": "{:.0f} / {:.0f} / {:,.0f}"},
                     {"name": "gRPC delivered / lost", "format": "{:,} / {}"},
                     {"name": "ZMQ delivered", "format": "{:,}"},
                     {"name": "bridge CPU %", "format": "{:.1f}"}],
            rows=alternation, **common),
    }
    for name, data in out.items():
        path = os.path.join(a.out_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print("wrote", path, file=sys.stderr)


if __name__ == "__main__":
    main()
