//! Pass 1: validate the whole payload, apply the profile, measure every submessage, and cut the
//! batch into records. Everything goes into the decoder's reusable scratch vectors.
use super::ekeys;
use super::error::{DecodeError, DecodeErrorKind as K};
use super::filter::{Locality, Tier, Traits};
use super::pb::{ld, vlen};
use super::reader::{bin_bits, read_token, Cur, Int, INT_SIZE};
use super::{BatchPlan, BlockInfo, Decoder, Ev, EvKind, Part, Rec, Span};
use rmp::Marker;

/// Worst-case `KvEventBatch` bytes outside `events`: sequence_number (1 + 10), timestamp
/// (1 + 8), dp_rank (1 + 10). Records are cut against this bound, so any header fits.
pub(crate) const REC_OVERHEAD_MAX: usize = 31;

/// Upper bound of the bytes of one `events` entry whose `data` body is `d` (< 2^32) bytes:
/// tag 1 + length ≤ 5 + event_id ≤ 1 + 10 + data tag 1 + length ≤ 5 + `d`. A closed form
/// instead of the exact varint sizes keeps pass 1 free of dependent size chains; it only
/// makes cuts a few bytes more conservative.
#[inline(always)]
pub(crate) fn entry_bound(d: usize) -> usize {
    d + 23
}

// Field ids (map keys / array positions).
const F_TYPE: u32 = 0;
const F_HASHES: u32 = 1;
const F_PARENT: u32 = 2;
const F_TOKENS: u32 = 3;
const F_BS: u32 = 4;
const F_LORA_ID: u32 = 5;
const F_MEDIUM: u32 = 6;
const F_LORA_NAME: u32 = 7;
const F_EXTRA: u32 = 8;
const F_GROUP: u32 = 9;
const F_KIND: u32 = 10;
const F_SLIDING: u32 = 11;
const F_LOCALITY: u32 = 12;
const F_OWNERSHIP: u32 = 13;
const F_SESSION: u32 = 14;
const F_LOOKAHEAD: u32 = 15;
const F_SALT: u32 = 16;
const F_METADATA: u32 = 17;

const ALLOW_STORED: u32 = (1 << 18) - 1;
const ALLOW_REMOVED: u32 =
    1 << F_TYPE | 1 << F_HASHES | 1 << F_MEDIUM | 1 << F_GROUP | 1 << F_LOCALITY | 1 << F_OWNERSHIP;
const ALLOW_CLEARED: u32 = 1 << F_TYPE | 1 << F_OWNERSHIP;

fn key_id(k: &[u8]) -> Option<u32> {
    Some(match k {
        b"type" => F_TYPE,
        b"block_hashes" => F_HASHES,
        b"parent_block_hash" => F_PARENT,
        b"token_ids" => F_TOKENS,
        b"block_size" => F_BS,
        b"lora_id" => F_LORA_ID,
        b"medium" => F_MEDIUM,
        b"lora_name" => F_LORA_NAME,
        b"extra_keys" => F_EXTRA,
        b"group_idx" => F_GROUP,
        b"kv_cache_spec_kind" => F_KIND,
        b"kv_cache_spec_sliding_window" => F_SLIDING,
        b"locality" => F_LOCALITY,
        b"ownership" => F_OWNERSHIP,
        b"session_id" => F_SESSION,
        b"lookahead_token_ids" => F_LOOKAHEAD,
        b"cache_salt" => F_SALT,
        b"metadata" => F_METADATA,
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tag {
    Missing,
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag_of(s: &[u8]) -> Tag {
    match s {
        b"BlockStored" => Tag::Stored,
        b"BlockRemoved" => Tag::Removed,
        b"AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

/// Why a known event is skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Invalid {
    Type,
    Utf8,
    Missing,
    TooManyBlocks,
}

/// Fields of one event as parsed (any tag).
struct F {
    tag: Tag,
    seen: u32,
    hashes: Option<(u32, u32)>,
    /// Σ varint sizes of the hashes (packed `block_hashes` of a removal).
    packed: u32,
    parent: Option<i64>,
    tokens: Option<(u32, u32)>,
    /// Per-block token measurements made with the block-size hint: (start in `chunks`, bs).
    chunks: Option<(u32, u32)>,
    bs: Option<u64>,
    lora_id: Option<i64>,
    medium: Option<Span>,
    lora_name: Option<Span>,
    kind: Option<Span>,
    locality: Option<Span>,
    ownership: Option<Span>,
    session: Option<Span>,
    salt: Option<Span>,
    extra: Option<u32>,
    group: Option<u32>,
    sliding: Option<u32>,
    invalid: Option<Invalid>,
}

impl F {
    fn new() -> Self {
        F {
            tag: Tag::Missing,
            seen: 0,
            hashes: None,
            packed: 0,
            parent: None,
            tokens: None,
            chunks: None,
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
    fn bad(&mut self, why: Invalid) {
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

#[inline]
fn read_hash_after(c: &mut Cur<'_>, m: Marker, at: usize) -> FR<i64> {
    if let Some(i) = c.int_of(m)? {
        return Ok(Ok(i.bits() as i64));
    }
    match c.bin_of(m, at)? {
        Some(b) if !b.is_empty() => Ok(Ok(bin_bits(b) as i64)),
        _ => Ok(Err(Invalid::Type)),
    }
}

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

#[inline]
fn opt_ld(s: Option<Span>) -> usize {
    s.map_or(0, |s| ld(s.len as usize))
}

#[inline]
fn opt_v(v: Option<u64>) -> usize {
    v.map_or(0, |v| 1 + vlen(v))
}

impl Decoder {
    pub(crate) fn plan_inner(&mut self, p: &[u8]) -> Result<BatchPlan, DecodeError> {
        if p.is_empty() {
            return Err(DecodeError::new(K::Empty, 0));
        }
        if p.len() > self.cfg.max_payload {
            return Err(DecodeError::new(
                K::PayloadTooLarge {
                    len: p.len(),
                    limit: self.cfg.max_payload,
                },
                0,
            ));
        }
        let mut c = Cur::new(p, 0);
        let (m, at) = c.marker()?;
        let mut ts = None;
        let mut rank = None;
        let mut nev_total = 0u64;
        if let Some(n) = c.array_len(m, at)? {
            if n < 2 {
                return Err(DecodeError::new(K::BatchTooShort { len: n }, at));
            }
            ts = Some(read_ts(&mut c)?);
            nev_total = self.events(&mut c)?;
            if n >= 3 {
                rank = read_rank(&mut c)?;
            }
            for _ in 3..n {
                c.skip_value()?;
                self.stats.unknown_keys += 1;
            }
        } else if let Some(n) = c.map_len(m, at)? {
            self.stats.map_batches += 1;
            let mut seen_events = false;
            let mut seen_rank = false;
            for _ in 0..n {
                let (km, kat) = c.marker()?;
                let key = c.str_of(km, kat)?;
                let dup = |what| Err(DecodeError::new(K::DuplicateKey(what), kat));
                match key {
                    Some(b"ts") => {
                        if ts.is_some() {
                            return dup("ts");
                        }
                        ts = Some(read_ts(&mut c)?);
                    }
                    Some(b"events") => {
                        if seen_events {
                            return dup("events");
                        }
                        seen_events = true;
                        nev_total = self.events(&mut c)?;
                    }
                    Some(b"data_parallel_rank") | Some(b"attn_dp_rank") => {
                        if seen_rank {
                            return dup("rank");
                        }
                        seen_rank = true;
                        rank = read_rank(&mut c)?;
                    }
                    _ => {
                        if key.is_none() {
                            c.pos = kat;
                            c.skip_value()?;
                        }
                        c.skip_value()?;
                        self.stats.unknown_keys += 1;
                    }
                }
            }
            if !seen_events {
                return Err(DecodeError::new(K::MissingField("events"), 0));
            }
        } else {
            return Err(DecodeError::new(
                K::WrongType {
                    what: "batch",
                    marker: p[0],
                },
                0,
            ));
        }
        let ts = match ts {
            Some(t) => t,
            None => return Err(DecodeError::new(K::MissingField("ts"), 0)),
        };
        if c.pos != p.len() {
            self.stats.trailing_bytes += 1;
        }
        self.ts = ts;
        if nev_total == 0 {
            self.stats.empty_batches += 1;
        } else if self.recs.is_empty() {
            self.stats.emptied_batches += 1;
        }
        if self.recs.len() > 1 {
            self.stats.split_batches += 1;
        }
        Ok(BatchPlan {
            records: self.recs.len(),
            ts,
            rank,
            lost_removals: self.lost_removals,
        })
    }

    /// The events array: returns its declared length.
    fn events(&mut self, c: &mut Cur<'_>) -> Result<u64, DecodeError> {
        let (m, at) = c.marker()?;
        let n = match c.array_len(m, at)? {
            Some(n) => n,
            None => {
                return Err(DecodeError::new(
                    K::WrongType {
                        what: "events",
                        marker: c.buf[at],
                    },
                    at,
                ))
            }
        };
        if n as usize > self.cfg.max_events {
            return Err(DecodeError::new(
                K::TooManyEvents {
                    count: n as u64,
                    limit: self.cfg.max_events,
                },
                at,
            ));
        }
        for _ in 0..n {
            self.event(c)?;
        }
        Ok(n as u64)
    }

    /// One event: parse, validate, filter, measure, pack. Only structural errors are returned.
    fn event(&mut self, c: &mut Cur<'_>) -> Result<(), DecodeError> {
        let start = c.pos;
        let hmark = self.hashes.len();
        let mut f = F::new();
        let (m, at) = c.marker()?;
        if let Some(n) = c.array_len(m, at)? {
            if n == 0 {
                self.stats.malformed_events += 1;
                return Ok(());
            }
            let (tm, tat) = c.marker()?;
            match c.str_of(tm, tat)? {
                Some(t) => f.tag = tag_of(t),
                None => {
                    c.pos = tat;
                    c.skip_value()?;
                    for _ in 1..n {
                        c.skip_value()?;
                    }
                    self.stats.malformed_events += 1;
                    return Ok(());
                }
            }
            if f.tag == Tag::Unknown {
                for _ in 1..n {
                    c.skip_value()?;
                }
                self.stats.unknown_tags += 1;
                return Ok(());
            }
            let max_pos = match f.tag {
                Tag::Stored => 11,
                Tag::Removed => 3,
                _ => 0,
            };
            for i in 1..n {
                if i > max_pos {
                    c.skip_value()?;
                    self.stats.unknown_keys += 1;
                    continue;
                }
                let id = match (f.tag, i) {
                    (Tag::Stored, 7) => {
                        if matches!(
                            Marker::from_u8(c.peek()?),
                            Marker::FixMap(_) | Marker::Map16 | Marker::Map32
                        ) {
                            F_METADATA
                        } else {
                            F_LORA_NAME
                        }
                    }
                    (Tag::Stored, 8) => F_EXTRA,
                    (Tag::Stored, 9) => F_GROUP,
                    (Tag::Stored, 10) => F_KIND,
                    (Tag::Stored, 11) => F_SLIDING,
                    (Tag::Stored, i) => i, // 1..=6 match the field ids
                    (_, 1) => F_HASHES,
                    (_, 2) => F_MEDIUM,
                    _ => F_GROUP,
                };
                self.field(c, id, &mut f)?;
            }
            // array stores shorter than 5 lack required fields: caught by finalize
        } else if let Some(n) = c.map_len(m, at)? {
            for _ in 0..n {
                let (km, kat) = c.marker()?;
                let id = match c.str_of(km, kat)? {
                    Some(k) => key_id(k),
                    None => {
                        c.pos = kat;
                        c.skip_value()?;
                        None
                    }
                };
                match id {
                    Some(id) if f.seen & (1 << id) == 0 => {
                        f.seen |= 1 << id;
                        if id == F_TYPE {
                            let vs = c.pos;
                            let (vm, vat) = c.marker()?;
                            match c.str_of(vm, vat)? {
                                Some(t) => f.tag = tag_of(t),
                                None => {
                                    c.pos = vs;
                                    c.skip_value()?;
                                    f.bad(Invalid::Type);
                                }
                            }
                        } else {
                            self.field(c, id, &mut f)?;
                        }
                    }
                    Some(_) => {
                        // duplicate key
                        c.skip_value()?;
                        f.bad(Invalid::Type);
                    }
                    None => {
                        c.skip_value()?;
                        self.stats.unknown_keys += 1;
                    }
                }
            }
            let allow = match f.tag {
                Tag::Stored => ALLOW_STORED,
                Tag::Removed => ALLOW_REMOVED,
                Tag::Cleared => ALLOW_CLEARED,
                _ => ALLOW_STORED,
            };
            self.stats.unknown_keys += (f.seen & !allow).count_ones() as u64;
            if f.tag == Tag::Unknown {
                self.hashes.truncate(hmark);
                self.stats.unknown_tags += 1;
                return Ok(());
            }
            if f.tag == Tag::Missing {
                f.bad(Invalid::Missing);
            }
        } else {
            c.pos = start;
            c.skip_value()?;
            self.stats.malformed_events += 1;
            return Ok(());
        }
        let buf = c.buf;
        match f.tag {
            Tag::Stored => self.finish_store(buf, &f, hmark),
            Tag::Removed => self.finish_removal(buf, &f, hmark),
            _ => self.finish_clear(buf, &f, hmark),
        }
        Ok(())
    }

    /// Reads one known field into `f`; a semantic mismatch rewinds, skips and marks `f` invalid.
    fn field(&mut self, c: &mut Cur<'_>, id: u32, f: &mut F) -> Result<(), DecodeError> {
        let vs = c.pos;
        let r: Result<(), Invalid> = match id {
            F_HASHES => self.read_hashes(c)?.map(|(h, packed)| {
                f.hashes = Some(h);
                f.packed = packed;
            }),
            F_PARENT => read_opt_hash(c, &mut f.parent)?,
            F_LORA_ID => read_opt_hash(c, &mut f.lora_id)?,
            F_TOKENS => self.read_tokens(c)?.map(|(v, ch)| {
                f.tokens = Some(v);
                f.chunks = ch;
            }),
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

    /// `token_ids`: an array of ints; returns (offset of the first element, count) and, when the
    /// count is a multiple of the block-size hint (the last pairable store's `block_size`), the
    /// per-block (offset, packed bytes) measured on the way, so pass 1 walks the tokens once.
    /// Without the hint only the structure is checked here (every element an int, in bounds);
    /// the values (0 ≤ v ≤ u32::MAX) are then checked by the measuring walk, which runs for the
    /// stores that are forwarded with tokens.
    #[allow(clippy::type_complexity)]
    fn read_tokens(&mut self, c: &mut Cur<'_>) -> FR<((u32, u32), Option<(u32, u32)>)> {
        let (m, at) = c.marker()?;
        let n = match c.array_len(m, at)? {
            Some(n) => n,
            None => return Ok(Err(Invalid::Type)),
        };
        let first = c.pos;
        let buf = c.buf;
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
            return Ok(Ok(((first as u32, n), Some((start as u32, bs as u32)))));
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
        Ok(Ok(((first as u32, n), None)))
    }

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

    fn read_metadata(&mut self, c: &mut Cur<'_>, f: &mut F) -> FR<()> {
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

    fn malformed(&mut self, why: Invalid, removal: bool, hmark: usize) {
        self.hashes.truncate(hmark);
        self.stats.malformed_events += 1;
        match why {
            Invalid::Utf8 => self.stats.invalid_utf8 += 1,
            Invalid::TooManyBlocks => self.stats.too_many_blocks += 1,
            _ => {}
        }
        if removal {
            self.stats.malformed_removals += 1;
            self.lost_removals += 1;
        }
    }

    /// Tier and locality of a store or removal, or `None` when the profile drops it (counted).
    /// The group's kind is remembered either way.
    fn kept(
        &mut self,
        buf: &[u8],
        f: &F,
        unpairable: bool,
    ) -> Option<(Option<Tier>, Option<Locality>)> {
        let (tier, locality) = self.classify(buf, f.medium, f.locality);
        let group = self.group_kind(buf, f.kind, f.group);
        let t = Traits {
            tier,
            group,
            locality,
            ownership: f.ownership.map(|o| o.get(buf)),
            unpairable,
        };
        (!self.filtered(t)).then_some((tier, locality))
    }

    fn finish_store(&mut self, buf: &[u8], f: &F, hmark: usize) {
        let (Some((hs, n)), Some((toff, ntok)), Some(bs)) = (f.hashes, f.tokens, f.bs) else {
            let why = f.invalid.unwrap_or(Invalid::Missing);
            return self.malformed(why, false, hmark);
        };
        if let Some(why) = f.invalid {
            return self.malformed(why, false, hmark);
        }
        if bs > i32::MAX as u64 {
            return self.malformed(Invalid::Type, false, hmark);
        }
        self.stats.stored_events += 1;
        if n == 0 {
            self.stats.empty_events += 1;
            return self.hashes.truncate(hmark);
        }
        let pairable = bs > 0 && (n as u64) * bs == ntok as u64;
        if !pairable {
            if ntok == 0 && bs == 0 {
                self.stats.placeholders += 1;
            } else {
                self.stats.unpairable_stores += 1;
            }
        }
        let Some((tier, loc)) = self.kept(buf, f, !pairable) else {
            return self.hashes.truncate(hmark);
        };
        if !pairable {
            self.stats.hash_only_stores += 1;
        }
        // per-block measurement
        let bs_eff: i32 = if pairable { bs as i32 } else { 0 };
        let cl = tier.map(|t| t.cache_level() as u64);
        let per_block = opt_v(if bs_eff != 0 {
            Some(bs_eff as i64 as u64)
        } else {
            None
        }) + opt_v(f.lora_id.map(|v| v as u64))
            + opt_v(cl);
        let blk_start = self.blocks.len();
        let mut tpos = toff as usize;
        let pre = match f.chunks {
            Some((cs, cbs)) if pairable && cbs as u64 == bs => Some(cs as usize),
            _ => None,
        };
        if pairable {
            self.bs_hint = bs as u32;
        }
        for i in 0..n as usize {
            let h = self.hashes[hs as usize + i];
            let mut body = per_block + if h != 0 { 1 + vlen(h as u64) } else { 0 };
            let mut tok_off = tpos as u32;
            let mut tb = 0usize;
            if let Some(cs) = pre {
                let (o, t) = self.chunks[cs + i];
                tok_off = o;
                tb = t as usize;
                body += ld(tb);
            } else if pairable {
                for _ in 0..bs {
                    let Some(v) = read_token(buf, &mut tpos) else {
                        // a token id that is negative or above u32::MAX
                        self.blocks.truncate(blk_start);
                        self.stats.stored_events -= 1;
                        return self.malformed(Invalid::Type, false, hmark);
                    };
                    tb += vlen(v as u64);
                }
                body += ld(tb);
            }
            self.blocks.push(BlockInfo {
                tok_off,
                tok_bytes: tb as u32,
                ek_off: 0,
                body_len: body as u32,
            });
        }
        if let Some(eoff) = f.extra {
            self.measure_extra(buf, eoff as usize, blk_start, n as usize);
        }
        let fixed = opt_v(tier.map(|t| t.value() as u64))
            + opt_ld(f.medium)
            + opt_v(f.group.map(u64::from))
            + opt_ld(f.kind)
            + opt_v(f.sliding.map(u64::from))
            + opt_v(loc.map(|l| l.value() as u64))
            + opt_ld(f.ownership)
            + opt_ld(f.session)
            + opt_ld(f.lora_name)
            + opt_ld(f.salt);
        let ev = Ev {
            kind: EvKind::Stored,
            parent: f.parent,
            tier,
            medium: f.medium,
            group_idx: f.group,
            spec_kind: f.kind,
            sliding: f.sliding,
            locality: loc,
            ownership: f.ownership,
            session_id: f.session,
            lora_name: f.lora_name,
            cache_salt: f.salt,
            lora_id: f.lora_id,
            block_size: bs_eff,
            hash_only: !pairable,
            hash_start: hs,
            blk_start: blk_start as u32,
            n,
            fixed_len: fixed as u32,
            packed: 0,
        };
        self.evs.push(ev);
        self.pack(hmark);
    }

    fn measure_extra(&mut self, buf: &[u8], off: usize, blk_start: usize, n: usize) {
        let mut c = Cur::new(buf, off);
        let Ok((m, at)) = c.marker() else { return };
        let Ok(Some(len)) = c.array_len(m, at) else {
            self.stats.extra_key_shapes_skipped += 1;
            return;
        };
        if len as usize != n {
            self.stats.extra_key_shapes_skipped += 1;
        }
        for i in 0..len as usize {
            let p = c.pos;
            if i < n && buf[p] != 0xc0 {
                let mut sz = 0usize;
                let skipped = ekeys::walk(buf, p, &mut |k| sz += k.entry_len());
                self.stats.extra_key_shapes_skipped += skipped;
                let b = &mut self.blocks[blk_start + i];
                b.ek_off = p as u32;
                b.body_len += sz as u32;
            }
            if c.skip_value().is_err() {
                return;
            }
        }
    }

    fn finish_removal(&mut self, buf: &[u8], f: &F, hmark: usize) {
        let Some((hs, n)) = f.hashes else {
            let why = f.invalid.unwrap_or(Invalid::Missing);
            return self.malformed(why, true, hmark);
        };
        if let Some(why) = f.invalid {
            return self.malformed(why, true, hmark);
        }
        self.stats.removed_events += 1;
        if n == 0 {
            self.stats.empty_events += 1;
            return self.hashes.truncate(hmark);
        }
        let Some((tier, loc)) = self.kept(buf, f, false) else {
            return self.hashes.truncate(hmark);
        };
        let fixed = opt_v(tier.map(|t| t.cache_level() as u64))
            + opt_v(tier.map(|t| t.value() as u64))
            + opt_ld(f.medium)
            + opt_v(f.group.map(u64::from))
            + opt_v(loc.map(|l| l.value() as u64))
            + opt_ld(f.ownership);
        let ev = Ev {
            kind: EvKind::Removed,
            tier,
            medium: f.medium,
            group_idx: f.group,
            locality: loc,
            ownership: f.ownership,
            hash_start: hs,
            n,
            fixed_len: fixed as u32,
            packed: f.packed,
            ..Ev::EMPTY
        };
        self.evs.push(ev);
        self.pack(hmark);
    }

    fn finish_clear(&mut self, buf: &[u8], f: &F, hmark: usize) {
        if let Some(why) = f.invalid {
            return self.malformed(why, false, hmark);
        }
        self.hashes.truncate(hmark);
        self.stats.cleared_events += 1;
        let ownership = f.ownership.map(|o| o.get(buf));
        if self.filtered(Traits {
            ownership,
            ..Traits::default()
        }) {
            return;
        }
        let ev = Ev {
            kind: EvKind::Cleared,
            ownership: f.ownership,
            fixed_len: opt_ld(f.ownership) as u32,
            ..Ev::EMPTY
        };
        self.evs.push(ev);
        self.pack(hmark);
    }

    /// Body length of a store part's blocks field entries for blocks `lo..hi`.
    #[inline]
    fn blk_entry(&self, ev: &PackInfo, i: u32) -> usize {
        ld(self.blocks[(ev.blk_start + i) as usize].body_len as usize)
    }

    #[inline]
    fn parent_len(&self, ev: &PackInfo, lo: u32) -> usize {
        let p = if lo == 0 {
            ev.parent
        } else {
            Some(self.hashes[(ev.hash_start + lo - 1) as usize])
        };
        opt_v(p.map(|v| v as u64))
    }

    /// Adds an event's part(s) to the records, splitting when needed. Drops (and counts) an
    /// event whose smallest part cannot fit into an empty record.
    fn pack(&mut self, hmark: usize) {
        let ev = {
            let e = self.evs.last().expect("event pushed");
            PackInfo {
                kind: e.kind,
                parent: e.parent,
                n: e.n,
                fixed_len: e.fixed_len,
                blk_start: e.blk_start,
                hash_start: e.hash_start,
                packed: e.packed,
            }
        };
        let thr = self.cfg.split_threshold;
        let room = thr.saturating_sub(REC_OVERHEAD_MAX);
        let ei = self.evs.len() as u32 - 1;
        // whole-event size, and the largest unit (block / hash) for the oversize check
        let (whole, unit_max) = match ev.kind {
            EvKind::Stored => {
                let mut s = 0usize;
                let mut mx = 0usize;
                for i in 0..ev.n {
                    let e = self.blk_entry(&ev, i);
                    s += e;
                    mx = mx.max(e);
                }
                (
                    ev.fixed_len as usize + self.parent_len(&ev, 0) + s,
                    ev.fixed_len as usize + 11 + mx,
                )
            }
            EvKind::Removed => {
                let s = ev.packed as usize;
                (
                    ev.fixed_len as usize + ld(s),
                    ev.fixed_len as usize + ld(10),
                )
            }
            EvKind::Cleared => (ev.fixed_len as usize, ev.fixed_len as usize),
        };
        let eb = entry_bound(whole);
        if self.open && self.used + eb <= thr {
            self.push_part(ei, 0, ev.n, whole, eb);
            return;
        }
        if eb <= room {
            self.open = false;
            self.push_part(ei, 0, ev.n, whole, eb);
            return;
        }
        if entry_bound(unit_max) > room {
            self.stats.oversized_events += 1;
            if ev.kind == EvKind::Stored {
                self.blocks.truncate(ev.blk_start as usize);
            }
            if ev.kind == EvKind::Removed {
                self.lost_removals += 1;
            }
            self.hashes.truncate(hmark);
            self.evs.pop();
            return;
        }

        // split at block / hash boundaries
        self.stats.split_events += 1;
        let mut lo = 0u32;
        while lo < ev.n {
            if !self.open {
                self.recs.push(Rec {
                    p0: self.parts.len() as u32,
                    p1: self.parts.len() as u32,
                });
                self.used = REC_OVERHEAD_MAX;
                self.open = true;
            }
            let avail = thr - self.used;
            let mut hi = lo;
            let mut d;
            match ev.kind {
                EvKind::Stored => {
                    d = ev.fixed_len as usize + self.parent_len(&ev, lo);
                    while hi < ev.n {
                        let nd = d + self.blk_entry(&ev, hi);
                        if entry_bound(nd) > avail {
                            break;
                        }
                        d = nd;
                        hi += 1;
                    }
                }
                _ => {
                    let mut packed = 0usize;
                    d = ev.fixed_len as usize;
                    while hi < ev.n {
                        let np = packed + vlen(self.hashes[(ev.hash_start + hi) as usize] as u64);
                        let nd = ev.fixed_len as usize + ld(np);
                        if entry_bound(nd) > avail {
                            break;
                        }
                        packed = np;
                        d = nd;
                        hi += 1;
                    }
                }
            }
            if hi == lo {
                // nothing fits in what is left of this record: start a fresh one
                self.open = false;
                continue;
            }
            let eb = entry_bound(d);
            self.push_part(ei, lo, hi, d, eb);
            lo = hi;
            if lo < ev.n {
                self.open = false;
            }
        }
    }

    fn push_part(&mut self, ev: u32, lo: u32, hi: u32, d: usize, eb: usize) {
        if !self.open {
            self.recs.push(Rec {
                p0: self.parts.len() as u32,
                p1: self.parts.len() as u32,
            });
            self.used = REC_OVERHEAD_MAX;
            self.open = true;
        }
        self.parts.push(Part {
            ev,
            lo,
            hi,
            data_len: d as u32,
        });
        self.recs.last_mut().expect("open record").p1 += 1;
        self.used += eb;
    }
}

/// What `pack` needs of an event.
struct PackInfo {
    kind: EvKind,
    parent: Option<i64>,
    n: u32,
    fixed_len: u32,
    blk_start: u32,
    hash_start: u32,
    packed: u32,
}

/// `ts`: float64, float32 or int.
fn read_ts(c: &mut Cur<'_>) -> Result<f64, DecodeError> {
    let (m, at) = c.marker()?;
    match m {
        Marker::F64 => {
            let b = c.take(8)?;
            Ok(f64::from_be_bytes(b.try_into().expect("8 bytes")))
        }
        Marker::F32 => {
            let b = c.take(4)?;
            Ok(f32::from_be_bytes(b.try_into().expect("4 bytes")) as f64)
        }
        _ => match c.int_of(m)? {
            Some(Int::U(v)) => Ok(v as f64),
            Some(Int::I(v)) => Ok(v as f64),
            None => Err(DecodeError::new(
                K::WrongType {
                    what: "ts",
                    marker: c.buf[at],
                },
                at,
            )),
        },
    }
}

/// The batch's rank element: int → Some, anything else → None (skipped).
fn read_rank(c: &mut Cur<'_>) -> Result<Option<i64>, DecodeError> {
    let s = c.pos;
    let (m, _) = c.marker()?;
    if let Some(i) = c.int_of(m)? {
        return Ok(i.as_i64());
    }
    c.pos = s;
    c.skip_value()?;
    Ok(None)
}
