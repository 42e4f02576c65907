//! `kvbridge subscribe`: a gRPC subscriber that prints each batch as canonical JSON.

use prost::Message;

use super::{BatchPrinter, CliError};
use crate::proto::common::{KvEventBatch, SubscribeKvEventsRequest};

/// `kvbridge subscribe` flags.
#[derive(clap::Args, Debug)]
pub struct SubscribeArgs {
    /// Bridge address (`HOST:PORT` or `http://HOST:PORT`).
    #[arg(long, default_value = crate::fanout::DEFAULT_GRPC)]
    grpc: String,
    /// Resume cursor S: 0 = everything retained then live; S > 0 = batches after S.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Stop after this many batches (default: run until the stream ends).
    #[arg(long)]
    count: Option<u64>,
    /// Which engine's service path to call (all are served identically).
    #[arg(long, default_value = "vllm", value_parser = engine_names())]
    engine: String,
    /// Select one rank's stream (`kvbridge-dp-rank` metadata; needs `serve --dp-mode metadata`).
    #[arg(long)]
    rank: Option<u32>,
    /// Trust this PEM CA (or self-signed certificate) and connect with TLS.
    #[arg(long = "tls-ca", value_name = "FILE")]
    tls_ca: Option<std::path::PathBuf>,
    /// Server name to verify with TLS (default: the host in --grpc).
    #[arg(long = "tls-domain", value_name = "NAME")]
    tls_domain: Option<String>,
    /// Bearer token file for a bridge started with a token (or env `KVBRIDGE_AUTH_TOKEN`).
    #[arg(long = "auth-token-file", value_name = "FILE")]
    auth_token_file: Option<std::path::PathBuf>,
    /// Read the stream back from NATS JetStream instead of gRPC (server URLs, comma-separated).
    #[command(flatten)]
    nats: super::subscribe_nats::NatsSubscribeArgs,
}

pub(super) fn run(a: SubscribeArgs) -> Result<(), CliError> {
    let rt = super::runtime()?;
    if a.nats.nats.is_some() {
        return rt.block_on(super::subscribe_nats::run(&a.nats, a.from, a.count, a.rank));
    }
    rt.block_on(async move {
        let scheme = if a.tls_ca.is_some() { "https" } else { "http" };
        let uri = if a.grpc.contains("://") {
            a.grpc.clone()
        } else {
            format!("{scheme}://{}", a.grpc)
        };
        let mut endpoint = tonic::transport::Endpoint::from_shared(uri.clone())
            .map_err(|e| CliError::Setup(format!("--grpc {:?}: {e}", a.grpc)))?
            .connect_timeout(std::time::Duration::from_secs(5));
        if let Some(ca) = &a.tls_ca {
            let pem = std::fs::read(ca)
                .map_err(|e| CliError::Setup(format!("--tls-ca {}: {e}", ca.display())))?;
            let mut tls = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(pem));
            if let Some(d) = &a.tls_domain {
                tls = tls.domain_name(d.clone());
            }
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| CliError::Setup(format!("--tls-ca {}: {e}", ca.display())))?;
        }
        let token = match &a.auth_token_file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .map_err(|e| {
                        CliError::Setup(format!("--auth-token-file {}: {e}", f.display()))
                    })?
                    .trim()
                    .to_string(),
            ),
            None => std::env::var(crate::secrets::AUTH_TOKEN_ENV)
                .ok()
                .map(|t| t.trim().to_string()),
        };
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| CliError::Setup(format!("--grpc {uri}: cannot connect: {e}")))?;
        let mut req = tonic::Request::new(SubscribeKvEventsRequest {
            start_sequence_number: a.from,
            load_records_before_first_batch: false,
        });
        if let Some(t) = token.filter(|t| !t.is_empty()) {
            let v = format!("Bearer {t}").parse().map_err(|_| {
                CliError::Setup("the auth token is not a valid header value".into())
            })?;
            req.metadata_mut().insert("authorization", v);
        }
        if let Some(r) = a.rank {
            req.metadata_mut().insert(
                crate::fanout::DP_RANK_HEADER,
                r.to_string().parse().expect("digits are valid metadata"),
            );
        }
        let service = crate::proto::engine_service(&a.engine).expect("clap checked --engine");
        let path = http::uri::PathAndQuery::from_static(service.path);
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready()
            .await
            .map_err(|e| CliError::Setup(format!("--grpc {uri}: {e}")))?;
        let codec = tonic_prost::ProstCodec::<SubscribeKvEventsRequest, KvEventBatch>::default();
        let resp = grpc.server_streaming(req, path, codec).await;
        let mut stream = resp.map_err(status_error)?.into_inner();
        let printer = BatchPrinter::new();
        let mut seen = 0u64;
        use std::io::Write;
        let stdout = std::io::stdout();
        while a.count.is_none_or(|c| seen < c) {
            match stream.message().await {
                Ok(Some(batch)) => {
                    let line = printer
                        .to_json(&batch.encode_to_vec())
                        .map_err(CliError::Failed)?;
                    let mut out = stdout.lock();
                    if writeln!(out, "{line}").and_then(|_| out.flush()).is_err() {
                        return Ok(()); // stdout closed (e.g. piped into head)
                    }
                    seen += 1;
                }
                Ok(None) => return Err(CliError::Failed("stream ended by the server".into())),
                Err(s) => return Err(status_error(s)),
            }
        }
        Ok(())
    })
}

/// `--engine` accepts the short names of [`crate::proto::ENGINE_SERVICES`].
fn engine_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(crate::proto::ENGINE_SERVICES.map(|s| s.engine))
}

fn status_error(s: tonic::Status) -> CliError {
    CliError::Failed(format!("status {:?}: {}", s.code(), s.message()))
}
