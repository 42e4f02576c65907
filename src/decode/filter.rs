//! The filter profile (docs/smg-api.md §5): what [`Profile::Smg`] drops and why, in one place, and
//! the engine strings it looks at — tier (from `medium`), locality, the attention group's kind.
//! [`Profile::All`] drops nothing here; unpairable stores then go out hash-only.
//!
//! Reasons, first match counted ([`DropReason`]): DISK/EXTERNAL tier (stores, removals); a group whose
//! kind is not main attention (stores, removals; the kind is learnt per `group_idx` from the
//! stores, under both profiles, and kept across restarts: groups.rs); a removal of a group no
//! store has been seen of (its kind is unknown: forwarding it could drop a block the main
//! group holds); a store that contradicts its group's pinned kind or block size (another cache
//! under the same index); REMOTE locality (stores, removals); ownership `kvcr`,
//! case-insensitive (stores, removals, clears); unpairable stores.
use super::enums::{Locality, Tier};
use super::groups::{Conflict, GroupKind, StoreGroup};
use super::scratch::Span;
use super::stats::DecodeStats;
use super::{Decoder, Profile};

/// Why [`Profile::Smg`] drops an event. Checked in this order; the first match is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DropReason {
    /// DISK or EXTERNAL tier (`filtered_tier`).
    Tier,
    /// A group that is not main attention (`filtered_group`).
    Group,
    /// A removal of a group whose kind is not known: no store of it seen
    /// (`filtered_group_unknown`).
    GroupUnknown,
    /// A store contradicting its group's pinned kind or block size (`filtered_group_conflict`).
    GroupConflict,
    /// REMOTE locality (`filtered_remote`).
    Remote,
    /// Ownership `kvcr` (`filtered_ownership`).
    Ownership,
    /// A store whose tokens cannot be paired with its hashes, or a placeholder
    /// (`filtered_unpairable`).
    Unpairable,
}

impl DropReason {
    fn counter(self, s: &mut DecodeStats) -> &mut u64 {
        match self {
            DropReason::Tier => &mut s.filtered_tier,
            DropReason::Group => &mut s.filtered_group,
            DropReason::GroupUnknown => &mut s.filtered_group_unknown,
            DropReason::GroupConflict => &mut s.filtered_group_conflict,
            DropReason::Remote => &mut s.filtered_remote,
            DropReason::Ownership => &mut s.filtered_ownership,
            DropReason::Unpairable => &mut s.filtered_unpairable,
        }
    }
}

/// What the filter looks at in one event.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Traits<'a> {
    pub(crate) tier: Option<Tier>,
    pub(crate) group: GroupKind,
    /// A removal whose group no store has been seen of.
    pub(crate) group_unseen: bool,
    /// A store contradicting its group.
    pub(crate) group_conflict: bool,
    pub(crate) locality: Option<Locality>,
    pub(crate) ownership: Option<&'a [u8]>,
    pub(crate) unpairable: bool,
}

/// The SMG profile's verdict: the first reason to drop, or `None` to keep.
fn smg_verdict(t: &Traits<'_>) -> Option<DropReason> {
    if matches!(t.tier, Some(Tier::Disk | Tier::External)) {
        Some(DropReason::Tier)
    } else if t.group_conflict {
        Some(DropReason::GroupConflict)
    } else if t.group == GroupKind::Other {
        Some(DropReason::Group)
    } else if t.group_unseen {
        Some(DropReason::GroupUnknown)
    } else if t.locality == Some(Locality::Remote) {
        Some(DropReason::Remote)
    } else if t.ownership.is_some_and(|o| o.eq_ignore_ascii_case(b"kvcr")) {
        Some(DropReason::Ownership)
    } else if t.unpairable {
        Some(DropReason::Unpairable)
    } else {
        None
    }
}

impl Decoder {
    /// Tier and locality of an event; counts a locality that is neither LOCAL nor REMOTE.
    pub(crate) fn classify(
        &mut self,
        buf: &[u8],
        medium: Option<Span>,
        locality: Option<Span>,
    ) -> (Option<Tier>, Option<Locality>) {
        let tier = medium.and_then(|s| Tier::from_medium(s.get(buf)));
        let loc = locality.and_then(|s| {
            let l = Locality::parse(s.get(buf));
            if l.is_none() {
                self.stats.locality_unknown += 1;
            }
            l
        });
        (tier, loc)
    }

    /// The kind of a store's group, and whether the store contradicts what its group is pinned
    /// to (groups.rs); learns from it otherwise, under both profiles.
    pub(crate) fn store_group(
        &mut self,
        buf: &[u8],
        f: &super::fields::Fields,
        tier: Option<Tier>,
    ) -> (GroupKind, bool) {
        let kind = f.kind.map(|k| GroupKind::of_spec_kind(k.get(buf)));
        let Some(idx) = f.group else {
            return (kind.unwrap_or_default(), false);
        };
        let device = matches!(tier, None | Some(Tier::Device));
        let bs =
            f.bs.filter(|&b| b > 0 && b <= u32::MAX as u64)
                .map(|b| b as u32);
        // Only a store that names its kind is a full block of its group: vLLM's partial-block
        // stores (`BlockPool.cache_partial_block`, 0.32) carry the group but no kind and the
        // length of the partial stretch as `block_size`. Pinned by one of those first, the
        // group's real blocks would all look like another cache and be dropped under `smg`.
        let (kind, conflict) = self.groups.store(StoreGroup {
            idx,
            kind,
            window: f.sliding,
            device_block_size: bs.filter(|_| device && kind.is_some()),
        });
        (kind, conflict == Conflict::Yes)
    }

    /// The kind of a removal's group: its own `kv_cache_spec_kind` if it has one, else what
    /// was learnt for its `group_idx`; and whether no store of that group has been seen.
    pub(crate) fn removal_group(&self, buf: &[u8], f: &super::fields::Fields) -> (GroupKind, bool) {
        if let Some(k) = f.kind {
            return (GroupKind::of_spec_kind(k.get(buf)), false);
        }
        match f.group {
            None => (GroupKind::Unknown, false),
            Some(idx) => match self.groups.get(idx) {
                Some(g) => (g.kind, false),
                None => (GroupKind::Unknown, true),
            },
        }
    }

    /// Applies the profile: true = drop the event (counted by reason).
    pub(crate) fn filtered(&mut self, t: Traits<'_>) -> bool {
        if self.cfg.profile != Profile::Smg {
            return false;
        }
        match smg_verdict(&t) {
            Some(why) => {
                *why.counter(&mut self.stats) += 1;
                true
            }
            None => false,
        }
    }
}
