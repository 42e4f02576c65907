//! Configuration for `kvbridge serve`: command-line flags, an optional TOML file, and the
//! validated [`ServeConfig`] the service runs on.
//!
//! Every setting is defined once, as a field of the struct of its concern ([`EngineArgs`],
//! [`RingArgs`], [`StreamingArgs`], [`SecurityArgs`], [`OpsArgs`], …, one file each): that field
//! is both the flag (clap) and the TOML key (serde), with the same kebab-case name, and its doc
//! comment is the `--help` text. A flag given on the command line wins over the file. Each
//! concern has one validator that turns it into the settings type of the component it configures
//! ([`IngestConfig`], [`RingConfig`], [`FanoutConfig`], [`SecurityConfig`], [`ProxyConfig`],
//! …, each defined by that component with its defaults and limits), before anything is started,
//! so a bad value is reported as one line naming the problem (the CLI turns it into exit code 2).
//! [`ServeArgs::resolve`] adds the checks that span concerns and nests the results in
//! [`ServeConfig`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::IgnoredAny;
use serde::Deserialize;
use thiserror::Error;

use crate::fanout::{DpMode, FanoutConfig};
use crate::ingest::IngestConfig;
use crate::proxy::{ProxyConfig, PROXY_MAX_STREAMS_PER_CONNECTION};
use crate::publish_zmq::PublishZmqConfig;
use crate::ring::RingConfig;
use crate::secrets::SecurityConfig;
use crate::snapshot::SnapshotConfig;

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
    /// A TLS file or the bearer token cannot be read or is not usable.
    #[error(transparent)]
    Secret(#[from] crate::secrets::SecretError),
}

fn invalid(message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(message.into())
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

// After the macro, which they use.
mod engine;
mod kv_events;
mod nats;
mod ops;
mod proxy;
mod publish_zmq;
mod reference;
mod ring;
mod security;
mod snapshot;
mod streaming;
mod values;

pub use engine::{EngineArgs, DEFAULT_DATA_PARALLEL_SIZE, MAX_DATA_PARALLEL_SIZE};
pub use kv_events::EngineFamily;
pub use nats::NatsArgs;
pub use ops::{
    default_metrics_addr, LogFormat, OpsArgs, OpsConfig, DEFAULT_HEALTH_GRACE_MS,
    MAX_HEALTH_GRACE_MS, METRICS_OFF, METRICS_PORT_OFFSET,
};
pub use proxy::ProxyArgs;
pub use publish_zmq::PublishZmqArgs;
pub use reference::{flag_reference, serve_defaults, with_defaults};
pub use ring::RingArgs;
pub use security::SecurityArgs;
pub use snapshot::SnapshotArgs;
pub use streaming::{ProfileArg, StreamingArgs};
pub use values::{
    parse_addr, parse_duration, parse_short_duration, parse_size, validate_endpoint, ByteSize,
};

use crate::sink::NatsConfig;

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
        // Sidecar mode raises the default stream limit (see `PROXY_MAX_STREAMS_PER_CONNECTION`),
        // so whether the flag was given at all is noted before it is resolved.
        let streams_given = streaming
            .max_streams_per_connection
            .or(file.streaming.max_streams_per_connection)
            .is_some();
        let proxy = proxy.merge(file.proxy).validate()?;
        let (ingest, warnings) = engine.merge(file.engine).validate()?;
        let mut fanout = streaming.merge(file.streaming).validate()?;
        let ring = ring.merge(file.ring).validate()?;
        let security = security.merge(file.security).validate()?;
        let ops = ops.merge(file.ops).validate(fanout.grpc)?;
        let nats = nats.merge(file.nats).validate()?;
        let snapshot = snapshot.merge(file.snapshot).validate()?;
        let publish_zmq = publish_zmq.merge(file.publish_zmq).validate()?;
        if let Some(p) = &publish_zmq {
            let n = ingest.ranks.len() as u32;
            // Each rank's wire numbers its batches with its own ring's sequence numbers.
            if n > 1 && fanout.dp_mode != DpMode::Metadata {
                return Err(invalid(format!(
                    "--publish-zmq with {n} ranks needs --dp-mode metadata (one ring, hence one contiguous sequence, per rank)"
                )));
            }
            p.check_ranks(n).map_err(invalid)?;
        }
        if proxy.is_some() && !streams_given {
            fanout.max_streams_per_connection = PROXY_MAX_STREAMS_PER_CONNECTION;
        }
        Ok(ServeConfig {
            ingest,
            ring,
            fanout,
            security,
            ops,
            snapshot,
            nats,
            proxy,
            publish_zmq,
            warnings,
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

/// The validated configuration of `kvbridge serve`: each component's settings, as that component
/// defines them.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The engine publishers and what ingest accepts from them.
    pub ingest: IngestConfig,
    /// The ring file, its size and numbering.
    pub ring: RingConfig,
    /// The gRPC edge: listener, multi-rank mode, profile and limits (flags under "Streaming").
    pub fanout: FanoutConfig,
    /// TLS and the bearer token, read at validation time, and the files to re-read them from.
    pub security: SecurityConfig,
    /// Metrics, logs and health.
    pub ops: OpsConfig,
    /// Snapshots for late joiners.
    pub snapshot: SnapshotConfig,
    /// The NATS JetStream sink, when `--nats` is given.
    pub nats: Option<NatsConfig>,
    /// Sidecar mode: the engine's gRPC server everything but `SubscribeKvEvents` goes to.
    pub proxy: Option<ProxyConfig>,
    /// Re-publishing on the engines' ZMQ wire, when `--publish-zmq` is given.
    pub publish_zmq: Option<PublishZmqConfig>,
    /// Configuration problems that do not stop the bridge, logged once it starts.
    pub warnings: Vec<String>,
}

#[cfg(test)]
mod tests;
