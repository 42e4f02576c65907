//! Operations: the ring file on disk. Its mode, a record damaged in it, a ring damaged at
//! start-up or truncated under the bridge, and the files a failed start, a fresh start and the
//! demo leave behind (none of their own).

use crate::common;

use std::os::unix::fs::PermissionsExt;

use common::ops::*;
use common::*;

#[test]
fn ring_file_is_0600_by_default_and_0640_with_shm_group_read() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    for (extra, mode) in [(None, 0o600), (Some("--shm-group-read"), 0o640)] {
        let shm = dir.path().join(format!("ring-{mode:o}"));
        let mut args = engine_args(&e);
        args.extend(extra.map(s));
        let bridge = Bridge::start(dir.path(), &shm, &args);
        let m = std::fs::metadata(&shm).unwrap().permissions().mode() & 0o777;
        assert_eq!(m, mode, "ring file mode {m:o}");
        bridge.stop();
    }
}

/// File offset of record `seq` in a ring file, found through its index (as a reader finds it).
fn ring_record_offset(ring: &std::path::Path, seq: u64) -> u64 {
    use kvbridge_shm::layout::*;
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(ring).unwrap();
    let u64_at = |off: u64| {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, off).unwrap();
        u64::from_le_bytes(b)
    };
    let slots = u64_at(OFF_INDEX_SLOTS as u64);
    let cap = u64_at(OFF_CAPACITY as u64);
    let pos = u64_at(u64_at(OFF_INDEX_OFFSET as u64) + 8 * (seq & (slots - 1)));
    u64_at(OFF_DATA_OFFSET as u64) + (pos & (cap - 1))
}

/// A record damaged in the ring file (not through the writer) is never served: the subscriber
/// that reaches it ends with DATA_LOSS naming corruption, the metric counts it, a fresh
/// subscriber starts after it, and `kvbridge tail` reports it as corrupt, not as a lap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_record_in_the_ring_is_data_loss_not_served() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let mut args = engine_args(&e);
    args.extend([s("--ring-size"), s("1MiB")]);
    let ring = dir.path().join("ring");
    let (bridge, maddr) = Bridge::start_with_metrics(dir.path(), &ring, &args);
    e.wait_subscribed();
    // 100 batches of ~6.6 KB: all retained by the 1 MiB ring, but record 10 is long gone from
    // the recent cache (a quarter of the ring), so a resume at 5 reads it from the ring.
    publish_stores(&e, 1, 100, 100);
    wait_metrics(maddr, T, |p| {
        metric(p, "kvbridge_ring_newest_seq", &[("ring", "merged")]) == 100.0
    });
    let payload_byte =
        ring_record_offset(&ring, 10) + kvbridge_shm::layout::RECORD_HEADER_LEN as u64 + 20;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&ring)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, payload_byte).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], payload_byte).unwrap();

    let mut sub = subscribe(&bridge.url(), 5).await.unwrap();
    let mut next = 6;
    let status = loop {
        match tokio::time::timeout(T, sub.message())
            .await
            .expect("stream must end")
        {
            Ok(Some(batch)) => {
                assert_eq!(
                    batch.sequence_number, next,
                    "delivered in order, up to the damage"
                );
                next += 1;
            }
            Ok(None) => panic!("ended without a status"),
            Err(st) => break st,
        }
    };
    assert_eq!(next, 10, "batches 6..=9 delivered, 10 not");
    assert_eq!(status.code(), tonic::Code::DataLoss, "{status:?}");
    assert!(
        status.message().contains("corrupt record"),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("batch 10"),
        "{}",
        status.message()
    );
    let page = scrape(maddr);
    assert_eq!(
        metric(
            &page,
            "kvbridge_ring_corrupt_records_total",
            &[("ring", "merged")]
        ),
        1.0
    );
    assert_eq!(
        metric(
            &page,
            "kvbridge_ring_reader_laps_total",
            &[("ring", "merged")]
        ),
        0.0
    );
    // A gateway resubscribes from 0: it starts after the damaged record instead of hitting it
    // again; a resume from before it is out of range.
    let mut fresh = subscribe(&bridge.url(), 0).await.unwrap();
    let got = collect_until(&mut fresh, T, |b| !b.is_empty()).await;
    assert_eq!(got[0].sequence_number, 11);
    let err = subscribe(&bridge.url(), 3)
        .await
        .expect_err("before the damage");
    assert_eq!(err.code(), tonic::Code::OutOfRange, "{err:?}");

    // `kvbridge tail` from another process: 1..=9, "corrupt record 10", 11, 12.
    let out = std::process::Command::new(bin())
        .args([
            "tail",
            "--shm",
            &ring.display().to_string(),
            "--count",
            "11",
            "--meta",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("corrupt record 10"), "{stderr}");
    assert!(!stderr.contains("lapped"), "{stderr}");
    let seqs: Vec<u64> = stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, (1..=9).chain(11..=12).collect::<Vec<_>>());

    // Restarted, the bridge adopts the ring, finds the damaged record while recovering (WARN)
    // and still starts fresh subscribers after it.
    let bridge = bridge.restart(dir.path());
    // The text log colours field names: drop the escape sequences before matching.
    let log: String = bridge
        .log()
        .split('\x1b')
        .enumerate()
        .map(|(i, part)| {
            if i == 0 {
                part
            } else {
                part.split_once('m').map_or(part, |(_, rest)| rest)
            }
        })
        .collect();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("fail their checksum")
            && l.contains("last_corrupt_seq=10")),
        "{log}"
    );
    let mut fresh = subscribe(&bridge.url(), 0).await.unwrap();
    let got = collect_until(&mut fresh, T, |b| !b.is_empty()).await;
    assert_eq!(got[0].sequence_number, 11);
    assert!(bridge.stop().success());
}

/// A ring file found damaged at start-up (here: truncated) is replaced, with a WARN naming
/// what was wrong.
#[test]
fn a_damaged_ring_at_start_up_is_replaced_with_a_warning_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    {
        let opts = kvbridge_shm::WriterOptions {
            capacity: 1 << 20,
            seq_base: Some(1),
            group_read: false,
        };
        let mut w = kvbridge_shm::RingWriter::open(&ring, &opts).unwrap();
        w.append(b"x", kvbridge_shm::RecordMeta::default()).unwrap();
    }
    let full = std::fs::metadata(&ring).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ring)
        .unwrap()
        .set_len(full / 2)
        .unwrap();
    let e = Engine::start(0);
    let mut args = engine_args(&e);
    args.extend([s("--ring-size"), s("1MiB")]);
    let bridge = Bridge::start(dir.path(), &ring, &args);
    assert_eq!(
        std::fs::metadata(&ring).unwrap().len(),
        full,
        "a new, whole ring"
    );
    let log = bridge.log();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains(&format!("truncated: {} bytes", full / 2))),
        "{log}"
    );
    assert!(bridge.stop().success());
}

/// A ring file truncated under a running bridge is noticed at the next heartbeat: an ERROR names
/// it and the bridge shuts down with exit code 1 instead of dying of SIGBUS.
#[test]
fn a_ring_truncated_under_the_bridge_stops_it_cleanly() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let e = Engine::start(0);
    let mut args = engine_args(&e);
    args.extend([s("--ring-size"), s("1MiB")]);
    let mut bridge = Bridge::start(dir.path(), &ring, &args);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ring)
        .unwrap()
        .set_len(0)
        .unwrap();
    let status = eventually("the bridge exited", T, || {
        bridge.child.try_wait().unwrap().ok_or("still running")
    });
    let log = bridge.log();
    assert_eq!(
        status.signal(),
        None,
        "killed by a signal: {status:?}\n{log}"
    );
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("truncated to 0 bytes")),
        "{log}"
    );
}

/// A start that fails after creating its ring (here: an unusable TLS certificate, checked after
/// the rings are opened) removes that ring and its wake file again.
#[test]
fn a_failed_start_leaves_no_ring_or_wake_file() {
    let dir = tempfile::tempdir().unwrap();
    // PEM files of the right kinds (so that configuration accepts them) that TLS cannot use.
    let (cert, key) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
    std::fs::write(
        &cert,
        "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    std::fs::write(
        &key,
        "-----BEGIN PRIVATE KEY-----\nx\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let ring = dir.path().join("ring");
    let out = std::process::Command::new(bin())
        .args([
            "serve",
            "--zmq",
            "tcp://127.0.0.1:5999",
            "--grpc",
            "127.0.0.1:0",
        ])
        .args(["--metrics", "off", "--shm", &ring.display().to_string()])
        .args(["--tls-cert", &cert.display().to_string()])
        .args(["--tls-key", &key.display().to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--tls-key"), "{err}");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ring"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// At start-up the bridge removes leftovers of its own rings — a wake file whose ring is gone
/// (also of a rank ring of an earlier run), a ring a crashed writer was still creating — and
/// nothing else.
#[test]
fn serve_start_up_removes_stale_ring_files_it_owns() {
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let stale = [
        "ring.wake",
        "ring-rank3.wake",
        "ring.tmp.2147483646.ab12",
        "ring-rank1.tmp.2147483646.cd34",
    ];
    for f in stale.iter().chain(&["other.wake", "ring-old.wake"]) {
        std::fs::write(dir.path().join(f), b"x").unwrap();
    }
    let e = Engine::start(0);
    let mut args = engine_args(&e);
    args.extend([s("--ring-size"), s("1MiB")]);
    let bridge = Bridge::start(dir.path(), &ring, &args);
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        // the harness's own files: the bridge's log and ready file
        .filter(|n| !n.ends_with(".log") && !n.starts_with("ready-"))
        .collect();
    names.sort();
    // `ring.wake` is there again: the new ring's own; `ring.snapshot` is the new ring's start-up
    // checkpoint (written before the bridge serves).
    assert_eq!(
        names,
        [
            "other.wake",
            "ring",
            "ring-old.wake",
            "ring.snapshot",
            "ring.wake"
        ]
    );
    let log = bridge.log();
    for f in &stale[1..] {
        assert!(
            log.lines()
                .any(|l| l.contains("removed a stale ring file") && l.contains(f)),
            "{f}: {log}"
        );
    }
    assert!(bridge.stop().success());
}

/// `kvbridge demo` runs its whole path on a ring in /dev/shm and leaves neither the ring nor
/// its wake file behind.
#[test]
fn the_demo_leaves_no_ring_or_wake_file() {
    let out = run_ok(&[
        "demo",
        "--duration",
        "1",
        "--rate",
        "50",
        "--ranks",
        "1",
        "--subscribers",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ring = stdout
        .split_whitespace()
        .find(|w| w.contains("kvbridge-demo-"))
        .expect("the demo names its ring");
    assert!(!std::path::Path::new(ring).exists(), "{ring} left behind");
    let wake = format!("{ring}.wake");
    assert!(!std::path::Path::new(&wake).exists(), "{wake} left behind");
}
