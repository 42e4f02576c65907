//! Operations: the operational flags (TLS, token, limits, timeouts, checkpoint interval) are
//! validated at start-up with one line and exit code 2.

use crate::common;

use common::ops::*;
use common::*;

#[test]
fn new_flags_are_validated_with_one_line_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("c.pem");
    std::fs::write(
        &cert,
        "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n").unwrap();
    let toml = dir.path().join("k.toml");
    std::fs::write(
        &toml,
        "zmq = [\"tcp://*:5557\"]\nmax-streams-per-connection = 0\n",
    )
    .unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![s("--tls-cert"), cert.display().to_string()],
            "--tls-cert needs --tls-key",
        ),
        (
            vec![s("--tls-key"), cert.display().to_string()],
            "--tls-key needs --tls-cert",
        ),
        (
            vec![
                s("--tls-cert"),
                cert.display().to_string(),
                s("--tls-key"),
                cert.display().to_string(),
            ],
            "--tls-key",
        ),
        (
            vec![s("--auth-token-file"), empty.display().to_string()],
            "empty",
        ),
        (
            vec![s("--auth-token-file"), s("/nonexistent/token")],
            "--auth-token-file",
        ),
        (
            vec![s("--max-streams-per-connection"), s("0")],
            "--max-streams-per-connection",
        ),
        (
            vec![s("--health-grace-ms"), s("999999999999")],
            "--health-grace-ms",
        ),
        (
            vec![s("--handshake-timeout-ms"), s("0")],
            "--handshake-timeout-ms",
        ),
        (vec![s("--fanout-linger"), s("5")], "--fanout-linger"),
        (vec![s("--fanout-linger"), s("2s")], "--fanout-linger"),
        (
            vec![s("--max-engine-message"), s("1KiB")],
            "--max-engine-message",
        ),
        (
            vec![s("--checkpoint-interval"), s("0s")],
            "--checkpoint-interval",
        ),
        (
            vec![s("--checkpoint-interval"), s("8d")],
            "--checkpoint-interval",
        ),
    ];
    // Its own ring path, port and no metrics port: nothing of a failed start lands in /dev/shm
    // (and nothing else on the machine can make it fail for another reason).
    let ring = dir.path().join("ring").display().to_string();
    let isolated = [
        "--grpc",
        "127.0.0.1:0",
        "--metrics",
        "off",
        "--shm",
        ring.as_str(),
    ];
    for (extra, needle) in cases {
        let out = std::process::Command::new(bin())
            .args(["serve", "--zmq", "tcp://*:5557"])
            .args(isolated)
            .args(&extra)
            .env_remove("KVBRIDGE_AUTH_TOKEN")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{extra:?}: {err}");
    }
    let out = std::process::Command::new(bin())
        .args(["serve", "--config", &toml.display().to_string()])
        .args(isolated)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-streams-per-connection"));
    let out = std::process::Command::new(bin())
        .args(["serve", "--zmq", "tcp://*:5557"])
        .args(isolated)
        .env("KVBRIDGE_AUTH_TOKEN", "has space")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("KVBRIDGE_AUTH_TOKEN"));
}
