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
//! The records themselves, and how they are numbered and interleaved into a subscriber's
//! stream, are the gRPC edge's ([`crate::fanout::with_load_records`]); this module only polls.

use std::sync::{Arc, Weak};
use std::time::Duration;

use prost::Message;
use tonic::Code;

use super::Sidecar;
use crate::fanout::LoadSample;
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
            s.metrics.load_polls.with_label_values(&["failed"]).inc();
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
                    .load_polls
                    .with_label_values(&["undecodable"])
                    .inc();
                tracing::debug!(error = %e, "GetLoads answer undecodable");
                continue;
            }
        };
        s.metrics.load_polls.with_label_values(&["ok"]).inc();
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
        tx.send_replace(Some(Arc::new(LoadSample::new(loads))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
