//! Operations: metrics, logs and health. These are the `kvbridge serve` command's own settings
//! ([`OpsConfig`]): it binds the Prometheus listener, installs the log format and hands the
//! health grace to the reporter.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::values::parse_addr;
use super::{invalid, ConfigError, Merge};

/// The default Prometheus port is the gRPC port plus this (minus it when that would pass 65535):
/// see [`default_metrics_addr`].
pub const METRICS_PORT_OFFSET: u16 = 1000;
/// Default health grace period (ms) after start-up and after the last upstream disconnect.
pub const DEFAULT_HEALTH_GRACE_MS: u64 = 10_000;
/// Longest health grace period accepted: a day (ms).
pub const MAX_HEALTH_GRACE_MS: u64 = 24 * 3600 * 1000;
/// The `--metrics` value that disables the Prometheus endpoint.
pub const METRICS_OFF: &str = "off";
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

/// The validated operations settings: what the `kvbridge serve` command itself sets up around
/// the components (the Prometheus listener, the log format, the health grace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpsConfig {
    /// Prometheus address, `None` when disabled.
    pub metrics: Option<SocketAddr>,
    /// Log format.
    pub log_format: LogFormat,
    /// Health grace period after start-up and after the last upstream disconnect.
    pub health_grace: Duration,
    /// `--ready-file`: written once start-up is done, removed on exit.
    pub ready_file: Option<PathBuf>,
}

impl OpsArgs {
    /// `grpc` decides the default metrics address.
    pub(super) fn validate(self, grpc: SocketAddr) -> Result<OpsConfig, ConfigError> {
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::config::tests::flags;

    #[test]
    fn metrics_default_follows_the_grpc_port() {
        let metrics = |extra: &[&str]| {
            let mut argv = vec!["--zmq", "tcp://*:5557"];
            argv.extend(extra);
            flags(&argv).resolve().unwrap().ops.metrics
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
        assert_eq!(
            c.ring.ring_path(40001),
            PathBuf::from("/dev/shm/kvbridge-40001")
        );
    }
}
