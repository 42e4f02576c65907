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
//!
//! The settings are this module's too: [`SecurityConfig`], what `--tls-cert`, `--tls-key` and
//! `--auth-token-file` (or [`AUTH_TOKEN_ENV`]) resolve to, read and checked by the functions that
//! also re-read them ([`read_tls_files`], [`read_token`], [`read_pem`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use thiserror::Error;

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

/// Environment variable holding the gRPC bearer token (alternative to `--auth-token-file`).
pub const AUTH_TOKEN_ENV: &str = "KVBRIDGE_AUTH_TOKEN";

/// A secret that cannot be read or is not usable; the message names the flag and the file.
#[derive(Debug, Error)]
pub enum SecretError {
    /// The file could not be read.
    #[error("{flag} {}: {source}", path.display())]
    Read {
        /// The flag that names the file.
        flag: &'static str,
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file holds no PEM block of the expected kind.
    #[error("{flag} {}: not a PEM file (no {marker:?} block)", path.display())]
    NotPem {
        /// The flag that names the file.
        flag: &'static str,
        /// File.
        path: PathBuf,
        /// The PEM label looked for.
        marker: &'static str,
    },
    /// [`AUTH_TOKEN_ENV`] is set but not Unicode.
    #[error("{AUTH_TOKEN_ENV}: {0}")]
    Env(std::env::VarError),
    /// The token is empty.
    #[error("{from}: the token is empty")]
    EmptyToken {
        /// Where the token came from.
        from: String,
    },
    /// The token is not one line of printable ASCII.
    #[error("{from}: the token must be one line of printable ASCII without spaces")]
    BadToken {
        /// Where the token came from.
        from: String,
    },
}

/// The validated TLS and token settings of the gRPC edge, with the secrets already read.
#[derive(Clone, Debug, Default)]
pub struct SecurityConfig {
    /// TLS certificate chain and key (PEM), read at validation time.
    pub tls: Option<TlsFiles>,
    /// Bearer token every `SubscribeKvEvents` call must carry, if set.
    pub auth_token: Option<String>,
    /// Where `tls` and `auth_token` were read from, to re-read them on SIGHUP or change.
    pub files: SecretFiles,
}

/// PEM contents of `--tls-cert` and `--tls-key`.
#[derive(Clone)]
pub struct TlsFiles {
    /// Certificate chain, PEM.
    pub cert: Vec<u8>,
    /// Private key, PEM.
    pub key: Vec<u8>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TlsFiles({} cert bytes, key redacted)", self.cert.len())
    }
}

/// The files the secrets come from (`--tls-cert`/`--tls-key`, `--auth-token-file`): kept so
/// that a running bridge can re-read them when they rotate (see [`watch`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SecretFiles {
    /// Certificate chain and private key.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Bearer token (a token from the environment is not reloadable).
    pub token: Option<PathBuf>,
}

impl SecretFiles {
    /// Reads the certificate chain and key again, checked as at start-up.
    pub fn read_tls(&self) -> Option<Result<TlsFiles, SecretError>> {
        self.tls.as_ref().map(|(c, k)| read_tls_files(c, k))
    }

    /// Reads the token file again, checked as at start-up.
    pub fn read_token(&self) -> Option<Result<String, SecretError>> {
        let p = self.token.as_deref()?;
        Some(read_token(Some(p)).map(|t| t.expect("a token file yields a token or an error")))
    }
}

/// Reads `--tls-cert` and `--tls-key`, each checked to hold its PEM block.
pub fn read_tls_files(cert: &Path, key: &Path) -> Result<TlsFiles, SecretError> {
    Ok(TlsFiles {
        cert: read_pem("--tls-cert", cert, "CERTIFICATE")?,
        key: read_pem("--tls-key", key, "PRIVATE KEY")?,
    })
}

/// Reads the PEM file `path` given with `flag`, checked to hold a `marker` block.
pub fn read_pem(
    flag: &'static str,
    path: &Path,
    marker: &'static str,
) -> Result<Vec<u8>, SecretError> {
    let bytes = std::fs::read(path).map_err(|source| SecretError::Read {
        flag,
        path: path.to_owned(),
        source,
    })?;
    if !String::from_utf8_lossy(&bytes).contains(marker) {
        return Err(SecretError::NotPem {
            flag,
            path: path.to_owned(),
            marker,
        });
    }
    Ok(bytes)
}

/// The bearer token from `file` (`--auth-token-file`), else from [`AUTH_TOKEN_ENV`]; `None` when
/// neither is set.
pub fn read_token(file: Option<&Path>) -> Result<Option<String>, SecretError> {
    let (text, from) = match file {
        Some(p) => (
            std::fs::read_to_string(p).map_err(|source| SecretError::Read {
                flag: "--auth-token-file",
                path: p.to_owned(),
                source,
            })?,
            format!("--auth-token-file {}", p.display()),
        ),
        None => match std::env::var(AUTH_TOKEN_ENV) {
            Ok(v) => (v, AUTH_TOKEN_ENV.to_string()),
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(e) => return Err(SecretError::Env(e)),
        },
    };
    let token = text.trim();
    if token.is_empty() {
        return Err(SecretError::EmptyToken { from });
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(SecretError::BadToken { from });
    }
    Ok(Some(token.to_string()))
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
