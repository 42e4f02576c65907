use std::io;
use std::path::PathBuf;

/// Everything that can go wrong opening or writing a ring.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("ring file {path} does not exist")]
    NotFound { path: PathBuf },
    #[error("no permission to open {path} (file mode is 0600 unless the writer sets group_read)")]
    PermissionDenied { path: PathBuf },
    #[error("{path} is not a kvbridge ring (magic {found:#018x})")]
    BadMagic { path: PathBuf, found: u64 },
    #[error("{path} has ring layout version {found}, this build reads version {expected}")]
    BadVersion {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error("{path} is too small: {len} bytes, its header needs at least {need}")]
    TooSmall { path: PathBuf, len: u64, need: u64 },
    #[error("{path} has an inconsistent header: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("no space to allocate {requested} bytes for {path} (is /dev/shm full?)")]
    NoSpace { path: PathBuf, requested: u64 },
    #[error("{path} is locked by another live writer (pid {pid})")]
    Locked { path: PathBuf, pid: u32 },
    #[error("record of {len} bytes exceeds the ring's maximum of {max}")]
    RecordTooLarge { len: usize, max: usize },
    #[error("invalid option: {0}")]
    InvalidOption(String),
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
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
    #[error("sequence {requested} is older than the retained window [{oldest}, {newest}]")]
    TooOld {
        requested: u64,
        oldest: u64,
        newest: u64,
    },
    #[error("sequence {requested} is ahead of newest {newest} + 1")]
    Future { requested: u64, newest: u64 },
}
