//! Load records (docs/smg-api.md §3.5): the engine's `GetLoads`, polled every
//! `--load-interval-ms`, mapped onto `EngineLoad` and sent as `load_only` batches to the
//! subscribers that asked for them (request field 2, `load_records_before_first_batch`).
//!
//! G2 gateways feed these records to their load monitor; by default they poll `GetLoads` only
//! every 10 s. A sidecar reaches the engine anyway, so it can keep the gateway's view within
//! one interval of the engine's.
//!
//! | `EngineLoad` | from the engine's `SchedulerLoad` |
//! |---|---|
//! | `running_requests`, `waiting_requests`, `max_running_requests` | `num_running_reqs`, `num_waiting_reqs`, `max_running_requests` (negative → 0) |
//! | `token_usage`, `gen_throughput`, `cache_hit_rate` | the same fields |
//! | `num_used_tokens`, `max_total_num_tokens` | the same fields |
//! | `waiting_uncached_tokens` | `num_waiting_uncached_tokens`, SGLang / TokenSpeed only (vLLM has no such field: left unset rather than 0) |
//! | `memory`, `queues`, `speculative`, `lora`, `disaggregation` | the sections of the same names, when the engine sends them |
//! | `sample` | kvbridge's poll counter, from 1 |
//! | `age_ms` | time since the engine answered, at the moment the record is sent |
//! | `load_only` | always true: these batches carry no events |
//!
//! **Numbering.** A `load_only` batch repeats the number of the last batch sent on that stream;
//! before the first one it carries 0, which only clients that set field 2 accept — and only they
//! get these records. One record per engine DP rank per sample; `dp_rank` is set only when the
//! engine reports more than one rank.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::Stream;
use prost::Message;
use tonic::{Code, Status};

use super::Sidecar;
use crate::fanout::EncodedBatch;
use crate::proto::common as pb;

/// The engines' `GetLoads` request (identical in SGLang, vLLM and TokenSpeed).
#[derive(Clone, PartialEq, Message)]
struct GetLoadsRequest {
    #[prost(int32, optional, tag = "1")]
    dp_rank: Option<i32>,
    #[prost(string, repeated, tag = "2")]
    include: Vec<String>,
}

/// The engines' `GetLoadsResponse`, as far as kvbridge reads it.
#[derive(Clone, PartialEq, Message)]
struct GetLoadsResponse {
    #[prost(int32, tag = "3")]
    dp_rank_count: i32,
    #[prost(message, repeated, tag = "4")]
    loads: Vec<SchedulerLoad>,
}

/// One DP rank's load; vLLM fills fields 1–11, SGLang all of them.
#[derive(Clone, PartialEq, Message)]
struct SchedulerLoad {
    #[prost(int32, tag = "1")]
    dp_rank: i32,
    #[prost(int32, tag = "2")]
    num_running_reqs: i32,
    #[prost(int32, tag = "3")]
    num_waiting_reqs: i32,
    #[prost(int32, tag = "5")]
    num_used_tokens: i32,
    #[prost(int32, tag = "6")]
    max_total_num_tokens: i32,
    #[prost(double, tag = "7")]
    token_usage: f64,
    #[prost(double, tag = "8")]
    gen_throughput: f64,
    #[prost(double, tag = "9")]
    cache_hit_rate: f64,
    #[prost(int32, tag = "11")]
    max_running_requests: i32,
    #[prost(message, optional, tag = "12")]
    memory: Option<pb::EngineMemory>,
    #[prost(message, optional, tag = "13")]
    speculative: Option<pb::EngineSpeculative>,
    #[prost(message, optional, tag = "14")]
    lora: Option<pb::EngineLora>,
    #[prost(message, optional, tag = "15")]
    disaggregation: Option<pb::EngineDisaggregation>,
    #[prost(message, optional, tag = "16")]
    queues: Option<pb::EngineQueues>,
    #[prost(int32, tag = "17")]
    num_waiting_uncached_tokens: i32,
}

// The engines' sections have the same field numbers and types as `EngineLoad`'s sub-messages
// (docs/smg-api.md §1), so they decode straight into them.

/// The `GetLoads` paths, in the order tried; the first that answers is kept. `true`: the
/// engine reports `num_waiting_uncached_tokens`.
const GET_LOADS: [(&str, bool); 3] = [
    ("/sglang.grpc.scheduler.SglangScheduler/GetLoads", true),
    ("/vllm.grpc.engine.VllmEngine/GetLoads", false),
    (
        "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/GetLoads",
        true,
    ),
];

/// How long an engine without `GetLoads` is left alone before kvbridge asks again.
const UNSUPPORTED_RETRY: Duration = Duration::from_secs(30);

/// One answer of the engine: a load per DP rank (`None`: the engine has a single rank).
#[derive(Debug)]
pub struct LoadSample {
    loads: Vec<(Option<i32>, pb::EngineLoad)>,
    at: Instant,
}

/// The latest [`LoadSample`] (`None` until the engine first answers).
pub type LoadFeed = tokio::sync::watch::Receiver<Option<Arc<LoadSample>>>;

fn non_negative(v: i32) -> u32 {
    v.max(0) as u32
}

fn engine_load(l: SchedulerLoad, sample: u64, uncached: bool) -> pb::EngineLoad {
    pb::EngineLoad {
        running_requests: non_negative(l.num_running_reqs),
        waiting_requests: non_negative(l.num_waiting_reqs),
        waiting_uncached_tokens: uncached.then(|| non_negative(l.num_waiting_uncached_tokens)),
        token_usage: l.token_usage,
        gen_throughput: l.gen_throughput,
        max_running_requests: non_negative(l.max_running_requests),
        age_ms: 0,
        sample,
        load_only: true,
        cache_hit_rate: Some(l.cache_hit_rate),
        num_used_tokens: Some(l.num_used_tokens),
        max_total_num_tokens: Some(l.max_total_num_tokens),
        memory: l.memory,
        queues: l.queues,
        speculative: l.speculative,
        lora: l.lora,
        disaggregation: l.disaggregation,
        ..Default::default()
    }
}

/// Polls `GetLoads` every `every` until the sidecar is dropped, publishing each answer.
pub(super) async fn poll(
    sidecar: Weak<Sidecar>,
    every: Duration,
    tx: tokio::sync::watch::Sender<Option<Arc<LoadSample>>>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let request = GetLoadsRequest {
        dp_rank: None,
        include: vec!["all".into()],
    }
    .encode_to_vec();
    let timeout = every.clamp(Duration::from_millis(100), Duration::from_secs(2));
    let mut path: Option<usize> = None;
    let mut sample = 0u64;
    let mut warned = false;
    // An engine that has no GetLoads at all (every path UNIMPLEMENTED: TRT-LLM, a test engine)
    // is asked again only every UNSUPPORTED_RETRY, not three calls per interval.
    let mut unsupported_until: Option<tokio::time::Instant> = None;
    loop {
        tick.tick().await;
        if unsupported_until.is_some_and(|t| tokio::time::Instant::now() < t) {
            continue;
        }
        let Some(s) = sidecar.upgrade() else { return };
        let order: Vec<usize> = match path {
            Some(i) => vec![i],
            None => (0..GET_LOADS.len()).collect(),
        };
        let mut answer = None;
        let mut last_err = None;
        for i in order {
            match s.upstream.unary(GET_LOADS[i].0, &request, timeout).await {
                Ok(bytes) => {
                    answer = Some((i, bytes));
                    break;
                }
                // Not this engine's service: try the next; a known path that stops answering
                // (engine replaced) is looked for again next time.
                Err(st) if st.code() == Code::Unimplemented => {
                    path = None;
                    last_err = Some(st);
                }
                Err(st) => {
                    last_err = Some(st);
                    break;
                }
            }
        }
        let Some((i, bytes)) = answer else {
            if last_err
                .as_ref()
                .is_some_and(|e| e.code() == Code::Unimplemented)
            {
                unsupported_until = Some(tokio::time::Instant::now() + UNSUPPORTED_RETRY);
            }
            s.metrics
                .proxy
                .load_polls
                .with_label_values(&["failed"])
                .inc();
            if !warned {
                if let Some(e) = last_err {
                    tracing::warn!(engine = %s.upstream.address(), code = ?e.code(), error = %e.message(),
                        "GetLoads failed: no load records until it answers");
                }
                warned = true;
            }
            continue;
        };
        path = Some(i);
        warned = false;
        unsupported_until = None;
        let resp = match GetLoadsResponse::decode(bytes) {
            Ok(r) => r,
            Err(e) => {
                s.metrics
                    .proxy
                    .load_polls
                    .with_label_values(&["undecodable"])
                    .inc();
                tracing::debug!(error = %e, "GetLoads answer undecodable");
                continue;
            }
        };
        s.metrics.proxy.load_polls.with_label_values(&["ok"]).inc();
        sample += 1;
        let many = resp.dp_rank_count > 1 || resp.loads.len() > 1;
        let loads = resp
            .loads
            .into_iter()
            .map(|l| {
                let rank = many.then_some(l.dp_rank);
                (rank, engine_load(l, sample, GET_LOADS[i].1))
            })
            .collect();
        tx.send_replace(Some(Arc::new(LoadSample {
            loads,
            at: Instant::now(),
        })));
    }
}

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
fn records(sample: &LoadSample, seq: u64) -> Vec<EncodedBatch> {
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
            EncodedBatch(Bytes::from(batch.encode_to_vec()))
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
    pending: VecDeque<EncodedBatch>,
}

/// Wraps a subscriber's stream (only one that set request field 2) with load records.
pub fn with_load_records<S>(inner: S, mut feed: LoadFeed) -> WithLoadRecords<S>
where
    S: Stream<Item = Result<EncodedBatch, Status>> + Send + Unpin,
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
    S: Stream<Item = Result<EncodedBatch, Status>> + Send + Unpin,
{
    type Item = Result<EncodedBatch, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(b) = this.pending.pop_front() {
            return Poll::Ready(Some(Ok(b)));
        }
        match Pin::new(&mut this.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(b))) => {
                if let Some(seq) = sequence_of(&b.0) {
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

    #[test]
    fn sglang_load_maps_onto_engine_load() {
        let l = SchedulerLoad {
            num_running_reqs: 3,
            num_waiting_reqs: -1,
            num_waiting_uncached_tokens: 77,
            token_usage: 0.25,
            max_running_requests: 64,
            memory: Some(pb::EngineMemory {
                token_capacity: 9,
                ..Default::default()
            }),
            ..Default::default()
        };
        let e = engine_load(l.clone(), 4, true);
        assert_eq!(
            (
                e.running_requests,
                e.waiting_requests,
                e.max_running_requests
            ),
            (3, 0, 64)
        );
        assert_eq!(e.waiting_uncached_tokens, Some(77));
        assert!(e.load_only && e.sample == 4 && e.token_usage == 0.25);
        assert_eq!(e.memory.unwrap().token_capacity, 9);
        assert_eq!(engine_load(l, 4, false).waiting_uncached_tokens, None);
    }
}
