"""Python ring reader vs Rust ring reader vs Python grpcio subscriber, in one run.

    python/bench/bench.py --kvbridge target/release/kvbridge [--rate 10000] [--seconds 5]

(run it with the venv of scripts/python-shm-venv.sh, which has kvbridge_shm, grpcio and
smg-grpc-proto). It starts `kvbridge serve` on a fresh ring, then `kvbridge bench --grpc … --shm
…` drives it with an open-loop simulated engine at --rate batches/s and measures its own Rust shm
reader and a Rust gRPC subscriber, while this script runs, in their own processes for the same
window:

* a Python `kvbridge_shm.Reader` that waits (futex, GIL released; not spinning), and
* a Python grpcio subscriber (SMG's published stubs, `SubscribeKvEvents`), which parses each
  message as any grpcio client does, and
* with --floor, the shm crate's example `floor_waiter` (build it with `cargo build --release -p
  kvbridge-shm --example floor_waiter`): a Rust process that does nothing but wait on the same
  futex (no spin) and take the clock. Its latency is the floor of any waiting reader on this
  machine under this load (the bridge's ingest → commit time plus the wake-up and scheduling
  latency); a reader's own cost is its distance to this line in the same run.

Latency: ingest→reader (the record's `ingest_ns`, stamped by the bridge when the batch arrived,
just before it is encoded and committed, to the reader's clock right after the read returns:
"commit→Python"; the Rust bench reports the same as "ring") and publish→reader (the batch's timestamp, the
publisher's *scheduled* send time, to the reader's clock: end to end, comparable across all four).

Then throughput: after the load stops, each Python reader drains the same backlog (every record
the ring retained) as fast as it can: records/s of the shm reader (bytes only, and with
`parse_batch` to a protobuf object) against the grpcio subscriber on the same records.
Prints a table and, with --json, writes the numbers.
"""

import argparse
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def lat(ns):
    return {
        "count": len(ns),
        "p50_us": pct(ns, 50) / 1e3,
        "p99_us": pct(ns, 99) / 1e3,
        "max_us": (max(ns) / 1e3) if ns else float("nan"),
    }


def seq_and_ts(b):
    """sequence_number (field 1) and timestamp (field 2, double) of an encoded KvEventBatch,
    which kvbridge writes first, in that order (no full parse: the cheap path of a reader)."""
    if not b or b[0] != 0x08:
        return None, None
    seq, shift, i = 0, 0, 1
    while True:
        c = b[i]
        seq |= (c & 0x7F) << shift
        i += 1
        if c < 0x80:
            break
        shift += 7
    if i + 9 <= len(b) and b[i] == 0x11:
        return seq, struct.unpack_from("<d", b, i + 1)[0]
    return seq, None


def set_slice(pid, us):
    """Ask the scheduler for a `us`-µs time slice for `pid` (0: the calling thread), staying
    SCHED_OTHER: Linux ≥ 6.12 (EEVDF) takes `sched_runtime` as the task's slice, and a task
    with a shorter slice gets an earlier deadline, so its wake-up preempts a running task with
    a longer one instead of queueing behind it. No privilege needed."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # struct sched_attr (SCHED_ATTR_SIZE_VER0): size, policy, flags, nice, priority, runtime,
    # deadline, period. x86-64 and arm64 syscall numbers.
    nr = {"x86_64": 314, "aarch64": 274}[os.uname().machine]
    attr = ctypes.create_string_buffer(struct.pack("<IIQiIQQQ", 48, 0, 0, 0, 0, us * 1000, 0, 0), 48)
    if libc.syscall(nr, pid, attr, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"sched_setattr(slice {us} µs): {os.strerror(e)}")


# ---- roles, each in its own process -------------------------------------------------------


def role_shm(a):
    import kvbridge_shm

    r = kvbridge_shm.Reader(a.ring, spin_us=a.spin_us)
    if a.slice_us:
        set_slice(0, a.slice_us)
    r.seek(r.window()[1] + 1)
    print("ready", flush=True)
    # The loop does no more than a lean consumer would: take the clock, keep the record. The
    # latencies are computed after the run, so the reader's own Python work between reads
    # (which delays its next wake-up on a busy machine) is as small as it can be; and it
    # keeps no object the cyclic GC tracks (a `Record` is one; its fields are not), so the
    # collections its allocations trigger stay small instead of walking every kept record.
    nows, ingests, seqs, payloads, laps = [], [], [], [], []
    t0 = time.time_ns()
    t_end = t0 + int(a.run_s * 1e9)
    while True:
        try:
            rec = r.next(timeout=0.2)
        except kvbridge_shm.Lapped as e:
            laps.append((time.time_ns(), e.missed, len(seqs)))
            continue
        now_ns = time.time_ns()
        if rec is not None:
            nows.append(now_ns)
            ingests.append(rec.ingest_ns)
            seqs.append(rec.sequence)
            payloads.append(rec.payload)
        if now_ns >= t_end:
            break
    count_from, count_to = t0 + int(a.warmup_s * 1e9), t0 + int((a.warmup_s + a.count_s) * 1e9)
    counted = lambda t: count_from <= t < count_to
    lost = sum(missed for t, missed, _ in laps if counted(t))
    after_lap = {i for _, _, i in laps}
    ingest, e2e, n, last = [], [], 0, None
    for i, (now_ns, ingest_ns, seq, payload) in enumerate(zip(nows, ingests, seqs, payloads)):
        if i in after_lap:
            last = None
        if counted(now_ns):
            n += 1
            ingest.append(now_ns - ingest_ns)
            _, ts = seq_and_ts(payload)
            if ts is not None:
                e2e.append(now_ns - int(ts * 1e9))
            if last is not None and seq != last + 1:
                lost += seq - last - 1
        last = seq
    print(json.dumps({"delivered": n, "lost": lost, "ingest": lat(ingest), "e2e": lat(e2e)}))


def stub():
    import grpc
    from smg_grpc_proto.generated import common_pb2
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc

    return grpc, common_pb2, vllm_engine_pb2_grpc


def role_grpc(a):
    grpc, common_pb2, vllm_grpc = stub()
    ch = grpc.insecure_channel(a.grpc)
    grpc.channel_ready_future(ch).result(timeout=20)
    s = vllm_grpc.VllmEngineStub(ch)
    it = s.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0))
    print("ready", flush=True)
    e2e, n, lost, last = [], 0, 0, None
    t0 = time.time()
    t_end = t0 + a.run_s
    count_from, count_to = a.warmup_s, a.warmup_s + a.count_s

    def stop(*_):
        it.cancel()

    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, a.run_s)
    try:
        for b in it:
            now_ns = time.time_ns()
            el = now_ns / 1e9 - t0
            if count_from <= el < count_to:
                n += 1
                e2e.append(now_ns - int(b.timestamp * 1e9))
                if last is not None and b.sequence_number != last + 1:
                    lost += b.sequence_number - last - 1
            last = b.sequence_number
            if time.time() >= t_end:
                break
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            raise
    print(json.dumps({"delivered": n, "lost": lost, "e2e": lat(e2e)}))


def role_drain_shm(a):
    import kvbridge_shm

    r = kvbridge_shm.Reader(a.ring)
    oldest, newest = r.window()
    out = {}
    for parse in (False, True):
        r.seek(oldest)
        t = time.perf_counter()
        n = 0
        while r.position <= newest:
            rec = r.next(timeout=1)
            if parse:
                kvbridge_shm.parse_batch(rec)
            n += 1
        out["parse" if parse else "bytes"] = n / (time.perf_counter() - t)
    out["records"] = newest - oldest + 1
    print(json.dumps(out))


def role_drain_grpc(a):
    grpc, common_pb2, vllm_grpc = stub()
    ch = grpc.insecure_channel(a.grpc, options=[("grpc.max_receive_message_length", 64 << 20)])
    s = vllm_grpc.VllmEngineStub(ch)
    # S = oldest: the records above it (S = 0 would mean "from the current state").
    oldest, newest = a.oldest, a.newest
    it = s.SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest(start_sequence_number=oldest)
    )
    t = time.perf_counter()
    n = 0
    for b in it:
        n += 1
        if b.sequence_number >= newest:
            break
    dt = time.perf_counter() - t
    it.cancel()
    print(json.dumps({"records": n, "rate": n / dt}))


# ---- orchestration -------------------------------------------------------------------------


def spawn_role(role, **kv):
    args = [sys.executable, os.path.abspath(__file__), "--role", role]
    for k, v in kv.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def result(p):
    out, _ = p.communicate(timeout=120)
    if p.returncode != 0:
        raise SystemExit(f"{p.args[3]} failed ({p.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvbridge", default="target/release/kvbridge")
    ap.add_argument("--rate", type=int, default=10000)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mix", default="small")
    ap.add_argument("--json")
    ap.add_argument("--spin-us", type=int, default=0,
                    help="the Python reader's opt-in spin before each futex wait (default 0)")
    ap.add_argument("--floor", metavar="FLOOR_WAITER",
                    help="also run this floor_waiter binary (cargo build --release -p kvbridge-shm "
                         "--example floor_waiter) as a reader in the same run: the latency floor "
                         "of a waiting reader on this machine under this load")
    ap.add_argument("--slice-us", type=int, default=0,
                    help="request this scheduler slice (µs, Linux >= 6.12) for the Python shm reader "
                         "and the floor waiter (default: the kernel's)")
    ap.add_argument("--floors", type=int, default=1,
                    help="with --floor: how many identical floor waiters (2: the spread between "
                         "two identical minimal readers woken by the same commit)")
    ap.add_argument("--floor-mode", default="wait", choices=["wait", "spin"],
                    help=argparse.SUPPRESS)
    # roles
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--ring", help=argparse.SUPPRESS)
    ap.add_argument("--grpc", help=argparse.SUPPRESS)
    ap.add_argument("--run-s", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--warmup-s", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--count-s", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--oldest", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--newest", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        {
            "shm": role_shm,
            "grpc": role_grpc,
            "drain-shm": role_drain_shm,
            "drain-grpc": role_drain_grpc,
        }[a.role](a)
        return

    tmp = tempfile.mkdtemp(prefix="kvbridge-pybench-")
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tmp
    ring = os.path.join(shm_dir, f"kvbridge-pybench-{os.getpid()}")
    grpc_addr = f"127.0.0.1:{free_port()}"
    engine = f"tcp://127.0.0.1:{free_port()}"
    bridge = subprocess.Popen(
        [a.kvbridge, "serve", "--zmq", engine, "--grpc", grpc_addr, "--shm", ring,
         "--metrics", "off", "--seq-base", "1", "--ring-size", "64MiB"],
        stdout=subprocess.DEVNULL,
        env=dict(os.environ, RUST_LOG="error"),
    )
    try:
        deadline = time.time() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", int(grpc_addr.split(":")[1])), 1).close()
                if os.path.exists(ring):
                    break
                time.sleep(0.05)
            except OSError:
                if time.time() > deadline:
                    raise SystemExit("kvbridge serve did not start")
                time.sleep(0.05)
        run_s = a.warmup + a.seconds + 1.5
        # The Rust bench sleeps 0.3 s before its clock starts; the Python readers count the
        # same window (warm-up + 0.3 s in, measured seconds long).
        py = [
            spawn_role("shm", ring=ring, run_s=run_s + 0.5, warmup_s=a.warmup + 0.5, count_s=a.seconds,
                       spin_us=a.spin_us, slice_us=a.slice_us),
            spawn_role("grpc", grpc=grpc_addr, run_s=run_s + 0.5, warmup_s=a.warmup + 0.5, count_s=a.seconds),
        ]
        for _ in range(a.floors if a.floor else 0):
            py.append(subprocess.Popen(
                [a.floor, ring, str(run_s + 0.5), str(a.warmup + 0.5), str(a.seconds), a.floor_mode],
                stdout=subprocess.PIPE, text=True))
            if a.slice_us:
                set_slice(py[-1].pid, a.slice_us)
        for p in py:
            if p.stdout.readline().strip() != "ready":
                raise SystemExit("a Python reader did not start")
        rust_json = os.path.join(tmp, "rust.json")
        rust = subprocess.run(
            [a.kvbridge, "bench", "--grpc", grpc_addr, "--shm", ring, "--engine-bind", engine,
             "--serve-pid", str(bridge.pid), "--rate", str(a.rate), "--duration", str(a.seconds),
             "--warmup", str(a.warmup), "--subscribers", "1", "--shm-readers", "1",
             "--mix", a.mix, "--json", rust_json],
            stdout=subprocess.DEVNULL,
        )
        if rust.returncode != 0:
            raise SystemExit("kvbridge bench failed")
        with open(rust_json) as f:
            rs = json.load(f)
        shm_py, grpc_py, *floor = [result(p) for p in py]
        drain_shm = result(spawn_role("drain-shm", ring=ring))
        import kvbridge_shm

        oldest, newest = kvbridge_shm.Reader(ring).window()
        drain_grpc = result(spawn_role("drain-grpc", grpc=grpc_addr, oldest=oldest, newest=newest))
    finally:
        bridge.send_signal(signal.SIGTERM)
        try:
            bridge.wait(timeout=15)
        except subprocess.TimeoutExpired:
            bridge.kill()
        for f in (ring, ring + ".wake"):
            try:
                os.unlink(f)
            except OSError:
                pass

    secs = a.seconds
    rows = [
        ("Rust shm reader (futex)", rs["shm"]["delivered"] / secs, rs["shm"]["lost"],
         rs["shm_ring_latency"], rs["shm_latency"]),
        ("Python kvbridge_shm.Reader", shm_py["delivered"] / secs, shm_py["lost"],
         shm_py["ingest"], shm_py["e2e"]),
    ] + [
        (f"floor: Rust waiter ({a.floor_mode})" + (f" #{k + 1}" if len(floor) > 1 else ""),
         fl["delivered"] / secs, fl["lost"], fl["ingest"], None)
        for k, fl in enumerate(floor)
    ] + [
        ("Rust gRPC subscriber", rs["grpc"]["delivered"] / secs, rs["grpc"]["lost"],
         None, rs["grpc_latency"]),
        ("Python grpcio subscriber", grpc_py["delivered"] / secs, grpc_py["lost"],
         None, grpc_py["e2e"]),
    ]
    f = lambda x: "-" if x is None else f"{x:.1f}"
    print(f"offered {a.rate} batches/s ({a.mix}), {secs} s measured, published {rs['published']}")
    print(f"{'reader':28} {'rec/s':>8} {'lost':>5} {'ingest→r p50':>13} {'p99':>8} {'publish→r p50':>14} {'p99':>8}  (µs)")
    for name, rate, lost, il, el in rows:
        print(f"{name:28} {rate:8.0f} {lost:5d} {f(il and il['p50_us']):>13} {f(il and il['p99_us']):>8} "
              f"{f(el and el['p50_us']):>14} {f(el and el['p99_us']):>8}")
    print(f"drain {drain_shm['records']} retained records as fast as possible:")
    print(f"  Python shm reader  {drain_shm['bytes']:10.0f} rec/s (bytes), "
          f"{drain_shm['parse']:10.0f} rec/s (+ parse_batch)")
    print(f"  Python grpcio      {drain_grpc['rate']:10.0f} rec/s (parsed by grpcio)")
    print(f"  ratio shm/grpcio   {drain_shm['bytes'] / drain_grpc['rate']:10.1f}x (bytes), "
          f"{drain_shm['parse'] / drain_grpc['rate']:10.1f}x (+ parse_batch)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rust": rs, "python_shm": shm_py, "python_grpc": grpc_py,
                       "floor": floor,
                       "drain_shm": drain_shm, "drain_grpc": drain_grpc}, fh, indent=2)


if __name__ == "__main__":
    main()
