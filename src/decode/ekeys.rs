//! `extra_keys` entries → [`Key`]s, walked by both passes (pass 1 measures them, pass 2 writes
//! them, with `extra_key_entry_len` / `write_extra_key` of `encode.rs`), so sizes and bytes agree.
//!
//! Block *i*'s entry: nil → no keys; str → `text`, bin → `blob`, int → `number`, a 2-array
//! (str, int) → `multimodal`; an array of such items → each item a key, one level of nested
//! arrays flattened (vLLM writes `(lora_name, [(mm_hash, offset), …], salt)`).
//!
//! **Typed keys** (vLLM #55488, `event_version` 1): an item may instead be a tagged map,
//! `{"type": T, …}`, which becomes the same key its untyped form did, so a router sees one
//! shape whatever the release: `MultiModalKey` (`hash`, `block_offset`) → `multimodal`,
//! `LoRAKey` (`name`) and `CacheSaltKey` (`salt`) → `text`, `PromptEmbedsKey` (`hash`) → `blob`
//! (or `text`), `LegacyExtraKey` (`value`) → its value read as an untyped item.
//!
//! Anything else (nil/float/bool items, maps of another type, deeper arrays, non-UTF-8 text)
//! is skipped and counted.
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
    if let Some(n) = c.map_len(m, at)? {
        if depth <= EK_DEPTH {
            return typed(c, n, depth, f);
        }
        c.pos = start;
        c.skip_value()?;
        return Ok(1);
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

/// The fields of a typed key that name what it holds.
#[derive(Default)]
struct TypedFields<'a> {
    tag: Option<&'a [u8]>,
    /// `hash`, `name` or `salt`: the key's text (or bytes, for `PromptEmbedsKey`).
    text: Option<&'a [u8]>,
    bytes: Option<&'a [u8]>,
    offset: Option<i64>,
    /// Offset of `LegacyExtraKey.value`.
    value: Option<usize>,
}

/// A typed key (a map of `n` pairs, `c` after its header): the key its untyped form was.
fn typed<'a>(
    c: &mut Cur<'a>,
    n: u32,
    depth: u32,
    f: &mut impl FnMut(Key<'a>),
) -> Result<u64, DecodeError> {
    let mut t = TypedFields::default();
    for _ in 0..n {
        let (km, kat) = c.marker()?;
        let key = c.str_of(km, kat)?;
        let vpos = c.pos;
        let (vm, vat) = c.marker()?;
        match key {
            Some(b"type") => {
                t.tag = c.str_of(vm, vat)?;
                if t.tag.is_none() {
                    c.pos = vpos;
                    c.skip_value()?;
                }
            }
            Some(b"hash" | b"name" | b"salt") => {
                if let Some(s) = c.str_of(vm, vat)? {
                    t.text = Some(s);
                } else if let Some(b) = c.bin_of(vm, vat)? {
                    t.bytes = Some(b);
                } else {
                    c.pos = vpos;
                    c.skip_value()?;
                }
            }
            Some(b"block_offset") => match c.int_of(vm)? {
                Some(i) => t.offset = Some(i.bits() as i64),
                None => {
                    c.pos = vpos;
                    c.skip_value()?;
                }
            },
            Some(b"value") => {
                t.value = Some(vpos);
                c.pos = vpos;
                c.skip_value()?;
            }
            _ => {
                // `modality` and anything newer: not part of the key a router compares.
                c.pos = vpos;
                c.skip_value()?;
            }
        }
    }
    let utf8 = |s: &'a [u8]| std::str::from_utf8(s).is_ok().then_some(s);
    let key = match (t.tag, t.text.and_then(utf8), t.bytes, t.offset) {
        (Some(b"MultiModalKey"), Some(id), _, Some(off)) => Key::Mm(id, off),
        (Some(b"LoRAKey" | b"CacheSaltKey" | b"PromptEmbedsKey"), Some(s), _, _) => Key::Text(s),
        (Some(b"PromptEmbedsKey"), None, Some(b), _) => Key::Blob(b),
        (Some(b"LegacyExtraKey"), ..) => {
            let Some(at) = t.value else { return Ok(1) };
            let end = c.pos;
            c.pos = at;
            // One level deeper, so that values nesting typed keys stay bounded.
            let skipped = item(c, depth + 1, f)?;
            c.pos = end;
            return Ok(skipped);
        }
        _ => return Ok(1),
    };
    f(key);
    Ok(0)
}
