//! gRPC streaming: the listener, what is streamed, and how many may subscribe, validated into
//! the gRPC edge's settings ([`FanoutConfig`]).

use std::time::Duration;

use serde::Deserialize;

use super::values::{parse_addr, parse_short_duration};
use super::{invalid, ConfigError, Merge};
use crate::decode::Profile;
use crate::fanout::{
    DpMode, FanoutConfig, DEFAULT_FANOUT_LINGER, DEFAULT_GRPC, DEFAULT_HANDSHAKE_TIMEOUT_MS,
    DEFAULT_MAX_STREAMS_PER_CONNECTION, DEFAULT_MAX_SUBSCRIBERS, MAX_FANOUT_LINGER,
    MAX_HANDSHAKE_TIMEOUT_MS,
};

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
        /// A stream whose next record is not there yet waits at most this long for more
        /// before writing what it has, as one write (`0`, `500us`, `2ms`; at most 1s): fewer
        /// writes and less CPU per delivered batch for up to this much added latency.
        #[arg(long, value_name = "DURATION")]
        pub fanout_linger: Option<String>,
    }
}

impl StreamingArgs {
    pub(super) fn validate(self) -> Result<FanoutConfig, ConfigError> {
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
        let linger = match &self.fanout_linger {
            Some(t) => parse_short_duration(t, MAX_FANOUT_LINGER)
                .map_err(|e| invalid(format!("--fanout-linger: {e}")))?,
            None => DEFAULT_FANOUT_LINGER,
        };
        Ok(FanoutConfig {
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
            linger,
        })
    }
}
