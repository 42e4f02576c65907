"""Reads a vLLM engine's own Prometheus counters from its PROMETHEUS_MULTIPROC_DIR, for
tests/it/common/real_engine/counters.rs (`VllmCounters`).

vLLM's gRPC launcher (SMG gRPC mode) serves no HTTP, so there is no /metrics to scrape; its
`prometheus_client` keeps every sample in the multiprocess directory it is given, which the
same library's `MultiProcessCollector` reads.

A long-lived process: prints "ready", then for each line on stdin (a directory) one JSON line
on stdout, {sample name: value summed over the sample's labels}.
"""
import json
import sys

from prometheus_client import CollectorRegistry, multiprocess


def counters(path: str) -> dict:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    out: dict = {}
    for family in registry.collect():
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(counters(line.strip())), flush=True)


if __name__ == "__main__":
    main()
