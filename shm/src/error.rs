use std::io;
use std::path::PathBuf;

/// Everything that can go wrong opening or writing a ring. Every variant names the file (or
/// the sizes) involved, so its message is a complete one-line diagnosis.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// The ring file does not exist.
    #[error("ring file {path} does not exist")]
    NotFound {
        /// Ring file.
        path: PathBuf,
    },
    /// The file exists but this process may not open it.
    #[error("no permission to open {path} (file mode is 0600 unless the writer sets group_read)")]
    PermissionDenied {
        /// Ring file.
        path: PathBuf,
    },
    /// The file does not start with the ring magic.
    #[error("{path} is not a kvbridge ring (magic {found:#018x})")]
    BadMagic {
        /// Ring file.
        path: PathBuf,
        /// The first eight bytes, little-endian.
        found: u64,
    },
    /// The ring was written by an incompatible layout version.
    #[error("{path} has ring layout version {found}, this build reads version {expected}")]
    BadVersion {
        /// Ring file.
        path: PathBuf,
        /// Version in the file.
        found: u32,
        /// Version this build implements.
        expected: u32,
    },
    /// The file is shorter than its header says it must be.
    #[error("{path} is too small: {len} bytes, its header needs at least {need}")]
    TooSmall {
        /// Ring file.
        path: PathBuf,
        /// Actual length.
        len: u64,
        /// Length the header requires.
        need: u64,
    },
    /// Header fields contradict each other.
    #[error("{path} has an inconsistent header: {reason}")]
    Corrupt {
        /// Ring file.
        path: PathBuf,
        /// Which check failed.
        reason: String,
    },
    /// The file system has no room for the ring.
    #[error("no space to allocate {requested} bytes for {path} (is /dev/shm full?)")]
    NoSpace {
        /// Ring file.
        path: PathBuf,
        /// Bytes requested (0 when unknown).
        requested: u64,
    },
    /// Another live process holds the writer lock.
    #[error("{path} is locked by another live writer (pid {pid})")]
    Locked {
        /// Ring file.
        path: PathBuf,
        /// The other writer's pid, as recorded in the header.
        pid: u32,
    },
    /// The ring file shrank while this writer had it mapped (someone truncated it). The writer
    /// has stopped touching the mapping: touching a page past the new end would be `SIGBUS`.
    #[error("ring file {path} was truncated to {len} bytes under its writer (the layout needs {need}); writing stopped")]
    Truncated {
        /// Ring file.
        path: PathBuf,
        /// Its length now.
        len: u64,
        /// The length its layout needs.
        need: u64,
    },
    /// A record larger than a quarter of the ring.
    #[error("record of {len} bytes exceeds the ring's maximum of {max}")]
    RecordTooLarge {
        /// Requested payload length.
        len: usize,
        /// Largest payload this ring accepts.
        max: usize,
    },
    /// A writer option is out of range.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// Any other I/O error.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// Ring file.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
}

impl ShmError {
    pub(crate) fn io(path: &std::path::Path, e: io::Error) -> ShmError {
        let path = path.to_path_buf();
        match e.kind() {
            io::ErrorKind::NotFound => ShmError::NotFound { path },
            io::ErrorKind::PermissionDenied => ShmError::PermissionDenied { path },
            _ if e.raw_os_error() == Some(libc::ENOSPC) => ShmError::NoSpace { path, requested: 0 },
            _ => ShmError::Io { path, source: e },
        }
    }
}

/// Why a [`crate::RingReader::seek`] was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SeekError {
    /// The record was already overwritten.
    #[error("sequence {requested} is older than the retained window [{oldest}, {newest}]")]
    TooOld {
        /// Sequence asked for.
        requested: u64,
        /// Oldest retained (O).
        oldest: u64,
        /// Newest committed (N).
        newest: u64,
    },
    /// The record does not exist yet (beyond N + 1).
    #[error("sequence {requested} is ahead of newest {newest} + 1")]
    Future {
        /// Sequence asked for.
        requested: u64,
        /// Newest committed (N).
        newest: u64,
    },
}
