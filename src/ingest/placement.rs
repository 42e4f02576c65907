//! SGLang #34407's placement snapshot (`snapshot-v2`, unmerged; docs/engine-wire.md §13), read
//! into what the state machine restores from: engine batches of stores, numbered at the cut.
//!
//! The worker answers `["", "snapshot-v2"]` with several messages, each `["", kind, payload]`:
//! one `header` (a msgpack map), `chunk`s (msgpack arrays of placement maps), then `end` (empty),
//! or an `error` (text) in place of any of them. The header's `barrier_seq` is the cut: the
//! worker published an empty barrier batch at that seq, and what follows the cut comes from
//! `resume_seq` = `barrier_seq` + 1 on, by its replay buffer and live stream.
//!
//! A placement names a block, its parent, its tier and its components, but no tokens. Each
//! becomes one `BlockStored` in SGLang 0.5.23's array form (`token_ids` empty, `medium` from the
//! tier), which the decoder forwards hash-only under `--profile all` and filters as unpairable
//! under `--profile smg`. An SMG consumer cannot be rebuilt from hashes alone, so under the SMG
//! profile the snapshot is declined ([`Reader::new`]'s `tokens_required`) and the rank stays
//! `degraded (missing_history)`, as it says: a state without tokens restored as `exact` would be
//! a silent divergence.

use serde::Deserialize;

use super::upstream::EngineSnapshot;
use super::wire::Epoch;

/// Placements per synthesized batch (as kvbridge's own snapshot service chunks).
const EVENTS_PER_CHUNK: usize = 256;
/// The most records one answer may declare (SGLang's own client's bound).
const MAX_RECORDS: u64 = 10_000_000;

/// The header fields kvbridge checks or uses. The branch's two consumers spell two of them
/// differently (`worker_epoch` / `epoch`, `dp_rank` / `replica_rank`): both are read.
#[derive(Deserialize)]
struct Header {
    version: u32,
    #[serde(alias = "epoch")]
    worker_epoch: String,
    #[serde(alias = "replica_rank")]
    dp_rank: u32,
    barrier_seq: i64,
    resume_seq: i64,
    barrier_id: String,
    record_count: u64,
}

/// One placement: a block on one tier.
#[derive(Deserialize)]
struct Record {
    block_hash: i64,
    parent_block_hash: Option<i64>,
    block_size: u32,
    /// 1 GPU, 2 host (CPU_PINNED), 3 disk.
    tier: i32,
    /// full = 1, swa = 2, mamba = 4; at least one.
    component_mask: u32,
}

/// Whether `frames` (one reply message) is the v2 protocol's: `["", "header" | "error", _]`.
/// vLLM #57789's answer starts `["", cut (8 bytes), …]` instead.
pub(super) fn is_v2(frames: &[Vec<u8>]) -> bool {
    frames.len() == 3 && frames[0].is_empty() && (frames[1] == b"header" || frames[1] == b"error")
}

/// The engine's `medium` for a placement tier (SGLang's `StorageMedium`).
fn medium(tier: i32) -> Option<&'static str> {
    match tier {
        1 => Some("GPU"),
        2 => Some("CPU_PINNED"),
        3 => Some("DISK"),
        _ => None,
    }
}

/// An answer being read, message by message.
pub(super) struct Reader {
    rank: u32,
    tokens_required: bool,
    header: Option<Header>,
    received: u64,
    chunks: Vec<Vec<u8>>,
    /// Events of the batch being built, and how many.
    events: Vec<u8>,
    n_events: usize,
}

impl Reader {
    /// A reader for rank `rank`'s answer. `tokens_required`: the decoder drops stores without
    /// tokens (`--profile smg`), so a placement state cannot be restored.
    pub(super) fn new(rank: u32, tokens_required: bool) -> Reader {
        Reader {
            rank,
            tokens_required,
            header: None,
            received: 0,
            chunks: Vec::new(),
            events: Vec::new(),
            n_events: 0,
        }
    }

    /// Reads one reply message; `Some` once the answer is complete (or refused).
    pub(super) fn feed(&mut self, frames: &[Vec<u8>]) -> Option<EngineSnapshot> {
        let [empty, kind, payload] = frames else {
            return Some(EngineSnapshot::Unavailable("malformed reply: not 3 frames"));
        };
        if !empty.is_empty() {
            return Some(EngineSnapshot::Unavailable(
                "malformed reply: no empty delimiter",
            ));
        }
        match (kind.as_slice(), &self.header) {
            (b"error", _) => {
                tracing::warn!(
                    error = %String::from_utf8_lossy(payload),
                    "the worker's snapshot-v2 answered an error"
                );
                Some(EngineSnapshot::Unavailable("the worker answered an error"))
            }
            (b"header", None) => self.header(payload).err().map(EngineSnapshot::Unavailable),
            (b"chunk", Some(_)) => self.chunk(payload).err().map(EngineSnapshot::Unavailable),
            (b"end", Some(_)) => Some(self.end(payload)),
            _ => Some(EngineSnapshot::Unavailable(
                "malformed reply: unexpected message",
            )),
        }
    }

    fn header(&mut self, payload: &[u8]) -> Result<(), &'static str> {
        let h: Header =
            rmp_serde::from_slice(payload).map_err(|_| "malformed reply: the header")?;
        if h.version != 2 {
            return Err("unsupported snapshot version");
        }
        if h.dp_rank != self.rank {
            return Err("the header names another rank");
        }
        if h.worker_epoch.is_empty() || h.barrier_id.is_empty() || h.barrier_seq < 0 {
            return Err("malformed reply: no epoch, barrier or cut");
        }
        if h.resume_seq != h.barrier_seq.saturating_add(1) {
            return Err("malformed reply: resume_seq is not barrier_seq + 1");
        }
        if h.record_count > MAX_RECORDS {
            return Err("the header declares too many records");
        }
        if self.tokens_required {
            return Err("a placement snapshot has no tokens, which --profile smg needs");
        }
        self.header = Some(h);
        Ok(())
    }

    fn chunk(&mut self, payload: &[u8]) -> Result<(), &'static str> {
        let records: Vec<Record> =
            rmp_serde::from_slice(payload).map_err(|_| "malformed reply: a chunk")?;
        let declared = self.header.as_ref().map_or(0, |h| h.record_count);
        self.received += records.len() as u64;
        if self.received > declared {
            return Err("more records than the header declares");
        }
        for r in &records {
            let medium = medium(r.tier).ok_or("malformed reply: a record's tier")?;
            if r.component_mask == 0 || r.block_size == 0 {
                return Err("malformed reply: a record without components or size");
            }
            self.store(r, medium);
        }
        Ok(())
    }

    fn end(&mut self, payload: &[u8]) -> EngineSnapshot {
        let Some(h) = self.header.take() else {
            return EngineSnapshot::Unavailable("malformed reply: no header");
        };
        if !payload.is_empty() || self.received != h.record_count {
            return EngineSnapshot::Unavailable("the records received are not those declared");
        }
        self.flush();
        EngineSnapshot::State {
            cut: h.barrier_seq as u64,
            epoch: Epoch::of_text(h.worker_epoch.as_bytes()),
            chunks: std::mem::take(&mut self.chunks),
        }
    }

    /// Appends `r` as a `BlockStored` in SGLang 0.5.23's array form: `["BlockStored", [hash],
    /// parent, [], block_size, nil, medium]`.
    fn store(&mut self, r: &Record, medium: &str) {
        use rmp::encode as enc;
        let w = &mut self.events;
        // (writes to a Vec cannot fail)
        let _ = enc::write_array_len(w, 7);
        let _ = enc::write_str(w, "BlockStored");
        let _ = enc::write_array_len(w, 1);
        let _ = enc::write_sint(w, r.block_hash);
        if let Some(p) = r.parent_block_hash {
            let _ = enc::write_sint(w, p);
        } else {
            let _ = enc::write_nil(w);
        }
        let _ = enc::write_array_len(w, 0);
        let _ = enc::write_uint(w, u64::from(r.block_size));
        let _ = enc::write_nil(w);
        let _ = enc::write_str(w, medium);
        self.n_events += 1;
        if self.n_events == EVENTS_PER_CHUNK {
            self.flush();
        }
    }

    /// Closes the batch being built: `[ts, [events…], dp_rank]`.
    fn flush(&mut self) {
        use rmp::encode as enc;
        if self.n_events == 0 {
            return;
        }
        let mut b = Vec::with_capacity(self.events.len() + 16);
        let _ = enc::write_array_len(&mut b, 3);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let _ = enc::write_f64(&mut b, now);
        let _ = enc::write_array_len(&mut b, self.n_events as u32);
        b.extend_from_slice(&self.events);
        let _ = enc::write_uint(&mut b, u64::from(self.rank));
        self.chunks.push(b);
        self.events.clear();
        self.n_events = 0;
    }
}

#[cfg(test)]
mod tests;
