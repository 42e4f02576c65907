//! `kvbridge subscribe --nats URL --worker ID`: one worker's stream read back from JetStream,
//! printed as the same JSON lines as the gRPC subscriber prints.
//!
//! An ordered consumer (ephemeral, flow-controlled, recreated by the client after a server
//! failover) walks the subject `<prefix>.<worker>.<merged|rank>`. `--from S` prints the batches
//! after kvbridge sequence `S`, as over gRPC; the stream is read from its start for that (a
//! consumer keeping its own position would rather keep the JetStream sequence it last handled).
//! A message repeating a (ring, sequence) already printed is skipped.

use futures_util::StreamExt;

use super::{BatchPrinter, CliError};
use crate::sink::NatsConfig;
use crate::sink::{HEADER_RING_ID, HEADER_SEQ};

/// The NATS side of `kvbridge subscribe`.
#[derive(clap::Args, Debug)]
pub(super) struct NatsSubscribeArgs {
    /// NATS server URLs, comma-separated: read from JetStream instead of gRPC (needs --worker).
    #[arg(long, value_name = "URL[,URL…]", requires = "worker")]
    pub(super) nats: Option<String>,
    /// With --nats: the bridge's worker id (its `--nats-worker-id`).
    #[arg(long, value_name = "ID")]
    worker: Option<String>,
    /// With --nats: the stream.
    #[arg(long, value_name = "NAME", default_value = crate::sink::DEFAULT_NATS_STREAM)]
    nats_stream: String,
    /// With --nats: the subject prefix.
    #[arg(long, value_name = "PREFIX", default_value = crate::sink::DEFAULT_NATS_SUBJECT_PREFIX)]
    nats_subject_prefix: String,
    /// With --nats: credentials file.
    #[arg(long, value_name = "FILE")]
    nats_creds: Option<std::path::PathBuf>,
    /// With --nats: PEM CA for the servers' TLS certificates.
    #[arg(long, value_name = "FILE")]
    nats_tls_ca: Option<std::path::PathBuf>,
}

pub(super) async fn run(
    a: &NatsSubscribeArgs,
    from: u64,
    count: Option<u64>,
    rank: Option<u32>,
) -> Result<(), CliError> {
    use async_nats::jetstream::consumer::{pull, DeliverPolicy};
    let urls = a.nats.clone().unwrap_or_default();
    let worker = a.worker.clone().unwrap_or_default();
    if !crate::sink::is_subject_token(&worker) {
        return Err(CliError::Setup(format!(
            "--worker {worker:?}: letters, digits, '-' and '_' only"
        )));
    }
    let cfg = NatsConfig {
        urls: urls.split(',').map(|u| u.trim().to_string()).collect(),
        subject_prefix: a.nats_subject_prefix.clone(),
        stream: a.nats_stream.clone(),
        replicas: 1,
        max_age: crate::sink::DEFAULT_NATS_MAX_AGE,
        worker_id: Some(worker.clone()),
        creds: a.nats_creds.clone(),
        tls_ca: a.nats_tls_ca.clone(),
        required: true,
    };
    let client = crate::sink::connect(&cfg, "kvbridge subscribe")
        .await
        .map_err(|e| CliError::Setup(e.to_string()))?;
    let js = async_nats::jetstream::new(client);
    let stream = js
        .get_stream(&cfg.stream)
        .await
        .map_err(|e| CliError::Setup(format!("--nats-stream {}: {e}", cfg.stream)))?;
    let tail = rank.map_or_else(|| "merged".to_string(), |r| r.to_string());
    let subject = format!("{}.{worker}.{tail}", cfg.subject_prefix);
    let consumer = stream
        .create_consumer(pull::OrderedConfig {
            filter_subject: subject.clone(),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .map_err(|e| CliError::Setup(format!("{subject}: cannot create a consumer: {e}")))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| CliError::Setup(format!("{subject}: {e}")))?;
    let printer = BatchPrinter::new();
    let stdout = std::io::stdout();
    let mut seen = 0u64;
    // (ring id, sequence) of the last batch printed.
    let mut last: Option<(String, u64)> = None;
    while count.is_none_or(|c| seen < c) {
        let m = match messages.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(CliError::Failed(format!("{subject}: {e}"))),
            None => return Err(CliError::Failed(format!("{subject}: consumer ended"))),
        };
        let h = |name: &str| {
            m.headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_string())
        };
        let seq: u64 = h(HEADER_SEQ).and_then(|s| s.parse().ok()).unwrap_or(0);
        let ring = h(HEADER_RING_ID).unwrap_or_default();
        match &last {
            None if seq <= from => continue,
            Some((r, s)) if *r == ring && seq <= *s => continue, // already printed
            _ => {}
        }
        let line = printer.to_json(&m.payload).map_err(CliError::Failed)?;
        use std::io::Write;
        let mut out = stdout.lock();
        if writeln!(out, "{line}").and_then(|_| out.flush()).is_err() {
            return Ok(());
        }
        last = Some((ring, seq));
        seen += 1;
    }
    Ok(())
}
