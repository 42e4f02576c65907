//! Typed decode errors: what went wrong and at which byte of the payload.
use thiserror::Error;

/// What made a payload undecodable as a whole. Event-level problems (a known event failing
/// validation, an unknown tag, an unknown key) never produce one of these: they are skipped and
/// counted in [`super::DecodeStats`].
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum DecodeErrorKind {
    /// The payload has no bytes.
    #[error("empty payload")]
    Empty,
    /// The payload ends inside a value.
    #[error("truncated payload ({need} more bytes needed)")]
    Truncated {
        /// Bytes missing for the value being read.
        need: usize,
    },
    /// An array/map/str/bin header declares more elements or bytes than the input has left
    /// (checked before anything is walked or reserved).
    #[error("declared length {declared} exceeds the remaining input")]
    LengthExceedsInput {
        /// The declared element or byte count.
        declared: u64,
    },
    /// The reserved msgpack marker `0xc1`.
    #[error("reserved msgpack marker 0xc1")]
    InvalidMarker,
    /// Containers nested deeper than the skip-depth bound.
    #[error("nesting deeper than {limit}")]
    TooDeep {
        /// The bound.
        limit: usize,
    },
    /// A batch-level value has the wrong msgpack type.
    #[error("unexpected msgpack marker 0x{marker:02x} for {what}")]
    WrongType {
        /// What was expected there.
        what: &'static str,
        /// The marker byte found.
        marker: u8,
    },
    /// The batch array has fewer than 2 elements.
    #[error("batch array has {len} elements, need at least 2")]
    BatchTooShort {
        /// Its length.
        len: u32,
    },
    /// A map-shaped batch lacks a required key.
    #[error("batch map lacks `{0}`")]
    MissingField(&'static str),
    /// A map-shaped batch repeats a key.
    #[error("batch map repeats `{0}`")]
    DuplicateKey(&'static str),
    /// More events than [`super::DecodeConfig::max_events`].
    #[error("{count} events exceed the limit of {limit}")]
    TooManyEvents {
        /// Declared event count.
        count: u64,
        /// Configured limit.
        limit: usize,
    },
    /// More bytes than [`super::DecodeConfig::max_payload`].
    #[error("payload of {len} bytes exceeds the limit of {limit}")]
    PayloadTooLarge {
        /// Payload length.
        len: usize,
        /// Configured limit.
        limit: usize,
    },
}

/// Why a payload could not be decoded at all (the whole batch is rejected; the caller treats it
/// as an undecodable batch, docs/engine-wire.md §8). Displays as "`<kind>` at byte `<offset>`".
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
#[error("{kind} at byte {offset}")]
pub struct DecodeError {
    /// What went wrong.
    pub kind: DecodeErrorKind,
    /// Byte offset in the payload.
    pub offset: usize,
}

impl DecodeErrorKind {
    /// Every [`label`](Self::label) (the metric's label values, exported at 0 from the start).
    pub const LABELS: [&'static str; 11] = [
        "empty",
        "truncated",
        "length_exceeds_input",
        "invalid_marker",
        "too_deep",
        "wrong_type",
        "batch_too_short",
        "missing_field",
        "duplicate_key",
        "too_many_events",
        "payload_too_large",
    ];

    /// A short name for metrics labels.
    pub fn label(&self) -> &'static str {
        match self {
            DecodeErrorKind::Empty => "empty",
            DecodeErrorKind::Truncated { .. } => "truncated",
            DecodeErrorKind::LengthExceedsInput { .. } => "length_exceeds_input",
            DecodeErrorKind::InvalidMarker => "invalid_marker",
            DecodeErrorKind::TooDeep { .. } => "too_deep",
            DecodeErrorKind::WrongType { .. } => "wrong_type",
            DecodeErrorKind::BatchTooShort { .. } => "batch_too_short",
            DecodeErrorKind::MissingField(_) => "missing_field",
            DecodeErrorKind::DuplicateKey(_) => "duplicate_key",
            DecodeErrorKind::TooManyEvents { .. } => "too_many_events",
            DecodeErrorKind::PayloadTooLarge { .. } => "payload_too_large",
        }
    }
}

impl DecodeError {
    #[cold]
    pub(crate) fn new(kind: DecodeErrorKind, offset: usize) -> Self {
        Self { kind, offset }
    }
}

#[cfg(test)]
mod tests {
    use super::DecodeErrorKind as K;

    /// `LABELS` is every label, so that every kind's series exists from the start.
    #[test]
    fn labels_are_every_kinds_label() {
        let every = [
            K::Empty,
            K::Truncated { need: 1 },
            K::LengthExceedsInput { declared: 1 },
            K::InvalidMarker,
            K::TooDeep { limit: 1 },
            K::WrongType {
                what: "x",
                marker: 0,
            },
            K::BatchTooShort { len: 1 },
            K::MissingField("x"),
            K::DuplicateKey("x"),
            K::TooManyEvents { count: 1, limit: 1 },
            K::PayloadTooLarge { len: 1, limit: 1 },
        ];
        let labels: Vec<&str> = every.iter().map(|k| k.label()).collect();
        assert_eq!(labels, K::LABELS);
    }
}
