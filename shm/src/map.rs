//! Interpreting a mapped ring file: header validation and building a
//! [`Ring`] view over the mapping.
//!
//! The bounds and alignment checks of the mapping's accessors (`Base`) are
//! `assert!`s, not `debug_assert!`s: they run in every build, release
//! included, so an offset outside the mapping panics instead of reading
//! outside it.

use crate::error::ShmError;
use crate::layout::*;
use crate::protocol::Ring;
use std::marker::PhantomData;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Immutable facts from header line 0, validated against the file length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub ring_id: u64,
    pub cap: u64,
    pub slots: u64,
    pub index_off: u64,
    pub data_off: u64,
    pub max_payload: usize,
    pub file_len: u64,
}

/// Offsets and total length of a new file for `cap` data bytes.
pub(crate) fn geometry_for(cap: u64, ring_id: u64) -> Geometry {
    let slots = index_slots(cap);
    let index_off = HEADER_LEN;
    let data_off = align_up(index_off + slots * 8, 4096);
    Geometry {
        ring_id,
        cap,
        slots,
        index_off,
        data_off,
        max_payload: max_payload(cap),
        file_len: data_off + cap,
    }
}

/// A mapping base pointer plus its length. Every accessor checks bounds and
/// alignment with `assert!`, in every build (a check per access, cheap beside
/// the atomic it guards, and what keeps a bad offset from becoming a wild read
/// in release); every offset used is a constant inside the 4 KiB header or
/// derived from a validated [`Geometry`].
#[derive(Clone, Copy)]
pub(crate) struct Base<'a> {
    pub ptr: *const u8,
    pub len: usize,
    pub _m: PhantomData<&'a [u8]>,
}

impl<'a> Base<'a> {
    /// View of a mapping that lives at least as long as `'a`.
    pub(crate) fn new(m: &'a [u8]) -> Base<'a> {
        Base {
            ptr: m.as_ptr(),
            len: m.len(),
            _m: PhantomData,
        }
    }

    pub(crate) fn u64_at(self, off: usize) -> &'a AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.len);
        // SAFETY: in bounds and 8-aligned (mappings are page aligned, `off`
        // is a multiple of 8) as asserted; the mapping lives for `'a` (the
        // borrow `Base::new` was built from).
        // AtomicU64 has the same layout as u64. Atomic *loads* on a read-only
        // mapping are fine: std documents that lock-free loads of at most
        // pointer width never write (see "Atomic accesses to read-only
        // memory" in std::sync::atomic); readers never store.
        unsafe { &*(self.ptr.add(off) as *const AtomicU64) }
    }

    pub(crate) fn u32_at(self, off: usize) -> &'a AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.len);
        // SAFETY: as for `u64_at`, with 4-byte alignment and size.
        unsafe { &*(self.ptr.add(off) as *const AtomicU32) }
    }

    pub(crate) fn words(self, off: u64, bytes: u64) -> &'a [AtomicU64] {
        assert!(off % 8 == 0 && bytes % 8 == 0 && off + bytes <= self.len as u64);
        // SAFETY: the range is in bounds and 8-aligned (asserted); it is
        // shared memory that other processes mutate, which is exactly what an
        // atomic slice allows.
        unsafe {
            std::slice::from_raw_parts(
                self.ptr.add(off as usize) as *const AtomicU64,
                (bytes / 8) as usize,
            )
        }
    }

    pub(crate) fn ring(self, g: &Geometry) -> Ring<'a> {
        Ring {
            cap: g.cap,
            slots: g.slots,
            max_payload: g.max_payload,
            tail: self.u64_at(OFF_TAIL),
            newest: self.u64_at(OFF_NEWEST),
            intent: self.u64_at(OFF_INTENT),
            oldest: self.u64_at(OFF_OLDEST),
            head: self.u64_at(OFF_HEAD),
            index: self.words(g.index_off, g.slots * 8),
            data: self.words(g.data_off, g.cap),
        }
    }

    pub(crate) fn load(self, off: usize) -> u64 {
        self.u64_at(off).load(Ordering::Acquire)
    }

    pub(crate) fn load32(self, off: usize) -> u32 {
        self.u32_at(off).load(Ordering::Acquire)
    }
}

/// Validate header line 0 of a mapping of `len` bytes.
pub(crate) fn parse_header(path: &Path, b: Base<'_>) -> Result<Geometry, ShmError> {
    let len = b.len as u64;
    if len < HEADER_LEN {
        return Err(ShmError::TooSmall {
            path: path.into(),
            len,
            need: HEADER_LEN,
        });
    }
    let magic = b.load(OFF_MAGIC);
    if magic != MAGIC {
        return Err(ShmError::BadMagic {
            path: path.into(),
            found: magic,
        });
    }
    let version = b.load32(OFF_VERSION);
    if version != LAYOUT_VERSION {
        return Err(ShmError::BadVersion {
            path: path.into(),
            found: version,
            expected: LAYOUT_VERSION,
        });
    }
    let corrupt = |reason: &str| ShmError::Corrupt {
        path: path.into(),
        reason: reason.into(),
    };
    let cap = b.load(OFF_CAPACITY);
    if cap < MIN_CAPACITY as u64 || !cap.is_power_of_two() || cap > (1 << 40) {
        return Err(corrupt("capacity is not a power of two >= 64 KiB"));
    }
    let expect = geometry_for(cap, b.load(OFF_RING_ID));
    if b.load32(OFF_HEADER_LEN) as u64 != HEADER_LEN
        || b.load(OFF_INDEX_SLOTS) != expect.slots
        || b.load(OFF_INDEX_OFFSET) != expect.index_off
        || b.load(OFF_DATA_OFFSET) != expect.data_off
        || b.load(OFF_MAX_PAYLOAD) != expect.max_payload as u64
    {
        return Err(corrupt("offsets do not match the layout for this capacity"));
    }
    if len < expect.file_len {
        return Err(ShmError::TooSmall {
            path: path.into(),
            len,
            need: expect.file_len,
        });
    }
    Ok(expect)
}
