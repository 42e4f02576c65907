//! The engine-wire edge's settings: what `--publish-zmq`, `--publish-zmq-replay`,
//! `--publish-zmq-snapshot`, `--publish-zmq-topic`, `--publish-zmq-layout` and `--publish-zmq-hwm` (or the TOML file)
//! resolve to. The edge owns them; `crate::config` only parses and validates the flags into them.

use super::WireLayout;

/// `--publish-zmq` and its companions, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishZmqConfig {
    /// The PUB endpoint of rank 0; rank r binds port + r.
    pub publish: TcpEndpoint,
    /// The replay ROUTER endpoint of rank 0, if replay is served.
    pub replay: Option<TcpEndpoint>,
    /// The snapshot ROUTER endpoint of rank 0 (vLLM #57789's wire: 24-byte seq frames carrying
    /// the ring's identity, heartbeats, a snapshot service), if served.
    pub snapshot: Option<TcpEndpoint>,
    /// Topic frame; `None`: the engine's own topic (`--topic` / `--kv-events-config`).
    pub topic: Option<String>,
    /// Event encoding.
    pub layout: WireLayout,
    /// Send high-water mark of each PUB connection, in messages (`--publish-zmq-hwm`).
    pub hwm: u32,
}

/// Default `--publish-zmq-hwm`: messages queued per subscriber connection before the PUB drops
/// that subscriber's messages. The engines queue 100,000; kvbridge queues as many as the engines
/// keep for replay (their `buffer_steps`, 10,000), because a subscriber further behind than that
/// recovers by seq gap and replay from kvbridge's ring, and a subscriber that never reads then
/// makes kvbridge hold a tenth of what it would at the engine's mark.
pub const DEFAULT_PUB_HWM: u32 = 10_000;
/// Largest `--publish-zmq-hwm` (libzmq takes an `int`; the engines' own mark is 100,000).
pub const MAX_PUB_HWM: u32 = 10_000_000;

/// A `tcp://HOST:PORT` endpoint to bind (HOST may be `*`, an address or `[v6]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpEndpoint {
    /// Host part as given.
    pub host: String,
    /// Port of rank 0 (0: an ephemeral port for every rank).
    pub port: u16,
}

impl TcpEndpoint {
    /// Parses `tcp://HOST:PORT`; the error is one line naming `flag`.
    pub fn parse(flag: &str, s: &str) -> Result<TcpEndpoint, String> {
        let rest = s.strip_prefix("tcp://").ok_or_else(|| {
            format!(
                "--{flag} {s:?}: must be tcp://HOST:PORT (kvbridge binds it, rank r on PORT + r)"
            )
        })?;
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| format!("--{flag} {s:?}: no port (tcp://HOST:PORT)"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("--{flag} {s:?}: the port must be a number from 0 to 65535"))?;
        if host.is_empty() {
            return Err(format!(
                "--{flag} {s:?}: no host (use * or 0.0.0.0 for every interface)"
            ));
        }
        Ok(TcpEndpoint {
            host: host.to_string(),
            port,
        })
    }

    /// The endpoint rank `rank` binds (port 0 stays ephemeral).
    pub(super) fn for_rank(&self, rank: u32) -> String {
        if self.port == 0 {
            format!("tcp://{}:*", self.host)
        } else {
            format!("tcp://{}:{}", self.host, u32::from(self.port) + rank)
        }
    }
}

impl PublishZmqConfig {
    /// Checks the ports of `ranks` ranks: every one fits, and no rank's PUB port is another
    /// rank's replay port (the clash the engines' own PORT + 1 replay default invites).
    pub fn check_ranks(&self, ranks: u32) -> Result<(), String> {
        let last = ranks.saturating_sub(1);
        let fits = |flag: &str, e: &TcpEndpoint| {
            if e.port != 0 && u32::from(e.port) + last > 65535 {
                Err(format!(
                    "--{flag}: port {} + rank {last} is beyond 65535",
                    e.port
                ))
            } else {
                Ok(())
            }
        };
        let mut named = vec![("publish-zmq", &self.publish)];
        named.extend(self.replay.iter().map(|r| ("publish-zmq-replay", r)));
        named.extend(self.snapshot.iter().map(|r| ("publish-zmq-snapshot", r)));
        for (i, &(flag, e)) in named.iter().enumerate() {
            fits(flag, e)?;
            for &(other, o) in &named[..i] {
                let (p, q) = (u32::from(o.port), u32::from(e.port));
                if p != 0 && q != 0 && p.max(q) - p.min(q) < ranks && o.host == e.host {
                    return Err(format!(
                        "--{other} port {p} and --{flag} port {q}: with {ranks} rank(s) \
                         the ranges {p}..{} and {q}..{} overlap; keep them {ranks} or more apart",
                        p + last,
                        q + last
                    ));
                }
            }
        }
        Ok(())
    }
}
