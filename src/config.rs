//! Configuration for `kvbridge serve`: command-line flags, an optional TOML file, and the
//! validated [`ServeConfig`] the service runs on.
//!
//! Every flag also exists in the TOML file under the same name (kebab-case); a flag given on the
//! command line wins over the file. Validation happens here, before anything is started, so a
//! bad value is reported as one line naming the problem (the CLI turns it into exit code 2).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

use crate::decode::Profile;

/// Default gRPC listen address (smg-api.md: the worker's KV-event port).
pub const DEFAULT_GRPC: &str = "127.0.0.1:50061";
/// Default Prometheus listen address.
pub const DEFAULT_METRICS: &str = "127.0.0.1:9464";
/// Default ring size: 64 MiB.
pub const DEFAULT_RING_SIZE: u64 = 64 << 20;
/// Smallest ring accepted (tests use small rings).
pub const MIN_RING_SIZE: u64 = 1 << 20;
/// Default split threshold for one record (smg-api.md §6.3).
pub const DEFAULT_SPLIT_THRESHOLD: u64 = 1 << 20;
/// Records must stay below gRPC's default 4 MiB message limit (G1 gateways).
pub const MAX_SPLIT_THRESHOLD: u64 = (4 << 20) - 64 * 1024;

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

/// How multiple DP ranks are exposed (smg-api.md §7).
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ProfileArg {
    /// Drop what SMG gateways would misindex (default).
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

/// `kvbridge serve` flags. Every one is optional here so that the TOML file can supply it.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct ServeArgs {
    /// Engine publisher to connect a SUB to, one per DP rank (rank = position). A wildcard host
    /// (`*`, `0.0.0.0`, `[::]`) is rewritten to loopback.
    #[arg(long = "zmq", value_name = "ENDPOINT")]
    pub zmq: Vec<String>,
    /// Address for a SUB to bind (the engine's PUB connects, e.g. `tcp://127.0.0.1:5557`).
    /// These ranks follow the `--zmq` ones.
    #[arg(long = "zmq-bind", value_name = "ENDPOINT")]
    pub zmq_bind: Vec<String>,
    /// The engine's replay ROUTER for the rank in the same position (`--zmq` then `--zmq-bind`).
    #[arg(long = "replay", value_name = "ENDPOINT")]
    pub replay: Vec<String>,
    /// ZMQ topic (default "": every topic). A non-empty topic is also compared exactly.
    #[arg(long)]
    pub topic: Option<String>,
    /// gRPC listen address [default: 127.0.0.1:50061].
    #[arg(long, value_name = "ADDR")]
    pub grpc: Option<String>,
    /// Ring file [default: /dev/shm/kvbridge-<grpc port>].
    #[arg(long, value_name = "PATH")]
    pub shm: Option<PathBuf>,
    /// Ring data size, e.g. `64MiB`, `1048576` [default: 64MiB, minimum 1MiB].
    #[arg(long = "ring-size", value_name = "BYTES")]
    pub ring_size: Option<String>,
    /// TOML file with any of these settings (flags win).
    #[arg(long, value_name = "FILE.toml")]
    pub config: Option<PathBuf>,
    /// First sequence number of a brand-new ring (default: previous high-water + 2, else Unix µs).
    #[arg(long = "seq-base", value_name = "N")]
    pub seq_base: Option<u64>,
    /// Engine batches encoding above this become several records [default: 1MiB, < 4MiB].
    #[arg(long = "split-threshold", value_name = "BYTES")]
    pub split_threshold: Option<String>,
    /// Event filter profile [default: smg].
    #[arg(long, value_enum)]
    pub profile: Option<ProfileArg>,
    /// Multi-rank mode [default: merged].
    #[arg(long = "dp-mode", value_enum)]
    pub dp_mode: Option<DpMode>,
    /// Send `dp_rank` on the merged stream (breaks G2 gateways, see README).
    #[arg(long = "send-dp-rank")]
    pub send_dp_rank: bool,
    /// Maximum concurrent subscribers; more get RESOURCE_EXHAUSTED [default: 10000].
    #[arg(long = "max-subscribers", value_name = "N")]
    pub max_subscribers: Option<usize>,
    /// Time to wait for the first replay reply and between replies, in ms [default: 2000].
    #[arg(long = "replay-timeout-ms", value_name = "MS")]
    pub replay_timeout_ms: Option<u64>,
    /// Make the ring file group-readable (0640 instead of 0600).
    #[arg(long = "shm-group-read")]
    pub shm_group_read: bool,
    /// Prometheus listen address [default: 127.0.0.1:9464]; `off` disables it.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Log format [default: text].
    #[arg(long = "log-format", value_enum)]
    pub log_format: Option<LogFormat>,
}

/// The same settings as read from a TOML file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    zmq: Vec<String>,
    #[serde(default)]
    zmq_bind: Vec<String>,
    #[serde(default)]
    replay: Vec<String>,
    topic: Option<String>,
    grpc: Option<String>,
    shm: Option<PathBuf>,
    ring_size: Option<SizeValue>,
    seq_base: Option<u64>,
    split_threshold: Option<SizeValue>,
    profile: Option<ProfileArg>,
    dp_mode: Option<DpMode>,
    send_dp_rank: Option<bool>,
    max_subscribers: Option<usize>,
    replay_timeout_ms: Option<u64>,
    shm_group_read: Option<bool>,
    metrics: Option<String>,
    log_format: Option<LogFormat>,
}

/// A size in TOML: a number of bytes or a string like "64MiB".
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    fn resolve(&self, what: &str) -> Result<u64, ConfigError> {
        match self {
            SizeValue::Bytes(n) => Ok(*n),
            SizeValue::Text(s) => {
                parse_size(s).map_err(|e| ConfigError::Invalid(format!("{what}: {e}")))
            }
        }
    }
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

/// The validated configuration of `kvbridge serve`.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// One entry per DP rank.
    pub ranks: Vec<RankEndpoint>,
    /// ZMQ topic.
    pub topic: String,
    /// gRPC listen address.
    pub grpc: SocketAddr,
    /// Ring file.
    pub shm: PathBuf,
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
    pub replay_timeout: std::time::Duration,
    /// Ring file mode 0640 instead of 0600.
    pub shm_group_read: bool,
    /// Prometheus address, `None` when disabled.
    pub metrics: Option<SocketAddr>,
    /// Log format.
    pub log_format: LogFormat,
}

impl ServeArgs {
    /// Merges flags over the TOML file (if any) and validates the result.
    pub fn resolve(&self) -> Result<ServeConfig, ConfigError> {
        let file = match &self.config {
            Some(path) => load_file(path)?,
            None => FileConfig::default(),
        };
        let pick = |flag: &Vec<String>, file: &Vec<String>| {
            if flag.is_empty() {
                file.clone()
            } else {
                flag.clone()
            }
        };
        let zmq = pick(&self.zmq, &file.zmq);
        let zmq_bind = pick(&self.zmq_bind, &file.zmq_bind);
        let replay = pick(&self.replay, &file.replay);

        let ranks = build_ranks(&zmq, &zmq_bind, &replay)?;

        let grpc_text = self
            .grpc
            .clone()
            .or(file.grpc)
            .unwrap_or_else(|| DEFAULT_GRPC.to_string());
        let grpc = parse_addr(&grpc_text)
            .map_err(|e| ConfigError::Invalid(format!("--grpc {grpc_text:?}: {e}")))?;
        let shm = self
            .shm
            .clone()
            .or(file.shm)
            .unwrap_or_else(|| PathBuf::from(format!("/dev/shm/kvbridge-{}", grpc.port())));
        let ring_size = match &self.ring_size {
            Some(s) => parse_size(s)
                .map_err(|e| ConfigError::Invalid(format!("--ring-size {s:?}: {e}")))?,
            None => match &file.ring_size {
                Some(v) => v.resolve("ring-size")?,
                None => DEFAULT_RING_SIZE,
            },
        };
        if ring_size < MIN_RING_SIZE {
            return Err(ConfigError::Invalid(format!(
                "--ring-size {ring_size}: must be at least 1MiB (1048576)"
            )));
        }
        if ring_size > (1 << 40) {
            return Err(ConfigError::Invalid(format!(
                "--ring-size {ring_size}: must be at most 1TiB"
            )));
        }
        let split_threshold = match &self.split_threshold {
            Some(s) => parse_size(s)
                .map_err(|e| ConfigError::Invalid(format!("--split-threshold {s:?}: {e}")))?,
            None => match &file.split_threshold {
                Some(v) => v.resolve("split-threshold")?,
                // Small rings (tests) get a proportionally smaller default.
                None => DEFAULT_SPLIT_THRESHOLD.min(ring_size / 4),
            },
        };
        if !(4096..=MAX_SPLIT_THRESHOLD).contains(&split_threshold) {
            return Err(ConfigError::Invalid(format!(
                "--split-threshold {split_threshold}: must be between 4096 and {MAX_SPLIT_THRESHOLD} (records stay under gRPC's 4 MiB limit)"
            )));
        }
        if split_threshold > ring_size / 4 {
            return Err(ConfigError::Invalid(format!(
                "--split-threshold {split_threshold}: must be at most a quarter of --ring-size ({ring_size})"
            )));
        }
        let metrics_text = self
            .metrics
            .clone()
            .or(file.metrics)
            .unwrap_or_else(|| DEFAULT_METRICS.to_string());
        let metrics =
            if metrics_text == "off" {
                None
            } else {
                Some(parse_addr(&metrics_text).map_err(|e| {
                    ConfigError::Invalid(format!("--metrics {metrics_text:?}: {e}"))
                })?)
            };
        let max_subscribers = self
            .max_subscribers
            .or(file.max_subscribers)
            .unwrap_or(10_000);
        if max_subscribers == 0 {
            return Err(ConfigError::Invalid(
                "--max-subscribers: must be at least 1".into(),
            ));
        }
        let replay_timeout_ms = self
            .replay_timeout_ms
            .or(file.replay_timeout_ms)
            .unwrap_or(2000);
        if replay_timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "--replay-timeout-ms: must be at least 1".into(),
            ));
        }
        let seq_base = self.seq_base.or(file.seq_base);
        if seq_base == Some(0) {
            return Err(ConfigError::Invalid(
                "--seq-base: sequence numbers start at 1 (0 is never sent)".into(),
            ));
        }
        Ok(ServeConfig {
            ranks,
            topic: self.topic.clone().or(file.topic).unwrap_or_default(),
            grpc,
            shm,
            ring_size,
            seq_base,
            split_threshold,
            profile: match self.profile.or(file.profile) {
                Some(ProfileArg::All) => Profile::All,
                _ => Profile::Smg,
            },
            dp_mode: self.dp_mode.or(file.dp_mode).unwrap_or_default(),
            send_dp_rank: self.send_dp_rank || file.send_dp_rank.unwrap_or(false),
            max_subscribers,
            replay_timeout: std::time::Duration::from_millis(replay_timeout_ms),
            shm_group_read: self.shm_group_read || file.shm_group_read.unwrap_or(false),
            metrics,
            log_format: self.log_format.or(file.log_format).unwrap_or_default(),
        })
    }
}

fn load_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.to_owned(),
        message: e.message().to_string(),
    })
}

fn build_ranks(
    zmq: &[String],
    zmq_bind: &[String],
    replay: &[String],
) -> Result<Vec<RankEndpoint>, ConfigError> {
    if zmq.is_empty() && zmq_bind.is_empty() {
        return Err(ConfigError::Invalid(
            "no engine endpoint: pass --zmq ENDPOINT (engine binds, the default tcp://*:5557) or --zmq-bind ENDPOINT".into(),
        ));
    }
    let total = zmq.len() + zmq_bind.len();
    if replay.len() > total {
        return Err(ConfigError::Invalid(format!(
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
        let endpoint = validate_endpoint(ep, !bind)
            .map_err(|e| ConfigError::Invalid(format!("{flag} {ep:?}: {e}")))?;
        let replay = match replay.get(i) {
            Some(r) => Some(
                validate_endpoint(r, true)
                    .map_err(|e| ConfigError::Invalid(format!("--replay {r:?}: {e}")))?,
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
    // engine-wire.md §2.2: replay = PUB + 1 collides with rank 1's PUB port.
    for a in &ranks {
        for b in &ranks {
            if a.rank != b.rank && a.endpoint == b.endpoint {
                return Err(ConfigError::Invalid(format!(
                    "rank {} and rank {} use the same endpoint {}",
                    a.rank, b.rank, a.endpoint
                )));
            }
            if let Some(r) = &b.replay {
                if *r == a.endpoint {
                    return Err(ConfigError::Invalid(format!(
                        "rank {}'s replay endpoint {r} is rank {}'s event endpoint (the engine's replay port collides with the next rank's PUB port)",
                        b.rank, a.rank
                    )));
                }
            }
        }
    }
    Ok(ranks)
}

/// Checks an endpoint's shape and, for a connecting socket, rewrites wildcard hosts to loopback
/// (ZMQ cannot connect to a wildcard; engine-wire.md §2.1).
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
    use super::*;

    fn args(zmq: &[&str]) -> ServeArgs {
        ServeArgs {
            zmq: zmq.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
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
        assert_eq!(c.shm, PathBuf::from("/dev/shm/kvbridge-50061"));
        assert_eq!(c.ring_size, 64 << 20);
        assert_eq!(c.ranks.len(), 2);
        assert_eq!(c.ranks[1].rank, 1);
        assert_eq!(c.topic, "");
    }

    #[test]
    fn rejects_bad_values_with_the_flag_named() {
        let mut a = args(&["tcp://*:5557"]);
        a.ring_size = Some("512KiB".into());
        assert!(a.resolve().unwrap_err().to_string().contains("--ring-size"));
        let mut a = args(&["tcp://*:5557"]);
        a.grpc = Some("nope".into());
        assert!(a.resolve().unwrap_err().to_string().contains("--grpc"));
        assert!(args(&[])
            .resolve()
            .unwrap_err()
            .to_string()
            .contains("no engine endpoint"));
        let mut a = args(&["tcp://*:5557", "tcp://*:5558"]);
        a.replay = vec!["tcp://*:5558".into()];
        assert!(a.resolve().unwrap_err().to_string().contains("collides"));
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
        a.grpc = Some("127.0.0.1:7001".into());
        assert_eq!(a.resolve().unwrap().grpc.port(), 7001);
        std::fs::write(&p, "bogus-key = 1\n").unwrap();
        assert!(a.resolve().unwrap_err().to_string().contains("bogus-key"));
    }
}
