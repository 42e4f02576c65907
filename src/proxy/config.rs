//! The sidecar's settings: what `--engine-grpc`, `--engine-tls-ca`, `--load-interval-ms` and
//! `--sidecar-*` (or the TOML file) resolve to (docs/smg-api.md §2 "Proxy mode"), and their
//! defaults and limits. The sidecar owns them; `crate::config` only parses and validates the
//! flags into them.

use std::time::Duration;

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

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
