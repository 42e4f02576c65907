//! Protobuf wire helpers: varint sizes and a slice writer.

/// Encoded size of a varint.
#[inline(always)]
pub(crate) fn vlen(v: u64) -> usize {
    VLEN_BY_LZ[(v | 1).leading_zeros() as usize] as usize
}

/// Varint size by the value's leading-zero count (0..=63).
static VLEN_BY_LZ: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut lz = 0;
    while lz < 64 {
        t[lz] = (64 - lz).div_ceil(7) as u8;
        lz += 1;
    }
    t
};

/// Size of a length-delimited field (tag byte + length prefix + body).
#[inline(always)]
pub(crate) fn ld(body: usize) -> usize {
    1 + vlen(body as u64) + body
}

/// Writes into a caller-provided slice. Indexing panics if the slice is too short, which the
/// callers rule out beforehand.
pub(crate) struct W<'a> {
    pub buf: &'a mut [u8],
    pub pos: usize,
}

impl W<'_> {
    #[inline(always)]
    pub(crate) fn u8(&mut self, b: u8) {
        self.buf[self.pos] = b;
        self.pos += 1;
    }
    #[inline(always)]
    pub(crate) fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.u8((v as u8) | 0x80);
            v >>= 7;
        }
        self.u8(v as u8);
    }
    #[inline(always)]
    pub(crate) fn bytes(&mut self, s: &[u8]) {
        let d = &mut self.buf[self.pos..self.pos + s.len()];
        if s.len() <= 16 {
            // short strings (medium, kind, …): avoid a memmove call
            for (d, s) in d.iter_mut().zip(s) {
                *d = *s;
            }
        } else {
            d.copy_from_slice(s);
        }
        self.pos += s.len();
    }
    /// Tag + length + bytes.
    #[inline(always)]
    pub(crate) fn ld_bytes(&mut self, tag: u8, s: &[u8]) {
        self.u8(tag);
        self.varint(s.len() as u64);
        self.bytes(s);
    }
}
