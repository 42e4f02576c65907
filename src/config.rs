//! Configuration for `kvbridge serve`: command-line flags, an optional TOML file, and the
//! validated [`ServeConfig`] the service runs on.
//!
//! Every setting is defined once, as a field of the struct of its concern ([`EngineArgs`],
//! [`RingArgs`], [`StreamingArgs`], [`SecurityArgs`], [`OpsArgs`]): that field is both the flag
//! (clap) and the TOML key (serde), with the same kebab-case name, and its doc comment is the
//! `--help` text. A flag given on the command line wins over the file. Each concern has one
//! validator that turns it into its part of [`ServeConfig`], before anything is started, so a bad
//! value is reported as one line naming the problem (the CLI turns it into exit code 2).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::IgnoredAny;
use serde::Deserialize;
use thiserror::Error;

use crate::decode::Profile;

mod kv_events;
mod reference;

pub use reference::{flag_reference, serve_defaults, with_defaults};

pub use kv_events::EngineFamily;

/// Default gRPC listen address (docs/smg-api.md: the worker's KV-event port).
pub const DEFAULT_GRPC: &str = "127.0.0.1:50061";
/// The default Prometheus port is the gRPC port plus this (minus it when that would pass 65535):
/// see [`default_metrics_addr`].
pub const METRICS_PORT_OFFSET: u16 = 1000;
/// Default ring size: 64 MiB.
pub const DEFAULT_RING_SIZE: u64 = 64 << 20;
/// Smallest ring accepted (tests use small rings).
pub const MIN_RING_SIZE: u64 = 1 << 20;
/// Largest ring accepted: 1 TiB.
pub const MAX_RING_SIZE: u64 = 1 << 40;
/// Default split threshold for one record (docs/smg-api.md §6.3).
pub const DEFAULT_SPLIT_THRESHOLD: u64 = 1 << 20;
/// Smallest split threshold accepted.
pub const MIN_SPLIT_THRESHOLD: u64 = 4096;
/// Records must stay below gRPC's default 4 MiB message limit (G1 gateways).
pub const MAX_SPLIT_THRESHOLD: u64 = (4 << 20) - 64 * 1024;
/// Default wait for the first replay reply and between replies (ms).
pub const DEFAULT_REPLAY_TIMEOUT_MS: u64 = 2000;
/// Default subscriber limit.
pub const DEFAULT_MAX_SUBSCRIBERS: usize = 10_000;
/// Default HTTP/2 stream limit per gRPC connection: far above what a gateway opens (SMG opens one
/// `SubscribeKvEvents` stream per worker on its connection to that worker), far below what would
/// let one connection pin much memory.
pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 100;
/// Default time a gRPC connection has to complete TLS and send the HTTP/2 preface and SETTINGS.
pub const DEFAULT_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Longest handshake timeout accepted (ms).
pub const MAX_HANDSHAKE_TIMEOUT_MS: u64 = 600_000;
/// Default largest engine message (ZMQ frame) accepted: 32 MiB. Real batches are far smaller
/// (a 100k-token prefill is about 0.5 MB, docs/engine-wire.md §10; a million tokens in one
/// step about 5 MB), and the cap bounds what one message can cost (about twice its size at
/// peak) and keeps one batch well inside the default ring.
pub const DEFAULT_MAX_ENGINE_MESSAGE: u64 = 32 << 20;
/// Smallest `--max-engine-message` accepted.
pub const MIN_MAX_ENGINE_MESSAGE: u64 = 4096;
/// Largest `--max-engine-message` accepted (the decoder addresses payloads with 32 bits).
pub const MAX_MAX_ENGINE_MESSAGE: u64 = 1 << 30;
/// Default health grace period (ms) after start-up and after the last upstream disconnect.
pub const DEFAULT_HEALTH_GRACE_MS: u64 = 10_000;
/// Longest health grace period accepted: a day (ms).
pub const MAX_HEALTH_GRACE_MS: u64 = 24 * 3600 * 1000;
/// The `--metrics` value that disables the Prometheus endpoint.
pub const METRICS_OFF: &str = "off";
/// Largest `--data-parallel-size` accepted.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 1024;
/// Default `--data-parallel-size`: one rank.
pub const DEFAULT_DATA_PARALLEL_SIZE: u32 = 1;

/// Where `/metrics` is served when `--metrics` is not given: on loopback, at the gRPC port +
/// [`METRICS_PORT_OFFSET`] (gRPC 50061 → 127.0.0.1:51061), or − the offset for gRPC ports above
/// 64535. Several bridges on one host therefore need only distinct gRPC ports, and each one's
/// metrics port follows from its gRPC port. gRPC port 0 (any free port) gives metrics port 0 as
/// well; both bound addresses are logged.
pub fn default_metrics_addr(grpc: SocketAddr) -> SocketAddr {
    let port = match grpc.port() {
        0 => 0,
        p => p
            .checked_add(METRICS_PORT_OFFSET)
            .unwrap_or(p - METRICS_PORT_OFFSET),
    };
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A configuration problem; the message names the flag or key.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The TOML file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The TOML file is not valid.
    #[error("config file {path}: {message}")]
    Parse {
        /// File.
        path: PathBuf,
        /// Parser message.
        message: String,
    },
    /// A value is out of range or malformed.
    #[error("{0}")]
    Invalid(String),
}

fn invalid(message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(message.into())
}

/// How multiple DP ranks are exposed (docs/smg-api.md §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum DpMode {
    /// (a) All ranks feed one ring with one counter; `dp_rank` unset unless `--send-dp-rank`.
    #[default]
    Merged,
    /// (b) As merged, plus one ring per rank, selected by the `kvbridge-dp-rank` request header.
    Metadata,
}

/// The filter profile as a flag value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ProfileArg {
    /// Drop what SMG gateways would misindex.
    #[default]
    Smg,
    /// Forward everything decodable.
    All,
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// A byte size as written: `64MiB` or `1048576` (a flag value or a TOML string), or a TOML
/// integer. It is parsed by the ring validator, not by clap or serde, so that a malformed size is
/// reported like every other bad value: one line naming the flag or the key.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(from = "SizeValue")]
pub enum ByteSize {
    /// A flag value, e.g. `--ring-size 64MiB`.
    Flag(String),
    /// A TOML string, e.g. `ring-size = "64MiB"`.
    Text(String),
    /// A number of bytes, e.g. `ring-size = 67108864`.
    Bytes(u64),
}

/// A size in TOML: a number of bytes or a string like "64MiB".
#[derive(Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl From<SizeValue> for ByteSize {
    fn from(v: SizeValue) -> Self {
        match v {
            SizeValue::Bytes(n) => ByteSize::Bytes(n),
            SizeValue::Text(s) => ByteSize::Text(s),
        }
    }
}

impl std::str::FromStr for ByteSize {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(ByteSize::Flag(s.to_string()))
    }
}

impl ByteSize {
    /// The size in bytes; `name` is the setting, for the error message.
    fn bytes(&self, name: &str) -> Result<u64, ConfigError> {
        match self {
            ByteSize::Bytes(n) => Ok(*n),
            ByteSize::Flag(s) => parse_size(s).map_err(|e| invalid(format!("--{name} {s:?}: {e}"))),
            ByteSize::Text(s) => parse_size(s).map_err(|e| invalid(format!("{name}: {e}"))),
        }
    }
}

/// "A flag given on the command line wins over the file", per kind of setting.
trait Merge {
    fn merge(self, file: Self) -> Self;
}

impl<T> Merge for Option<T> {
    fn merge(self, file: Self) -> Self {
        self.or(file)
    }
}

/// A repeatable flag replaces the file's whole list.
impl<T> Merge for Vec<T> {
    fn merge(self, file: Self) -> Self {
        if self.is_empty() {
            file
        } else {
            self
        }
    }
}

/// A switch can only turn a setting on (there is no `--no-…`), so either side enables it.
impl Merge for bool {
    fn merge(self, file: Self) -> Self {
        self || file
    }
}

/// Defines one concern: a struct whose every field is one setting, both a flag and a TOML key
/// (kebab-case, absent keys take the field's `Default`), and its merge of flags over the file.
macro_rules! concern {
    (
        $(#[$attr:meta])*
        pub struct $name:ident {
            $( $(#[$field_attr:meta])* pub $field:ident: $ty:ty, )*
        }
    ) => {
        #[derive(clap::Args, Deserialize, Debug, Default, Clone)]
        #[serde(default, rename_all = "kebab-case")]
        $(#[$attr])*
        pub struct $name {
            $( $(#[$field_attr])* pub $field: $ty, )*
        }

        impl Merge for $name {
            fn merge(self, file: Self) -> Self {
                Self { $( $field: self.$field.merge(file.$field), )* }
            }
        }
    };
}

/// `kvbridge serve` flags, which are also the keys of its TOML file. Every setting is optional
/// here so that the file can supply it; [`ServeArgs::resolve`] merges and validates.
#[derive(clap::Args, Deserialize, Debug, Default, Clone)]
#[serde(rename_all = "kebab-case")]
pub struct ServeArgs {
    /// TOML file with any of these settings (flags win).
    #[arg(long, value_name = "FILE.toml")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Engine input.
    #[command(flatten)]
    #[serde(flatten)]
    pub engine: EngineArgs,
    /// The ring.
    #[command(flatten)]
    #[serde(flatten)]
    pub ring: RingArgs,
    /// gRPC streaming.
    #[command(flatten)]
    #[serde(flatten)]
    pub streaming: StreamingArgs,
    /// TLS and the bearer token.
    #[command(flatten)]
    #[serde(flatten)]
    pub security: SecurityArgs,
    /// The NATS JetStream sink.
    #[command(flatten)]
    #[serde(flatten)]
    pub nats: NatsArgs,
    /// Snapshots for late joiners.
    #[command(flatten)]
    #[serde(flatten)]
    pub snapshot: SnapshotArgs,
    /// Re-publishing on the engines' ZMQ wire.
    #[command(flatten)]
    #[serde(flatten)]
    pub publish_zmq: PublishZmqArgs,
    /// Metrics, logs, health.
    #[command(flatten)]
    #[serde(flatten)]
    pub ops: OpsArgs,
    /// Sidecar mode: the engine's gRPC server behind kvbridge.
    #[command(flatten)]
    #[serde(flatten)]
    pub proxy: ProxyArgs,
    /// Keys of a TOML file that name no setting (`deny_unknown_fields` does not work with
    /// `flatten`); never set from flags, rejected by [`ServeArgs::resolve`].
    #[arg(skip)]
    #[serde(flatten)]
    unknown: BTreeMap<String, IgnoredAny>,
}

impl ServeArgs {
    /// Merges flags over the TOML file (if any) and validates the result.
    pub fn resolve(&self) -> Result<ServeConfig, ConfigError> {
        let file = match &self.config {
            Some(path) => load_file(path)?,
            None => ServeArgs::default(),
        };
        let ServeArgs {
            engine,
            ring,
            streaming,
            security,
            nats,
            ops,
            proxy,
            snapshot,
            publish_zmq,
            ..
        } = self.clone();
        // Sidecar mode raises the default stream limit (see `ProxyArgs`), so whether the flag
        // was given at all is noted before it is resolved.
        let streams_given = streaming
            .max_streams_per_connection
            .or(file.streaming.max_streams_per_connection)
            .is_some();
        let proxy = proxy.merge(file.proxy).validate()?;
        let engine = engine.merge(file.engine).validate()?;
        let streaming = streaming.merge(file.streaming).validate()?;
        let ring = ring.merge(file.ring).validate()?;
        let security = security.merge(file.security).validate()?;
        let ops = ops.merge(file.ops).validate(streaming.grpc)?;
        let nats = nats.merge(file.nats).validate()?;
        let snapshot = snapshot.merge(file.snapshot).validate()?;
        let publish_zmq = publish_zmq.merge(file.publish_zmq).validate()?;
        if let Some(p) = &publish_zmq {
            let n = engine.ranks.len() as u32;
            // Each rank's wire numbers its batches with its own ring's sequence numbers.
            if n > 1 && streaming.dp_mode != DpMode::Metadata {
                return Err(invalid(format!(
                    "--publish-zmq with {n} ranks needs --dp-mode metadata (one ring, hence one contiguous sequence, per rank)"
                )));
            }
            p.check_ranks(n).map_err(invalid)?;
        }
        Ok(ServeConfig {
            publish_zmq,
            snapshot,
            ranks: engine.ranks,
            topic: engine.topic,
            grpc: streaming.grpc,
            shm: ring.shm,
            ring_size: ring.ring_size,
            seq_base: ring.seq_base,
            split_threshold: ring.split_threshold,
            profile: streaming.profile,
            dp_mode: streaming.dp_mode,
            send_dp_rank: streaming.send_dp_rank,
            max_subscribers: streaming.max_subscribers,
            replay_timeout: engine.replay_timeout,
            max_engine_message: engine.max_engine_message,
            shm_group_read: ring.shm_group_read,
            warnings: engine.warnings,
            metrics: ops.metrics,
            log_format: ops.log_format,
            health_grace: ops.health_grace,
            ready_file: ops.ready_file,
            tls: security.tls,
            auth_token: security.auth_token,
            secret_files: security.files,
            max_streams_per_connection: match &proxy {
                Some(_) if !streams_given => PROXY_MAX_STREAMS_PER_CONNECTION,
                _ => streaming.max_streams_per_connection,
            },
            handshake_timeout: streaming.handshake_timeout,
            nats,
            proxy,
        })
    }

    /// Every setting's name (the flag without `--`, which is also the TOML key), in `--help`
    /// order.
    fn setting_names() -> Vec<String> {
        use clap::Args;
        ServeArgs::augment_args(clap::Command::new("serve"))
            .get_arguments()
            .filter_map(|a| a.get_long())
            .filter(|name| *name != "config")
            .map(str::to_string)
            .collect()
    }
}

fn load_file(path: &Path) -> Result<ServeArgs, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    let parse_error = |message: String| ConfigError::Parse {
        path: path.to_owned(),
        message,
    };
    let file: ServeArgs = toml::from_str(&text).map_err(|e| parse_error(e.message().into()))?;
    if let Some(key) = file.unknown.keys().next() {
        // The text serde's `deny_unknown_fields` would give.
        let expected: Vec<String> = ServeArgs::setting_names()
            .iter()
            .map(|n| format!("`{n}`"))
            .collect();
        return Err(parse_error(format!(
            "unknown field `{key}`, expected one of {}",
            expected.join(", ")
        )));
    }
    Ok(file)
}

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
        /// ZMQ topic. A non-empty topic is also compared exactly.
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

struct EngineConfig {
    ranks: Vec<RankEndpoint>,
    topic: String,
    replay_timeout: Duration,
    warnings: Vec<String>,
    max_engine_message: u64,
}

impl EngineArgs {
    fn validate(self) -> Result<EngineConfig, ConfigError> {
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
        let replay_timeout = Duration::from_millis(replay_timeout_ms);
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
            return Ok(EngineConfig {
                ranks: build_ranks(&self.zmq, &self.zmq_bind, &self.replay)?,
                topic: self.topic.unwrap_or_default(),
                replay_timeout,
                max_engine_message,
                warnings: Vec::new(),
            });
        };
        let explicit: Vec<&str> = [
            (!self.zmq.is_empty(), "--zmq"),
            (!self.zmq_bind.is_empty(), "--zmq-bind"),
            (!self.replay.is_empty(), "--replay"),
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
        let derived = kv_events::derive(kv_events_config, dp_size, self.engine)
            .map_err(|e| invalid(format!("--kv-events-config: {e}")))?;
        check_ranks(&derived.ranks)?;
        Ok(EngineConfig {
            ranks: derived.ranks,
            topic: derived.topic,
            replay_timeout,
            max_engine_message,
            warnings: derived
                .ignored_keys
                .iter()
                .map(|k| {
                    format!(
                        "--kv-events-config: ignoring {k:?}, which no engine's KVEventsConfig has"
                    )
                })
                .collect(),
        })
    }
}

concern! {
    /// The ring: its file, size and numbering.
    #[command(next_help_heading = "Ring")]
    pub struct RingArgs {
        /// Ring file.
        #[arg(long, value_name = "PATH")]
        pub shm: Option<PathBuf>,
        /// Ring data size, e.g. `64MiB`, `1048576`.
        #[arg(long, value_name = "BYTES")]
        pub ring_size: Option<ByteSize>,
        /// First sequence number of a brand-new ring.
        #[arg(long, value_name = "N")]
        pub seq_base: Option<u64>,
        /// Engine batches encoding above this become several records, each under 4MiB.
        #[arg(long, value_name = "BYTES")]
        pub split_threshold: Option<ByteSize>,
        /// Make the ring file group-readable (0640 instead of 0600).
        #[arg(long)]
        pub shm_group_read: bool,
    }
}

struct RingConfig {
    shm: Option<PathBuf>,
    ring_size: u64,
    seq_base: Option<u64>,
    split_threshold: u64,
    shm_group_read: bool,
}

impl RingArgs {
    fn validate(self) -> Result<RingConfig, ConfigError> {
        let ring_size = match &self.ring_size {
            Some(s) => s.bytes("ring-size")?,
            None => DEFAULT_RING_SIZE,
        };
        if ring_size < MIN_RING_SIZE {
            return Err(invalid(format!(
                "--ring-size {ring_size}: must be at least 1MiB ({MIN_RING_SIZE})"
            )));
        }
        if ring_size > MAX_RING_SIZE {
            return Err(invalid(format!(
                "--ring-size {ring_size}: must be at most 1TiB"
            )));
        }
        let split_threshold = match &self.split_threshold {
            Some(s) => s.bytes("split-threshold")?,
            // Small rings (tests) get a proportionally smaller default.
            None => DEFAULT_SPLIT_THRESHOLD.min(ring_size / 4),
        };
        if !(MIN_SPLIT_THRESHOLD..=MAX_SPLIT_THRESHOLD).contains(&split_threshold) {
            return Err(invalid(format!(
                "--split-threshold {split_threshold}: must be between {MIN_SPLIT_THRESHOLD} and {MAX_SPLIT_THRESHOLD} (records stay under gRPC's 4 MiB limit)"
            )));
        }
        if split_threshold > ring_size / 4 {
            return Err(invalid(format!(
                "--split-threshold {split_threshold}: must be at most a quarter of --ring-size ({ring_size})"
            )));
        }
        if self.seq_base == Some(0) {
            return Err(invalid(
                "--seq-base: sequence numbers start at 1 (0 is never sent)",
            ));
        }
        Ok(RingConfig {
            shm: self.shm,
            ring_size,
            seq_base: self.seq_base,
            split_threshold,
            shm_group_read: self.shm_group_read,
        })
    }
}

concern! {
    /// Snapshots for late joiners (docs/smg-api.md §6.5).
    #[command(next_help_heading = "Snapshots")]
    pub struct SnapshotArgs {
        /// When a subscriber starting from 0 gets the live block table as snapshot chunks.
        #[arg(long, value_enum)]
        pub snapshot: Option<crate::snapshot::SnapshotMode>,
        /// Most blocks the table holds per ring; beyond, snapshots are marked incomplete.
        #[arg(long, value_name = "N")]
        pub snapshot_max_blocks: Option<usize>,
        /// Largest snapshot chunk (4KiB to 4MiB − 64KiB).
        #[arg(long, value_name = "BYTES")]
        pub snapshot_chunk_size: Option<ByteSize>,
        /// Least time between two checkpoints of the table beside the ring when the ring is not
        /// about to lap the last one (1s to 7d, e.g. 90s, 5m).
        #[arg(long, value_name = "DURATION")]
        pub checkpoint_interval: Option<String>,
    }
}

impl SnapshotArgs {
    fn validate(self) -> Result<crate::snapshot::SnapshotConfig, ConfigError> {
        let max_blocks = self
            .snapshot_max_blocks
            .unwrap_or(crate::snapshot::DEFAULT_MAX_BLOCKS);
        if max_blocks == 0 {
            return Err(invalid(
                "--snapshot-max-blocks: must be at least 1 (use --snapshot off for no table)",
            ));
        }
        let chunk = match &self.snapshot_chunk_size {
            Some(s) => s.bytes("snapshot-chunk-size")?,
            None => crate::snapshot::CHUNK_MAX as u64,
        };
        if !(crate::snapshot::CHUNK_MIN as u64..=MAX_SPLIT_THRESHOLD).contains(&chunk) {
            return Err(invalid(format!(
                "--snapshot-chunk-size {chunk}: must be between {} and {MAX_SPLIT_THRESHOLD} bytes",
                crate::snapshot::CHUNK_MIN
            )));
        }
        let checkpoint_interval = match &self.checkpoint_interval {
            None => crate::snapshot::DEFAULT_CHECKPOINT_INTERVAL,
            Some(t) => {
                parse_duration(t).map_err(|e| invalid(format!("--checkpoint-interval: {e}")))?
            }
        };
        if checkpoint_interval > Duration::from_secs(7 * 86_400) {
            return Err(invalid(format!(
                "--checkpoint-interval {}: at most 7d",
                self.checkpoint_interval.as_deref().unwrap_or_default()
            )));
        }
        Ok(crate::snapshot::SnapshotConfig {
            mode: self.snapshot.unwrap_or_default(),
            max_blocks,
            chunk_bytes: chunk as usize,
            checkpoint_interval,
        })
    }
}

concern! {
    /// Re-publishing on the engines' own ZMQ wire (docs/dynamo-llm-d.md).
    #[command(next_help_heading = "Engine-wire publishing (ZMQ)")]
    pub struct PublishZmqArgs {
        /// Bind a ZMQ PUB per DP rank, rank r on PORT + r, carrying every ring record as the
        /// engine's own `[topic, seq, EventBatch]` (for Dynamo, llm-d and other ZMQ consumers).
        #[arg(long, value_name = "tcp://HOST:PORT")]
        pub publish_zmq: Option<String>,
        /// Also bind the replay ROUTER of rank r on PORT + r (the vLLM replay protocol).
        #[arg(long, value_name = "tcp://HOST:PORT")]
        pub publish_zmq_replay: Option<String>,
        /// Topic frame of published batches.
        #[arg(long, value_name = "TOPIC")]
        pub publish_zmq_topic: Option<String>,
        /// Event encoding: tagged maps (vLLM >= 0.24) or tagged arrays (older consumers).
        #[arg(long, value_enum)]
        pub publish_zmq_layout: Option<crate::publish_zmq::WireLayout>,
    }
}

impl PublishZmqArgs {
    fn validate(self) -> Result<Option<crate::publish_zmq::PublishZmqConfig>, ConfigError> {
        use crate::publish_zmq::{PublishZmqConfig, TcpEndpoint};
        let Some(publish) = self.publish_zmq else {
            for (name, given) in [
                ("publish-zmq-replay", self.publish_zmq_replay.is_some()),
                ("publish-zmq-topic", self.publish_zmq_topic.is_some()),
                ("publish-zmq-layout", self.publish_zmq_layout.is_some()),
            ] {
                if given {
                    return Err(invalid(format!("--{name} needs --publish-zmq")));
                }
            }
            return Ok(None);
        };
        let publish = TcpEndpoint::parse("publish-zmq", &publish).map_err(invalid)?;
        let replay = match &self.publish_zmq_replay {
            Some(r) => Some(TcpEndpoint::parse("publish-zmq-replay", r).map_err(invalid)?),
            None => None,
        };
        Ok(Some(PublishZmqConfig {
            publish,
            replay,
            topic: self.publish_zmq_topic,
            layout: self.publish_zmq_layout.unwrap_or_default(),
        }))
    }
}

concern! {
    /// gRPC streaming: the listener, what is streamed, and how many may subscribe.
    #[command(next_help_heading = "Streaming")]
    pub struct StreamingArgs {
        /// gRPC listen address.
        #[arg(long, value_name = "ADDR")]
        pub grpc: Option<String>,
        /// Multi-rank mode.
        #[arg(long, value_enum)]
        pub dp_mode: Option<DpMode>,
        /// Send `dp_rank` on the merged stream (breaks G2 gateways, see README).
        #[arg(long)]
        pub send_dp_rank: bool,
        /// Event filter profile.
        #[arg(long, value_enum)]
        pub profile: Option<ProfileArg>,
        /// Maximum concurrent subscribers; more get RESOURCE_EXHAUSTED.
        #[arg(long, value_name = "N")]
        pub max_subscribers: Option<usize>,
        /// HTTP/2 max concurrent streams per gRPC connection; more wait on the client.
        #[arg(long, value_name = "N")]
        pub max_streams_per_connection: Option<u32>,
        /// Close a gRPC connection that has not completed TLS (if on) and sent the HTTP/2
        /// preface and its SETTINGS within this many ms.
        #[arg(long, value_name = "MS")]
        pub handshake_timeout_ms: Option<u64>,
    }
}

struct StreamingConfig {
    grpc: SocketAddr,
    dp_mode: DpMode,
    send_dp_rank: bool,
    profile: Profile,
    max_subscribers: usize,
    max_streams_per_connection: u32,
    handshake_timeout: Duration,
}

impl StreamingArgs {
    fn validate(self) -> Result<StreamingConfig, ConfigError> {
        let grpc_text = self.grpc.unwrap_or_else(|| DEFAULT_GRPC.to_string());
        let grpc =
            parse_addr(&grpc_text).map_err(|e| invalid(format!("--grpc {grpc_text:?}: {e}")))?;
        let max_subscribers = self.max_subscribers.unwrap_or(DEFAULT_MAX_SUBSCRIBERS);
        if max_subscribers == 0 {
            return Err(invalid("--max-subscribers: must be at least 1"));
        }
        if self.max_streams_per_connection == Some(0) {
            return Err(invalid(
                "--max-streams-per-connection: must be at least 1 (omit it for the default)",
            ));
        }
        let handshake_timeout_ms = self
            .handshake_timeout_ms
            .unwrap_or(DEFAULT_HANDSHAKE_TIMEOUT_MS);
        if !(1..=MAX_HANDSHAKE_TIMEOUT_MS).contains(&handshake_timeout_ms) {
            return Err(invalid(format!(
                "--handshake-timeout-ms {handshake_timeout_ms}: must be between 1 and {MAX_HANDSHAKE_TIMEOUT_MS}"
            )));
        }
        Ok(StreamingConfig {
            grpc,
            dp_mode: self.dp_mode.unwrap_or_default(),
            send_dp_rank: self.send_dp_rank,
            profile: match self.profile {
                Some(ProfileArg::All) => Profile::All,
                Some(ProfileArg::Smg) | None => Profile::Smg,
            },
            max_subscribers,
            max_streams_per_connection: self
                .max_streams_per_connection
                .unwrap_or(DEFAULT_MAX_STREAMS_PER_CONNECTION),
            handshake_timeout: Duration::from_millis(handshake_timeout_ms),
        })
    }
}

concern! {
    /// Security: TLS for gRPC and the subscribers' bearer token.
    #[command(next_help_heading = "Security")]
    pub struct SecurityArgs {
        /// TLS certificate chain (PEM) for gRPC; needs `--tls-key`.
        #[arg(long, value_name = "FILE")]
        pub tls_cert: Option<PathBuf>,
        /// TLS private key (PEM) for gRPC; needs `--tls-cert`.
        #[arg(long, value_name = "FILE")]
        pub tls_key: Option<PathBuf>,
        /// File holding the bearer token gRPC subscribers must send (`authorization: Bearer …`);
        /// the env var KVBRIDGE_AUTH_TOKEN is the alternative. The token is never a flag value.
        #[arg(long, value_name = "FILE")]
        pub auth_token_file: Option<PathBuf>,
    }
}

struct SecurityConfig {
    tls: Option<TlsFiles>,
    auth_token: Option<String>,
    files: SecretFiles,
}

impl SecurityArgs {
    /// Reads the PEM files and the token (file, else the environment).
    fn validate(self) -> Result<SecurityConfig, ConfigError> {
        let files = SecretFiles {
            tls: self.tls_cert.clone().zip(self.tls_key.clone()),
            token: self.auth_token_file.clone(),
        };
        let tls = match (self.tls_cert, self.tls_key) {
            (None, None) => None,
            (Some(c), Some(k)) => Some(read_tls_files(&c, &k)?),
            (Some(_), None) => {
                return Err(invalid("--tls-cert needs --tls-key (give both or neither)"))
            }
            (None, Some(_)) => {
                return Err(invalid("--tls-key needs --tls-cert (give both or neither)"))
            }
        };
        Ok(SecurityConfig {
            tls,
            auth_token: resolve_token(self.auth_token_file.as_deref())?,
            files,
        })
    }
}

concern! {
    /// Operations: metrics, logs and health.
    #[command(next_help_heading = "Operations")]
    pub struct OpsArgs {
        /// Prometheus listen address, or `off`.
        #[arg(long, value_name = "ADDR")]
        pub metrics: Option<String>,
        /// Log format.
        #[arg(long, value_enum)]
        pub log_format: Option<LogFormat>,
        /// Health stays SERVING this long after start-up and after the last upstream disconnect,
        /// in ms.
        #[arg(long, value_name = "MS")]
        pub health_grace_ms: Option<u64>,
        /// Once every listener is bound and start-up is done, write this JSON file (atomically:
        /// a temporary file renamed): `pid`, `grpc` and `metrics` (null when off) as bound, and
        /// `publish_zmq`, each rank's bound PUB and replay endpoints. Removed on exit; a
        /// supervisor or test waits for it instead of reading logs or probing ports.
        #[arg(long, value_name = "FILE")]
        pub ready_file: Option<PathBuf>,
    }
}

struct OpsConfig {
    metrics: Option<SocketAddr>,
    log_format: LogFormat,
    health_grace: Duration,
    ready_file: Option<PathBuf>,
}

impl OpsArgs {
    /// `grpc` decides the default metrics address.
    fn validate(self, grpc: SocketAddr) -> Result<OpsConfig, ConfigError> {
        let metrics = match self.metrics.as_deref() {
            None => Some(default_metrics_addr(grpc)),
            Some(METRICS_OFF) => None,
            Some(text) => {
                Some(parse_addr(text).map_err(|e| invalid(format!("--metrics {text:?}: {e}")))?)
            }
        };
        let health_grace_ms = self.health_grace_ms.unwrap_or(DEFAULT_HEALTH_GRACE_MS);
        if health_grace_ms > MAX_HEALTH_GRACE_MS {
            return Err(invalid(format!(
                "--health-grace-ms {health_grace_ms}: must be at most a day ({MAX_HEALTH_GRACE_MS})"
            )));
        }
        Ok(OpsConfig {
            metrics,
            log_format: self.log_format.unwrap_or_default(),
            health_grace: Duration::from_millis(health_grace_ms),
            ready_file: self.ready_file,
        })
    }
}

// ------------------------------------------------------------------------------- NATS sink

// The sink's settings type and defaults are the sink's own (`crate::sink`); here only the flags.
pub use crate::sink::{
    is_subject_token, NatsConfig, DEFAULT_NATS_MAX_AGE, DEFAULT_NATS_REPLICAS, DEFAULT_NATS_STREAM,
    DEFAULT_NATS_SUBJECT_PREFIX,
};

concern! {
    /// The NATS JetStream sink: every ring record also published to a replicated stream.
    #[command(next_help_heading = "NATS JetStream sink")]
    pub struct NatsArgs {
        /// NATS server URLs, comma-separated (`nats://host:4222,nats://…`): publish every ring
        /// record to JetStream (off when not given).
        #[arg(long, value_name = "URL[,URL…]")]
        pub nats: Option<String>,
        /// Subject prefix: records go to `<prefix>.<worker-id>.<rank|merged>`.
        #[arg(long, value_name = "PREFIX")]
        pub nats_subject_prefix: Option<String>,
        /// JetStream stream, created (or checked) with subjects `<prefix>.>`.
        #[arg(long, value_name = "NAME")]
        pub nats_stream: Option<String>,
        /// Stream replicas; an existing stream with another value is an error.
        #[arg(long, value_name = "N")]
        pub nats_replicas: Option<usize>,
        /// Stream retention (max age), e.g. `1h`, `30m`, `2d`; an existing stream with another
        /// value is an error.
        #[arg(long, value_name = "DURATION")]
        pub nats_max_age: Option<String>,
        /// This bridge's name in the subjects (letters, digits, `-`, `_`).
        #[arg(long, value_name = "ID")]
        pub nats_worker_id: Option<String>,
        /// NATS credentials file (`.creds`: user JWT and NKey seed).
        #[arg(long, value_name = "FILE")]
        pub nats_creds: Option<PathBuf>,
        /// Trust this PEM CA for the NATS servers' TLS certificates (and require TLS).
        #[arg(long, value_name = "FILE")]
        pub nats_tls_ca: Option<PathBuf>,
        /// Refuse to start (exit 2) unless NATS answers and the stream is usable; by default
        /// kvbridge serves without NATS and the sink connects in the background.
        #[arg(long)]
        pub nats_required: bool,
    }
}

/// `90s`, `30m`, `1h`, `2d` (or a bare number of seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("not a duration: {s:?} (try 1h, 30m or 90s)"))?;
    let mult = match unit.trim() {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        u => return Err(format!("unknown unit {u:?} in {s:?} (use s, m, h or d)")),
    };
    n.checked_mul(mult)
        .filter(|&secs| secs > 0)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{s:?}: must be more than 0 and fit in 64 bits of seconds"))
}

impl NatsArgs {
    fn validate(self) -> Result<Option<NatsConfig>, ConfigError> {
        let Some(urls) = self.nats else {
            let given = [
                ("nats-subject-prefix", self.nats_subject_prefix.is_some()),
                ("nats-stream", self.nats_stream.is_some()),
                ("nats-replicas", self.nats_replicas.is_some()),
                ("nats-max-age", self.nats_max_age.is_some()),
                ("nats-worker-id", self.nats_worker_id.is_some()),
                ("nats-creds", self.nats_creds.is_some()),
                ("nats-tls-ca", self.nats_tls_ca.is_some()),
                ("nats-required", self.nats_required),
            ];
            if let Some((name, _)) = given.iter().find(|(_, g)| *g) {
                return Err(invalid(format!("--{name} needs --nats")));
            }
            return Ok(None);
        };
        let urls: Vec<String> = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_string)
            .collect();
        if urls.is_empty() {
            return Err(invalid("--nats: no server URL given"));
        }
        for u in &urls {
            let rest = u.split_once("://").map_or(u.as_str(), |(scheme, rest)| {
                if matches!(scheme, "nats" | "tls") {
                    rest
                } else {
                    ""
                }
            });
            if rest.is_empty() || rest.contains('/') {
                return Err(invalid(format!(
                    "--nats {u:?}: not a NATS server URL (try nats://host:4222)"
                )));
            }
        }
        let prefix = self
            .nats_subject_prefix
            .unwrap_or_else(|| DEFAULT_NATS_SUBJECT_PREFIX.to_string());
        if !prefix.split('.').all(is_subject_token) {
            return Err(invalid(format!(
                "--nats-subject-prefix {prefix:?}: dot-separated tokens of letters, digits, '-' and '_'"
            )));
        }
        let stream = self
            .nats_stream
            .unwrap_or_else(|| DEFAULT_NATS_STREAM.to_string());
        if !is_subject_token(&stream) {
            return Err(invalid(format!(
                "--nats-stream {stream:?}: letters, digits, '-' and '_' only"
            )));
        }
        let replicas = self.nats_replicas.unwrap_or(DEFAULT_NATS_REPLICAS);
        if !(1..=5).contains(&replicas) {
            return Err(invalid(format!(
                "--nats-replicas {replicas}: JetStream allows 1 to 5"
            )));
        }
        let max_age = match &self.nats_max_age {
            None => DEFAULT_NATS_MAX_AGE,
            Some(t) => parse_duration(t).map_err(|e| invalid(format!("--nats-max-age: {e}")))?,
        };
        if let Some(w) = &self.nats_worker_id {
            if !is_subject_token(w) {
                return Err(invalid(format!(
                    "--nats-worker-id {w:?}: letters, digits, '-' and '_' only (it is one subject token)"
                )));
            }
        }
        for (name, f) in [
            ("nats-creds", &self.nats_creds),
            ("nats-tls-ca", &self.nats_tls_ca),
        ] {
            if let Some(f) = f {
                std::fs::metadata(f)
                    .map_err(|e| invalid(format!("--{name} {}: {e}", f.display())))?;
            }
        }
        Ok(Some(NatsConfig {
            urls,
            subject_prefix: prefix,
            stream,
            replicas,
            max_age,
            worker_id: self.nats_worker_id,
            creds: self.nats_creds,
            tls_ca: self.nats_tls_ca,
            required: self.nats_required,
        }))
    }
}

// ---- Sidecar mode (docs/smg-api.md §2 "Proxy mode") ----

/// Default `--load-interval-ms` in sidecar mode.
pub const DEFAULT_LOAD_INTERVAL_MS: u64 = 500;
/// Longest `--load-interval-ms`.
pub const MAX_LOAD_INTERVAL_MS: u64 = 3_600_000;
/// Default `--sidecar-connection-buffer`: what kvbridge may hold for one client connection's
/// forwarded streams. With the sidecar's windows (`proxy::Budgets`), 128 MiB lets one connection
/// (a gateway's) have about 900 forwarded streams moving at once.
pub const DEFAULT_SIDECAR_CONNECTION_BUFFER: u64 = 128 << 20;
/// Default `--sidecar-buffer`: what kvbridge may hold for all client connections together.
pub const DEFAULT_SIDECAR_BUFFER: u64 = 1 << 30;
/// Smallest `--sidecar-connection-buffer`: room for a few streams besides the upload window.
pub const MIN_SIDECAR_CONNECTION_BUFFER: u64 = 1 << 20;
/// Default `--sidecar-stall-timeout-ms`.
pub const DEFAULT_SIDECAR_STALL_TIMEOUT_MS: u64 = 30_000;
/// HTTP/2 max concurrent streams per client connection in sidecar mode when
/// `--max-streams-per-connection` is not given: gRPC servers (grpcio, which vLLM and SGLang
/// serve with) advertise no limit, and kvbridge must never advertise a lower one than the engine
/// (docs/smg-api.md §2), so the default is "no practical limit".
pub const PROXY_MAX_STREAMS_PER_CONNECTION: u32 = u32::MAX;

concern! {
    /// Sidecar mode: kvbridge listens on the worker URL the gateway registers, serves
    /// `SubscribeKvEvents` itself and forwards every other call to the engine's gRPC server.
    #[command(next_help_heading = "Sidecar")]
    pub struct ProxyArgs {
        /// The engine's gRPC server, `HOST:PORT` (`http://`, `grpc://` prefixes accepted;
        /// `https://` / `grpcs://` = TLS, with --engine-tls-ca). Turns sidecar mode on: every call
        /// but SubscribeKvEvents is forwarded there, and the gateway is given kvbridge's --grpc
        /// address as the worker URL.
        #[arg(long, value_name = "HOST:PORT")]
        pub engine_grpc: Option<String>,
        /// CA certificate(s) (PEM) that sign the engine's gRPC TLS certificate; needs an
        /// `https://` --engine-grpc.
        #[arg(long, value_name = "FILE")]
        pub engine_tls_ca: Option<PathBuf>,
        /// Poll the engine's GetLoads this often and send `load_only` records to subscribers that
        /// ask for them (0 = off).
        #[arg(long, value_name = "MS")]
        pub load_interval_ms: Option<u64>,
        /// Most bytes kvbridge holds for one client connection's forwarded calls, both directions
        /// (e.g. `128MiB`): each forwarded stream takes its share while it lasts, and a stream
        /// that finds none left waits for one (HTTP/2 flow control holds back the peers).
        #[arg(long, value_name = "SIZE")]
        pub sidecar_connection_buffer: Option<ByteSize>,
        /// Most bytes kvbridge holds for all client connections' forwarded calls together
        /// (e.g. `1GiB`); at least --sidecar-connection-buffer.
        #[arg(long, value_name = "SIZE")]
        pub sidecar_buffer: Option<ByteSize>,
        /// A forwarded call that moves no byte for this long while it is owed some (a response
        /// its client does not take, a request the engine does not read or the client does not
        /// finish) is reset (RESOURCE_EXHAUSTED) if other calls wait for buffer space; 0 = never.
        #[arg(long, value_name = "MS")]
        pub sidecar_stall_timeout_ms: Option<u64>,
    }
}

/// Where the engine's gRPC server is, as `--engine-grpc` gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineGrpc {
    /// TLS to the engine.
    pub tls: bool,
    /// Host name or IP (without brackets).
    pub host: String,
    /// Port.
    pub port: u16,
}

impl std::fmt::Display for EngineGrpc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        if self.host.contains(':') {
            write!(f, "{scheme}://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{scheme}://{}:{}", self.host, self.port)
        }
    }
}

/// Validated sidecar settings.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// The engine's gRPC server.
    pub engine: EngineGrpc,
    /// PEM CA bundle for TLS to the engine.
    pub tls_ca: Option<Vec<u8>>,
    /// GetLoads polling period; `None` = off.
    pub load_interval: Option<Duration>,
    /// Most bytes held for one client connection's forwarded streams.
    pub connection_buffer: u64,
    /// Most bytes held for all client connections' forwarded streams.
    pub buffer: u64,
    /// How long a forwarded call that moves nothing may keep its share while others wait;
    /// `None` = for ever.
    pub stall_timeout: Option<Duration>,
}

/// Parses `--engine-grpc`: `[scheme://]HOST:PORT`, an IPv6 host in brackets.
pub fn parse_engine_grpc(text: &str) -> Result<EngineGrpc, String> {
    let t = text.trim();
    let (tls, rest) = if let Some(r) = t.strip_prefix("https://").or(t.strip_prefix("grpcs://")) {
        (true, r)
    } else if let Some(r) = t.strip_prefix("http://").or(t.strip_prefix("grpc://")) {
        (false, r)
    } else if t.contains("://") {
        return Err("scheme must be http://, https://, grpc:// or grpcs://".into());
    } else {
        (false, t)
    };
    let rest = rest.trim_end_matches('/');
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or("expected HOST:PORT, e.g. 127.0.0.1:50051")?;
    let port: u16 = port.parse().map_err(|_| format!("bad port {port:?}"))?;
    if port == 0 {
        return Err("port 0: give the engine's actual gRPC port".into());
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.contains('/') {
        return Err("expected HOST:PORT, e.g. 127.0.0.1:50051".into());
    }
    Ok(EngineGrpc {
        tls,
        host: host.to_string(),
        port,
    })
}

impl ProxyArgs {
    fn validate(self) -> Result<Option<ProxyConfig>, ConfigError> {
        let Some(text) = self.engine_grpc.clone() else {
            if self.load_interval_ms.is_some()
                || self.engine_tls_ca.is_some()
                || self.sidecar_connection_buffer.is_some()
                || self.sidecar_buffer.is_some()
                || self.sidecar_stall_timeout_ms.is_some()
            {
                return Err(invalid(
                    "--load-interval-ms, --engine-tls-ca and --sidecar-* need --engine-grpc (sidecar mode)",
                ));
            }
            return Ok(None);
        };
        let engine = parse_engine_grpc(&text)
            .map_err(|e| invalid(format!("--engine-grpc {text:?}: {e}")))?;
        let tls_ca = match (&self.engine_tls_ca, engine.tls) {
            (Some(p), true) => Some(read_pem("--engine-tls-ca", p, "CERTIFICATE")?),
            (Some(_), false) => {
                return Err(invalid(format!(
                    "--engine-tls-ca needs TLS to the engine: write --engine-grpc https://{}:{}",
                    engine.host, engine.port
                )))
            }
            (None, true) => {
                return Err(invalid(
                    "--engine-grpc https://…: give the CA that signs the engine's certificate with --engine-tls-ca FILE",
                ))
            }
            (None, false) => None,
        };
        let ms = self.load_interval_ms.unwrap_or(DEFAULT_LOAD_INTERVAL_MS);
        if ms > MAX_LOAD_INTERVAL_MS {
            return Err(invalid(format!(
                "--load-interval-ms {ms}: must be at most an hour ({MAX_LOAD_INTERVAL_MS}); 0 turns polling off"
            )));
        }
        let (connection_buffer, buffer) = self.buffers()?;
        let stall = self
            .sidecar_stall_timeout_ms
            .unwrap_or(DEFAULT_SIDECAR_STALL_TIMEOUT_MS);
        if stall > MAX_LOAD_INTERVAL_MS {
            return Err(invalid(format!(
                "--sidecar-stall-timeout-ms {stall}: must be at most an hour ({MAX_LOAD_INTERVAL_MS}); 0 = never"
            )));
        }
        Ok(Some(ProxyConfig {
            engine,
            tls_ca,
            load_interval: (ms > 0).then(|| Duration::from_millis(ms)),
            connection_buffer,
            buffer,
            stall_timeout: (stall > 0).then(|| Duration::from_millis(stall)),
        }))
    }

    /// `--sidecar-connection-buffer` and `--sidecar-buffer`, checked against each other.
    fn buffers(&self) -> Result<(u64, u64), ConfigError> {
        let size = |v: &Option<ByteSize>, name: &str, default: u64| {
            v.as_ref().map_or(Ok(default), |b| b.bytes(name))
        };
        let conn = size(
            &self.sidecar_connection_buffer,
            "sidecar-connection-buffer",
            DEFAULT_SIDECAR_CONNECTION_BUFFER,
        )?;
        let total = size(
            &self.sidecar_buffer,
            "sidecar-buffer",
            DEFAULT_SIDECAR_BUFFER,
        )?;
        // The budgets are counted in a semaphore of u32 permits per KiB (`proxy::Budgets`).
        let most = u64::from(u32::MAX) << 10;
        if !(MIN_SIDECAR_CONNECTION_BUFFER..=most).contains(&conn) {
            return Err(invalid(format!(
                "--sidecar-connection-buffer {conn} bytes: must be between 1MiB and 4TiB"
            )));
        }
        if total < conn || total > most {
            return Err(invalid(format!(
                "--sidecar-buffer {total} bytes: must be at least --sidecar-connection-buffer ({conn} bytes) and at most 4TiB"
            )));
        }
        Ok((conn, total))
    }
}

/// The validated configuration of `kvbridge serve`.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// One entry per DP rank.
    pub ranks: Vec<RankEndpoint>,
    /// ZMQ topic.
    pub topic: String,
    /// gRPC listen address.
    pub grpc: SocketAddr,
    /// Ring file given with `--shm`; see [`ServeConfig::ring_path`].
    pub shm: Option<PathBuf>,
    /// Ring data size in bytes.
    pub ring_size: u64,
    /// First number of a brand-new ring.
    pub seq_base: Option<u64>,
    /// Record split threshold in bytes.
    pub split_threshold: u64,
    /// Filter profile.
    pub profile: Profile,
    /// Multi-rank mode.
    pub dp_mode: DpMode,
    /// Send `dp_rank` on the merged stream.
    pub send_dp_rank: bool,
    /// Subscriber limit.
    pub max_subscribers: usize,
    /// Replay reply timeout.
    pub replay_timeout: Duration,
    /// Largest engine message (ZMQ frame) accepted, in bytes; also the decoder's payload limit.
    pub max_engine_message: u64,
    /// Ring file mode 0640 instead of 0600.
    pub shm_group_read: bool,
    /// Configuration problems that do not stop the bridge, logged once it starts.
    pub warnings: Vec<String>,
    /// Prometheus address, `None` when disabled.
    pub metrics: Option<SocketAddr>,
    /// Log format.
    pub log_format: LogFormat,
    /// Health grace period after start-up and after the last upstream disconnect.
    pub health_grace: Duration,
    /// `--ready-file`: written once start-up is done, removed on exit.
    pub ready_file: Option<PathBuf>,
    /// TLS certificate chain and key (PEM), read at validation time.
    pub tls: Option<TlsFiles>,
    /// Bearer token every `SubscribeKvEvents` call must carry, if set.
    pub auth_token: Option<String>,
    /// Where `tls` and `auth_token` were read from, to re-read them on SIGHUP or change.
    pub secret_files: SecretFiles,
    /// HTTP/2 max concurrent streams per connection.
    pub max_streams_per_connection: u32,
    /// Time a gRPC connection has to complete TLS and send the HTTP/2 preface and SETTINGS.
    pub handshake_timeout: Duration,
    /// The NATS JetStream sink, when `--nats` is given.
    pub nats: Option<NatsConfig>,
    /// Sidecar mode: the engine's gRPC server everything but `SubscribeKvEvents` goes to.
    pub proxy: Option<ProxyConfig>,
    /// Snapshots for late joiners.
    pub snapshot: crate::snapshot::SnapshotConfig,
    /// Re-publishing on the engines' ZMQ wire, when `--publish-zmq` is given.
    pub publish_zmq: Option<crate::publish_zmq::PublishZmqConfig>,
}

impl ServeConfig {
    /// The ring file: `--shm`, else `/dev/shm/kvbridge-<grpc_port>` where `grpc_port` is the
    /// port gRPC is bound to (so that `--grpc …:0` still gives each bridge a ring of its own).
    pub fn ring_path(&self, grpc_port: u16) -> PathBuf {
        self.shm
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("/dev/shm/kvbridge-{grpc_port}")))
    }
}

/// PEM contents of `--tls-cert` and `--tls-key`.
#[derive(Clone)]
pub struct TlsFiles {
    /// Certificate chain, PEM.
    pub cert: Vec<u8>,
    /// Private key, PEM.
    pub key: Vec<u8>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TlsFiles({} cert bytes, key redacted)", self.cert.len())
    }
}

/// The files the secrets come from (`--tls-cert`/`--tls-key`, `--auth-token-file`): kept so
/// that a running bridge can re-read them when they rotate (see `crate::secrets`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SecretFiles {
    /// Certificate chain and private key.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Bearer token (a token from the environment is not reloadable).
    pub token: Option<PathBuf>,
}

impl SecretFiles {
    /// Reads the certificate chain and key again, checked as at start-up.
    pub fn read_tls(&self) -> Option<Result<TlsFiles, ConfigError>> {
        self.tls.as_ref().map(|(c, k)| read_tls_files(c, k))
    }

    /// Reads the token file again, checked as at start-up.
    pub fn read_token(&self) -> Option<Result<String, ConfigError>> {
        let p = self.token.as_deref()?;
        Some(resolve_token(Some(p)).map(|t| t.expect("a token file yields a token or an error")))
    }
}

fn read_tls_files(cert: &Path, key: &Path) -> Result<TlsFiles, ConfigError> {
    Ok(TlsFiles {
        cert: read_pem("--tls-cert", cert, "CERTIFICATE")?,
        key: read_pem("--tls-key", key, "PRIVATE KEY")?,
    })
}

/// One engine publisher (one DP rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEndpoint {
    /// Rank index (position in the configuration).
    pub rank: u32,
    /// Endpoint for the SUB (already rewritten from a wildcard when connecting).
    pub endpoint: String,
    /// True: the SUB binds (the engine's PUB connects).
    pub bind: bool,
    /// The engine's replay ROUTER for this rank, if any.
    pub replay: Option<String>,
}

/// Environment variable holding the gRPC bearer token (alternative to `--auth-token-file`).
pub const AUTH_TOKEN_ENV: &str = "KVBRIDGE_AUTH_TOKEN";

fn read_pem(flag: &str, path: &Path, marker: &str) -> Result<Vec<u8>, ConfigError> {
    let bytes =
        std::fs::read(path).map_err(|e| invalid(format!("{flag} {}: {e}", path.display())))?;
    if !String::from_utf8_lossy(&bytes).contains(marker) {
        return Err(invalid(format!(
            "{flag} {}: not a PEM file (no {marker:?} block)",
            path.display()
        )));
    }
    Ok(bytes)
}

fn resolve_token(file: Option<&Path>) -> Result<Option<String>, ConfigError> {
    let (text, from) = match file {
        Some(p) => (
            std::fs::read_to_string(p)
                .map_err(|e| invalid(format!("--auth-token-file {}: {e}", p.display())))?,
            format!("--auth-token-file {}", p.display()),
        ),
        None => match std::env::var(AUTH_TOKEN_ENV) {
            Ok(v) => (v, AUTH_TOKEN_ENV.to_string()),
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(e) => return Err(invalid(format!("{AUTH_TOKEN_ENV}: {e}"))),
        },
    };
    let token = text.trim();
    if token.is_empty() {
        return Err(invalid(format!("{from}: the token is empty")));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(format!(
            "{from}: the token must be one line of printable ASCII without spaces"
        )));
    }
    Ok(Some(token.to_string()))
}

fn build_ranks(
    zmq: &[String],
    zmq_bind: &[String],
    replay: &[String],
) -> Result<Vec<RankEndpoint>, ConfigError> {
    if zmq.is_empty() && zmq_bind.is_empty() {
        return Err(invalid(
            "no engine endpoint: pass --kv-events-config with the engine's own JSON, or --zmq ENDPOINT (engine binds, the default tcp://*:5557) or --zmq-bind ENDPOINT",
        ));
    }
    let total = zmq.len() + zmq_bind.len();
    if replay.len() > total {
        return Err(invalid(format!(
            "{} --replay endpoints for {total} ranks: give at most one per --zmq/--zmq-bind, in the same order",
            replay.len()
        )));
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
        let replay = match replay.get(i) {
            Some(r) => Some(
                validate_endpoint(r, true).map_err(|e| invalid(format!("--replay {r:?}: {e}")))?,
            ),
            None => None,
        };
        ranks.push(RankEndpoint {
            rank: i as u32,
            endpoint,
            bind,
            replay,
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

/// Checks an endpoint's shape and, for a connecting socket, rewrites wildcard hosts to loopback
/// (ZMQ cannot connect to a wildcard; docs/engine-wire.md §2.1).
pub fn validate_endpoint(ep: &str, connect: bool) -> Result<String, String> {
    if let Some(rest) = ep.strip_prefix("tcp://") {
        let (host, port) = rest.rsplit_once(':').ok_or("expected tcp://HOST:PORT")?;
        let port: u16 = port.parse().map_err(|_| format!("bad port {port:?}"))?;
        if host.is_empty() {
            return Err("empty host".into());
        }
        if connect && port == 0 {
            return Err("cannot connect to port 0 (take the engine's actual port from its /kv_event_sources)".into());
        }
        let host = if connect {
            match host {
                "*" | "0.0.0.0" => "127.0.0.1",
                h if h.starts_with('[')
                    && h.contains("::")
                    && h.trim_matches(|c| c == '[' || c == ']' || c == ':')
                        .is_empty() =>
                {
                    "[::1]"
                }
                h => h,
            }
        } else {
            host
        };
        Ok(format!("tcp://{host}:{port}"))
    } else if let Some(path) = ep.strip_prefix("ipc://") {
        if path.is_empty() {
            return Err("empty ipc path".into());
        }
        Ok(ep.to_string())
    } else if ep.starts_with("inproc://") {
        Err("inproc endpoints are unreachable from another process".into())
    } else {
        Err("expected tcp://HOST:PORT or ipc://PATH".into())
    }
}

/// Parses `HOST:PORT` (IP addresses and `localhost`).
pub fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    if let Some(port) = s.strip_prefix("localhost:") {
        let port: u16 = port.parse().map_err(|_| format!("bad port {port:?}"))?;
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    Err("expected IP:PORT, e.g. 127.0.0.1:50061".into())
}

/// Parses a byte size: `1048576`, `64MiB`, `1GiB`, `512KiB`, `4M`, `1k`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("not a size: {s:?} (try 64MiB or 1048576)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {s:?} (use KiB, MiB or GiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use clap::Parser;

    use super::*;

    /// `kvbridge serve` on its own, to parse flags as the CLI does.
    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn flags<S: AsRef<str>>(list: &[S]) -> ServeArgs {
        let argv = std::iter::once("serve").chain(list.iter().map(|s| s.as_ref()));
        Serve::try_parse_from(argv).unwrap().args
    }

    /// Writes `text` to a new file in `dir` and returns flags naming it with `--config`.
    fn file(dir: &Path, text: &str) -> ServeArgs {
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
    fn show(c: &ServeConfig) -> String {
        format!("{c:?} {:?}", c.tls.as_ref().map(|t| (&t.cert, &t.key)))
    }

    fn args(zmq: &[&str]) -> ServeArgs {
        let mut a = ServeArgs::default();
        a.engine.zmq = zmq.iter().map(|s| s.to_string()).collect();
        a
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("1048576").unwrap(), 1 << 20);
        assert_eq!(parse_size("2 GiB").unwrap(), 2 << 30);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5XB").is_err());
    }

    #[test]
    fn wildcard_rewrite_only_when_connecting() {
        assert_eq!(
            validate_endpoint("tcp://*:5557", true).unwrap(),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(
            validate_endpoint("tcp://0.0.0.0:5557", true).unwrap(),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(
            validate_endpoint("tcp://[::]:5557", true).unwrap(),
            "tcp://[::1]:5557"
        );
        assert_eq!(
            validate_endpoint("tcp://10.1.2.3:5557", true).unwrap(),
            "tcp://10.1.2.3:5557"
        );
        assert_eq!(
            validate_endpoint("tcp://*:5557", false).unwrap(),
            "tcp://*:5557"
        );
        assert!(validate_endpoint("inproc://x", true).is_err());
        assert!(validate_endpoint("tcp://host", true).is_err());
        assert!(validate_endpoint("udp://x:1", true).is_err());
        assert!(validate_endpoint("tcp://*:0", true).is_err());
    }

    #[test]
    fn defaults_and_ranks() {
        let c = args(&["tcp://*:5557", "tcp://*:5558"]).resolve().unwrap();
        assert_eq!(c.grpc.to_string(), DEFAULT_GRPC);
        assert_eq!(
            c.ring_path(c.grpc.port()),
            PathBuf::from("/dev/shm/kvbridge-50061")
        );
        assert_eq!(c.metrics, Some("127.0.0.1:51061".parse().unwrap()));
        assert_eq!(c.ring_size, 64 << 20);
        assert_eq!(c.ranks.len(), 2);
        assert_eq!(c.ranks[1].rank, 1);
        assert_eq!(c.topic, "");
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
    fn the_checkpoint_interval_is_a_duration_from_1s_to_7d() {
        let interval = |extra: &[&str]| {
            let mut a = vec!["--zmq", "tcp://*:5557"];
            a.extend(extra);
            flags(&a).resolve().map(|c| c.snapshot.checkpoint_interval)
        };
        assert_eq!(interval(&[]).unwrap(), Duration::from_secs(60));
        assert_eq!(
            interval(&["--checkpoint-interval", "90s"]).unwrap(),
            Duration::from_secs(90)
        );
        assert_eq!(
            interval(&["--checkpoint-interval", "7d"]).unwrap(),
            Duration::from_secs(7 * 86_400)
        );
        for bad in ["0", "1w", "8d", "soon"] {
            let err = interval(&["--checkpoint-interval", bad]).unwrap_err();
            assert!(
                err.to_string().starts_with("--checkpoint-interval"),
                "{bad}: {err}"
            );
        }
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
        assert_eq!(c.ranks[0].endpoint, "tcp://127.0.0.1:6000");
        assert_eq!(c.grpc.port(), 7000);
        assert_eq!(c.ring_size, 2 << 20);
        assert_eq!(c.topic, "kv");
        a.streaming.grpc = Some("127.0.0.1:7001".into());
        assert_eq!(a.resolve().unwrap().grpc.port(), 7001);
        std::fs::write(&p, "bogus-key = 1\n").unwrap();
        assert!(a.resolve().unwrap_err().to_string().contains("bogus-key"));
    }

    #[test]
    fn engine_grpc_addresses() {
        let e = parse_engine_grpc("127.0.0.1:50051").unwrap();
        assert_eq!(
            (e.tls, e.host.as_str(), e.port),
            (false, "127.0.0.1", 50051)
        );
        assert_eq!(e.to_string(), "http://127.0.0.1:50051");
        let e = parse_engine_grpc("https://engine.local:443/").unwrap();
        assert_eq!(
            (e.tls, e.host.as_str(), e.port),
            (true, "engine.local", 443)
        );
        let e = parse_engine_grpc("grpc://[::1]:50051").unwrap();
        assert_eq!(
            (e.host.as_str(), e.to_string()),
            ("::1", "http://[::1]:50051".into())
        );
        for bad in ["", "engine", "host:0", "host:x", "ftp://h:1", ":5", "h/x:1"] {
            assert!(parse_engine_grpc(bad).is_err(), "{bad:?} accepted");
        }
        // TLS needs the CA; the CA needs TLS; polling needs sidecar mode.
        let err = |argv: &[&str]| flags(argv).resolve().unwrap_err().to_string();
        assert!(err(&["--zmq", "tcp://*:1", "--engine-grpc", "https://h:1"])
            .contains("--engine-tls-ca"));
        assert!(err(&["--zmq", "tcp://*:1", "--load-interval-ms", "5"]).contains("--engine-grpc"));
        let ok = flags(&["--zmq", "tcp://*:1", "--engine-grpc", "h:1"])
            .resolve()
            .unwrap();
        let p = ok.proxy.unwrap();
        assert_eq!(
            p.load_interval,
            Some(Duration::from_millis(DEFAULT_LOAD_INTERVAL_MS))
        );
        assert_eq!(
            ok.max_streams_per_connection,
            PROXY_MAX_STREAMS_PER_CONNECTION
        );
        let capped = flags(&[
            "--zmq",
            "tcp://*:1",
            "--engine-grpc",
            "h:1",
            "--max-streams-per-connection",
            "50",
        ])
        .resolve()
        .unwrap();
        assert_eq!(
            capped.max_streams_per_connection, 50,
            "an explicit limit is kept"
        );
    }

    #[test]
    fn sidecar_buffer_budgets_are_checked() {
        let sidecar = |extra: &[&str]| {
            let mut argv = vec!["--zmq", "tcp://*:1", "--engine-grpc", "h:1"];
            argv.extend_from_slice(extra);
            flags(&argv).resolve()
        };
        let p = sidecar(&[]).unwrap().proxy.unwrap();
        assert_eq!(p.connection_buffer, DEFAULT_SIDECAR_CONNECTION_BUFFER);
        assert_eq!(p.buffer, DEFAULT_SIDECAR_BUFFER);
        assert_eq!(
            p.stall_timeout,
            Some(Duration::from_millis(DEFAULT_SIDECAR_STALL_TIMEOUT_MS))
        );
        let p = sidecar(&[
            "--sidecar-connection-buffer",
            "16MiB",
            "--sidecar-buffer",
            "40MiB",
            "--sidecar-stall-timeout-ms",
            "0",
        ])
        .unwrap()
        .proxy
        .unwrap();
        assert_eq!((p.connection_buffer, p.buffer), (16 << 20, 40 << 20));
        assert_eq!(p.stall_timeout, None);
        for (bad, names) in [
            (
                &["--sidecar-connection-buffer", "512KiB"][..],
                "--sidecar-connection-buffer",
            ),
            (
                &["--sidecar-connection-buffer", "lots"][..],
                "--sidecar-connection-buffer",
            ),
            (
                &[
                    "--sidecar-connection-buffer",
                    "64MiB",
                    "--sidecar-buffer",
                    "32MiB",
                ][..],
                "--sidecar-buffer",
            ),
            (
                &["--sidecar-stall-timeout-ms", "3600001"][..],
                "--sidecar-stall-timeout-ms",
            ),
        ] {
            let e = sidecar(bad).unwrap_err().to_string();
            assert!(e.contains(names) && !e.contains('\n'), "{bad:?}: {e}");
        }
        let e = flags(&["--zmq", "tcp://*:1", "--sidecar-buffer", "1GiB"])
            .resolve()
            .unwrap_err()
            .to_string();
        assert!(e.contains("--engine-grpc"), "{e}");
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

    /// An engine configuration (no spaces: the rows split flags on whitespace).
    const KV: &str = r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:6000"}"#;
    /// One whose meaning depends on the engine (`0.0.0.0`).
    const KV_ANY: &str =
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://0.0.0.0:6000"}"#;

    #[test]
    fn nats_settings_are_checked() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("2d").unwrap(), Duration::from_secs(172_800));
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert!(parse_duration("0h").is_err());
        assert!(parse_duration("1w").is_err());
        let err = |argv: &[&str]| {
            let mut v = vec!["--zmq", "tcp://*:5557"];
            v.extend_from_slice(argv);
            flags(&v).resolve().unwrap_err().to_string()
        };
        assert_eq!(err(&["--nats-stream", "S"]), "--nats-stream needs --nats");
        assert_eq!(err(&["--nats-required"]), "--nats-required needs --nats");
        assert!(err(&["--nats", "http://x:1"]).contains("not a NATS server URL"));
        assert!(
            err(&["--nats", "nats://x:1", "--nats-worker-id", "a.b"]).contains("one subject token")
        );
        assert!(err(&["--nats", "nats://x:1", "--nats-replicas", "7"]).contains("1 to 5"));
        assert!(err(&["--nats", "nats://x:1", "--nats-stream", "A B"]).contains("--nats-stream"));
        let c = flags(&["--zmq", "tcp://*:5557", "--nats", "nats://a:1, nats://b:2"])
            .resolve()
            .unwrap();
        let n = c.nats.unwrap();
        assert_eq!(n.urls, ["nats://a:1", "nats://b:2"]);
        assert_eq!((n.replicas, n.max_age), (3, Duration::from_secs(3600)));
        assert!(!n.required, "NATS is optional unless --nats-required");
        assert_eq!(
            (n.subject_prefix.as_str(), n.stream.as_str()),
            ("kv", "KV_EVENTS")
        );
    }

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

    #[test]
    fn publish_zmq_settings_are_checked() {
        let err = |a: &[&str]| {
            let mut v = vec!["--zmq", "tcp://*:5557"];
            v.extend_from_slice(a);
            flags(&v).resolve().unwrap_err().to_string()
        };
        assert_eq!(
            err(&["--publish-zmq-topic", "kv"]),
            "--publish-zmq-topic needs --publish-zmq"
        );
        assert!(err(&["--publish-zmq", "ipc:///x"]).contains("must be tcp://HOST:PORT"));
        assert!(err(&["--publish-zmq", "tcp://*:70000"]).contains("0 to 65535"));
        assert!(err(&["--publish-zmq", "tcp://:6000"]).contains("no host"));
        let two = |extra: &[&str]| {
            let mut v = vec!["--zmq", "tcp://*:5557", "--zmq", "tcp://*:5567"];
            v.extend_from_slice(extra);
            flags(&v).resolve().map(|_| ()).map_err(|e| e.to_string())
        };
        assert!(two(&["--publish-zmq", "tcp://*:6000"])
            .unwrap_err()
            .contains("needs --dp-mode metadata"));
        let clash = two(&[
            "--dp-mode",
            "metadata",
            "--publish-zmq",
            "tcp://*:6000",
            "--publish-zmq-replay",
            "tcp://*:6001",
        ])
        .unwrap_err();
        assert!(clash.contains("overlap"), "{clash}");
        two(&[
            "--dp-mode",
            "metadata",
            "--publish-zmq",
            "tcp://*:6000",
            "--publish-zmq-replay",
            "tcp://*:6002",
        ])
        .unwrap();
        assert!(
            two(&["--dp-mode", "metadata", "--publish-zmq", "tcp://*:65535"])
                .unwrap_err()
                .contains("beyond 65535")
        );
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

    #[test]
    fn metrics_default_follows_the_grpc_port() {
        let metrics = |extra: &[&str]| {
            let mut argv = vec!["--zmq", "tcp://*:5557"];
            argv.extend(extra);
            flags(&argv).resolve().unwrap().metrics
        };
        let at = |s: &str| Some(s.parse::<SocketAddr>().unwrap());
        assert_eq!(metrics(&[]), at("127.0.0.1:51061"));
        assert_eq!(metrics(&["--grpc", "0.0.0.0:50062"]), at("127.0.0.1:51062"));
        assert_eq!(
            metrics(&["--grpc", "127.0.0.1:65000"]),
            at("127.0.0.1:64000")
        );
        assert_eq!(
            metrics(&["--grpc", "127.0.0.1:64535"]),
            at("127.0.0.1:65535")
        );
        assert_eq!(metrics(&["--grpc", "127.0.0.1:0"]), at("127.0.0.1:0"));
        assert_eq!(
            metrics(&["--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:9464"]),
            at("127.0.0.1:9464")
        );
        assert_eq!(metrics(&["--metrics", "off"]), None);
        // The ring follows the gRPC port as bound.
        let c = flags(&["--zmq", "tcp://*:5557", "--grpc", "127.0.0.1:0"])
            .resolve()
            .unwrap();
        assert_eq!(c.ring_path(40001), PathBuf::from("/dev/shm/kvbridge-40001"));
    }

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
            c.ranks,
            [
                RankEndpoint {
                    rank: 0,
                    endpoint: "tcp://127.0.0.1:5557".into(),
                    bind: false,
                    replay: Some("tcp://127.0.0.1:5600".into()),
                },
                RankEndpoint {
                    rank: 1,
                    endpoint: "tcp://127.0.0.1:5558".into(),
                    bind: false,
                    replay: Some("tcp://127.0.0.1:5601".into()),
                },
            ]
        );
        assert_eq!(c.topic, "kv");
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
        assert_eq!(c.health_grace, Duration::from_millis(250));
        assert_eq!(c.max_streams_per_connection, 512);
        assert_eq!(c.auth_token.as_deref(), Some("abc.DEF-123"));
        assert!(c.tls.is_some());
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
            assert!(c.auth_token.is_none() && c.tls.is_none());
            assert_eq!(c.health_grace.as_millis() as u64, DEFAULT_HEALTH_GRACE_MS);
            assert_eq!(
                c.max_streams_per_connection,
                DEFAULT_MAX_STREAMS_PER_CONNECTION
            );
            assert_eq!(
                c.handshake_timeout,
                Duration::from_millis(DEFAULT_HANDSHAKE_TIMEOUT_MS)
            );
            assert_eq!(c.max_engine_message, DEFAULT_MAX_ENGINE_MESSAGE);
        }
    }
}
