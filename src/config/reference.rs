//! One source for what a `kvbridge serve` setting defaults to and means.
//!
//! The flags are `Option`s with no clap default, because a TOML file (`--config`) may supply the
//! value and a flag given on the command line wins over it; clap cannot tell "not given" from
//! "given the default" once it fills defaults in. So the defaults live in the constants the
//! validation uses, and [`serve_defaults`] turns those constants into the text `serve --help`
//! appends to each flag ([`with_defaults`]) and that the flag reference in `docs/flags.md` shows
//! ([`flag_reference`]). A unit test fails when that page differs from what this module renders
//! from clap, so the help, the page and the code cannot disagree; `KVBRIDGE_BLESS=1 cargo test
//! --lib flag_reference` rewrites the page.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{LogFormat, ProfileArg, DEFAULT_DATA_PARALLEL_SIZE, DEFAULT_HEALTH_GRACE_MS};
use crate::fanout::{
    DpMode, DEFAULT_GRPC, DEFAULT_HANDSHAKE_TIMEOUT_MS, DEFAULT_MAX_STREAMS_PER_CONNECTION,
    DEFAULT_MAX_SUBSCRIBERS,
};
use crate::ingest::{DEFAULT_MAX_ENGINE_MESSAGE, DEFAULT_REPLAY_TIMEOUT_MS};
use crate::proxy::{
    DEFAULT_LOAD_INTERVAL_MS, DEFAULT_SIDECAR_BUFFER, DEFAULT_SIDECAR_CONNECTION_BUFFER,
    DEFAULT_SIDECAR_STALL_TIMEOUT_MS,
};
use crate::ring::{DEFAULT_RING_SIZE, DEFAULT_SPLIT_THRESHOLD, MIN_RING_SIZE};
use crate::sink::{
    DEFAULT_NATS_MAX_AGE, DEFAULT_NATS_REPLICAS, DEFAULT_NATS_STREAM, DEFAULT_NATS_SUBJECT_PREFIX,
};

/// `n` bytes as the flags are written: `64MiB`, `4KiB`, or the number.
fn bytes_text(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{}GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}KiB", n >> 10),
        n => n.to_string(),
    }
}

/// A duration as [`super::parse_duration`] reads it: the largest whole unit.
fn duration_text(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        s if s >= 86_400 && s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s >= 3600 && s % 3600 == 0 => format!("{}h", s / 3600),
        s if s >= 60 && s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// A duration as [`super::parse_short_duration`] reads it.
fn short_duration_text(d: Duration) -> String {
    match d.as_micros() {
        0 => "0".into(),
        us if us % 1000 == 0 => format!("{}ms", us / 1000),
        us => format!("{us}us"),
    }
}

/// The name a value enum's default has on the command line.
fn enum_text<T: clap::ValueEnum + Default>() -> String {
    T::default()
        .to_possible_value()
        .map(|v| v.get_name().to_string())
        .unwrap_or_default()
}

/// Every `kvbridge serve` setting that has a default, by clap argument id (the field name), and
/// that default as the help shows it. Written here once, from the constants the validation uses.
pub fn serve_defaults() -> Vec<(&'static str, String)> {
    vec![
        // Engine input.
        ("topic", r#""" (every topic)"#.into()),
        ("replay_timeout_ms", DEFAULT_REPLAY_TIMEOUT_MS.to_string()),
        ("data_parallel_size", DEFAULT_DATA_PARALLEL_SIZE.to_string()),
        ("max_engine_message", bytes_text(DEFAULT_MAX_ENGINE_MESSAGE)),
        // Ring.
        ("shm", "/dev/shm/kvbridge-{grpc port}, the port as bound".into()),
        (
            "ring_size",
            format!(
                "{}, minimum {}",
                bytes_text(DEFAULT_RING_SIZE),
                bytes_text(MIN_RING_SIZE)
            ),
        ),
        ("seq_base", "previous high-water + 2, else Unix µs".into()),
        ("split_threshold", bytes_text(DEFAULT_SPLIT_THRESHOLD)),
        // Snapshots.
        ("snapshot", enum_text::<crate::snapshot::SnapshotMode>()),
        (
            "snapshot_max_blocks",
            crate::snapshot::DEFAULT_MAX_BLOCKS.to_string(),
        ),
        (
            "snapshot_chunk_size",
            bytes_text(crate::snapshot::CHUNK_MAX as u64),
        ),
        (
            "checkpoint_interval",
            duration_text(crate::snapshot::DEFAULT_CHECKPOINT_INTERVAL),
        ),
        // Streaming.
        ("grpc", DEFAULT_GRPC.into()),
        ("dp_mode", enum_text::<DpMode>()),
        ("profile", enum_text::<ProfileArg>()),
        ("max_subscribers", DEFAULT_MAX_SUBSCRIBERS.to_string()),
        (
            "max_streams_per_connection",
            format!(
                "{DEFAULT_MAX_STREAMS_PER_CONNECTION}; with --engine-grpc none, so the engine's own limit applies"
            ),
        ),
        (
            "handshake_timeout_ms",
            DEFAULT_HANDSHAKE_TIMEOUT_MS.to_string(),
        ),
        (
            "fanout_linger",
            short_duration_text(crate::fanout::DEFAULT_FANOUT_LINGER),
        ),
        // Operations.
        (
            "metrics",
            "127.0.0.1:{grpc port + 1000}, or port 0 when the gRPC port is 0".into(),
        ),
        ("log_format", enum_text::<LogFormat>()),
        ("health_grace_ms", DEFAULT_HEALTH_GRACE_MS.to_string()),
        // NATS JetStream sink.
        ("nats_subject_prefix", DEFAULT_NATS_SUBJECT_PREFIX.into()),
        ("nats_stream", DEFAULT_NATS_STREAM.into()),
        ("nats_replicas", DEFAULT_NATS_REPLICAS.to_string()),
        ("nats_max_age", duration_text(DEFAULT_NATS_MAX_AGE)),
        ("nats_worker_id", "HOSTNAME-GRPCPORT".into()),
        // Engine-wire publishing.
        ("publish_zmq_topic", "the engine's topic".into()),
        (
            "publish_zmq_layout",
            enum_text::<crate::publish_zmq::WireLayout>(),
        ),
        (
            "publish_zmq_hwm",
            crate::publish_zmq::DEFAULT_PUB_HWM.to_string(),
        ),
        // Sidecar.
        ("load_interval_ms", DEFAULT_LOAD_INTERVAL_MS.to_string()),
        (
            "sidecar_connection_buffer",
            bytes_text(DEFAULT_SIDECAR_CONNECTION_BUFFER),
        ),
        ("sidecar_buffer", bytes_text(DEFAULT_SIDECAR_BUFFER)),
        (
            "sidecar_stall_timeout_ms",
            DEFAULT_SIDECAR_STALL_TIMEOUT_MS.to_string(),
        ),
    ]
}

/// `serve`'s command with each flag's help ending in its default, `[default: …]`, as clap writes
/// its own defaults.
pub fn with_defaults(mut cmd: clap::Command) -> clap::Command {
    for (id, default) in serve_defaults() {
        cmd = cmd.mut_arg(id, |a| {
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            let long = a.get_long_help().map(|h| h.to_string());
            let a = a.help(format!("{help} [default: {default}]"));
            match long {
                Some(long) => a.long_help(format!("{long}\n\n[default: {default}]")),
                None => a,
            }
        });
    }
    cmd
}

/// The `serve` flag reference as markdown: one table per help heading, each flag with its value,
/// its default and its help, rendered from clap.
pub fn flag_reference(serve: &clap::Command) -> String {
    let defaults: BTreeMap<&str, String> = serve_defaults().into_iter().collect();
    // Built, so that clap has filled in each argument's value count and names.
    let mut serve = serve.clone();
    serve.build();
    let mut sections: Vec<(String, Vec<String>)> = Vec::new();
    for arg in serve.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if arg.is_hide_set() || long == "help" {
            continue;
        }
        let heading = arg.get_help_heading().unwrap_or("General").to_string();
        let takes_value = arg.get_num_args().is_some_and(|n| n.takes_values());
        let mut flag = format!("--{long}");
        if takes_value {
            let values: Vec<String> = arg
                .get_possible_values()
                .iter()
                .filter(|v| !v.is_hide_set())
                .map(|v| v.get_name().to_string())
                .collect();
            if values.is_empty() {
                let names = arg
                    .get_value_names()
                    .map(|n| {
                        n.iter()
                            .map(|s| s.to_string())
                            .collect::<Vec<_>>()
                            .join(" ")
                    })
                    .unwrap_or_else(|| long.to_uppercase());
                flag.push(' ');
                flag.push_str(&names);
            } else {
                flag.push(' ');
                flag.push_str(&values.join("|"));
            }
        }
        let repeat = matches!(arg.get_action(), clap::ArgAction::Append);
        let help = arg
            .get_help()
            .map(|h| h.to_string())
            .unwrap_or_default()
            .replace('\n', " ");
        let id = arg.get_id().as_str();
        let default = match defaults.get(id) {
            Some(d) => format!("`{d}`"),
            None if !takes_value => "off".into(),
            None => "—".into(),
        };
        let cell = |s: &str| s.replace('|', "\\|");
        let row = format!(
            "| `{}`{} | {} | {} |",
            cell(&flag),
            if repeat { " (repeat)" } else { "" },
            cell(&default),
            cell(&help)
        );
        match sections.iter_mut().find(|(h, _)| *h == heading) {
            Some((_, rows)) => rows.push(row),
            None => sections.push((heading, vec![row])),
        }
    }
    let mut out = String::new();
    for (heading, rows) in sections {
        out.push_str(&format!(
            "\n### {heading}\n\n| flag | default | meaning |\n|---|---|---|\n"
        ));
        for r in rows {
            out.push_str(&r);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse_duration, parse_size, ServeArgs};
    use clap::CommandFactory;

    /// The `serve` subcommand as `kvbridge` builds it (defaults not yet appended).
    fn serve() -> clap::Command {
        #[derive(clap::Parser)]
        struct Serve {
            #[command(flatten)]
            args: ServeArgs,
        }
        Serve::command().name("serve")
    }

    #[test]
    fn every_default_names_a_flag_and_no_help_writes_its_own() {
        let cmd = serve();
        let ids: Vec<String> = cmd
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect();
        for (id, _) in serve_defaults() {
            assert!(ids.iter().any(|i| i == id), "{id}: no such flag");
        }
        for a in cmd.get_arguments() {
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            assert!(
                !help.contains("[default:") && !help.contains("(default:"),
                "--{}: the help writes its default by hand; put it in serve_defaults()",
                a.get_id()
            );
        }
    }

    #[test]
    fn help_ends_each_flag_with_its_default() {
        let mut cmd = with_defaults(serve());
        let help = cmd.render_help().to_string();
        assert!(help.contains("[default: 64MiB, minimum 1MiB]"), "{help}");
        assert!(help.contains("[default: 1m]"), "{help}");
        assert!(
            help.contains(&format!("[default: {DEFAULT_GRPC}]")),
            "{help}"
        );
    }

    #[test]
    fn bytes_and_durations_are_written_as_the_flags_take_them() {
        assert_eq!(bytes_text(64 << 20), "64MiB");
        assert_eq!(bytes_text(4096), "4KiB");
        assert_eq!(bytes_text(1000), "1000");
        assert_eq!(duration_text(Duration::from_secs(3600)), "1h");
        assert_eq!(duration_text(Duration::from_secs(90)), "90s");
        for d in [1u64, 59, 60, 3600, 86_400, 7 * 86_400] {
            let t = duration_text(Duration::from_secs(d));
            assert_eq!(parse_duration(&t), Ok(Duration::from_secs(d)), "{t}");
        }
        for n in [1u64 << 20, 4096, 123] {
            assert_eq!(parse_size(&bytes_text(n)), Ok(n));
        }
    }

    const BEGIN: &str = "<!-- flag-reference: generated from clap by src/config/reference.rs; \
                         KVBRIDGE_BLESS=1 cargo test --lib flag_reference rewrites it -->\n";
    const END: &str = "<!-- /flag-reference -->";

    /// docs/flags.md shows exactly what clap knows: every flag, its default and its help.
    #[test]
    fn flag_reference_in_docs_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/flags.md");
        let page = std::fs::read_to_string(&path).expect("docs/flags.md");
        let (Some(a), Some(b)) = (page.find(BEGIN), page.find(END)) else {
            panic!("docs/flags.md has no flag-reference markers");
        };
        let want = flag_reference(&serve());
        let have = &page[a + BEGIN.len()..b];
        if have != want {
            if std::env::var_os("KVBRIDGE_BLESS").is_some() {
                let new = format!("{}{BEGIN}{want}{}", &page[..a], &page[b..]);
                std::fs::write(&path, new).expect("write docs/flags.md");
                return;
            }
            panic!(
                "docs/flags.md's flag reference differs from `kvbridge serve --help`; \
                 run KVBRIDGE_BLESS=1 cargo test --lib flag_reference and commit the page"
            );
        }
    }
}
