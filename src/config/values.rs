//! How values are written, shared by every concern: byte sizes, durations, socket addresses and
//! ZMQ endpoints, each parsed into a message that the caller prefixes with the flag or key.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use super::{invalid, ConfigError};

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
    pub(super) fn bytes(&self, name: &str) -> Result<u64, ConfigError> {
        match self {
            ByteSize::Bytes(n) => Ok(*n),
            ByteSize::Flag(s) => parse_size(s).map_err(|e| invalid(format!("--{name} {s:?}: {e}"))),
            ByteSize::Text(s) => parse_size(s).map_err(|e| invalid(format!("{name}: {e}"))),
        }
    }
}

/// A duration's number and unit (`"2ms"` → 2, `"ms"`); `examples` goes in the error.
fn number_and_unit<'a>(s: &'a str, examples: &str) -> Result<(u64, &'a str), String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n = num
        .parse()
        .map_err(|_| format!("not a duration: {s:?} (try {examples})"))?;
    Ok((n, unit.trim()))
}

/// `90s`, `30m`, `1h`, `2d` (or a bare number of seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = number_and_unit(s, "1h, 30m or 90s")?;
    let mult = match unit {
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

/// A short duration: `0`, or a whole number with `us`, `ms` or `s` (`500us`, `2ms`, `1s`), at
/// most `max`.
pub fn parse_short_duration(s: &str, max: Duration) -> Result<Duration, String> {
    let (n, unit) = number_and_unit(s, "0, 500us, 2ms or 1s")?;
    let d = match unit {
        "" if n == 0 => Duration::ZERO,
        "" => return Err(format!("{s:?}: give a unit (us, ms or s), e.g. {n}ms")),
        "us" | "µs" => Duration::from_micros(n),
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        u => return Err(format!("unknown unit {u:?} in {s:?} (use us, ms or s)")),
    };
    if d > max {
        return Err(format!("{s:?}: at most {max:?}"));
    }
    Ok(d)
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
    use super::*;

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
}
