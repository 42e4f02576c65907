//! The tests that span concerns: defaults, the TOML file against the flags, unknown keys, the
//! help headings, and every setting the same as a flag and as a TOML key. Each concern's own
//! checks are tested in its file, with the helpers here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;

use super::*;
use crate::fanout::{
    DEFAULT_GRPC, DEFAULT_HANDSHAKE_TIMEOUT_MS, DEFAULT_MAX_STREAMS_PER_CONNECTION,
};
use crate::ingest::DEFAULT_MAX_ENGINE_MESSAGE;
use crate::secrets::AUTH_TOKEN_ENV;

/// `kvbridge serve` on its own, to parse flags as the CLI does.
#[derive(Parser)]
struct Serve {
    #[command(flatten)]
    args: ServeArgs,
}

pub(super) fn flags<S: AsRef<str>>(list: &[S]) -> ServeArgs {
    let argv = std::iter::once("serve").chain(list.iter().map(|s| s.as_ref()));
    Serve::try_parse_from(argv).unwrap().args
}

/// Writes `text` to a new file in `dir` and returns flags naming it with `--config`.
pub(super) fn file(dir: &Path, text: &str) -> ServeArgs {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("k{n}.toml"));
    std::fs::write(&path, text).unwrap();
    ServeArgs {
        config: Some(path),
        ..Default::default()
    }
}

/// Everything a config holds, the TLS key included (its `Debug` redacts it).
pub(super) fn show(c: &ServeConfig) -> String {
    format!(
        "{c:?} {:?}",
        c.security.tls.as_ref().map(|t| (&t.cert, &t.key))
    )
}

pub(super) fn args(zmq: &[&str]) -> ServeArgs {
    let mut a = ServeArgs::default();
    a.engine.zmq = zmq.iter().map(|s| s.to_string()).collect();
    a
}

#[test]
fn defaults_and_ranks() {
    let c = args(&["tcp://*:5557", "tcp://*:5558"]).resolve().unwrap();
    assert_eq!(c.fanout.grpc.to_string(), DEFAULT_GRPC);
    assert_eq!(
        c.ring.ring_path(c.fanout.grpc.port()),
        PathBuf::from("/dev/shm/kvbridge-50061")
    );
    assert_eq!(c.ops.metrics, Some("127.0.0.1:51061".parse().unwrap()));
    assert_eq!(c.ring.size, 64 << 20);
    assert_eq!(c.ingest.ranks.len(), 2);
    assert_eq!(c.ingest.ranks[1].rank, 1);
    assert_eq!(c.ingest.topic, "");
}

#[test]
fn rejects_bad_values_with_the_flag_named() {
    let mut a = args(&["tcp://*:5557"]);
    a.ring.ring_size = Some(ByteSize::Flag("512KiB".into()));
    assert!(a.resolve().unwrap_err().to_string().contains("--ring-size"));
    let mut a = args(&["tcp://*:5557"]);
    a.streaming.grpc = Some("nope".into());
    assert!(a.resolve().unwrap_err().to_string().contains("--grpc"));
    assert!(args(&[])
        .resolve()
        .unwrap_err()
        .to_string()
        .contains("no engine endpoint"));
    let mut a = args(&["tcp://*:5557", "tcp://*:5558"]);
    a.engine.replay = vec!["tcp://*:5558".into()];
    assert!(a.resolve().unwrap_err().to_string().contains("collides"));
}

#[test]
fn bad_sizes_name_the_flag_or_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let err = flags(&["--zmq", "tcp://*:5557", "--ring-size", "lots"])
        .resolve()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        r#"--ring-size "lots": not a size: "lots" (try 64MiB or 1048576)"#
    );
    let a = file(
        dir.path(),
        "zmq = [\"tcp://*:5557\"]\nsplit-threshold = \"4XB\"\n",
    );
    assert_eq!(
        a.resolve().unwrap_err().to_string(),
        r#"split-threshold: unknown unit "xb" in "4XB" (use KiB, MiB or GiB)"#
    );
    let a = file(dir.path(), "zmq = [\"tcp://*:5557\"]\nring-size = 1024\n");
    assert_eq!(
        a.resolve().unwrap_err().to_string(),
        "--ring-size 1024: must be at least 1MiB (1048576)"
    );
}

#[test]
fn toml_file_and_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("k.toml");
    std::fs::write(&p, "zmq = [\"tcp://*:6000\"]\ngrpc = \"127.0.0.1:7000\"\nring-size = \"2MiB\"\ntopic = \"kv\"\n").unwrap();
    let mut a = ServeArgs {
        config: Some(p.clone()),
        ..Default::default()
    };
    let c = a.resolve().unwrap();
    assert_eq!(c.ingest.ranks[0].endpoint, "tcp://127.0.0.1:6000");
    assert_eq!(c.fanout.grpc.port(), 7000);
    assert_eq!(c.ring.size, 2 << 20);
    assert_eq!(c.ingest.topic, "kv");
    a.streaming.grpc = Some("127.0.0.1:7001".into());
    assert_eq!(a.resolve().unwrap().fanout.grpc.port(), 7001);
    std::fs::write(&p, "bogus-key = 1\n").unwrap();
    assert!(a.resolve().unwrap_err().to_string().contains("bogus-key"));
}

#[test]
fn unknown_toml_keys_are_rejected_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let base = "zmq = [\"tcp://*:5557\"]\n";
    for (text, key) in [
        ("bogus-key = 1\n", "bogus-key"),
        ("ring_size = \"2MiB\"\n", "ring_size"),
        ("config = \"other.toml\"\n", "config"),
        ("unknown = true\n", "unknown"),
        ("[ring]\nring-size = \"2MiB\"\n", "ring"),
    ] {
        let err = file(dir.path(), &format!("{base}{text}"))
            .resolve()
            .unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }), "{text}: {err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("unknown field `{key}`, expected one of `zmq`, ")),
            "{text}: {msg}"
        );
        let last = ServeArgs::setting_names().pop().unwrap();
        assert!(msg.ends_with(&format!("`{last}`")), "{msg}");
    }
}

#[test]
fn help_groups_every_setting_under_its_concern() {
    use clap::Args;
    let cmd = ServeArgs::augment_args(clap::Command::new("serve"));
    for arg in cmd.get_arguments() {
        let name = arg.get_long().unwrap();
        assert_eq!(
            arg.get_help_heading().is_none(),
            name == "config",
            "--{name}"
        );
    }
}

#[test]
fn ops_settings_from_toml_and_flags() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, tok) = (
        dir.path().join("c.pem"),
        dir.path().join("k.pem"),
        dir.path().join("t"),
    );
    std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nx\n").unwrap();
    std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\nx\n").unwrap();
    std::fs::write(&tok, "  abc.DEF-123\n").unwrap();
    let p = dir.path().join("k.toml");
    std::fs::write(
        &p,
        format!(
            "zmq = [\"tcp://*:6000\"]\nhealth-grace-ms = 250\nmax-streams-per-connection = 512\n\
             tls-cert = {cert:?}\ntls-key = {key:?}\nauth-token-file = {tok:?}\n"
        ),
    )
    .unwrap();
    let mut a = ServeArgs {
        config: Some(p),
        ..Default::default()
    };
    let c = a.resolve().unwrap();
    assert_eq!(c.ops.health_grace, Duration::from_millis(250));
    assert_eq!(c.fanout.max_streams_per_connection, 512);
    assert_eq!(c.security.auth_token.as_deref(), Some("abc.DEF-123"));
    assert!(c.security.tls.is_some());
    assert!(
        !format!("{c:?}").contains("PRIVATE"),
        "key redacted in Debug"
    );
    a.streaming.max_streams_per_connection = Some(0);
    assert!(a
        .resolve()
        .unwrap_err()
        .to_string()
        .contains("--max-streams-per-connection"));
    let d = args(&["tcp://*:5557"]);
    if std::env::var_os(AUTH_TOKEN_ENV).is_none() {
        let c = d.resolve().unwrap();
        assert!(c.security.auth_token.is_none() && c.security.tls.is_none());
        assert_eq!(
            c.ops.health_grace.as_millis() as u64,
            DEFAULT_HEALTH_GRACE_MS
        );
        assert_eq!(
            c.fanout.max_streams_per_connection,
            DEFAULT_MAX_STREAMS_PER_CONNECTION
        );
        assert_eq!(
            c.fanout.handshake_timeout,
            Duration::from_millis(DEFAULT_HANDSHAKE_TIMEOUT_MS)
        );
        assert_eq!(c.ingest.max_engine_message, DEFAULT_MAX_ENGINE_MESSAGE);
    }
}

/// An engine configuration (no spaces: the rows split flags on whitespace).
const KV: &str = r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:6000"}"#;

/// One whose meaning depends on the engine (`0.0.0.0`).
const KV_ANY: &str =
    r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://0.0.0.0:6000"}"#;

/// One row per setting: its flags, the same setting in TOML, and another TOML value for it.
struct Row {
    flags: Vec<String>,
    toml: String,
    other: String,
}

fn rows(dir: &Path) -> Vec<Row> {
    let pem = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let (cert, key) = (
        pem("c.pem", "-----BEGIN CERTIFICATE-----\nx\n"),
        pem("k.pem", "-----BEGIN PRIVATE KEY-----\nx\n"),
    );
    let (cert2, key2) = (
        pem("c2.pem", "-----BEGIN CERTIFICATE-----\nyy\n"),
        pem("k2.pem", "-----BEGIN PRIVATE KEY-----\nyy\n"),
    );
    let (token, token2) = (pem("t", "abc\n"), pem("t2", "def\n"));
    let row = |flags: &str, toml: &str, other: &str| Row {
        flags: flags.split_whitespace().map(str::to_string).collect(),
        toml: toml.to_string(),
        other: other.to_string(),
    };
    vec![
        // Engine input.
        row(
            "--zmq tcp://*:6000 --zmq tcp://*:6001",
            r#"zmq = ["tcp://*:6000", "tcp://*:6001"]"#,
            r#"zmq = ["tcp://*:7000"]"#,
        ),
        row(
            "--zmq-bind tcp://127.0.0.1:6002",
            r#"zmq-bind = ["tcp://127.0.0.1:6002"]"#,
            r#"zmq-bind = ["tcp://127.0.0.1:7002"]"#,
        ),
        row(
            "--replay tcp://127.0.0.1:6100",
            r#"replay = ["tcp://127.0.0.1:6100"]"#,
            r#"replay = ["tcp://127.0.0.1:7100"]"#,
        ),
        row(
            "--engine-snapshot tcp://127.0.0.1:6200",
            r#"engine-snapshot = ["tcp://127.0.0.1:6200"]"#,
            r#"engine-snapshot = ["tcp://127.0.0.1:7200"]"#,
        ),
        row("--topic kv", r#"topic = "kv""#, r#"topic = "other""#),
        row(
            "--replay-timeout-ms 500",
            "replay-timeout-ms = 500",
            "replay-timeout-ms = 600",
        ),
        row(
            &format!("--kv-events-config {KV}"),
            &format!("kv-events-config = '{KV}'"),
            &format!("kv-events-config = '{}'", KV.replace("6000", "7000")),
        ),
        row(
            &format!("--kv-events-config {KV} --data-parallel-size 2"),
            &format!("kv-events-config = '{KV}'\ndata-parallel-size = 2"),
            &format!("kv-events-config = '{KV}'\ndata-parallel-size = 3"),
        ),
        row(
            &format!("--kv-events-config {KV_ANY} --engine sglang"),
            &format!("kv-events-config = '{KV_ANY}'\nengine = \"sglang\""),
            &format!("kv-events-config = '{KV_ANY}'\nengine = \"vllm\""),
        ),
        row(
            "--max-engine-message 1MiB",
            r#"max-engine-message = "1MiB""#,
            "max-engine-message = 2097152",
        ),
        // Ring.
        row(
            "--shm /tmp/kvbridge-cfg-a",
            r#"shm = "/tmp/kvbridge-cfg-a""#,
            r#"shm = "/tmp/kvbridge-cfg-b""#,
        ),
        row(
            "--ring-size 2MiB",
            r#"ring-size = "2MiB""#,
            "ring-size = 4194304",
        ),
        row(
            "--ring-size 3145728",
            "ring-size = 3145728",
            r#"ring-size = "2MiB""#,
        ),
        row("--seq-base 5", "seq-base = 5", "seq-base = 6"),
        row(
            "--split-threshold 64KiB",
            "split-threshold = 65536",
            r#"split-threshold = "128KiB""#,
        ),
        row(
            "--shm-group-read",
            "shm-group-read = true",
            "shm-group-read = false",
        ),
        // Streaming.
        row(
            "--grpc 127.0.0.1:7000",
            r#"grpc = "127.0.0.1:7000""#,
            r#"grpc = "127.0.0.1:7001""#,
        ),
        row(
            "--dp-mode metadata",
            r#"dp-mode = "metadata""#,
            r#"dp-mode = "merged""#,
        ),
        row(
            "--send-dp-rank",
            "send-dp-rank = true",
            "send-dp-rank = false",
        ),
        row("--profile all", r#"profile = "all""#, r#"profile = "smg""#),
        // Snapshots.
        row(
            "--snapshot off",
            r#"snapshot = "off""#,
            r#"snapshot = "on""#,
        ),
        row(
            "--snapshot-max-blocks 1000",
            "snapshot-max-blocks = 1000",
            "snapshot-max-blocks = 2000",
        ),
        row(
            "--snapshot-chunk-size 64KiB",
            r#"snapshot-chunk-size = "64KiB""#,
            "snapshot-chunk-size = 8192",
        ),
        row(
            "--checkpoint-interval 5m",
            r#"checkpoint-interval = "5m""#,
            r#"checkpoint-interval = "90s""#,
        ),
        // Engine-wire publishing.
        row(
            "--publish-zmq tcp://*:6557",
            r#"publish-zmq = "tcp://*:6557""#,
            r#"publish-zmq = "tcp://*:6600""#,
        ),
        row(
            "--publish-zmq tcp://*:6557 --publish-zmq-replay tcp://*:6558",
            "publish-zmq = \"tcp://*:6557\"\npublish-zmq-replay = \"tcp://*:6558\"",
            "publish-zmq = \"tcp://*:6557\"\npublish-zmq-replay = \"tcp://*:6700\"",
        ),
        row(
            "--publish-zmq tcp://*:6557 --publish-zmq-snapshot tcp://*:6559",
            "publish-zmq = \"tcp://*:6557\"\npublish-zmq-snapshot = \"tcp://*:6559\"",
            "publish-zmq = \"tcp://*:6557\"\npublish-zmq-snapshot = \"tcp://*:6800\"",
        ),
        row(
            "--publish-zmq tcp://*:6557 --publish-zmq-topic kv",
            "publish-zmq = \"tcp://*:6557\"\npublish-zmq-topic = \"kv\"",
            "publish-zmq = \"tcp://*:6557\"\npublish-zmq-topic = \"other\"",
        ),
        row(
            "--publish-zmq tcp://*:6557 --publish-zmq-layout array",
            "publish-zmq = \"tcp://*:6557\"\npublish-zmq-layout = \"array\"",
            "publish-zmq = \"tcp://*:6557\"\npublish-zmq-layout = \"map\"",
        ),
        row(
            "--publish-zmq tcp://*:6557 --publish-zmq-hwm 500",
            "publish-zmq = \"tcp://*:6557\"\npublish-zmq-hwm = 500",
            "publish-zmq = \"tcp://*:6557\"\npublish-zmq-hwm = 900",
        ),
        row(
            "--max-subscribers 7",
            "max-subscribers = 7",
            "max-subscribers = 8",
        ),
        row(
            "--max-streams-per-connection 9",
            "max-streams-per-connection = 9",
            "max-streams-per-connection = 10",
        ),
        row(
            "--handshake-timeout-ms 2500",
            "handshake-timeout-ms = 2500",
            "handshake-timeout-ms = 3000",
        ),
        row(
            "--fanout-linger 5ms",
            "fanout-linger = \"5ms\"",
            "fanout-linger = \"500us\"",
        ),
        // Security.
        row(
            &format!("--tls-cert {cert} --tls-key {key}"),
            &format!("tls-cert = {cert:?}\ntls-key = {key:?}"),
            &format!("tls-cert = {cert2:?}\ntls-key = {key2:?}"),
        ),
        row(
            &format!("--auth-token-file {token}"),
            &format!("auth-token-file = {token:?}"),
            &format!("auth-token-file = {token2:?}"),
        ),
        // NATS sink.
        row(
            "--nats nats://127.0.0.1:4222",
            r#"nats = "nats://127.0.0.1:4222""#,
            r#"nats = "nats://127.0.0.1:4223""#,
        ),
        row(
            "--nats nats://a:4222 --nats-subject-prefix kvx",
            "nats = \"nats://a:4222\"\nnats-subject-prefix = \"kvx\"",
            "nats = \"nats://a:4222\"\nnats-subject-prefix = \"kvy\"",
        ),
        row(
            "--nats nats://a:4222 --nats-stream S1",
            "nats = \"nats://a:4222\"\nnats-stream = \"S1\"",
            "nats = \"nats://a:4222\"\nnats-stream = \"S2\"",
        ),
        row(
            "--nats nats://a:4222 --nats-replicas 1",
            "nats = \"nats://a:4222\"\nnats-replicas = 1",
            "nats = \"nats://a:4222\"\nnats-replicas = 5",
        ),
        row(
            "--nats nats://a:4222 --nats-max-age 30m",
            "nats = \"nats://a:4222\"\nnats-max-age = \"30m\"",
            "nats = \"nats://a:4222\"\nnats-max-age = \"2h\"",
        ),
        row(
            "--nats nats://a:4222 --nats-worker-id w1",
            "nats = \"nats://a:4222\"\nnats-worker-id = \"w1\"",
            "nats = \"nats://a:4222\"\nnats-worker-id = \"w2\"",
        ),
        row(
            &format!("--nats nats://a:4222 --nats-creds {token}"),
            &format!("nats = \"nats://a:4222\"\nnats-creds = {token:?}"),
            &format!("nats = \"nats://a:4222\"\nnats-creds = {token2:?}"),
        ),
        row(
            &format!("--nats nats://a:4222 --nats-tls-ca {cert}"),
            &format!("nats = \"nats://a:4222\"\nnats-tls-ca = {cert:?}"),
            &format!("nats = \"nats://a:4222\"\nnats-tls-ca = {cert2:?}"),
        ),
        row(
            "--nats nats://a:4222 --nats-required",
            "nats = \"nats://a:4222\"\nnats-required = true",
            "nats = \"nats://a:4222\"\nnats-required = false",
        ),
        // Operations.
        row(
            "--metrics 127.0.0.1:9999",
            r#"metrics = "127.0.0.1:9999""#,
            r#"metrics = "off""#,
        ),
        row(
            "--log-format json",
            r#"log-format = "json""#,
            r#"log-format = "text""#,
        ),
        row(
            "--health-grace-ms 250",
            "health-grace-ms = 250",
            "health-grace-ms = 300",
        ),
        row(
            "--ready-file /run/kvbridge/ready.json",
            r#"ready-file = "/run/kvbridge/ready.json""#,
            r#"ready-file = "/tmp/ready.json""#,
        ),
        // Sidecar.
        row(
            "--engine-grpc 127.0.0.1:50051",
            r#"engine-grpc = "127.0.0.1:50051""#,
            r#"engine-grpc = "http://127.0.0.1:50052""#,
        ),
        row(
            &format!("--engine-grpc https://engine:50051 --engine-tls-ca {cert}"),
            &format!("engine-grpc = \"https://engine:50051\"\nengine-tls-ca = {cert:?}"),
            &format!("engine-grpc = \"https://engine:50051\"\nengine-tls-ca = {cert2:?}"),
        ),
        row(
            "--engine-grpc 127.0.0.1:50051 --load-interval-ms 0",
            "engine-grpc = \"127.0.0.1:50051\"\nload-interval-ms = 0",
            "engine-grpc = \"127.0.0.1:50051\"\nload-interval-ms = 250",
        ),
        row(
            "--engine-grpc 127.0.0.1:50051 --sidecar-connection-buffer 16MiB",
            "engine-grpc = \"127.0.0.1:50051\"\nsidecar-connection-buffer = \"16MiB\"",
            "engine-grpc = \"127.0.0.1:50051\"\nsidecar-connection-buffer = 33554432",
        ),
        row(
            "--engine-grpc 127.0.0.1:50051 --sidecar-buffer 2GiB",
            "engine-grpc = \"127.0.0.1:50051\"\nsidecar-buffer = \"2GiB\"",
            "engine-grpc = \"127.0.0.1:50051\"\nsidecar-buffer = \"512MiB\"",
        ),
        row(
            "--engine-grpc 127.0.0.1:50051 --sidecar-stall-timeout-ms 0",
            "engine-grpc = \"127.0.0.1:50051\"\nsidecar-stall-timeout-ms = 0",
            "engine-grpc = \"127.0.0.1:50051\"\nsidecar-stall-timeout-ms = 5000",
        ),
    ]
}

/// Every setting is in the table, and each gives the same configuration as a flag and as a TOML
/// key, changes it from the default, and as a flag wins over another value in the file.
#[test]
fn every_setting_is_the_same_as_a_flag_and_as_a_toml_key() {
    let dir = tempfile::tempdir().unwrap();
    let rows = rows(dir.path());
    let names: BTreeSet<String> = ServeArgs::setting_names().into_iter().collect();
    let flag_names: BTreeSet<String> = rows
        .iter()
        .flat_map(|r| &r.flags)
        .filter_map(|f| f.strip_prefix("--"))
        .map(str::to_string)
        .collect();
    assert_eq!(
        flag_names, names,
        "a setting without a row (or a row without a setting)"
    );
    let toml_keys: BTreeSet<String> = rows
        .iter()
        .flat_map(|r| r.toml.parse::<toml::Table>().unwrap().into_iter())
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        toml_keys, names,
        "a setting's TOML key differs from its flag"
    );

    let base_zmq = "tcp://*:5557";
    let default = show(&flags(&["--zmq", base_zmq]).resolve().unwrap());
    for row in &rows {
        let what = row.flags.join(" ");
        // Every row needs a rank; the zmq and kv-events-config rows bring their own.
        let (mut argv, mut base_toml) = (row.flags.clone(), String::new());
        if !argv
            .iter()
            .any(|f| f == "--zmq" || f == "--kv-events-config")
        {
            argv.extend(["--zmq".to_string(), base_zmq.to_string()]);
            base_toml = format!("zmq = [{base_zmq:?}]\n");
        }
        let from_flags = show(&flags(&argv).resolve().unwrap());
        let from_toml = file(dir.path(), &format!("{base_toml}{}\n", row.toml));
        assert_eq!(from_flags, show(&from_toml.resolve().unwrap()), "{what}");
        assert_ne!(from_flags, default, "{what}: no effect");

        let other = file(dir.path(), &format!("{base_toml}{}\n", row.other));
        assert_ne!(
            show(&other.resolve().unwrap()),
            from_flags,
            "{what}: same as other"
        );
        let mut both = flags(&argv);
        both.config = other.config;
        assert_eq!(
            show(&both.resolve().unwrap()),
            from_flags,
            "{what}: file won"
        );
    }
}
