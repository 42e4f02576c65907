//! What the `ops_*` modules share: the real binary in front of one simulated engine
//! (vLLM's layout), tonic clients of its vLLM service, and chained stores published on the engine.

use std::time::Duration;

use super::{store, Engine};
use kvbridge::proto::common::SubscribeKvEventsRequest;
use kvbridge_tools::sim::{Layout, SimEvent};
use tonic::transport::Channel;

pub const T: Duration = Duration::from_secs(30);

pub const L: Layout = Layout::Vllm0102;

pub const VLLM: &str = "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents";

pub fn s(v: &str) -> String {
    v.to_string()
}

pub fn engine_args(e: &Engine) -> Vec<String> {
    e.bridge_args()
}

pub fn req(start: u64) -> SubscribeKvEventsRequest {
    SubscribeKvEventsRequest {
        start_sequence_number: start,
        load_records_before_first_batch: false,
    }
}

pub async fn channel(url: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// Publishes `n` chained stores of `blocks` blocks each, once `e` has a subscriber; returns their
/// hashes in order.
pub fn publish_stores(e: &Engine, seed: u64, n: usize, blocks: usize) -> Vec<u64> {
    // A PUB socket drops what it sends before the subscription reaches it.
    e.wait_subscribed();
    let mut parent = None;
    let mut all = Vec::new();
    for i in 0..n as u64 {
        let ev = store(seed + i, blocks, parent);
        if let SimEvent::Stored { hashes, .. } = &ev {
            parent = hashes.last().copied();
            all.extend(hashes);
        }
        e.publish(L, vec![ev], 0);
    }
    all
}
