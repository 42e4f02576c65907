//! Frame validation for the engine's two ZMQ message shapes (docs/engine-wire.md §1 and §7).

/// Why a live message was dropped before decoding (also the metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameDrop {
    /// Not exactly 3 frames.
    FrameCount,
    /// The seq frame is not exactly 8 bytes.
    SeqLength,
    /// A non-empty topic that is not exactly ours (ZMQ matched it by prefix).
    Topic,
}

impl FrameDrop {
    /// Every `reason` of `kvbridge_frames_dropped_total`: these, and the two ingest finds after
    /// validation (an empty payload, a malformed replay reply).
    pub const LABELS: [&'static str; 5] = [
        "frame_count",
        "seq_length",
        "topic",
        "empty_payload",
        "replay_malformed",
    ];

    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            FrameDrop::FrameCount => "frame_count",
            FrameDrop::SeqLength => "seq_length",
            FrameDrop::Topic => "topic",
        }
    }
}

/// Validates a live message `[topic, seq(8, BE), payload]`; returns its seq.
pub fn live_seq(frames: &[&[u8]], topic: &[u8]) -> Result<u64, FrameDrop> {
    let [t, seq, _payload] = frames else {
        return Err(FrameDrop::FrameCount);
    };
    let seq: [u8; 8] = (*seq).try_into().map_err(|_| FrameDrop::SeqLength)?;
    if !topic.is_empty() && *t != topic {
        return Err(FrameDrop::Topic);
    }
    Ok(u64::from_be_bytes(seq))
}

/// One reply frame set from the replay ROUTER, as seen by a DEALER.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply<'a> {
    /// A buffered batch.
    Batch(u64, &'a [u8]),
    /// The end marker (seq `u64::MAX`, empty payload).
    End,
}

/// Parses a replay reply: old form `[b"", seq, payload]` or new form `[b"", topic, seq, payload]`.
pub fn replay_reply<'a>(frames: &[&'a [u8]]) -> Result<Reply<'a>, &'static str> {
    let (delim, seq, payload) = match frames {
        [d, s, p] => (*d, *s, *p),
        [d, _topic, s, p] => (*d, *s, *p),
        _ => return Err("replay reply with neither 3 nor 4 frames"),
    };
    if !delim.is_empty() {
        return Err("replay reply without the empty delimiter frame");
    }
    let seq: [u8; 8] = seq
        .try_into()
        .map_err(|_| "replay reply seq is not 8 bytes")?;
    let seq = u64::from_be_bytes(seq);
    if seq == u64::MAX {
        return Ok(Reply::End);
    }
    Ok(Reply::Batch(seq, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_frames() {
        let seq = 7u64.to_be_bytes();
        assert_eq!(live_seq(&[b"", &seq, b"x"], b""), Ok(7));
        assert_eq!(live_seq(&[b"kv-2", &seq, b"x"], b""), Ok(7));
        assert_eq!(
            live_seq(&[b"kv-2", &seq, b"x"], b"kv"),
            Err(FrameDrop::Topic)
        );
        assert_eq!(live_seq(&[b"kv", &seq, b"x"], b"kv"), Ok(7));
        assert_eq!(live_seq(&[b"", &seq], b""), Err(FrameDrop::FrameCount));
        assert_eq!(
            live_seq(&[b"", &seq, b"x", b"y"], b""),
            Err(FrameDrop::FrameCount)
        );
        assert_eq!(
            live_seq(&[b"", &seq[..7], b"x"], b""),
            Err(FrameDrop::SeqLength)
        );
        assert_eq!(
            live_seq(&[b"", &[0u8; 9], b"x"], b""),
            Err(FrameDrop::SeqLength)
        );
    }

    #[test]
    fn replay_forms() {
        let seq = 3u64.to_be_bytes();
        let end = u64::MAX.to_be_bytes();
        assert_eq!(replay_reply(&[b"", &seq, b"p"]), Ok(Reply::Batch(3, b"p")));
        assert_eq!(
            replay_reply(&[b"", b"kv", &seq, b"p"]),
            Ok(Reply::Batch(3, b"p"))
        );
        assert_eq!(replay_reply(&[b"", &end, b""]), Ok(Reply::End));
        assert_eq!(replay_reply(&[b"", b"", &end, b""]), Ok(Reply::End));
        assert!(replay_reply(&[b"x", &seq, b"p"]).is_err());
        assert!(replay_reply(&[b"", &seq[..4], b"p"]).is_err());
        assert!(replay_reply(&[b"", &seq]).is_err());
    }
}
