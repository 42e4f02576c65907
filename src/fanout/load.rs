//! Load records in a subscriber's stream (docs/smg-api.md §3.5): the latest engine load sample,
//! sent as `load_only` batches to subscribers that asked for them (request field 2,
//! `load_records_before_first_batch`). Where the samples come from is not this module's concern:
//! in sidecar mode `crate::proxy` polls the engine's `GetLoads` and sends each answer into the
//! [`LoadFeed`] attached with [`Fanout::attach_load_feed`](super::Fanout::attach_load_feed).
//!
//! **Numbering.** A `load_only` batch repeats the number of the last batch sent on that stream;
//! before the first one it carries 0, which only clients that set field 2 accept — and only they
//! get these records. One record per engine DP rank per sample; `dp_rank` is set only when the
//! engine reports more than one rank.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use futures_util::Stream;
use prost::Message;
use tonic::Status;

use super::{EncodedBatch, Outgoing};
use crate::proto::common as pb;

/// One answer of the engine: a load per DP rank (`None`: the engine has a single rank).
#[derive(Debug)]
pub struct LoadSample {
    loads: Vec<(Option<i32>, pb::EngineLoad)>,
    at: Instant,
}

impl LoadSample {
    /// A sample taken now: each DP rank's load (rank `None`: the engine has a single rank).
    pub fn new(loads: Vec<(Option<i32>, pb::EngineLoad)>) -> LoadSample {
        LoadSample {
            loads,
            at: Instant::now(),
        }
    }
}

/// The latest [`LoadSample`] (`None` until the engine first answers).
pub type LoadFeed = tokio::sync::watch::Receiver<Option<Arc<LoadSample>>>;

/// The `sequence_number` (field 1) of an encoded `KvEventBatch`.
fn sequence_of(mut buf: &[u8]) -> Option<u64> {
    use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext, WireType};
    while !buf.is_empty() {
        let (tag, wire) = decode_key(&mut buf).ok()?;
        if tag == 1 && wire == WireType::Varint {
            return decode_varint(&mut buf).ok();
        }
        skip_field(wire, tag, &mut buf, DecodeContext::default()).ok()?;
    }
    Some(0)
}

/// The `load_only` batches of `sample`, numbered `seq`.
fn records(sample: &LoadSample, seq: u64) -> Vec<Outgoing> {
    let age = sample.at.elapsed().as_millis().min(u32::MAX as u128) as u32;
    let now = crate::clock::unix_nanos() as f64 * 1e-9;
    sample
        .loads
        .iter()
        .map(|(rank, load)| {
            let mut load = load.clone();
            load.age_ms = age;
            let batch = pb::KvEventBatch {
                sequence_number: seq,
                timestamp: now,
                events: Vec::new(),
                dp_rank: *rank,
                snapshot: None,
                load: Some(load),
            };
            Outgoing::made(EncodedBatch::frame(&batch.encode_to_vec()))
        })
        .collect()
}

type SampleStream = Pin<Box<dyn Stream<Item = Option<Arc<LoadSample>>> + Send>>;

/// `inner` (a subscriber's batches) with the feed's load records interleaved: the current sample
/// at once, then each new one. Batches go first when both are ready; the stream ends when
/// `inner` does.
pub struct WithLoadRecords<S> {
    inner: S,
    samples: SampleStream,
    last_seq: u64,
    pending: VecDeque<Outgoing>,
}

/// Wraps a subscriber's stream (only one that set request field 2) with load records.
pub fn with_load_records<S>(inner: S, mut feed: LoadFeed) -> WithLoadRecords<S>
where
    S: Stream<Item = Result<Outgoing, Status>> + Send + Unpin,
{
    feed.mark_changed();
    let samples = futures_util::stream::unfold(feed, |mut feed| async move {
        feed.changed().await.ok()?;
        let v = feed.borrow_and_update().clone();
        Some((v, feed))
    });
    WithLoadRecords {
        inner,
        samples: Box::pin(samples),
        last_seq: 0,
        pending: VecDeque::new(),
    }
}

impl<S> Stream for WithLoadRecords<S>
where
    S: Stream<Item = Result<Outgoing, Status>> + Send + Unpin,
{
    type Item = Result<Outgoing, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(b) = this.pending.pop_front() {
            return Poll::Ready(Some(Ok(b)));
        }
        match Pin::new(&mut this.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(b))) => {
                if let Some(seq) = sequence_of(b.batch.record()) {
                    this.last_seq = seq;
                }
                return Poll::Ready(Some(Ok(b)));
            }
            Poll::Ready(other) => return Poll::Ready(other),
            Poll::Pending => {}
        }
        loop {
            match this.samples.as_mut().poll_next(cx) {
                Poll::Ready(Some(Some(sample))) => {
                    this.pending.extend(records(&sample, this.last_seq));
                    if let Some(b) = this.pending.pop_front() {
                        return Poll::Ready(Some(Ok(b)));
                    }
                }
                Poll::Ready(Some(None)) => continue,
                // The poller is gone (shutdown): batches only from here on.
                Poll::Ready(None) => {
                    this.samples = Box::pin(futures_util::stream::pending());
                    return Poll::Pending;
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_number_is_read_from_the_encoding() {
        let b = pb::KvEventBatch {
            sequence_number: 1_700_000_000_000_001,
            timestamp: 1.5,
            ..Default::default()
        };
        assert_eq!(sequence_of(&b.encode_to_vec()), Some(1_700_000_000_000_001));
        assert_eq!(sequence_of(&[]), Some(0));
    }
}
