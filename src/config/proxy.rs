//! Sidecar mode (docs/smg-api.md §2 "Proxy mode"), validated into the sidecar's settings
//! ([`ProxyConfig`]).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::values::ByteSize;
use super::{invalid, ConfigError, Merge};
use crate::proxy::{
    parse_engine_grpc, ProxyConfig, DEFAULT_LOAD_INTERVAL_MS, DEFAULT_SIDECAR_BUFFER,
    DEFAULT_SIDECAR_CONNECTION_BUFFER, DEFAULT_SIDECAR_STALL_TIMEOUT_MS, MAX_LOAD_INTERVAL_MS,
    MIN_SIDECAR_CONNECTION_BUFFER,
};

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

impl ProxyArgs {
    pub(super) fn validate(self) -> Result<Option<ProxyConfig>, ConfigError> {
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
            (Some(p), true) => Some(crate::secrets::read_pem("--engine-tls-ca", p, "CERTIFICATE")?),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::flags;
    use crate::proxy::PROXY_MAX_STREAMS_PER_CONNECTION;

    #[test]
    fn sidecar_flags_need_each_other() {
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
            ok.fanout.max_streams_per_connection,
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
            capped.fanout.max_streams_per_connection, 50,
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
}
