//! Live TLS certificate and bearer token, re-read when they rotate, without a restart.
//!
//! Certificates and tokens are rotated by agents (cert-manager, vault agent) that rewrite the
//! files in place or, in Kubernetes, swap a symlinked directory. [`Secrets`] holds the current
//! TLS acceptor and token in [`ArcSwap`]s: every accepted connection takes the acceptor current
//! at that moment, every `SubscribeKvEvents` call compares against the token current at that
//! moment, and nothing else holds them, so a swap never touches a connection or stream that is
//! already open (their TLS session keys are their own; the token is checked once, when a stream
//! opens).
//!
//! [`watch`] re-reads the files on `SIGHUP` and when they change. Change detection is a stat of
//! each file once a second (modification time, size, inode, following symlinks), not inotify:
//! the Kubernetes secret-volume update replaces a symlink two levels up, which a watch on the
//! file itself does not see, and three `stat` calls a second cost nothing measurable. A file that
//! does not parse, or a certificate that does not match its key (as happens for a moment when
//! an agent writes the two files one after the other), is logged and the secret in use is kept;
//! the next change is tried again.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;

use crate::config::SecretFiles;
use crate::net::Tls;

/// How often the files are checked for a change.
pub const POLL_EVERY: Duration = Duration::from_secs(1);

/// The TLS acceptor and bearer token in use, swappable while serving.
pub struct Secrets {
    tls: Option<ArcSwap<Tls>>,
    token: Option<ArcSwap<String>>,
}

impl Secrets {
    /// Secrets with these starting values (`None`: plaintext / no token, for the whole run).
    pub fn new(tls: Option<Tls>, token: Option<String>) -> Self {
        Secrets {
            tls: tls.map(ArcSwap::from_pointee),
            token: token.map(ArcSwap::from_pointee),
        }
    }

    /// The acceptor for a connection accepted now.
    pub fn tls(&self) -> Option<Arc<Tls>> {
        self.tls.as_ref().map(ArcSwap::load_full)
    }

    /// Runs `f` on the token in use (`None`: no token required).
    pub fn with_token<R>(&self, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        match &self.token {
            Some(t) => f(Some(t.load().as_bytes())),
            None => f(None),
        }
    }

    /// Re-reads whichever of `files` is configured; what fails to load is logged and kept.
    /// Returns how many secrets were replaced.
    pub fn reload(&self, files: &SecretFiles, why: &str) -> usize {
        let mut replaced = 0;
        if let (Some(slot), Some(read)) = (&self.tls, files.read_tls()) {
            match read
                .map_err(|e| e.to_string())
                .and_then(|f| Tls::from_pem(&f.cert, &f.key))
            {
                Ok(tls) => {
                    slot.store(Arc::new(tls));
                    replaced += 1;
                    tracing::info!(why, "TLS certificate reloaded; new connections use it");
                }
                Err(e) => tracing::error!(why, error = %e,
                    "cannot reload the TLS certificate; still serving the previous one"),
            }
        }
        if let (Some(slot), Some(read)) = (&self.token, files.read_token()) {
            match read {
                Ok(t) => {
                    slot.store(Arc::new(t));
                    replaced += 1;
                    tracing::info!(why, "bearer token reloaded; new streams must send it");
                }
                Err(e) => tracing::error!(why, error = %e,
                    "cannot reload the bearer token; still accepting the previous one"),
            }
        }
        replaced
    }
}

/// What identifies one version of a file (following symlinks); `None` while it is missing.
type Stamp = Option<(SystemTime, u64, u64, u64)>;

fn stamp(p: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino(), m.dev()))
}

fn stamps(paths: &[PathBuf]) -> Vec<Stamp> {
    paths.iter().map(|p| stamp(p)).collect()
}

/// Reloads `secrets` from `files` on every `SIGHUP` and whenever one of the files changes,
/// until dropped. Without files to watch it still takes `SIGHUP` (so the signal never kills the
/// bridge) and only logs that there is nothing to reload.
pub async fn watch(secrets: Arc<Secrets>, files: SecretFiles) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot catch SIGHUP; secrets reload on file change only");
            None
        }
    };
    let paths: Vec<PathBuf> = files
        .tls
        .iter()
        .flat_map(|(c, k)| [c.clone(), k.clone()])
        .chain(files.token.clone())
        .collect();
    if hup.is_none() && paths.is_empty() {
        return;
    }
    let mut seen = stamps(&paths);
    let mut tick = tokio::time::interval(POLL_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let why = tokio::select! {
            Some(()) = async { match &mut hup { Some(h) => h.recv().await, None => None } } => "SIGHUP",
            _ = tick.tick(), if !paths.is_empty() => {
                let now = stamps(&paths);
                if now == seen {
                    continue;
                }
                seen = now;
                "file changed"
            }
            else => return,
        };
        if paths.is_empty() {
            tracing::info!(
                why,
                "SIGHUP: no --tls-cert/--tls-key or --auth-token-file to reload"
            );
            continue;
        }
        if why == "SIGHUP" {
            seen = stamps(&paths);
        }
        secrets.reload(&files, why);
    }
}
