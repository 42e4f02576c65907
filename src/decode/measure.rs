//! Pass 1, per parsed event: check its required fields, ask the filter (`filter.rs`), measure
//! its protobuf sizes into the scratch (with the `*_len` functions of `encode.rs`), and hand it
//! to `pack.rs`.
use super::encode::{
    block_len, block_shared_len, cleared_len, extra_key_entry_len, removed_fixed_len,
    stored_fixed_len,
};
use super::enums::{Locality, Tier};
use super::fields::{Fields, Invalid, Tokens};
use super::filter::Traits;
use super::pb::vlen;
use super::reader::{read_token, Cur};
use super::scratch::{BlockInfo, Ev, EvKind};
use super::{ekeys, Decoder};

impl Decoder {
    /// A parsed `BlockStored`: validated, classified, filtered, measured, packed.
    pub(crate) fn add_store(&mut self, buf: &[u8], f: &Fields, hmark: usize) {
        let (Some((hs, n)), Some(tok), Some(bs)) = (f.hashes, f.tokens, f.bs) else {
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
        let pairable = !tok.bigram && bs > 0 && (n as u64) * bs == tok.n as u64;
        if tok.bigram {
            self.stats.bigram_stores += 1;
        }
        if !pairable {
            if tok.n == 0 && bs == 0 {
                self.stats.placeholders += 1;
            } else {
                self.stats.unpairable_stores += 1;
            }
        }
        let Some((tier, locality)) = self.kept(buf, f, true, !pairable) else {
            return self.hashes.truncate(hmark);
        };
        if !pairable {
            self.stats.hash_only_stores += 1;
        }
        let mut ev = Ev {
            kind: EvKind::Stored,
            parent: f.parent,
            tier,
            medium: f.medium,
            group_idx: f.group,
            spec_kind: f.kind,
            sliding: f.sliding,
            locality,
            ownership: f.ownership,
            session_id: f.session,
            lora_name: f.lora_name,
            cache_salt: f.salt,
            lora_id: f.lora_id,
            block_size: if pairable { bs as i32 } else { 0 },
            hash_start: hs,
            blk_start: self.blocks.len() as u32,
            n,
            fixed_len: 0,
            packed: 0,
        };
        if pairable {
            self.bs_hint = bs as u32;
        }
        if !self.measure_blocks(buf, &ev, tok) {
            // a token id that is negative or above u32::MAX
            self.stats.stored_events -= 1;
            return self.malformed(Invalid::Type, false, hmark);
        }
        if let Some(eoff) = f.extra {
            self.measure_extra(buf, eoff as usize, ev.blk_start as usize, n as usize);
        }
        ev.fixed_len = stored_fixed_len(&ev) as u32;
        self.evs.push(ev);
        self.pack(hmark);
    }

    /// Pushes one [`BlockInfo`] per block of the store `ev` (`extra_keys` not yet counted),
    /// measuring the packed token bytes of each — or taking them from the walk `read_tokens`
    /// made with the block-size hint, when it used this store's `block_size`. Hash-only stores
    /// get blocks without tokens. Returns false, with nothing pushed, on a token id that is not
    /// a u32.
    fn measure_blocks(&mut self, buf: &[u8], ev: &Ev, tok: Tokens) -> bool {
        let shared = block_shared_len(ev);
        let bs = ev.block_size as u32; // 0 = hash-only
        let pre = match tok.chunks {
            Some((cs, cbs)) if bs != 0 && cbs == bs => Some(cs as usize),
            _ => None,
        };
        let mut tpos = tok.off as usize;
        for i in 0..ev.n as usize {
            let h = self.hashes[ev.hash_start as usize + i];
            let mut tok_off = tpos as u32;
            let mut tb = 0usize;
            if let Some(cs) = pre {
                let (o, t) = self.chunks[cs + i];
                tok_off = o;
                tb = t as usize;
            } else if bs != 0 {
                for _ in 0..bs {
                    let Some(v) = read_token(buf, &mut tpos) else {
                        self.blocks.truncate(ev.blk_start as usize);
                        return false;
                    };
                    tb += vlen(v as u64);
                }
            }
            self.blocks.push(BlockInfo {
                tok_off,
                tok_bytes: tb as u32,
                ek_off: 0,
                body_len: block_len(h, tb, shared) as u32,
            });
        }
        true
    }

    /// Adds the `extra_keys` of blocks `blk_start..blk_start + n` from the store's
    /// `extra_keys` list at `off` (one entry per block; a length mismatch or a non-list is
    /// counted as a skipped shape).
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
                let skipped = ekeys::walk(buf, p, &mut |k| sz += extra_key_entry_len(k));
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

    /// A parsed `BlockRemoved`: validated, classified, filtered, measured, packed.
    pub(crate) fn add_removal(&mut self, buf: &[u8], f: &Fields, hmark: usize) {
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
        let Some((tier, locality)) = self.kept(buf, f, false, false) else {
            return self.hashes.truncate(hmark);
        };
        let mut ev = Ev {
            kind: EvKind::Removed,
            tier,
            medium: f.medium,
            group_idx: f.group,
            locality,
            ownership: f.ownership,
            hash_start: hs,
            n,
            packed: f.packed,
            ..Ev::EMPTY
        };
        ev.fixed_len = removed_fixed_len(&ev) as u32;
        self.evs.push(ev);
        self.pack(hmark);
    }

    /// A parsed `AllBlocksCleared`: validated, filtered (ownership only), packed.
    pub(crate) fn add_clear(&mut self, buf: &[u8], f: &Fields, hmark: usize) {
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
        let mut ev = Ev {
            kind: EvKind::Cleared,
            ownership: f.ownership,
            ..Ev::EMPTY
        };
        ev.fixed_len = cleared_len(&ev) as u32;
        self.evs.push(ev);
        self.pack(hmark);
    }

    /// Tier and locality of a store or removal, or `None` when the profile drops it (counted).
    /// A store's group is learnt from either way.
    fn kept(
        &mut self,
        buf: &[u8],
        f: &Fields,
        store: bool,
        unpairable: bool,
    ) -> Option<(Option<Tier>, Option<Locality>)> {
        let (tier, locality) = self.classify(buf, f.medium, f.locality);
        let ((group, group_conflict), group_unseen) = if store {
            (self.store_group(buf, f, tier), false)
        } else {
            let (kind, unseen) = self.removal_group(buf, f);
            ((kind, false), unseen)
        };
        let t = Traits {
            tier,
            group,
            group_unseen,
            group_conflict,
            locality,
            ownership: f.ownership.map(|o| o.get(buf)),
            unpairable,
        };
        (!self.filtered(t)).then_some((tier, locality))
    }

    /// Skips an event that failed validation (counted by reason; a removal is a lost one).
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
}
