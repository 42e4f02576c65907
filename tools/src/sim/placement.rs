//! SGLang #34407's placement snapshot service (`snapshot-v2`, unmerged; kvbridge's
//! docs/engine-wire.md §13), as the branch's worker answers it: on `["", "snapshot-v2"]` it
//! publishes an empty barrier batch (its topic carrying `\0sgl-kv-snapshot=<id>`), then sends
//! `["", "header", map]`, `["", "chunk", [map, …]]` and `["", "end", ""]`. Its state is a mirror
//! of the stores and removals published through [`EnginePublisher::publish_events`], one record
//! per block and tier, in first-store order.

use std::collections::HashMap;

use rmp::encode as enc;

use super::{encode_batch, EnginePublisher, Identity, Layout, SimEvent};

/// Records per chunk (the branch's worker sends 4096; smaller here, so tests see several).
const CHUNK_RECORDS: usize = 100;

/// The service's socket and the worker's mirror.
pub(super) struct Placements {
    router: zmq::Socket,
    /// (hash, tier) → (first-store order, parent, block size).
    mirror: HashMap<(u64, i32), (u64, Option<u64>, u32)>,
    order: u64,
    /// Answer every request with an `error` message.
    pub(super) error: bool,
}

/// SGLang's tier number for a `medium` (no medium: the device).
fn tier(medium: Option<&str>) -> i32 {
    match medium {
        Some("CPU_PINNED") | Some("CPU") => 2,
        Some("DISK") => 3,
        _ => 1,
    }
}

impl Placements {
    /// An engine restart: the state is empty.
    pub(super) fn clear(&mut self) {
        self.mirror.clear();
    }

    /// Applies one published batch's events to the mirror.
    fn apply(&mut self, events: &[SimEvent]) {
        for ev in events {
            match ev {
                SimEvent::Stored {
                    hashes,
                    parent,
                    block_size,
                    medium,
                    ..
                } => {
                    let t = tier(medium.as_deref());
                    let mut parent = *parent;
                    for h in hashes {
                        self.order += 1;
                        let order = self.order;
                        self.mirror
                            .entry((*h, t))
                            .or_insert((order, parent, *block_size));
                        parent = Some(*h);
                    }
                }
                SimEvent::Removed { hashes, medium } => {
                    let t = tier(medium.as_deref());
                    for h in hashes {
                        self.mirror.remove(&(*h, t));
                    }
                }
                SimEvent::Cleared => self.mirror.clear(),
            }
        }
    }
}

fn map_str(out: &mut Vec<u8>, k: &str, v: &str) {
    enc::write_str(out, k).expect("vec write");
    enc::write_str(out, v).expect("vec write");
}

fn map_int(out: &mut Vec<u8>, k: &str, v: i64) {
    enc::write_str(out, k).expect("vec write");
    enc::write_sint(out, v).expect("vec write");
}

impl EnginePublisher {
    /// Binds SGLang #34407's snapshot ROUTER at `endpoint` and returns where it is bound. From
    /// now on the batches published through [`publish_events`](Self::publish_events) build the
    /// state it answers with.
    pub fn serve_placements_at(&mut self, endpoint: &str) -> Result<String, zmq::Error> {
        let router = self.ctx.socket(zmq::ROUTER)?;
        router.set_linger(0)?;
        router.bind(endpoint)?;
        let at = router.get_last_endpoint()?.unwrap_or_default();
        self.placements = Some(Placements {
            router,
            mirror: HashMap::new(),
            order: 0,
            error: false,
        });
        Ok(at)
    }

    /// Answer snapshot-v2 requests with an `error` (as the worker does when it is busy).
    pub fn set_placements_error(&mut self, error: bool) {
        if let Some(p) = &mut self.placements {
            p.error = error;
        }
    }

    /// Encodes `events` in `layout`, publishes them with the next seq, and applies them to the
    /// placement mirror, if the service is open. Returns the seq.
    pub fn publish_events(
        &mut self,
        layout: Layout,
        ts: f64,
        events: &[SimEvent],
        rank: u32,
    ) -> u64 {
        if let Some(p) = &mut self.placements {
            p.apply(events);
        }
        self.publish(encode_batch(layout, ts, events, rank))
    }

    /// Answers every pending snapshot-v2 request.
    pub(super) fn serve_placements(&mut self) {
        let Some(p) = &self.placements else { return };
        let mut pending = Vec::new();
        while let Ok(frames) = p.router.recv_multipart(zmq::DONTWAIT) {
            pending.push(frames);
        }
        for frames in pending {
            self.answer_placements(frames);
        }
    }

    fn answer_placements(&mut self, frames: Vec<Vec<u8>>) {
        let [id, delim, command] = frames.as_slice() else {
            return;
        };
        let error = self.placements.as_ref().is_some_and(|p| p.error);
        if !delim.is_empty() || command != b"snapshot-v2" || error {
            let p = self.placements.as_ref().expect("open");
            let _ = p
                .router
                .send_multipart([&id[..], b"", b"error", b"snapshot provider busy"], 0);
            return;
        }
        let epoch = match &self.identity {
            Some(Identity::SglangEpoch(e)) => e.clone(),
            _ => "no-epoch".into(),
        };
        self.barrier_id += 1;
        let barrier_id = format!("barrier-{}", self.barrier_id);
        let barrier = encode_batch(Layout::Sglang0523, 0.0, &[], 0);
        let barrier_seq = self.publish_barrier(barrier, &barrier_id) as i64;
        let p = self.placements.as_ref().expect("open");
        let mut records: Vec<_> = p.mirror.iter().collect();
        records.sort_by_key(|(_, (order, ..))| *order);
        let mut header = Vec::new();
        enc::write_map_len(&mut header, 7).expect("vec write");
        map_int(&mut header, "version", 2);
        map_str(&mut header, "worker_epoch", &epoch);
        map_int(&mut header, "dp_rank", 0);
        map_int(&mut header, "barrier_seq", barrier_seq);
        map_int(&mut header, "resume_seq", barrier_seq + 1);
        map_str(&mut header, "barrier_id", &barrier_id);
        map_int(&mut header, "record_count", records.len() as i64);
        let _ = p
            .router
            .send_multipart([&id[..], b"", b"header", &header[..]], 0);
        for chunk in records.chunks(CHUNK_RECORDS) {
            let mut c = Vec::new();
            enc::write_array_len(&mut c, chunk.len() as u32).expect("vec write");
            for ((hash, tier), (_, parent, block_size)) in chunk {
                enc::write_map_len(&mut c, 5).expect("vec write");
                map_int(&mut c, "block_hash", *hash as i64);
                enc::write_str(&mut c, "parent_block_hash").expect("vec write");
                if let Some(ph) = parent {
                    enc::write_sint(&mut c, *ph as i64).expect("vec write");
                } else {
                    enc::write_nil(&mut c).expect("vec write");
                }
                map_int(&mut c, "block_size", i64::from(*block_size));
                map_int(&mut c, "tier", i64::from(*tier));
                map_int(&mut c, "component_mask", 1);
            }
            let _ = p.router.send_multipart([&id[..], b"", b"chunk", &c[..]], 0);
        }
        let _ = p.router.send_multipart([&id[..], b"", b"end", b""], 0);
    }
}
