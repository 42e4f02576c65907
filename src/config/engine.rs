//! Engine input: where the engine's events come from, validated into ingest's settings
//! ([`IngestConfig`]).

use std::time::Duration;

use serde::Deserialize;

use super::values::{validate_endpoint, ByteSize};
use super::{invalid, ConfigError, EngineFamily, Merge};
use crate::ingest::{
    IngestConfig, RankEndpoint, DEFAULT_MAX_ENGINE_MESSAGE, DEFAULT_REPLAY_TIMEOUT_MS,
    MAX_MAX_ENGINE_MESSAGE, MIN_MAX_ENGINE_MESSAGE,
};

/// Largest `--data-parallel-size` accepted.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 1024;
/// Default `--data-parallel-size`: one rank.
pub const DEFAULT_DATA_PARALLEL_SIZE: u32 = 1;

concern! {
    /// Engine input: where the engine's events come from.
    #[command(next_help_heading = "Engine input")]
    pub struct EngineArgs {
        /// Engine publisher to connect a SUB to, one per DP rank (rank = position). A wildcard host
        /// (`*`, `0.0.0.0`, `[::]`) is rewritten to loopback.
        #[arg(long, value_name = "ENDPOINT")]
        pub zmq: Vec<String>,
        /// Address for a SUB to bind (the engine's PUB connects, e.g. `tcp://127.0.0.1:5557`).
        /// These ranks follow the `--zmq` ones.
        #[arg(long, value_name = "ENDPOINT")]
        pub zmq_bind: Vec<String>,
        /// The engine's replay ROUTER for the rank in the same position (`--zmq` then `--zmq-bind`).
        #[arg(long, value_name = "ENDPOINT")]
        pub replay: Vec<String>,
        /// The engine's snapshot ROUTER (vLLM #57789's or SGLang #34407's `snapshot_endpoint`,
        /// both unmerged) for the rank in the same position: where the replay cannot fill (a late
        /// start past its buffer, an engine restart while kvbridge was down), the rank's state
        /// comes from it. SGLang's state has no tokens: declined under `--profile smg`.
        #[arg(long, value_name = "ENDPOINT")]
        pub engine_snapshot: Vec<String>,
        /// ZMQ topic. A non-empty topic is also compared exactly, up to the first NUL (SGLang
        /// #34407 appends its epoch after one).
        #[arg(long)]
        pub topic: Option<String>,
        /// Time to wait for the first replay reply and between replies, in ms.
        #[arg(long, value_name = "MS")]
        pub replay_timeout_ms: Option<u64>,
        /// The engine's own `--kv-events-config` JSON, or `@FILE` holding it: every rank's event
        /// and replay endpoints, who binds, and the topic follow from it as in the engine (instead
        /// of --zmq, --zmq-bind, --replay and --topic).
        #[arg(long, value_name = "JSON|@FILE")]
        pub kv_events_config: Option<String>,
        /// The engine's data-parallel size, with --kv-events-config: rank r publishes on the
        /// configured port + r.
        #[arg(long, value_name = "N")]
        pub data_parallel_size: Option<u32>,
        /// The engine that was given --kv-events-config; needed only where the engines' rules
        /// differ (`0.0.0.0`, SGLang's `bind` key), which kvbridge reports.
        #[arg(long, value_enum)]
        pub engine: Option<EngineFamily>,
        /// Largest engine message accepted, e.g. `32MiB`: ZMQ refuses a larger one (live or
        /// replayed) and drops the connection it came on; the batch is then a gap.
        #[arg(long, value_name = "BYTES")]
        pub max_engine_message: Option<ByteSize>,
    }
}

impl EngineArgs {
    /// Ingest's settings, and the configuration problems that do not stop the bridge.
    pub(super) fn validate(self) -> Result<(IngestConfig, Vec<String>), ConfigError> {
        let replay_timeout_ms = self.replay_timeout_ms.unwrap_or(DEFAULT_REPLAY_TIMEOUT_MS);
        if replay_timeout_ms == 0 {
            return Err(invalid("--replay-timeout-ms: must be at least 1"));
        }
        let max_engine_message = match &self.max_engine_message {
            Some(s) => s.bytes("max-engine-message")?,
            None => DEFAULT_MAX_ENGINE_MESSAGE,
        };
        if !(MIN_MAX_ENGINE_MESSAGE..=MAX_MAX_ENGINE_MESSAGE).contains(&max_engine_message) {
            return Err(invalid(format!(
                "--max-engine-message {max_engine_message}: must be between 4KiB ({MIN_MAX_ENGINE_MESSAGE}) and 1GiB ({MAX_MAX_ENGINE_MESSAGE})"
            )));
        }
        let (ranks, topic, warnings) = self.endpoints()?;
        let ingest = IngestConfig {
            ranks,
            topic,
            replay_timeout: Duration::from_millis(replay_timeout_ms),
            max_engine_message,
        };
        Ok((ingest, warnings))
    }

    /// Every rank's endpoints, the topic and the warnings: derived from `--kv-events-config`, or
    /// else given by `--zmq`, `--zmq-bind`, `--replay` and `--topic` (never both).
    fn endpoints(self) -> Result<(Vec<RankEndpoint>, String, Vec<String>), ConfigError> {
        let Some(kv_events_config) = &self.kv_events_config else {
            for (given, flag) in [
                (self.data_parallel_size.is_some(), "--data-parallel-size"),
                (self.engine.is_some(), "--engine"),
            ] {
                if given {
                    return Err(invalid(format!(
                        "{flag} goes with --kv-events-config (with --zmq, give one endpoint per rank)"
                    )));
                }
            }
            let ranks = build_ranks(
                &self.zmq,
                &self.zmq_bind,
                &self.replay,
                &self.engine_snapshot,
            )?;
            return Ok((ranks, self.topic.unwrap_or_default(), Vec::new()));
        };
        let explicit: Vec<&str> = [
            (!self.zmq.is_empty(), "--zmq"),
            (!self.zmq_bind.is_empty(), "--zmq-bind"),
            (!self.replay.is_empty(), "--replay"),
            (!self.engine_snapshot.is_empty(), "--engine-snapshot"),
            (self.topic.is_some(), "--topic"),
        ]
        .into_iter()
        .filter_map(|(given, flag)| given.then_some(flag))
        .collect();
        if !explicit.is_empty() {
            return Err(invalid(format!(
                "--kv-events-config already gives every rank's endpoints and the topic: drop {} (or drop --kv-events-config)",
                explicit.join(", ")
            )));
        }
        let dp_size = self
            .data_parallel_size
            .unwrap_or(DEFAULT_DATA_PARALLEL_SIZE);
        if !(1..=MAX_DATA_PARALLEL_SIZE).contains(&dp_size) {
            return Err(invalid(format!(
                "--data-parallel-size {dp_size}: must be between 1 and {MAX_DATA_PARALLEL_SIZE}"
            )));
        }
        let derived = super::kv_events::derive(kv_events_config, dp_size, self.engine)
            .map_err(|e| invalid(format!("--kv-events-config: {e}")))?;
        check_ranks(&derived.ranks)?;
        let warnings = derived
            .ignored_keys
            .iter()
            .map(|k| {
                format!("--kv-events-config: ignoring {k:?}, which no engine's KVEventsConfig has")
            })
            .collect();
        Ok((derived.ranks, derived.topic, warnings))
    }
}

fn build_ranks(
    zmq: &[String],
    zmq_bind: &[String],
    replay: &[String],
    snapshot: &[String],
) -> Result<Vec<RankEndpoint>, ConfigError> {
    if zmq.is_empty() && zmq_bind.is_empty() {
        return Err(invalid(
            "no engine endpoint: pass --kv-events-config with the engine's own JSON, or --zmq ENDPOINT (engine binds, the default tcp://*:5557) or --zmq-bind ENDPOINT",
        ));
    }
    let total = zmq.len() + zmq_bind.len();
    for (list, flag) in [(replay, "--replay"), (snapshot, "--engine-snapshot")] {
        if list.len() > total {
            return Err(invalid(format!(
                "{} {flag} endpoints for {total} ranks: give at most one per --zmq/--zmq-bind, in the same order",
                list.len()
            )));
        }
    }
    let mut ranks = Vec::with_capacity(total);
    for (i, (ep, bind)) in zmq
        .iter()
        .map(|e| (e, false))
        .chain(zmq_bind.iter().map(|e| (e, true)))
        .enumerate()
    {
        let flag = if bind { "--zmq-bind" } else { "--zmq" };
        let endpoint =
            validate_endpoint(ep, !bind).map_err(|e| invalid(format!("{flag} {ep:?}: {e}")))?;
        let connect = |list: &[String], flag: &str| match list.get(i) {
            Some(r) => validate_endpoint(r, true)
                .map(Some)
                .map_err(|e| invalid(format!("{flag} {r:?}: {e}"))),
            None => Ok(None),
        };
        ranks.push(RankEndpoint {
            rank: i as u32,
            endpoint,
            bind,
            replay: connect(replay, "--replay")?,
            snapshot: connect(snapshot, "--engine-snapshot")?,
        });
    }
    check_ranks(&ranks)?;
    Ok(ranks)
}

/// docs/engine-wire.md §2.2: no two ranks on one endpoint, and no replay endpoint that is a rank's
/// event endpoint (replay = PUB + 1 collides with rank 1's PUB port).
fn check_ranks(ranks: &[RankEndpoint]) -> Result<(), ConfigError> {
    for a in ranks {
        for b in ranks {
            if a.rank != b.rank && a.endpoint == b.endpoint {
                return Err(invalid(format!(
                    "rank {} and rank {} use the same endpoint {}",
                    a.rank, b.rank, a.endpoint
                )));
            }
            if let Some(r) = &b.replay {
                if *r == a.endpoint {
                    return Err(invalid(format!(
                        "rank {}'s replay endpoint {r} is rank {}'s event endpoint (the engine's replay port collides with the next rank's PUB port)",
                        b.rank, a.rank
                    )));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{file, flags};

    #[test]
    fn kv_events_config_derives_the_ranks() {
        let c = flags(&[
            "--kv-events-config",
            r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600", "topic": "kv"}"#,
            "--data-parallel-size",
            "2",
        ])
        .resolve()
        .unwrap();
        assert_eq!(
            c.ingest.ranks,
            [
                RankEndpoint {
                    rank: 0,
                    endpoint: "tcp://127.0.0.1:5557".into(),
                    bind: false,
                    replay: Some("tcp://127.0.0.1:5600".into()),
                    snapshot: None,
                },
                RankEndpoint {
                    rank: 1,
                    endpoint: "tcp://127.0.0.1:5558".into(),
                    bind: false,
                    replay: Some("tcp://127.0.0.1:5601".into()),
                    snapshot: None,
                },
            ]
        );
        assert_eq!(c.ingest.topic, "kv");
        assert!(c.warnings.is_empty());
        let c = flags(&["--kv-events-config", r#"{"publisher": "zmq", "hwm2": 1}"#])
            .resolve()
            .unwrap();
        assert_eq!(
            c.warnings,
            ["--kv-events-config: ignoring \"hwm2\", which no engine's KVEventsConfig has"]
        );
    }

    #[test]
    fn kv_events_config_excludes_explicit_endpoints() {
        let dir = tempfile::tempdir().unwrap();
        let kv = r#"{"publisher": "zmq"}"#;
        for (extra, named) in [
            (vec!["--zmq", "tcp://*:5557"], "drop --zmq (or"),
            (
                vec!["--zmq-bind", "tcp://127.0.0.1:5557"],
                "drop --zmq-bind (or",
            ),
            (
                vec!["--replay", "tcp://*:5558", "--topic", "kv"],
                "drop --replay, --topic (or",
            ),
        ] {
            let mut argv = vec!["--kv-events-config", kv];
            argv.extend(&extra);
            let e = flags(&argv).resolve().unwrap_err().to_string();
            assert!(e.contains(named), "{extra:?}: {e}");
        }
        // A file's --zmq and a flag's --kv-events-config conflict as well.
        let mut a = file(dir.path(), "zmq = [\"tcp://*:5557\"]\n");
        a.engine.kv_events_config = Some(kv.into());
        assert!(a.resolve().unwrap_err().to_string().contains("drop --zmq"));
        for (argv, want) in [
            (
                vec!["--zmq", "tcp://*:5557", "--data-parallel-size", "2"],
                "--data-parallel-size goes with --kv-events-config",
            ),
            (
                vec!["--zmq", "tcp://*:5557", "--engine", "vllm"],
                "--engine goes with --kv-events-config",
            ),
            (
                vec!["--kv-events-config", kv, "--data-parallel-size", "0"],
                "--data-parallel-size 0: must be between 1 and",
            ),
            (
                vec![
                    "--kv-events-config",
                    r#"{"publisher": "zmq", "replay_endpoint": "tcp://*:5558"}"#,
                    "--data-parallel-size",
                    "2",
                ],
                "--kv-events-config: rank 0's replay port 5558 is rank 1's event port",
            ),
        ] {
            let e = flags(&argv).resolve().unwrap_err().to_string();
            assert!(e.starts_with(want), "{argv:?}: {e}");
        }
    }
}
