//! A table's image: the flat byte form taken under the table lock (a linear copy, so the lock is
//! held only as long as a copy takes), and read back outside it to build snapshot chunks or to
//! restore a table from a checkpoint. The byte layout is specified in `LAYOUT.md` beside this
//! file (§2, "image").
use super::table::{Entry, Key, Table};

/// Image format version (`LAYOUT.md` §2).
pub(crate) const IMAGE_VERSION: u32 = 2;

/// Why an image could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ImageError {
    /// Shorter than its own lengths say.
    #[error("image truncated at byte {0}")]
    Truncated(usize),
    /// A block names an attribute set the image does not hold.
    #[error("image names unknown attribute set {0}")]
    UnknownAttrs(u32),
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

impl Table {
    /// Appends the table's image to `out` (LAYOUT.md §2).
    pub(crate) fn write_image(&self, out: &mut Vec<u8>) {
        out.reserve(self.heap_bytes_hint());
        put_u32(out, IMAGE_VERSION);
        put_u64(out, self.cut);
        put_u64(out, self.origin);
        put_u64(out, self.unknown);
        let used: Vec<u32> = (0..self.attrs.len() as u32)
            .filter(|&i| self.attrs[i as usize].refs > 0)
            .collect();
        put_u32(out, used.len() as u32);
        for id in used {
            let a = &self.attrs[id as usize];
            put_u32(out, id);
            put_u32(out, a.bytes.len() as u32);
            out.extend_from_slice(&a.bytes);
        }
        put_u64(out, self.len() as u64);
        for (key, e) in self.entries() {
            put_u64(out, key.hash() as u64);
            out.push(key.class());
            out.extend_from_slice(&key.group().to_le_bytes());
            out.push(e.copies);
            out.extend_from_slice(&e.rank.to_le_bytes());
            out.push(e.parent.is_some() as u8);
            put_u64(out, e.parent.unwrap_or(0) as u64);
            put_u32(out, e.attrs);
            put_u32(out, e.block.len() as u32);
            out.extend_from_slice(e.block);
        }
    }

    fn heap_bytes_hint(&self) -> usize {
        64 + self.len() * 32 + self.bytes() / 2
    }
}

/// One block of an image, borrowing its bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ImageBlock<'a> {
    pub(crate) hash: i64,
    pub(crate) class: u8,
    /// The table's group (`group_idx`, unset = 0); 0 in a version 1 image.
    pub(crate) group: u16,
    pub(crate) copies: u8,
    pub(crate) rank: u16,
    pub(crate) parent: Option<i64>,
    pub(crate) attrs: u32,
    pub(crate) block: &'a [u8],
}

/// A parsed image.
pub(crate) struct Image<'a> {
    pub(crate) cut: u64,
    pub(crate) origin: u64,
    pub(crate) unknown: u64,
    /// Attribute sets by id (`None`: unused id).
    pub(crate) attrs: Vec<Option<&'a [u8]>>,
    pub(crate) blocks: Vec<ImageBlock<'a>>,
}

struct Rd<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ImageError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or(ImageError::Truncated(self.pos))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, ImageError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, ImageError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, ImageError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, ImageError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
}

impl<'a> Image<'a> {
    /// Reads an image written by [`Table::write_image`].
    pub(crate) fn parse(b: &'a [u8]) -> Result<Self, ImageError> {
        let mut r = Rd { b, pos: 0 };
        let version = r.u32()?;
        let cut = r.u64()?;
        let origin = r.u64()?;
        let unknown = r.u64()?;
        let na = r.u32()?;
        let mut attrs: Vec<Option<&[u8]>> = Vec::new();
        for _ in 0..na {
            let id = r.u32()? as usize;
            let len = r.u32()? as usize;
            let bytes = r.take(len)?;
            if id >= attrs.len() {
                if id > b.len() {
                    return Err(ImageError::UnknownAttrs(id as u32));
                }
                attrs.resize(id + 1, None);
            }
            attrs[id] = Some(bytes);
        }
        let nb = r.u64()?;
        if nb > (b.len() / 28) as u64 {
            return Err(ImageError::Truncated(r.pos));
        }
        let mut blocks = Vec::with_capacity(nb as usize);
        for _ in 0..nb {
            let hash = r.u64()? as i64;
            let class = r.u8()?;
            let group = if version >= 2 { r.u16()? } else { 0 };
            let copies = r.u8()?;
            let rank = r.u16()?;
            let has_parent = r.u8()? != 0;
            let parent = r.u64()? as i64;
            let attrs_id = r.u32()?;
            let len = r.u32()? as usize;
            let block = r.take(len)?;
            if attrs.get(attrs_id as usize).copied().flatten().is_none() {
                return Err(ImageError::UnknownAttrs(attrs_id));
            }
            blocks.push(ImageBlock {
                hash,
                class,
                group,
                copies,
                rank,
                parent: has_parent.then_some(parent),
                attrs: attrs_id,
                block,
            });
        }
        Ok(Image {
            cut,
            origin,
            unknown,
            attrs,
            blocks,
        })
    }

    /// A table holding this image's state (bounded by `max_blocks`; blocks over the bound make
    /// it incomplete).
    pub(crate) fn to_table(&self, max_blocks: usize) -> Table {
        let mut t = Table::new(max_blocks, self.origin);
        t.cut = self.cut;
        t.unknown = self.unknown;
        let ids: Vec<Option<u32>> = self
            .attrs
            .iter()
            .map(|a| a.map(|a| t.attrs_id(a)))
            .collect();
        let mut lost = false;
        for b in &self.blocks {
            let Some(Some(attrs)) = ids.get(b.attrs as usize).copied() else {
                lost = true;
                continue;
            };
            let e = Entry::new(b.parent, b.block, attrs, b.copies.max(1), b.rank);
            if !t.insert(Key::new(b.hash, b.class, b.group), e) {
                lost = true;
            }
        }
        for id in ids.into_iter().flatten() {
            t.unused_attrs(id);
        }
        if lost {
            t.unknown = t.unknown.saturating_add(1);
        }
        t
    }
}
