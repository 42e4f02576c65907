//! The NATS JetStream sink, validated into the sink's settings ([`NatsConfig`]).

use std::path::PathBuf;

use serde::Deserialize;

use super::values::parse_duration;
use super::{invalid, ConfigError, Merge};
use crate::sink::{
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

impl NatsArgs {
    pub(super) fn validate(self) -> Result<Option<NatsConfig>, ConfigError> {
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
        let urls = server_urls(&urls)?;
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

/// `--nats`: comma-separated `nats://` or `tls://` URLs (a bare `host:port` too), at least one.
fn server_urls(text: &str) -> Result<Vec<String>, ConfigError> {
    let urls: Vec<String> = text
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
    Ok(urls)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::tests::flags;

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
}
