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
