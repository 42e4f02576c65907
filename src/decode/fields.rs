//! One event's fields as parsed: the field ids, what each field's value may be (typed readers
//! that report a semantic mismatch as [`Invalid`] instead of an error), and [`Fields`], the
//! parsed event handed from `parse.rs` to `measure.rs`. Hashes go straight into the decoder's
//! scratch; tokens are measured on the way when the block-size hint applies.
use super::error::DecodeError;
use super::pb::vlen;
use super::reader::{bin_bits, read_token, Cur, Int, INT_SIZE};
use super::scratch::Span;
use super::Decoder;
use rmp::Marker;

// Field ids: one per known event key (`parse.rs` maps map keys and array positions to them);
// also the bits of `Fields::seen`.
pub(crate) const F_TYPE: u32 = 0;
pub(crate) const F_HASHES: u32 = 1;
pub(crate) const F_PARENT: u32 = 2;
pub(crate) const F_TOKENS: u32 = 3;
pub(crate) const F_BS: u32 = 4;
pub(crate) const F_LORA_ID: u32 = 5;
pub(crate) const F_MEDIUM: u32 = 6;
pub(crate) const F_LORA_NAME: u32 = 7;
pub(crate) const F_EXTRA: u32 = 8;
pub(crate) const F_GROUP: u32 = 9;
pub(crate) const F_KIND: u32 = 10;
pub(crate) const F_SLIDING: u32 = 11;
pub(crate) const F_LOCALITY: u32 = 12;
pub(crate) const F_OWNERSHIP: u32 = 13;
pub(crate) const F_SESSION: u32 = 14;
pub(crate) const F_LOOKAHEAD: u32 = 15;
pub(crate) const F_SALT: u32 = 16;
pub(crate) const F_METADATA: u32 = 17;
// Known fields kvbridge reads past on purpose (docs/engine-wire.md §9, "Fields read past"):
// nothing in SMG's encoding carries them, and none changes what a block is.
/// vLLM #48933 (open): `BlockRemoved.remaining_copy_counts`, physical copies left per hash.
pub(crate) const F_COPIES: u32 = 18;
/// SGLang #39620 (open): `BlockRemoved.reason` (`evicted`, `demoted`, …).
pub(crate) const F_REASON: u32 = 19;
/// vLLM #55488: `BlockStored.event_version` (1: typed `extra_keys`).
pub(crate) const F_VERSION: u32 = 20;
/// ROCm ATOM: `BlockStored.token_offset`, a trailing element after the known fields.
pub(crate) const F_TOKEN_OFFSET: u32 = 21;
/// vLLM #44488 (open): `BlockStored.block_offsets` of a sparse store.
pub(crate) const F_BLOCK_OFFSETS: u32 = 22;

/// The newest `event_version` whose meaning kvbridge knows; a newer one is counted in
/// `unknown_keys` (the event is still decoded: a version names new meanings, not a new shape).
pub(crate) const KNOWN_EVENT_VERSION: u64 = 1;

/// An event's tag.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Tag {
    Missing,
    Stored,
    Removed,
    Cleared,
    /// vLLM #50732 (open): `BlockInactive`, a block no request references any more but still
    /// cached. Nothing for a router's index: skipped and counted (`inactive_events`).
    Inactive,
    Unknown,
}

pub(crate) fn tag_of(s: &[u8]) -> Tag {
    match s {
        b"BlockStored" => Tag::Stored,
        b"BlockRemoved" => Tag::Removed,
        b"AllBlocksCleared" => Tag::Cleared,
        b"BlockInactive" => Tag::Inactive,
        _ => Tag::Unknown,
    }
}

/// Why a known event is skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Invalid {
    Type,
    Utf8,
    Missing,
    TooManyBlocks,
}

/// `token_ids` as read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tokens {
    /// Offset of the first element.
    pub(crate) off: u32,
    /// Element count.
    pub(crate) n: u32,
    /// Per-block (offset, packed bytes) measured with the block-size hint: (start in
    /// `Decoder::chunks`, the hint used).
    pub(crate) chunks: Option<(u32, u32)>,
    /// SGLang's EAGLE form (SGLang #39610): `[[t0, t1], [t1, t2], …]`, one bigram per position.
    /// Its `n` pairs cover `n + 1` tokens shifted by one, so they never pair with the hashes as
    /// tokens: the store goes out hash-only (or is filtered as unpairable).
    pub(crate) bigram: bool,
}

/// Fields of one event as parsed (any tag).
pub(crate) struct Fields {
    pub(crate) tag: Tag,
    /// Map keys seen (bit per field id).
    pub(crate) seen: u32,
    /// (start in `Decoder::hashes`, count).
    pub(crate) hashes: Option<(u32, u32)>,
    /// Σ varint sizes of the hashes (packed `block_hashes` of a removal).
    pub(crate) packed: u32,
    pub(crate) parent: Option<i64>,
    pub(crate) tokens: Option<Tokens>,
    pub(crate) bs: Option<u64>,
    pub(crate) lora_id: Option<i64>,
    pub(crate) medium: Option<Span>,
    pub(crate) lora_name: Option<Span>,
    pub(crate) kind: Option<Span>,
    pub(crate) locality: Option<Span>,
    pub(crate) ownership: Option<Span>,
    pub(crate) session: Option<Span>,
    pub(crate) salt: Option<Span>,
    /// Offset of a non-nil `extra_keys` value.
    pub(crate) extra: Option<u32>,
    pub(crate) group: Option<u32>,
    pub(crate) sliding: Option<u32>,
    /// The first reason the event failed validation.
    pub(crate) invalid: Option<Invalid>,
}

impl Fields {
    pub(crate) fn new() -> Self {
        Fields {
            tag: Tag::Missing,
            seen: 0,
            hashes: None,
            packed: 0,
            parent: None,
            tokens: None,
            bs: None,
            lora_id: None,
            medium: None,
            lora_name: None,
            kind: None,
            locality: None,
            ownership: None,
            session: None,
            salt: None,
            extra: None,
            group: None,
            sliding: None,
            invalid: None,
        }
    }
    pub(crate) fn bad(&mut self, why: Invalid) {
        if self.invalid.is_none() {
            self.invalid = Some(why);
        }
    }
}

/// Outcome of a typed field read: `Ok(Err(_))` = semantic mismatch (rewind and skip).
type FR<T> = Result<Result<T, Invalid>, DecodeError>;

#[inline]
fn span(c: &Cur<'_>, s: &[u8]) -> Span {
    Span {
        off: (c.pos - s.len()) as u32,
        len: s.len() as u32,
    }
}

impl Decoder {
    /// Reads one known field into `f`; a semantic mismatch rewinds, skips and marks `f` invalid.
    pub(crate) fn field(
        &mut self,
        c: &mut Cur<'_>,
        id: u32,
        f: &mut Fields,
    ) -> Result<(), DecodeError> {
        let vs = c.pos;
        let r: Result<(), Invalid> = match id {
            F_HASHES => self.read_hashes(c)?.map(|(h, packed)| {
                f.hashes = Some(h);
                f.packed = packed;
            }),
            F_PARENT => read_opt_hash(c, &mut f.parent)?,
            F_LORA_ID => read_opt_hash(c, &mut f.lora_id)?,
            F_TOKENS => self.read_tokens(c)?.map(|t| f.tokens = Some(t)),
            F_BS => {
                let (m, _) = c.marker()?;
                match c.int_of(m)?.and_then(Int::as_u64) {
                    Some(v) => {
                        f.bs = Some(v);
                        Ok(())
                    }
                    None => Err(Invalid::Type),
                }
            }
            F_MEDIUM => read_opt_str(c, &mut f.medium)?,
            F_LORA_NAME => read_opt_str(c, &mut f.lora_name)?,
            F_KIND => read_opt_str(c, &mut f.kind)?,
            F_LOCALITY => read_opt_str(c, &mut f.locality)?,
            F_OWNERSHIP => read_opt_str(c, &mut f.ownership)?,
            F_SESSION => read_opt_str(c, &mut f.session)?,
            F_SALT => read_opt_str(c, &mut f.salt)?,
            F_GROUP => read_opt_u32(c, &mut f.group)?,
            F_SLIDING => read_opt_u32(c, &mut f.sliding)?,
            F_EXTRA => {
                if c.peek()? != 0xc0 {
                    f.extra = Some(c.pos as u32);
                }
                c.skip_value()?;
                Ok(())
            }
            F_METADATA => self.read_metadata(c, f)?,
            F_VERSION => {
                let (m, _) = c.marker()?;
                match c.int_of(m)?.and_then(Int::as_u64) {
                    Some(v) => {
                        if v > KNOWN_EVENT_VERSION {
                            self.stats.unknown_keys += 1;
                        }
                        Ok(())
                    }
                    None => Err(Invalid::Type),
                }
            }
            _ => {
                // lookahead_token_ids and anything known-but-unused
                c.skip_value()?;
                Ok(())
            }
        };
        if let Err(why) = r {
            c.pos = vs;
            c.skip_value()?;
            f.bad(why);
        }
        Ok(())
    }

    /// `token_ids`: an array of ints. When the count is a multiple of the block-size hint (the
    /// last pairable store's `block_size`), the per-block (offset, packed bytes) are measured
    /// on the way into `chunks`, so pass 1 walks the tokens once. Without the hint only the
    /// structure is checked here (every element an int, in bounds); the values
    /// (0 ≤ v ≤ u32::MAX) are then checked by the measuring walk, which runs for the stores
    /// that are forwarded with tokens.
    fn read_tokens(&mut self, c: &mut Cur<'_>) -> FR<Tokens> {
        let (m, at) = c.marker()?;
        let n = match c.array_len(m, at)? {
            Some(n) => n,
            None => return Ok(Err(Invalid::Type)),
        };
        let first = c.pos;
        let buf = c.buf;
        if n > 0 && matches!(buf.get(first), Some(0x90..=0x9f | 0xdc | 0xdd)) {
            return Ok(read_bigrams(c, n)?.map(|()| Tokens {
                off: first as u32,
                n,
                chunks: None,
                bigram: true,
            }));
        }
        let mut pos = first;
        let bs = self.bs_hint as usize;
        if n > 0 && bs > 0 && n as usize % bs == 0 {
            let start = self.chunks.len();
            for _ in 0..n as usize / bs {
                let off = pos;
                let mut tb = 0usize;
                for _ in 0..bs {
                    match read_token(buf, &mut pos) {
                        Some(v) => tb += vlen(v as u64),
                        None => {
                            self.chunks.truncate(start);
                            return Ok(Err(Invalid::Type));
                        }
                    }
                }
                self.chunks.push((off as u32, tb as u32));
            }
            c.pos = pos;
            return Ok(Ok(Tokens {
                off: first as u32,
                n,
                chunks: Some((start as u32, bs as u32)),
                bigram: false,
            }));
        }
        for _ in 0..n {
            let Some(&b) = buf.get(pos) else {
                return Ok(Err(Invalid::Type));
            };
            let sz = INT_SIZE[b as usize];
            if sz == 0 {
                return Ok(Err(Invalid::Type));
            }
            pos += sz as usize;
        }
        if pos > buf.len() {
            return Ok(Err(Invalid::Type));
        }
        c.pos = pos;
        Ok(Ok(Tokens {
            off: first as u32,
            n,
            chunks: None,
            bigram: false,
        }))
    }

    /// `block_hashes` into `hashes`: returns ((start, count), Σ varint sizes).
    fn read_hashes(&mut self, c: &mut Cur<'_>) -> FR<((u32, u32), u32)> {
        let (m, at) = c.marker()?;
        let n = match c.array_len(m, at)? {
            Some(n) => n,
            None => return Ok(Err(Invalid::Type)),
        };
        if n as usize > self.cfg.max_blocks_per_event {
            return Ok(Err(Invalid::TooManyBlocks));
        }
        let start = self.hashes.len() as u32;
        let mut packed = 0usize;
        for _ in 0..n {
            let (m, at) = c.marker()?;
            match read_hash_after(c, m, at)? {
                Ok(h) => {
                    packed += vlen(h as u64);
                    self.hashes.push(h);
                }
                Err(e) => {
                    self.hashes.truncate(start as usize);
                    return Ok(Err(e));
                }
            }
        }
        Ok(Ok(((start, n), packed as u32)))
    }

    /// SGLang's `metadata` map: `cache_salt` is lifted, other keys are skipped and counted.
    fn read_metadata(&mut self, c: &mut Cur<'_>, f: &mut Fields) -> FR<()> {
        let (m, at) = c.marker()?;
        if m == Marker::Null {
            return Ok(Ok(()));
        }
        let n = match c.map_len(m, at)? {
            Some(n) => n,
            None => return Ok(Err(Invalid::Type)),
        };
        for _ in 0..n {
            let (km, kat) = c.marker()?;
            match c.str_of(km, kat)? {
                Some(b"cache_salt") => {
                    if let Err(e) = read_opt_str(c, &mut f.salt)? {
                        return Ok(Err(e));
                    }
                }
                k => {
                    if k.is_none() {
                        c.pos = kat;
                        c.skip_value()?;
                    }
                    c.skip_value()?;
                    self.stats.unknown_keys += 1;
                }
            }
        }
        Ok(Ok(()))
    }
}

/// A string (UTF-8-checked); nil → None.
#[inline]
fn read_opt_str(c: &mut Cur<'_>, out: &mut Option<Span>) -> FR<()> {
    let (m, at) = c.marker()?;
    if m == Marker::Null {
        *out = None;
        return Ok(Ok(()));
    }
    match c.str_of(m, at)? {
        Some(s) => {
            if !s.is_ascii() && std::str::from_utf8(s).is_err() {
                return Ok(Err(Invalid::Utf8));
            }
            *out = Some(span(c, s));
            Ok(Ok(()))
        }
        None => Ok(Err(Invalid::Type)),
    }
}

/// `n` bigrams `[a, b]` of token ids (u32 each), read past; any other element is a type error.
fn read_bigrams(c: &mut Cur<'_>, n: u32) -> FR<()> {
    for _ in 0..n {
        let (m, at) = c.marker()?;
        if c.array_len(m, at)? != Some(2) {
            return Ok(Err(Invalid::Type));
        }
        for _ in 0..2 {
            let (m, _) = c.marker()?;
            match c.int_of(m)?.and_then(Int::as_u64) {
                Some(v) if v <= u32::MAX as u64 => {}
                _ => return Ok(Err(Invalid::Type)),
            }
        }
    }
    Ok(Ok(()))
}

/// A hash / lora_id: int (low 64 bits) or bin (last 8 bytes BE, len ≥ 1); nil → None.
#[inline]
fn read_opt_hash(c: &mut Cur<'_>, out: &mut Option<i64>) -> FR<()> {
    let (m, at) = c.marker()?;
    if m == Marker::Null {
        *out = None;
        return Ok(Ok(()));
    }
    Ok(read_hash_after(c, m, at)?.map(|h| *out = Some(h)))
}

/// A hash whose marker `m` (at `at`) is read.
#[inline]
fn read_hash_after(c: &mut Cur<'_>, m: Marker, at: usize) -> FR<i64> {
    if let Some(i) = c.int_of(m)? {
        c.signed_hash |= matches!(i, Int::I(v) if v < 0);
        return Ok(Ok(i.bits() as i64));
    }
    match c.bin_of(m, at)? {
        Some(b) if !b.is_empty() => Ok(Ok(bin_bits(b) as i64)),
        _ => Ok(Err(Invalid::Type)),
    }
}

/// A u32 (any int width, value in range); nil → None.
#[inline]
fn read_opt_u32(c: &mut Cur<'_>, out: &mut Option<u32>) -> FR<()> {
    let (m, _) = c.marker()?;
    if m == Marker::Null {
        *out = None;
        return Ok(Ok(()));
    }
    match c.int_of(m)?.and_then(Int::as_u64) {
        Some(v) if v <= u32::MAX as u64 => {
            *out = Some(v as u32);
            Ok(Ok(()))
        }
        _ => Ok(Err(Invalid::Type)),
    }
}
