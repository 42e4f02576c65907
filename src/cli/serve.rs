//! `kvbridge serve`: the flags resolved, the signals caught and the ready file written around
//! the service ([`crate::service`], which starts and stops everything).

use super::CliError;
use crate::config::ServeArgs;
use crate::service::{run_service, Service};

pub(super) fn run(args: ServeArgs) -> Result<(), CliError> {
    let cfg = args.resolve().map_err(|e| CliError::Setup(e.to_string()))?;
    super::init_tracing(cfg.ops.log_format);
    let rt = super::runtime()?;
    rt.block_on(async move {
        // Before anything starts: a SIGTERM during start-up still means a clean stop.
        let mut stop = StopSignals::install()?;
        // One left by an earlier run must not pass for this one's.
        if let Some(path) = &cfg.ops.ready_file {
            remove_ready_file(path);
        }
        let handle = run_service(&cfg).await?;
        let ready = match &cfg.ops.ready_file {
            Some(path) => match write_ready_file(path, &handle) {
                Ok(()) => Some(path.clone()),
                Err(e) => {
                    handle.shutdown().await;
                    return Err(CliError::Setup(format!(
                        "--ready-file {}: {e}",
                        path.display()
                    )));
                }
            },
            None => None,
        };
        let mut fatal = handle.failure();
        let failed = tokio::select! {
            _ = stop.recv() => None,
            f = fatal.wait_for(Option::is_some) => Some(match f {
                Ok(f) => f.clone().unwrap_or_default(),
                Err(_) => "the ring heartbeat thread ended unexpectedly".to_string(),
            }),
        };
        match &failed {
            None => {
                tracing::info!("shutting down: stopping ingest, ending streams, releasing the ring")
            }
            Some(why) => tracing::error!("shutting down after a fatal ring error: {why}"),
        }
        // Not ready any more from the moment shutting down begins.
        if let Some(path) = &ready {
            remove_ready_file(path);
        }
        handle.shutdown().await;
        match failed {
            None => Ok(()),
            Some(why) => Err(CliError::Failed(why)),
        }
    })
}

/// Writes `--ready-file`: the addresses as bound, as one JSON object, through a temporary file
/// in the same directory renamed over `path`, so that a reader sees the whole file or none.
fn write_ready_file(path: &std::path::Path, h: &Service) -> std::io::Result<()> {
    let publish_zmq: Vec<serde_json::Value> = h
        .publish_zmq
        .iter()
        .map(|b| {
            serde_json::json!({ "rank": b.rank, "publish": b.publish, "replay": b.replay,
                "snapshot": b.snapshot })
        })
        .collect();
    let text = serde_json::json!({
        "pid": std::process::id(),
        "grpc": h.grpc_addr.to_string(),
        "metrics": h.metrics_addr.map(|a| a.to_string()),
        "publish_zmq": publish_zmq,
    })
    .to_string();
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    let written = std::fs::write(&tmp, text + "\n").and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Removes `--ready-file` (nothing to do when it is not there).
fn remove_ready_file(path: &std::path::Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove the ready file")
        }
    }
}

/// SIGTERM and SIGINT (Ctrl-C), caught from the moment they are installed.
pub struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs the handlers (needs a running tokio runtime).
    pub fn install() -> Result<Self, CliError> {
        use tokio::signal::unix::{signal, SignalKind};
        let install = |kind| {
            signal(kind)
                .map_err(|e| CliError::Setup(format!("cannot install a signal handler: {e}")))
        };
        Ok(StopSignals {
            term: install(SignalKind::terminate())?,
            int: install(SignalKind::interrupt())?,
        })
    }

    /// Waits for either signal.
    pub async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}
