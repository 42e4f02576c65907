//! Frame validation for the engine's two ZMQ message shapes (docs/engine-wire.md §1 and §7),
//! and the publisher epochs the engines' next wire carries beside them (docs/engine-wire.md §13):
//! vLLM #57789's 16-byte publisher UUID after the 8-byte seq, SGLang #34407's
//! `\0sgl-kv-epoch=<epoch>` after the topic.

/// Why a live message was dropped before decoding (also the metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameDrop {
    /// Not exactly 3 frames.
    FrameCount,
    /// The seq frame is neither 8 bytes nor 24 (8 and a publisher UUID).
    SeqLength,
    /// A non-empty topic that is not exactly ours up to its first NUL (ZMQ matched it by
    /// prefix), or whose fields after it are not `sgl-kv-…=` ones.
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

/// A publisher's incarnation as its message names it: one value per publisher lifetime, so a new
/// one is an engine restart. vLLM's UUID as its 128 bits; SGLang's epoch text (up to 256 bytes)
/// folded into 128 bits (one stream carries one kind or the other, never both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Epoch(pub u128);

impl Epoch {
    /// SGLang's epoch text: four CRC-32C of it, each over a different one-byte prefix (a stable
    /// 128-bit fingerprint; two epochs of one worker colliding would take 2^-64 luck).
    pub(crate) fn of_text(text: &[u8]) -> Epoch {
        let mut v: u128 = 0;
        for salt in 0u8..4 {
            let c = crc32c::crc32c_append(crc32c::crc32c(&[salt]), text);
            v = (v << 32) | c as u128;
        }
        Epoch(v)
    }
}

/// A valid live message's seq and, on the engines' next wire, its publisher's epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Live {
    /// The engine's sequence number.
    pub seq: u64,
    /// The publisher's incarnation, when the message names one.
    pub epoch: Option<Epoch>,
}

/// The longest SGLang epoch #34407 sends.
const MAX_EPOCH: usize = 256;

/// Validates a live message `[topic, seq, payload]`: the seq frame 8 bytes (big-endian), or 24
/// (vLLM #57789: the seq, then the publisher's UUID); the topic ours up to its first NUL, any
/// fields after it SGLang #34407's (`sgl-kv-epoch=<epoch>`, `sgl-kv-snapshot=<barrier id>`).
pub fn live_seq(frames: &[&[u8]], topic: &[u8]) -> Result<Live, FrameDrop> {
    let [t, seq, _payload] = frames else {
        return Err(FrameDrop::FrameCount);
    };
    let (seq, uuid) = match seq.len() {
        8 => (*seq, None),
        24 => (&seq[..8], Some(&seq[8..])),
        _ => return Err(FrameDrop::SeqLength),
    };
    let seq = u64::from_be_bytes(seq.try_into().expect("8 bytes"));
    let mut fields = t.split(|&b| b == 0);
    let base = fields.next().unwrap_or_default();
    if !topic.is_empty() && base != topic {
        return Err(FrameDrop::Topic);
    }
    let mut epoch = uuid.map(|u| Epoch(u128::from_be_bytes(u.try_into().expect("16 bytes"))));
    for f in fields {
        if let Some(e) = f.strip_prefix(b"sgl-kv-epoch=") {
            if e.is_empty() || e.len() > MAX_EPOCH {
                return Err(FrameDrop::Topic);
            }
            // A UUID, where both are present, decides.
            epoch = epoch.or(Some(Epoch::of_text(e)));
        } else if !f.starts_with(b"sgl-kv-") {
            return Err(FrameDrop::Topic);
        }
    }
    Ok(Live { seq, epoch })
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

    fn seq_of(r: Result<Live, FrameDrop>) -> Result<u64, FrameDrop> {
        r.map(|l| l.seq)
    }

    #[test]
    fn live_frames() {
        let seq = 7u64.to_be_bytes();
        assert_eq!(
            live_seq(&[b"", &seq, b"x"], b""),
            Ok(Live {
                seq: 7,
                epoch: None
            })
        );
        assert_eq!(seq_of(live_seq(&[b"kv-2", &seq, b"x"], b"")), Ok(7));
        assert_eq!(
            live_seq(&[b"kv-2", &seq, b"x"], b"kv"),
            Err(FrameDrop::Topic)
        );
        assert_eq!(seq_of(live_seq(&[b"kv", &seq, b"x"], b"kv")), Ok(7));
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
        assert_eq!(
            live_seq(&[b"", &[0u8; 25], b"x"], b""),
            Err(FrameDrop::SeqLength)
        );
    }

    /// vLLM #57789 (`vMaroon/vllm` @ 08ee3e5, `ZmqEventPublisher`): with a snapshot endpoint the
    /// seq frame is `seq.to_bytes(8, "big") + uuid4().bytes`.
    #[test]
    fn a_24_byte_seq_carries_the_publisher_uuid() {
        let uuid = [0xa5u8; 16];
        let frame = [&9u64.to_be_bytes()[..], &uuid[..]].concat();
        let live = live_seq(&[b"", &frame, b"x"], b"").unwrap();
        assert_eq!(live.seq, 9);
        assert_eq!(live.epoch, Some(Epoch(u128::from_be_bytes(uuid))));
        let other = [&9u64.to_be_bytes()[..], &[0x5au8; 16][..]].concat();
        assert_ne!(
            live_seq(&[b"", &other, b"x"], b"").unwrap().epoch,
            live.epoch
        );
    }

    /// SGLang #34407 (`sgl-project/sglang` @ 3536c7c, `replica_bridge.rs`): the topic frame is
    /// `<topic>\0sgl-kv-epoch=<epoch>`, with `\0sgl-kv-snapshot=<barrier_id>` on the barrier
    /// batch.
    #[test]
    fn an_sglang_topic_carries_its_epoch() {
        let seq = 3u64.to_be_bytes();
        let a = live_seq(&[b"kv\0sgl-kv-epoch=e-1", &seq, b"x"], b"kv").unwrap();
        let barrier = live_seq(
            &[b"kv\0sgl-kv-epoch=e-1\0sgl-kv-snapshot=b7", &seq, b"x"],
            b"kv",
        )
        .unwrap();
        let b = live_seq(&[b"kv\0sgl-kv-epoch=e-2", &seq, b"x"], b"").unwrap();
        assert_eq!(a.seq, 3);
        assert!(a.epoch.is_some());
        assert_eq!(a.epoch, barrier.epoch, "the barrier field is no new epoch");
        assert_ne!(a.epoch, b.epoch);
        // Ours up to the NUL, or dropped; a field that is not SGLang's is not a topic we know.
        assert_eq!(
            live_seq(&[b"kv2\0sgl-kv-epoch=e-1", &seq, b"x"], b"kv"),
            Err(FrameDrop::Topic)
        );
        assert_eq!(
            live_seq(&[b"kv\0other=1", &seq, b"x"], b"kv"),
            Err(FrameDrop::Topic)
        );
        let long = [&b"kv\0sgl-kv-epoch="[..], &[b'e'; 257][..]].concat();
        assert_eq!(live_seq(&[&long, &seq, b"x"], b"kv"), Err(FrameDrop::Topic));
        // No epoch field: today's wire.
        assert_eq!(live_seq(&[b"kv", &seq, b"x"], b"kv").unwrap().epoch, None);
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
