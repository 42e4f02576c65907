//! `extra_keys` entries → [`Key`]s, walked by both passes (pass 1 measures them, pass 2 writes
//! them, with `extra_key_entry_len` / `write_extra_key` of `encode.rs`), so sizes and bytes agree.
//!
//! Block *i*'s entry: nil → no keys; str → `text`, bin → `blob`, int → `number`, a 2-array
//! (str, int) → `multimodal`; an array of such items → each item a key, one level of nested
//! arrays flattened (vLLM writes `(lora_name, [(mm_hash, offset), …], salt)`). Anything else
//! (nil/float/bool/map items, deeper arrays, non-UTF-8 text) is skipped and counted.
use super::error::DecodeError;
use super::reader::Cur;

/// Array nesting followed below a block's entry.
const EK_DEPTH: u32 = 2;

/// One `KvBlockExtraKey`, borrowing from the payload.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Key<'a> {
    /// `text` (valid UTF-8).
    Text(&'a [u8]),
    /// `blob`.
    Blob(&'a [u8]),
    /// `number` (int64 bits).
    Number(i64),
    /// `multimodal`: identifier, offset.
    Mm(&'a [u8], i64),
}

/// Walks the (non-nil, structurally valid) entry at `pos`, calling `f` per key. Returns the
/// number of skipped shapes.
pub(crate) fn walk<'a>(buf: &'a [u8], pos: usize, f: &mut impl FnMut(Key<'a>)) -> u64 {
    let mut c = Cur::new(buf, pos);
    item(&mut c, 0, f).unwrap_or(1)
}

fn item<'a>(c: &mut Cur<'a>, depth: u32, f: &mut impl FnMut(Key<'a>)) -> Result<u64, DecodeError> {
    let start = c.pos;
    let (m, at) = c.marker()?;
    if let Some(s) = c.str_of(m, at)? {
        if std::str::from_utf8(s).is_ok() {
            f(Key::Text(s));
            return Ok(0);
        }
        return Ok(1);
    }
    if let Some(b) = c.bin_of(m, at)? {
        f(Key::Blob(b));
        return Ok(0);
    }
    if let Some(i) = c.int_of(m)? {
        f(Key::Number(i.bits() as i64));
        return Ok(0);
    }
    if let Some(n) = c.array_len(m, at)? {
        if n == 2 {
            // (str, int) → multimodal
            let save = c.pos;
            let (m1, a1) = c.marker()?;
            if let Some(id) = c.str_of(m1, a1)? {
                let (m2, _) = c.marker()?;
                if let Some(off) = c.int_of(m2)? {
                    if std::str::from_utf8(id).is_ok() {
                        f(Key::Mm(id, off.bits() as i64));
                        return Ok(0);
                    }
                    return Ok(1);
                }
            }
            c.pos = save;
        }
        if depth < EK_DEPTH {
            let mut skipped = 0;
            for _ in 0..n {
                skipped += item(c, depth + 1, f)?;
            }
            return Ok(skipped);
        }
    }
    c.pos = start;
    c.skip_value()?;
    Ok(1)
}
