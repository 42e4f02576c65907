//! A bounds-checked msgpack reader over the borrowed payload.
//!
//! Markers are classified with `rmp::Marker`; data bytes are read straight from the slice, so
//! every error carries the byte offset and nothing is copied or allocated. Skipping is iterative
//! with a fixed-size stack ([`MAX_DEPTH`]); every declared element count is compared with the
//! bytes left before anything is walked (each element takes at least one byte).
use super::error::{DecodeError, DecodeErrorKind as K};
use rmp::Marker;

/// Bound on container nesting inside a skipped value.
pub const MAX_DEPTH: usize = 32;

/// A msgpack integer as read: unsigned markers give `U`, signed ones `I`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Int {
    U(u64),
    I(i64),
}

impl Int {
    /// The 64-bit two's-complement pattern (SMG int64 rule for ints).
    #[inline]
    pub(crate) fn bits(self) -> u64 {
        match self {
            Int::U(v) => v,
            Int::I(v) => v as u64,
        }
    }
    #[inline]
    pub(crate) fn as_u64(self) -> Option<u64> {
        match self {
            Int::U(v) => Some(v),
            Int::I(v) => u64::try_from(v).ok(),
        }
    }
    #[inline]
    pub(crate) fn as_i64(self) -> Option<i64> {
        match self {
            Int::U(v) => i64::try_from(v).ok(),
            Int::I(v) => Some(v),
        }
    }
}

/// A cursor over the payload.
#[derive(Clone, Copy)]
pub(crate) struct Cur<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
    /// A hash was read as a negative int: the engine sends signed int64 hashes (SGLang).
    pub(crate) signed_hash: bool,
}

impl<'a> Cur<'a> {
    #[inline]
    pub(crate) fn new(buf: &'a [u8], pos: usize) -> Self {
        Self {
            buf,
            pos,
            signed_hash: false,
        }
    }
    #[inline]
    pub(crate) fn left(&self) -> usize {
        self.buf.len() - self.pos
    }
    #[cold]
    fn trunc(&self, need: usize) -> DecodeError {
        DecodeError::new(
            K::Truncated {
                need: need - self.left(),
            },
            self.pos,
        )
    }
    #[inline(always)]
    pub(crate) fn peek(&self) -> Result<u8, DecodeError> {
        match self.buf.get(self.pos) {
            Some(&b) => Ok(b),
            None => Err(self.trunc(1)),
        }
    }
    #[inline(always)]
    pub(crate) fn byte(&mut self) -> Result<u8, DecodeError> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }
    #[inline(always)]
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.left() {
            return Err(self.trunc(n));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    #[inline(always)]
    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        match self.buf.get(self.pos..self.pos + N) {
            Some(s) => {
                self.pos += N;
                Ok(s.try_into().expect("N bytes"))
            }
            None => Err(self.trunc(N)),
        }
    }
    #[inline]
    fn u8d(&mut self) -> Result<u64, DecodeError> {
        Ok(self.byte()? as u64)
    }
    #[inline]
    fn u16d(&mut self) -> Result<u64, DecodeError> {
        Ok(u16::from_be_bytes(self.be()?) as u64)
    }
    #[inline]
    fn u32d(&mut self) -> Result<u64, DecodeError> {
        Ok(u32::from_be_bytes(self.be()?) as u64)
    }
    /// Checks a declared element/byte count against the input left.
    #[inline]
    fn check(&self, at: usize, n: u64) -> Result<u32, DecodeError> {
        if n > self.left() as u64 {
            Err(DecodeError::new(K::LengthExceedsInput { declared: n }, at))
        } else {
            Ok(n as u32)
        }
    }
    /// Reads a marker; returns it with its offset.
    #[inline(always)]
    pub(crate) fn marker(&mut self) -> Result<(Marker, usize), DecodeError> {
        let at = self.pos;
        let b = self.byte()?;
        Ok((Marker::from_u8(b), at))
    }

    /// Array length for an array marker (`None` for any other marker).
    #[inline(always)]
    pub(crate) fn array_len(&mut self, m: Marker, at: usize) -> Result<Option<u32>, DecodeError> {
        let n = match m {
            Marker::FixArray(n) => n as u64,
            Marker::Array16 => self.u16d()?,
            Marker::Array32 => self.u32d()?,
            _ => return Ok(None),
        };
        self.check(at, n).map(Some)
    }
    /// Map length (pairs) for a map marker (`None` for any other marker).
    #[inline]
    pub(crate) fn map_len(&mut self, m: Marker, at: usize) -> Result<Option<u32>, DecodeError> {
        let n = match m {
            Marker::FixMap(n) => n as u64,
            Marker::Map16 => self.u16d()?,
            Marker::Map32 => self.u32d()?,
            _ => return Ok(None),
        };
        self.check(at, 2 * n)?;
        Ok(Some(n as u32))
    }
    /// String bytes for a str marker (`None` for any other marker). Not UTF-8-checked.
    #[inline(always)]
    pub(crate) fn str_of(&mut self, m: Marker, at: usize) -> Result<Option<&'a [u8]>, DecodeError> {
        let n = match m {
            Marker::FixStr(n) => n as u64,
            Marker::Str8 => self.u8d()?,
            Marker::Str16 => self.u16d()?,
            Marker::Str32 => self.u32d()?,
            _ => return Ok(None),
        };
        let n = self.check(at, n)?;
        self.take(n as usize).map(Some)
    }
    /// Bin bytes for a bin marker (`None` for any other marker).
    #[inline(always)]
    pub(crate) fn bin_of(&mut self, m: Marker, at: usize) -> Result<Option<&'a [u8]>, DecodeError> {
        let n = match m {
            Marker::Bin8 => self.u8d()?,
            Marker::Bin16 => self.u16d()?,
            Marker::Bin32 => self.u32d()?,
            _ => return Ok(None),
        };
        let n = self.check(at, n)?;
        self.take(n as usize).map(Some)
    }
    /// Integer for an int marker of any width (`None` for any other marker).
    #[inline(always)]
    pub(crate) fn int_of(&mut self, m: Marker) -> Result<Option<Int>, DecodeError> {
        Ok(Some(match m {
            Marker::FixPos(v) => Int::U(v as u64),
            Marker::FixNeg(v) => Int::I(v as i64),
            Marker::U8 => Int::U(self.u8d()?),
            Marker::U16 => Int::U(self.u16d()?),
            Marker::U32 => Int::U(self.u32d()?),
            Marker::U64 => Int::U(u64::from_be_bytes(self.be()?)),
            Marker::I8 => Int::I(i8::from_be_bytes(self.be()?) as i64),
            Marker::I16 => Int::I(i16::from_be_bytes(self.be()?) as i64),
            Marker::I32 => Int::I(i32::from_be_bytes(self.be()?) as i64),
            Marker::I64 => Int::I(i64::from_be_bytes(self.be()?)),
            _ => return Ok(None),
        }))
    }

    /// Skips one value structurally (any type), bounded by [`MAX_DEPTH`].
    pub(crate) fn skip_value(&mut self) -> Result<(), DecodeError> {
        let mut stack = [0u64; MAX_DEPTH];
        let mut depth = 0usize;
        let mut todo: u64 = 1;
        loop {
            while todo == 0 {
                if depth == 0 {
                    return Ok(());
                }
                depth -= 1;
                todo = stack[depth];
            }
            todo -= 1;
            let at = self.pos;
            let b = self.byte()?;
            let n: u64 = match b {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
                0xa0..=0xbf => (b & 0x1f) as u64,
                0x80..=0x9f | 0xdc..=0xdf => {
                    let cnt = match b {
                        0x80..=0x8f => 2 * (b & 0x0f) as u64,
                        0x90..=0x9f => (b & 0x0f) as u64,
                        0xdc => self.u16d()?,
                        0xdd => self.u32d()?,
                        0xde => 2 * self.u16d()?,
                        _ => 2 * self.u32d()?,
                    };
                    self.check(at, cnt)?;
                    if cnt > 0 {
                        if depth == MAX_DEPTH {
                            return Err(DecodeError::new(K::TooDeep { limit: MAX_DEPTH }, at));
                        }
                        stack[depth] = todo;
                        depth += 1;
                        todo = cnt;
                    }
                    continue;
                }
                0xc1 => return Err(DecodeError::new(K::InvalidMarker, at)),
                0xc4 | 0xd9 => self.u8d()?,
                0xc5 | 0xda => self.u16d()?,
                0xc6 | 0xdb => self.u32d()?,
                0xc7 => self.u8d()? + 1,
                0xc8 => self.u16d()? + 1,
                0xc9 => self.u32d()? + 1,
                0xca => 4,
                0xcb => 8,
                0xcc | 0xd0 => 1,
                0xcd | 0xd1 => 2,
                0xce | 0xd2 => 4,
                0xcf | 0xd3 => 8,
                0xd4 => 2,
                0xd5 => 3,
                0xd6 => 5,
                0xd7 => 9,
                _ => 17, // 0xd8 fixext16
            };
            let n = self.check(at, n)?;
            self.pos += n as usize;
        }
    }
}

/// Encoded size of an int value by marker byte (0 = not an int).
pub(crate) static INT_SIZE: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut i = 0;
    while i < 0x80 {
        t[i] = 1;
        i += 1;
    }
    let mut i = 0xe0;
    while i < 0x100 {
        t[i] = 1;
        i += 1;
    }
    t[0xcc] = 2;
    t[0xd0] = 2;
    t[0xcd] = 3;
    t[0xd1] = 3;
    t[0xce] = 5;
    t[0xd2] = 5;
    t[0xcf] = 9;
    t[0xd3] = 9;
    t
};

/// A token id (uint ≤ u32::MAX, any width, signed markers with non-negative values accepted).
/// `None` on any other type/range or truncation. Advances `pos` only on success.
#[inline(always)]
pub(crate) fn read_token(buf: &[u8], pos: &mut usize) -> Option<u32> {
    let p = *pos;
    let b = *buf.get(p)?;
    if b < 0x80 {
        *pos = p + 1;
        return Some(b as u32);
    }
    match b {
        0xcd => {
            let s = buf.get(p + 1..p + 3)?;
            *pos = p + 3;
            Some(u16::from_be_bytes([s[0], s[1]]) as u32)
        }
        0xce => {
            let s = buf.get(p + 1..p + 5)?;
            *pos = p + 5;
            Some(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
        }
        0xcc => {
            let v = *buf.get(p + 1)?;
            *pos = p + 2;
            Some(v as u32)
        }
        _ => read_token_slow(buf, pos),
    }
}

#[cold]
fn read_token_slow(buf: &[u8], pos: &mut usize) -> Option<u32> {
    let p = *pos;
    let b = *buf.get(p)?;
    let d = buf.get(p + 1..)?;
    let (v, n): (i128, usize) = match b {
        0xcf => (u64::from_be_bytes(d.get(..8)?.try_into().ok()?) as i128, 8),
        0xd0 => (*d.first()? as i8 as i128, 1),
        0xd1 => (i16::from_be_bytes(d.get(..2)?.try_into().ok()?) as i128, 2),
        0xd2 => (i32::from_be_bytes(d.get(..4)?.try_into().ok()?) as i128, 4),
        0xd3 => (i64::from_be_bytes(d.get(..8)?.try_into().ok()?) as i128, 8),
        _ => return None,
    };
    if !(0..=u32::MAX as i128).contains(&v) {
        return None;
    }
    *pos = p + 1 + n;
    Some(v as u32)
}

/// SMG int64 rule for a bin hash: the last 8 bytes big-endian, zero-left-padded.
#[inline]
pub(crate) fn bin_bits(b: &[u8]) -> u64 {
    let tail = &b[b.len().saturating_sub(8)..];
    let mut v = 0u64;
    for &x in tail {
        v = (v << 8) | x as u64;
    }
    v
}
