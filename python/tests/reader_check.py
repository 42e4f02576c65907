"""Python side of tests/it/python_shm.rs: drives kvbridge_shm.Reader against a running bridge.

Every mode prints one JSON object per line on stdout (flushed) and reads its cue lines, if any,
from stdin, so the Rust test can interleave bridge actions (publish, SIGKILL, restart) with the
reader's steps. Any unexpected outcome raises, which exits non-zero with a traceback the test
shows.
"""

import argparse
import json
import sys
import threading

import kvbridge_shm


def emit(**kv):
    sys.stdout.write(json.dumps(kv) + "\n")
    sys.stdout.flush()


def cue(expected):
    line = sys.stdin.readline().strip()
    if line != expected:
        raise SystemExit(f"expected cue {expected!r}, got {line!r}")


def record_json(rec):
    return dict(
        event="record",
        seq=rec.sequence,
        dp_rank=rec.dp_rank,
        upstream_seq=rec.upstream_seq,
        ingest_ns=rec.ingest_ns,
        flags=rec.flags,
        payload=rec.payload.hex(),
    )


def read_one(r, timeout=30.0):
    rec = r.next(timeout=timeout)
    if rec is None:
        raise SystemExit(f"no record within {timeout} s at position {r.position}")
    return rec


def mappings_of(path):
    """Permissions of every mapping of `path` in this process (from /proc/self/maps)."""
    perms = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip() == path:
                perms.append(parts[1])
    return perms


def mode_dump(a):
    r = kvbridge_shm.Reader(a.ring)
    oldest, newest = r.window()
    emit(event="window", oldest=oldest, newest=newest, position=r.position, path=r.path,
         alive=r.writer_alive(), repr=repr(r))
    if a.start is not None:
        r.seek(a.start)
    for _ in range(a.count):
        rec = read_one(r)
        batch = kvbridge_shm.parse_batch(rec)
        assert batch.sequence_number == rec.sequence, (batch.sequence_number, rec.sequence)
        assert len(rec) == len(rec.payload)
        emit(**record_json(rec))
    # Nothing more is published: a short wait ends with None, not an exception.
    assert r.next(timeout=0.05) is None
    assert r.poll() is None
    # seek outside the window is refused with the window's numbers.
    try:
        r.seek(newest + 5)
    except kvbridge_shm.SeekOutOfRange as e:
        emit(event="seek_error", requested=e.requested, oldest=e.oldest, newest=e.newest)
    else:
        raise SystemExit("seek past newest + 1 was accepted")
    # The opt-in spin: a waiting read with it still ends with None; out of range is refused.
    s = kvbridge_shm.Reader(a.ring, spin_us=50)
    first = read_one(s)
    assert first.sequence == oldest and first.payload == kvbridge_shm.Reader(a.ring).next().payload
    s.seek(newest + 1)
    assert s.next(timeout=0.01) is None
    try:
        kvbridge_shm.Reader(a.ring, spin_us=1001)
    except ValueError:
        pass
    else:
        raise SystemExit("spin_us=1001 was accepted")
    # Waiting releases the GIL: while a thread waits in next() (nothing is published, so it
    # waits the full second), this thread keeps running, and a call into the same Reader from
    # here is refused (RuntimeError) instead of blocking.
    w = kvbridge_shm.Reader(a.ring)
    w.seek(newest + 1)
    started, done = threading.Event(), threading.Event()

    def waiter():
        started.set()
        w.next(timeout=1.0)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    started.wait()
    spins, busy = 0, 0
    while not done.is_set():
        spins += 1
        try:
            w.window()
        except RuntimeError:
            busy += 1
    t.join()
    emit(event="gil", spins=spins, busy=busy)
    # The reader cannot write the ring: every mapping of the ring file is read-only. Only the
    # `.wake` side file (a futex waiter count) is mapped writable.
    emit(
        event="maps",
        ring=mappings_of(a.ring),
        wake=mappings_of(a.ring + ".wake"),
    )


def mode_lap(a):
    r = kvbridge_shm.Reader(a.ring)
    r.seek(r.window()[1] + 1)
    emit(event="ready", position=r.position)
    cue("go")
    wanted = r.position
    window = r.window()
    try:
        rec = r.next(timeout=5)
    except kvbridge_shm.Lapped as e:
        emit(
            event="lapped",
            wanted=wanted,
            missed=e.missed,
            resume_at=e.resume_at,
            position=r.position,
            oldest=window[0],
            newest=window[1],
        )
    else:
        raise SystemExit(f"expected Lapped, got {rec!r}")
    emit(**record_json(read_one(r)))


def mode_kill(a):
    r = kvbridge_shm.Reader(a.ring)
    r.seek(a.start)
    for _ in range(a.count):
        emit(**record_json(read_one(r)))
    emit(event="caught_up", position=r.position, alive=r.writer_alive())
    try:
        rec = r.next()  # no timeout: waits until something happens
    except kvbridge_shm.WriterGone as e:
        emit(event="gone", resume_at=e.resume_at, alive=r.writer_alive())
    else:
        raise SystemExit(f"expected WriterGone, got {rec!r}")
    # Wait right away, while the writer is still dead: a timeout covers its restart (the
    # restarted writer adopts the same file and wakes this reader), so no WriterGone here.
    for _ in range(a.more):
        emit(**record_json(read_one(r, timeout=60)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["dump", "lap", "kill"])
    p.add_argument("--ring", required=True)
    p.add_argument("--start", type=int)
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--more", type=int, default=0)
    a = p.parse_args()
    {"dump": mode_dump, "lap": mode_lap, "kill": mode_kill}[a.mode](a)
    emit(event="done")


if __name__ == "__main__":
    main()
