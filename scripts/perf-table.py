#!/usr/bin/env python3
"""Runs the performance rows of docs/performance.md with `kvbridge bench` and prints a markdown table of the
medians of N runs per row (default 3). Usage: scripts/perf-table.py [--runs N] [--seconds S] [--out docs/perf/NAME.json]

With --out it writes the table as data (docs/perf/*.json); the pages' tables are rendered from
those files by scripts/perf-tables.py, so they cannot drift from the numbers.

Each row starts its own bridge (`kvbridge bench` without --grpc). Latency is end to end from the
publisher's scheduled send time (no coordinated omission); "ring" is commit → shm reader.
"""
import argparse, importlib.util, json, os, platform, statistics, subprocess, sys, tempfile, time

_spec = importlib.util.spec_from_file_location("perf_tables", os.path.join(os.path.dirname(__file__), "perf-tables.py"))
perf_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(perf_tables)

# The table's columns and how each cell's values are written (scripts/perf-tables.py).
COLUMNS = [
    {"name": "row"},
    {"name": "delivered/published", "format": "{:.0f} / {:.0f}"},
    {"name": "lost", "format": "{:.0f}"},
    {"name": "gRPC p50 / p99 / p99.9 µs", "format": "{:.0f} / {:.0f} / {:.0f}"},
    {"name": "shm p50 / p99 µs", "format": "{:.0f} / {:.0f}"},
    {"name": "ring p50 / p99 / p99.9 µs", "format": "{:.1f} / {:.1f} / {:.1f}"},
    {"name": "bridge CPU %", "format": "{:.1f}"},
    {"name": "RSS MiB", "format": "{:.0f}"},
    {"name": "CPU ms / delivered MB", "format": "{:.1f}"},
    {"name": "CPU µs / batch", "format": "{:.2f}"},
]


def machine():
    """What the numbers were measured on: cores, CPU model, kernel, load average at the start."""
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPUs ({model}), Linux {platform.release()}, load average {load:.1f} at the start"

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
    ap.add_argument("--out", help="write the table's data (JSON, docs/perf/*.json) here instead of printing it")
    ap.add_argument("--machine", default="", help="describe the machine (default: from /proc)")
    a = ap.parse_args()
    rows = list(ROWS)
    best = None
    for rate in [int(x) for x in a.max_rates.split(",") if x]:
        rows.append((f"N=1, C=1, R={rate // 1000}k", rate, 1, 1, 1, []))
    rows = [r for r in rows if a.only in r[0]]
    out = []
    for label, rate, subs, conns, readers, extra in rows:
        rs = [run(a.bin, rate, subs, conns, readers, extra, a.seconds) for _ in range(a.runs)]
        lost = max(r["grpc"]["lost"] + r["grpc"]["errors"] + r["shm"]["lost"] + r["shm"]["errors"] for r in rs)
        if rate > 10000 and lost == 0:
            best = rate
        g = lambda k: (lambda r: r["grpc_latency"][k])
        s = lambda k: (lambda r: r["shm_latency"][k])
        q = lambda k: (lambda r: r["shm_ring_latency"][k])
        out.append([
            label,
            [med(rs, lambda r: r["grpc"]["delivered"] / max(1, subs)), med(rs, lambda r: r["published"])],
            lost,
            [med(rs, g("p50_us")), med(rs, g("p99_us")), med(rs, g("p999_us"))],
            [med(rs, s("p50_us")), med(rs, s("p99_us"))],
            [med(rs, q("p50_us")), med(rs, q("p99_us")), med(rs, q("p999_us"))],
            med(rs, lambda r: r["bridge_cpu_percent"]),
            med(rs, lambda r: r["bridge_peak_rss_kib"]) / 1024,
            med(rs, lambda r: r["cpu_ms_per_delivered_mb"]),
            med(rs, lambda r: r["cpu_us_per_delivered_batch"]),
        ])
        print(f"{label}: done", file=sys.stderr, flush=True)
    data = {
        "title": "Fan-out, shaped like real gateways",
        "command": "scripts/perf-table.py " + " ".join(sys.argv[1:]),
        "machine": a.machine or machine(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "columns": COLUMNS,
        "rows": out,
    }
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {a.out}; render the pages with scripts/perf-tables.py", file=sys.stderr)
    else:
        print(perf_tables.render(data, "(stdout)"))
    print(f"\nhighest tested rate with zero loss for N=1: {best}")


if __name__ == "__main__":
    sys.exit(main())
