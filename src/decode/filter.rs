//! The filter profile (docs/smg-api.md §5): what [`Profile::Smg`] drops and why, in one place, and
//! the engine strings it looks at — tier (from `medium`), locality, the attention group's kind.
//! [`Profile::All`] drops nothing here; unpairable stores then go out hash-only.
//!
//! Reasons, first match counted ([`DropReason`]): DISK/EXTERNAL tier (stores, removals); a group whose
//! kind is not main attention (stores, removals; the kind is remembered per `group_idx` for later
//! events that omit it, under both profiles); REMOTE locality (stores, removals); ownership
//! `kvcr`, case-insensitive (stores, removals, clears); unpairable stores.
use super::enums::{Locality, Tier};
use super::scratch::Span;
use super::stats::DecodeStats;
use super::{Decoder, Profile};

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
    fn of_spec_kind(k: &[u8]) -> GroupKind {
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

/// Group indices remembered for the kind filter.
const MAX_GROUPS: usize = 4096;

/// Why [`Profile::Smg`] drops an event. Checked in this order; the first match is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DropReason {
    /// DISK or EXTERNAL tier (`filtered_tier`).
    Tier,
    /// A group that is not main attention (`filtered_group`).
    Group,
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
    pub(crate) locality: Option<Locality>,
    pub(crate) ownership: Option<&'a [u8]>,
    pub(crate) unpairable: bool,
}

/// The SMG profile's verdict: the first reason to drop, or `None` to keep.
fn smg_verdict(t: &Traits<'_>) -> Option<DropReason> {
    if matches!(t.tier, Some(Tier::Disk | Tier::External)) {
        Some(DropReason::Tier)
    } else if t.group == GroupKind::Other {
        Some(DropReason::Group)
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

    /// The kind of an event's group: from its `kv_cache_spec_kind` (remembered for its
    /// `group_idx`, when below [`MAX_GROUPS`]), else the kind remembered for its `group_idx`.
    pub(crate) fn group_kind(
        &mut self,
        buf: &[u8],
        spec_kind: Option<Span>,
        group: Option<u32>,
    ) -> GroupKind {
        match (spec_kind, group) {
            (Some(k), g) => {
                let kind = GroupKind::of_spec_kind(k.get(buf));
                if let Some(g) = g {
                    let g = g as usize;
                    if g < MAX_GROUPS {
                        if self.group_kind.len() <= g {
                            self.group_kind.resize(g + 1, GroupKind::Unknown);
                        }
                        self.group_kind[g] = kind;
                    }
                }
                kind
            }
            (None, Some(g)) => self.group_kind.get(g as usize).copied().unwrap_or_default(),
            (None, None) => GroupKind::Unknown,
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
