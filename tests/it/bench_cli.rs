//! `kvbridge bench` as a functional check (not a timing assertion): a few seconds at a small
//! rate, against a bridge it starts, must deliver everything to every reader.

use std::process::Command;

#[test]
fn bench_runs_and_reports_zero_loss() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args([
            "bench",
            "--rate",
            "200",
            "--duration",
            "3",
            "--warmup",
            "1",
            "--subscribers",
            "4",
            "--connections",
            "2",
        ])
        .args(["--shm-readers", "2", "--ring-size", "8MiB", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let published = r["published"].as_u64().unwrap();
    assert!(published >= 400, "published {published}");
    for path in ["grpc", "shm"] {
        assert_eq!(r[path]["lost"], 0, "{path}: {r}");
        assert_eq!(r[path]["duplicates"], 0, "{path}: {r}");
        assert_eq!(r[path]["errors"], 0, "{path}: {r}");
    }
    // Every subscriber saw (about) every published batch: the window edges may differ by a few.
    let min = r["grpc_min_delivered"].as_u64().unwrap();
    assert!(
        min + 20 >= published,
        "a subscriber fell short: {min} of {published}"
    );
    assert!(r["shm"]["delivered"].as_u64().unwrap() + 40 >= 2 * published);
    assert!(r["bridge_cpu_seconds"].as_f64().is_some());
    assert!(r["bridge_peak_rss_kib"].as_u64().unwrap() > 0);
    assert!(String::from_utf8_lossy(&out.stdout).contains("p99"));
}

/// A short `kvbridge bench --floor` (200 batches/s for 2 s, 4 subscribers on 2 connections, no
/// shm readers) with `extra` flags: its JSON result and its stdout. Fails unless it exits 0.
fn small_floor_bench(extra: &[&str]) -> (serde_json::Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args(["bench", "--rate", "200", "--duration", "2", "--warmup", "1"])
        .args([
            "--subscribers",
            "4",
            "--connections",
            "2",
            "--shm-readers",
            "0",
        ])
        .args(["--ring-size", "8MiB", "--floor"])
        .args(extra)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "stdout:\n{text}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (r, text)
}

/// `kvbridge bench --floor`: after the run, the same shape without gRPC (a sender process
/// writing one frame-sized message per connection per batch) is measured with both senders,
/// every message arrives in order and the sender's CPU is reported.
#[test]
fn bench_floor_reports_both_senders_without_loss() {
    let (r, text) = small_floor_bench(&[]);
    let floor = r["floor"].as_array().expect("floor rows");
    let senders: Vec<&str> = floor
        .iter()
        .map(|f| f["sender"].as_str().unwrap())
        .collect();
    assert_eq!(senders, ["blocking", "tokio"], "{r}");
    // A gRPC frame of the mean delivered size: record + 5-byte prefix + 9-byte frame header,
    // twice (two subscribers per connection).
    let record =
        r["delivered_mb"].as_f64().unwrap() * 1e6 / r["grpc"]["delivered"].as_f64().unwrap();
    for f in floor {
        assert_eq!(f["lost"], 0, "{f}");
        assert_eq!(f["connections"], 2, "{f}");
        let bytes = f["message_bytes"].as_f64().unwrap();
        assert!(
            (bytes - 2.0 * (record + 14.0)).abs() <= 2.0,
            "{bytes} vs {record}: {f}"
        );
        // 2 connections × 200/s × 2 s; generous, since a loaded machine may delay the sender.
        let messages = f["delivered_messages"].as_u64().unwrap();
        assert!((400..=900).contains(&messages), "{f}");
        assert_eq!(
            f["delivered_batches"].as_u64().unwrap(),
            2 * messages,
            "{f}"
        );
        assert!(f["cpu_us_per_delivered_batch"].as_f64().is_some(), "{f}");
    }
    assert!(text.contains("floor (Blocking sender"), "{text}");
}

/// `kvbridge bench --floor --floor-senders h2-writev`: the prototype sender (a real HTTP/2
/// handshake written by hand, then one `writev` of frame header + gRPC prefix and the shared
/// payload per connection per batch, within the client's windows) delivers every message, in
/// order, to real HTTP/2 clients, and its CPU and write counters are reported.
#[test]
fn bench_floor_h2_writev_sender_delivers_without_loss() {
    let (r, text) = small_floor_bench(&["--floor-senders", "h2-writev"]);
    let floor = r["floor"].as_array().expect("floor rows");
    assert_eq!(floor.len(), 1, "{r}");
    let f = &floor[0];
    assert_eq!(f["sender"], "h2-writev", "{f}");
    assert_eq!(f["lost"], 0, "{f}");
    assert_eq!(f["connections"], 2, "{f}");
    // 2 connections × 200/s × 2 s; generous, since a loaded machine may delay the sender.
    let messages = f["delivered_messages"].as_u64().unwrap();
    assert!((400..=900).contains(&messages), "{f}");
    assert!(f["cpu_us_per_delivered_batch"].as_f64().is_some(), "{f}");
    // Every batch was offered to every connection in (at least) one writev.
    assert!(f["h2"]["writes"].as_u64().unwrap() >= messages, "{f}");
    assert!(text.contains("floor (H2Writev sender"), "{text}");
    assert!(text.contains("floor side by side"), "{text}");
}

/// `kvbridge bench --zmq-subscribers`: the `--publish-zmq` column and its bare-relay floor, both
/// read by the same number of SUBs in the same run, each delivering every batch to every SUB, and
/// the CPU per record of the bridge and of the relay process.
#[test]
fn bench_zmq_column_reports_the_bridge_and_its_floor() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args(["bench", "--rate", "200", "--duration", "2", "--warmup", "1"])
        .args([
            "--subscribers",
            "1",
            "--shm-readers",
            "0",
            "--ring-size",
            "8MiB",
        ])
        .args(["--zmq-subscribers", "2", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout:\n{text}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("zmq vs floor"), "{text}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let z = &r["zmq"];
    assert_eq!(z["subscribers"], 2, "{r}");
    let published = r["published"].as_u64().unwrap();
    for col in ["bridge", "floor"] {
        let c = &z[col];
        assert_eq!(c["delivery"]["lost"], 0, "{col}: {c}");
        let delivered = c["delivery"]["delivered"].as_u64().unwrap();
        // every batch to both SUBs, give or take the window's edges on a loaded machine
        assert!(
            delivered + 20 >= 2 * published,
            "{col}: {delivered} of 2 × {published}"
        );
        assert!(c["latency"]["p99_us"].as_f64().unwrap() > 0.0, "{col}: {c}");
    }
    // CPU per record of each whole process (the relay is a process of its own, as the bridge).
    for key in ["bridge_cpu_us_per_record", "floor_cpu_us_per_record"] {
        let v = z[key].as_f64().unwrap_or_else(|| panic!("{key}: {z}"));
        assert!(v > 0.0 && v < 1e6, "{key}: {v}");
    }
}

/// `--zmq-alternate 1`: two windows, the first with no ZMQ subscriber and the second with 2, each
/// with the gRPC column; a bad K is one line and exit 2.
#[test]
fn bench_zmq_alternate_measures_grpc_without_and_with_zmq_subscribers() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args(["bench", "--rate", "200", "--duration", "1", "--warmup", "1"])
        .args(["--subscribers", "1", "--shm-readers", "0"])
        .args(["--ring-size", "8MiB", "--zmq-subscribers", "2"])
        .args(["--zmq-alternate", "1", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout:\n{text}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("grpc with / without ZMQ subscribers"),
        "{text}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let ws = r["zmq_alternation"].as_array().expect("the windows");
    assert_eq!(ws.len(), 2, "{r}");
    for (w, subs) in ws.iter().zip([0, 2]) {
        assert_eq!(w["zmq_subscribers"], subs, "{w}");
        assert!(w["grpc"]["delivered"].as_u64().unwrap() > 100, "{w}");
        assert_eq!(w["grpc"]["lost"], 0, "{w}");
    }
    assert_eq!(
        ws[0]["zmq"]["delivered"], 0,
        "no ZMQ SUB in the first window"
    );
    assert!(
        ws[1]["zmq"]["delivered"].as_u64().unwrap() > 200,
        "{}",
        ws[1]
    );

    let bad = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args(["bench", "--zmq-alternate", "2"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
}
