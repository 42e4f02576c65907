#!/usr/bin/env python3
"""Runs the performance rows of docs/performance.md with `kvbridge bench` and prints a markdown table of the
medians of N runs per row (default 3). Usage: scripts/perf-table.py [--runs N] [--seconds S]

Each row starts its own bridge (`kvbridge bench` without --grpc). Latency is end to end from the
publisher's scheduled send time (no coordinated omission); "ring" is commit → shm reader.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile

ROWS = [
    # (label, rate, subscribers, connections, shm readers, extra flags). One subscriber per
    # connection, as N SMG gateways are N connections; "C=1" rows multiplex for contrast.
    ("N=1, C=1, R=1k", 1000, 1, 1, 1, []),
    ("N=10, C=10, R=1k", 1000, 10, 10, 1, []),
    ("N=100, C=100, R=1k", 1000, 100, 100, 1, []),
    ("N=100, C=1 (multiplexed), R=1k", 1000, 100, 1, 1, []),
    ("N=1000, C=10 (multiplexed), R=1k", 1000, 1000, 10, 1, []),
    ("N=1, C=1, R=10k", 10000, 1, 1, 1, []),
    ("N=1, C=1, R=10k, shm busy-poll", 10000, 1, 1, 1, ["--shm-spin"]),
]


def run(binary, rate, subs, conns, readers, extra, seconds):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [binary, "bench", "--rate", str(rate), "--duration", str(seconds), "--warmup", "2",
               "--subscribers", str(subs), "--connections", str(conns), "--shm-readers", str(readers),
               "--json", f.name] + extra
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.load(open(f.name))


def med(rs, key):
    vals = [key(r) for r in rs if key(r) is not None]
    return statistics.median(vals) if vals else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(__file__), "..", "target", "release", "kvbridge"))
    ap.add_argument("--max-rates", default="20000,30000,40000,60000")
    ap.add_argument("--only", default="", help="run only the rows whose label contains this")
    a = ap.parse_args()
    rows = list(ROWS)
    print("| row | delivered/published | lost | gRPC p50 / p99 / p99.9 µs | shm p50 / p99 µs | ring p50 / p99 / p99.9 µs | bridge CPU % | RSS MiB | CPU ms / delivered MB | CPU µs / delivered batch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    best = None
    for rate in [int(x) for x in a.max_rates.split(",") if x]:
        rows.append((f"N=1, C=1, R={rate // 1000}k", rate, 1, 1, 1, []))
    rows = [r for r in rows if a.only in r[0]]
    for label, rate, subs, conns, readers, extra in rows:
        rs = [run(a.bin, rate, subs, conns, readers, extra, a.seconds) for _ in range(a.runs)]
        lost = max(r["grpc"]["lost"] + r["grpc"]["errors"] + r["shm"]["lost"] + r["shm"]["errors"] for r in rs)
        if rate > 10000 and lost == 0:
            best = rate
        g = lambda k: (lambda r: r["grpc_latency"][k])
        s = lambda k: (lambda r: r["shm_latency"][k])
        q = lambda k: (lambda r: r["shm_ring_latency"][k])
        print(f"| {label} | {med(rs, lambda r: r['grpc']['delivered'] / max(1, subs)):.0f} / {med(rs, lambda r: r['published']):.0f} "
              f"| {lost} | {med(rs, g('p50_us')):.0f} / {med(rs, g('p99_us')):.0f} / {med(rs, g('p999_us')):.0f} "
              f"| {med(rs, s('p50_us')):.0f} / {med(rs, s('p99_us')):.0f} "
              f"| {med(rs, q('p50_us')):.1f} / {med(rs, q('p99_us')):.1f} / {med(rs, q('p999_us')):.1f} "
              f"| {med(rs, lambda r: r['bridge_cpu_percent']):.1f} | {med(rs, lambda r: r['bridge_peak_rss_kib']) / 1024:.0f} "
              f"| {med(rs, lambda r: r['cpu_ms_per_delivered_mb']):.1f} "
              f"| {med(rs, lambda r: r['cpu_us_per_delivered_batch']):.2f} |", flush=True)
    print(f"\nhighest tested rate with zero loss for N=1: {best}")


if __name__ == "__main__":
    sys.exit(main())
