//! What the decoder knows of each KV-cache group of its rank, learnt from the stores it has
//! seen: the group's kind, its sliding window and its block size on the device tier
//! (docs/engine-wire.md §7 "Groups and tiers").
//!
//! **Why it must outlive the process.** A hybrid model's engine (sliding window + full
//! attention: Gemma 3, Mistral, Qwen) publishes one group per attention kind, and the same
//! block hash in several groups. Its stores say their group's kind, its removals only the group
//! index. Under `--profile smg` kvbridge keeps the main-attention groups and drops the others;
//! a removal is told apart by the kind learnt for its index. A kvbridge that forgot what it
//! learnt (a restart on the same ring) would forward a sliding group's removal of a hash the
//! full group still holds, and every gateway would drop a block the engine has. So the groups
//! are written to the ring's writer notes (shm LAYOUT.md §3.1) whenever they change, before the
//! batch that taught them is published, and a restarted kvbridge starts from them.
//!
//! **Pinned.** The first store of a group fixes its kind and (on the device tier) its block
//! size. A later store of the same index that contradicts either (DeepSeek-V4's fp4 indexer
//! cache publishes `mla_attention` stores of block size 4 as group 0 beside the real group 0 at
//! block size 256) is another cache under the same index: [`Conflict`] makes the filter drop it
//! under `smg`, counted, and nothing is learnt from it.

/// What kind of KV-cache group an event belongs to (from `kv_cache_spec_kind`, or remembered
/// for its `group_idx`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(u8)]
pub(crate) enum GroupKind {
    /// No kind given and none remembered for the group.
    #[default]
    Unknown,
    /// `full_attention`, `mla_attention` or `sink_full_attention` (case-insensitive).
    MainAttention,
    /// Any other kind (sliding window, mamba, …): SMG would misindex it.
    Other,
}

impl GroupKind {
    #[inline]
    pub(crate) fn of_spec_kind(k: &[u8]) -> GroupKind {
        if k.eq_ignore_ascii_case(b"full_attention")
            || k.eq_ignore_ascii_case(b"mla_attention")
            || k.eq_ignore_ascii_case(b"sink_full_attention")
        {
            GroupKind::MainAttention
        } else {
            GroupKind::Other
        }
    }
}

/// Groups remembered per rank (indices at or above it are treated as unseen).
pub(crate) const MAX_GROUPS: usize = 4096;

/// One group as learnt from its stores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Group {
    /// A store of the group has been seen (or the group was restored from the ring).
    pub(crate) seen: bool,
    /// The kind its stores gave (`Unknown`: they carry none, as older engines).
    pub(crate) kind: GroupKind,
    /// `kv_cache_spec_sliding_window` (0: none given).
    pub(crate) window: u32,
    /// `block_size` of its device-tier stores (0: none seen yet).
    pub(crate) block_size: u32,
}

/// What a store says about its group, compared with what the group is pinned to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Conflict {
    /// Consistent (or the first store of its group).
    No,
    /// Its kind or device block size contradicts the group's.
    Yes,
}

/// The groups of one rank, by `group_idx`.
#[derive(Debug, Default)]
pub(crate) struct Groups {
    by_idx: Vec<Group>,
    /// Something changed since [`Groups::take_changed`] last returned.
    changed: bool,
}

/// A store's group-related fields, as parsed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StoreGroup {
    pub(crate) idx: u32,
    /// `kv_cache_spec_kind`, classified.
    pub(crate) kind: Option<GroupKind>,
    pub(crate) window: Option<u32>,
    /// `block_size` when the store is on the device tier (GPU, or no medium) and non-zero.
    pub(crate) device_block_size: Option<u32>,
}

impl Groups {
    /// The kind a store of `s` is filtered by, learning from it when it is consistent.
    pub(crate) fn store(&mut self, s: StoreGroup) -> (GroupKind, Conflict) {
        let i = s.idx as usize;
        if i >= MAX_GROUPS {
            return (s.kind.unwrap_or_default(), Conflict::No);
        }
        if self.by_idx.len() <= i {
            self.by_idx.resize(i + 1, Group::default());
        }
        let g = &mut self.by_idx[i];
        if !g.seen {
            *g = Group {
                seen: true,
                kind: s.kind.unwrap_or_default(),
                window: s.window.unwrap_or(0),
                block_size: s.device_block_size.unwrap_or(0),
            };
            self.changed = true;
            return (g.kind, Conflict::No);
        }
        let kind_differs = matches!(s.kind, Some(k) if g.kind != GroupKind::Unknown && k != g.kind);
        let size_differs =
            matches!(s.device_block_size, Some(b) if g.block_size != 0 && b != g.block_size);
        if kind_differs || size_differs {
            return (GroupKind::Other, Conflict::Yes);
        }
        if let (GroupKind::Unknown, Some(k)) = (g.kind, s.kind) {
            g.kind = k;
            self.changed = true;
        }
        if let (0, Some(b)) = (g.block_size, s.device_block_size) {
            g.block_size = b;
            self.changed = true;
        }
        if let (0, Some(w)) = (g.window, s.window) {
            g.window = w;
            self.changed = true;
        }
        (s.kind.unwrap_or(g.kind), Conflict::No)
    }

    /// The group `idx` of a removal: `None` when no store of it has been seen.
    pub(crate) fn get(&self, idx: u32) -> Option<Group> {
        self.by_idx.get(idx as usize).copied().filter(|g| g.seen)
    }

    /// Every group seen, with its index, when anything changed since the last call.
    pub(crate) fn take_changed(&mut self) -> Option<Vec<(u32, Group)>> {
        if !std::mem::take(&mut self.changed) {
            return None;
        }
        Some(self.iter().collect())
    }

    fn iter(&self) -> impl Iterator<Item = (u32, Group)> + '_ {
        self.by_idx
            .iter()
            .enumerate()
            .filter(|(_, g)| g.seen)
            .map(|(i, g)| (i as u32, *g))
    }

    /// Starts from `groups` (restored from the ring), without marking a change.
    pub(crate) fn restore(&mut self, groups: impl IntoIterator<Item = (u32, Group)>) {
        for (i, g) in groups {
            let i = i as usize;
            if i < MAX_GROUPS {
                if self.by_idx.len() <= i {
                    self.by_idx.resize(i + 1, Group::default());
                }
                self.by_idx[i] = Group { seen: true, ..g };
            }
        }
    }

    /// Forgets every group (a new engine incarnation may serve another model).
    pub(crate) fn forget(&mut self) {
        if self.by_idx.iter().any(|g| g.seen) {
            self.changed = true;
        }
        self.by_idx.clear();
    }
}

/// A group as one 16-byte ring writer note: `[1, kind, rank u16, group u32, block_size u32,
/// window u32]`, little-endian (kind: 0 none given, 1 main attention, 2 other).
pub(crate) fn note(rank: u32, idx: u32, g: &GroupNote) -> [u8; 16] {
    let mut n = [0u8; 16];
    n[0] = NOTE_GROUP;
    n[1] = g.kind;
    n[2..4].copy_from_slice(&(rank.min(u16::MAX as u32) as u16).to_le_bytes());
    n[4..8].copy_from_slice(&idx.to_le_bytes());
    n[8..12].copy_from_slice(&g.block_size.to_le_bytes());
    n[12..16].copy_from_slice(&g.window.to_le_bytes());
    n
}

/// The note type of a group note.
const NOTE_GROUP: u8 = 1;

/// A group as its note carries it (what the decoder learnt of a group, outside the decoder).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupNote {
    /// 0 none given, 1 main attention, 2 other.
    pub kind: u8,
    /// Device-tier block size (0: none seen).
    pub block_size: u32,
    /// Sliding window (0: none given).
    pub window: u32,
}

/// A group note read back: (rank, group index, group); `None` for another note type.
pub fn parse_note(n: &[u8; 16]) -> Option<(u32, u32, GroupNote)> {
    if n[0] != NOTE_GROUP || n[1] > 2 {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes(n[i..i + 4].try_into().expect("4 bytes"));
    let rank = u16::from_le_bytes([n[2], n[3]]) as u32;
    Some((
        rank,
        u32_at(4),
        GroupNote {
            kind: n[1],
            block_size: u32_at(8),
            window: u32_at(12),
        },
    ))
}

impl From<Group> for GroupNote {
    fn from(g: Group) -> Self {
        GroupNote {
            kind: match g.kind {
                GroupKind::Unknown => 0,
                GroupKind::MainAttention => 1,
                GroupKind::Other => 2,
            },
            block_size: g.block_size,
            window: g.window,
        }
    }
}

impl From<GroupNote> for Group {
    fn from(n: GroupNote) -> Self {
        Group {
            seen: true,
            kind: match n.kind {
                1 => GroupKind::MainAttention,
                2 => GroupKind::Other,
                _ => GroupKind::Unknown,
            },
            window: n.window,
            block_size: n.block_size,
        }
    }
}

impl super::Decoder {
    /// This rank's groups as ring writer notes, when the stores taught something new since the
    /// last call (or the groups were forgotten): the caller writes them to the ring before it
    /// publishes the batch.
    pub fn group_notes_changed(&mut self, rank: u32) -> Option<Vec<[u8; 16]>> {
        let groups = self.groups.take_changed()?;
        Some(
            groups
                .iter()
                .map(|(i, g)| note(rank, *i, &GroupNote::from(*g)))
                .collect(),
        )
    }

    /// Starts from groups kept in the ring by an earlier kvbridge ([`parse_note`]).
    pub fn restore_groups(&mut self, groups: impl IntoIterator<Item = (u32, GroupNote)>) {
        self.groups
            .restore(groups.into_iter().map(|(i, n)| (i, Group::from(n))));
    }

    /// Forgets every group: a new engine incarnation (which may serve another model).
    pub fn forget_groups(&mut self) {
        self.groups.forget();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(idx: u32, kind: Option<GroupKind>, bs: Option<u32>) -> StoreGroup {
        StoreGroup {
            idx,
            kind,
            window: None,
            device_block_size: bs,
        }
    }

    #[test]
    fn first_store_pins_kind_and_block_size_and_a_contradiction_is_a_conflict() {
        let mut g = Groups::default();
        let main = Some(GroupKind::MainAttention);
        assert_eq!(
            g.store(s(0, main, Some(256))),
            (GroupKind::MainAttention, Conflict::No)
        );
        assert!(g.take_changed().is_some());
        assert!(g.take_changed().is_none());
        // the same again: nothing new
        assert_eq!(g.store(s(0, main, Some(256))).1, Conflict::No);
        assert!(g.take_changed().is_none());
        // DeepSeek-V4's indexer cache: same index and kind, block size 4
        assert_eq!(
            g.store(s(0, main, Some(4))),
            (GroupKind::Other, Conflict::Yes)
        );
        // a sliding store under a main group's index
        let other = Some(GroupKind::Other);
        assert_eq!(
            g.store(s(0, other, None)),
            (GroupKind::Other, Conflict::Yes)
        );
        assert_eq!(g.get(0).unwrap().block_size, 256);
        assert!(g.take_changed().is_none(), "nothing learnt from conflicts");
        // a store with no kind or block size (an offload tier) keeps the group's kind
        assert_eq!(
            g.store(s(0, None, None)),
            (GroupKind::MainAttention, Conflict::No)
        );
    }

    #[test]
    fn removals_of_unseen_groups_are_told_apart_and_notes_round_trip() {
        let mut g = Groups::default();
        assert_eq!(g.get(1), None);
        g.store(StoreGroup {
            idx: 1,
            kind: Some(GroupKind::Other),
            window: Some(64),
            device_block_size: Some(32),
        });
        let seen = g.take_changed().unwrap();
        assert_eq!(seen.len(), 1);
        let (i, grp) = seen[0];
        let n = note(3, i, &grp.into());
        let (rank, idx, back) = parse_note(&n).unwrap();
        assert_eq!((rank, idx), (3, 1));
        let mut h = Groups::default();
        h.restore([(idx, Group::from(back))]);
        assert_eq!(h.get(1), Some(grp));
        assert!(h.take_changed().is_none(), "a restore is no change");
        h.forget();
        assert_eq!(h.get(1), None);
        assert_eq!(h.take_changed(), Some(vec![]));
        assert_eq!(parse_note(&[0u8; 16]), None);
    }
}
