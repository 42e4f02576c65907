//! The engine's enumerated strings as SMG's enums: `medium` → `KvCacheTier`, `locality` →
//! `KvCacheLocality`. The parser stores them in the scratch, the filter profile decides on them,
//! the encoder writes them; they sit apart from all three so that none imports another for them.

/// `KvCacheTier`, from the engine's `medium` (engine-wire §9). `cache_level` = tier − 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum Tier {
    Device = 1,
    Host = 2,
    Disk = 3,
    External = 4,
}

impl Tier {
    /// GPU → DEVICE, CPU/CPU_PINNED → HOST, DISK/FS/STORAGE → DISK, OBJ/EXTERNAL → EXTERNAL
    /// (case-insensitive); anything else → unset.
    #[inline]
    pub(crate) fn from_medium(medium: &[u8]) -> Option<Tier> {
        let eq = |s: &str| medium.eq_ignore_ascii_case(s.as_bytes());
        if eq("GPU") {
            Some(Tier::Device)
        } else if eq("CPU") || eq("CPU_PINNED") {
            Some(Tier::Host)
        } else if eq("DISK") || eq("FS") || eq("STORAGE") {
            Some(Tier::Disk)
        } else if eq("OBJ") || eq("EXTERNAL") {
            Some(Tier::External)
        } else {
            None
        }
    }

    /// The `KvCacheTier` enum value.
    #[inline]
    pub(crate) fn value(self) -> i32 {
        self as i32
    }

    /// `cache_level` (of each block, and of a removal): tier − 1.
    #[inline]
    pub(crate) fn cache_level(self) -> i32 {
        self as i32 - 1
    }
}

/// `KvCacheLocality`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum Locality {
    Local = 1,
    Remote = 2,
}

impl Locality {
    /// LOCAL / REMOTE, case-insensitive; anything else → unset (counted by the caller).
    #[inline]
    pub(crate) fn parse(s: &[u8]) -> Option<Locality> {
        if s.eq_ignore_ascii_case(b"LOCAL") {
            Some(Locality::Local)
        } else if s.eq_ignore_ascii_case(b"REMOTE") {
            Some(Locality::Remote)
        } else {
            None
        }
    }

    /// The `KvCacheLocality` enum value.
    #[inline]
    pub(crate) fn value(self) -> i32 {
        self as i32
    }
}
