//! The engine's replay client: a fresh DEALER per request to the rank's replay ROUTER
//! (docs/engine-wire.md §7), draining the live SUB meanwhile so the engine's PUB never drops.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::io::RankIo;
use super::placement;
use super::upstream::{EngineSnapshot, ReplayEnd, ReplaySource};
use super::wire::{self, Epoch, Reply};

impl RankIo {
    /// The replay client, when this rank has a replay endpoint.
    pub(super) fn replay(&self) -> Option<ZmqReplay<'_>> {
        let endpoint = self.rank.replay.as_deref()?;
        Some(ZmqReplay::new(self, endpoint))
    }
}

/// The engine's replay service, reached with a fresh DEALER per request (so a late reply to an
/// abandoned request can never be taken for part of the next one).
pub(super) struct ZmqReplay<'a> {
    io: &'a RankIo,
    endpoint: &'a str,
}

impl<'a> ZmqReplay<'a> {
    pub(super) fn new(io: &'a RankIo, endpoint: &'a str) -> Self {
        ZmqReplay { io, endpoint }
    }

    fn drain_live(&self, live: &mut dyn FnMut(u64, Vec<u8>)) {
        loop {
            match self.io.sub.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => {
                    let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
                    match wire::live_seq(&refs, &self.io.topic) {
                        // (queued behind the replay; the fill decides them by their bytes)
                        Ok(l) => live(l.seq, frames.into_iter().nth(2).unwrap_or_default()),
                        Err(d) => self.io.m.frame_dropped(d.label()),
                    }
                }
                Err(_) => return,
            }
        }
    }
}

/// What one wait for a reply brought.
enum Wait {
    /// The DEALER has a reply to read.
    Ready,
    /// Nothing yet (live batches may have been drained).
    Pending,
    /// The deadline passed.
    TimedOut,
    /// Shutdown was requested.
    Aborted,
}

impl ZmqReplay<'_> {
    /// Waits up to 100 ms (at most until `deadline`) for a reply on `dealer`, draining the live
    /// SUB to `live` meanwhile so that the engine's PUB never drops.
    fn wait(
        &self,
        dealer: &zmq::Socket,
        deadline: Instant,
        live: &mut dyn FnMut(u64, Vec<u8>),
    ) -> Wait {
        if self.io.stop.load(Ordering::Relaxed) {
            return Wait::Aborted;
        }
        let now = Instant::now();
        if now >= deadline {
            return Wait::TimedOut;
        }
        let wait = (deadline - now).min(Duration::from_millis(100)).as_millis() as i64;
        let mut items = [
            dealer.as_poll_item(zmq::POLLIN),
            self.io.sub.as_poll_item(zmq::POLLIN),
        ];
        if zmq::poll(&mut items, wait.max(1)).is_err() {
            return Wait::Pending;
        }
        if items[1].is_readable() {
            self.drain_live(live);
        }
        if items[0].is_readable() {
            Wait::Ready
        } else {
            Wait::Pending
        }
    }

    /// A fresh DEALER connected to `endpoint`, for one request.
    fn dealer(&self, endpoint: &str) -> Result<zmq::Socket, zmq::Error> {
        let d = self.io.ctx.socket(zmq::DEALER)?;
        d.set_linger(0)?;
        d.set_ipv6(true)?;
        d.set_rcvhwm(0)?;
        // An oversized reply closes this DEALER's connection: the request then times out.
        d.set_maxmsgsize(self.io.max_message)?;
        d.connect(endpoint)?;
        Ok(d)
    }
}

/// Reads vLLM #57789's snapshot reply `["", cut (8, signed BE), uuid (16), chunk, …]`.
fn snapshot_reply(frames: Vec<Vec<u8>>) -> EngineSnapshot {
    let mut it = frames.into_iter();
    let (Some(empty), Some(cut), Some(uuid)) = (it.next(), it.next(), it.next()) else {
        return EngineSnapshot::Unavailable("malformed reply: fewer than 3 frames");
    };
    let (Ok(cut), Ok(uuid)) = (<[u8; 8]>::try_from(cut), <[u8; 16]>::try_from(uuid)) else {
        return EngineSnapshot::Unavailable(
            "malformed reply: not an 8-byte seq and a 16-byte uuid",
        );
    };
    if !empty.is_empty() {
        return EngineSnapshot::Unavailable("malformed reply: no empty delimiter");
    }
    match i64::from_be_bytes(cut) {
        -1 => EngineSnapshot::Unavailable("the engine recorded nothing yet (-1)"),
        c if c < 0 => EngineSnapshot::Unavailable("the engine's snapshot is unavailable (-2)"),
        c => EngineSnapshot::State {
            cut: c as u64,
            epoch: Epoch(u128::from_be_bytes(uuid)),
            chunks: it.collect(),
        },
    }
}

impl ReplaySource for ZmqReplay<'_> {
    fn has_snapshot(&self) -> bool {
        self.io.rank.snapshot.is_some()
    }

    fn snapshot(&mut self, live: &mut dyn FnMut(u64, Vec<u8>)) -> EngineSnapshot {
        let Some(endpoint) = self.io.rank.snapshot.as_deref() else {
            return EngineSnapshot::Unavailable("no snapshot endpoint");
        };
        let dealer = match self.dealer(endpoint) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(endpoint, error = %e, "cannot open snapshot DEALER");
                return EngineSnapshot::Unavailable("cannot open a DEALER");
            }
        };
        tracing::info!(endpoint, "requesting the engine's snapshot");
        // vLLM #57789 answers any request body; SGLang #34407 wants `snapshot-v2`. The first
        // message tells which answered.
        if dealer
            .send_multipart([&b""[..], &b"snapshot-v2"[..]], 0)
            .is_err()
        {
            return EngineSnapshot::Unavailable("request not sent");
        }
        let mut v2: Option<placement::Reader> = None;
        let mut deadline = Instant::now() + self.io.replay_timeout;
        loop {
            match self.wait(&dealer, deadline, live) {
                Wait::Ready => {}
                Wait::Pending => continue,
                Wait::TimedOut => return EngineSnapshot::Unavailable("no reply in time"),
                Wait::Aborted => return EngineSnapshot::Unavailable("shutting down"),
            }
            while let Ok(frames) = dealer.recv_multipart(zmq::DONTWAIT) {
                let reader = match &mut v2 {
                    Some(r) => r,
                    None if placement::is_v2(&frames) => v2.insert(placement::Reader::new(
                        self.io.rank.rank,
                        self.io.tokens_required,
                    )),
                    None => return snapshot_reply(frames),
                };
                if let Some(done) = reader.feed(&frames) {
                    return done;
                }
                deadline = Instant::now() + self.io.replay_timeout;
            }
        }
    }

    fn replay(
        &mut self,
        from: u64,
        batch: &mut dyn FnMut(u64, &[u8]),
        live: &mut dyn FnMut(u64, Vec<u8>),
    ) -> ReplayEnd {
        let dealer = match self.dealer(self.endpoint) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(endpoint = self.endpoint, error = %e, "cannot open replay DEALER");
                return ReplayEnd::Malformed;
            }
        };
        tracing::info!(endpoint = self.endpoint, from, "requesting replay");
        let start = from.to_be_bytes();
        if let Err(e) = dealer.send_multipart([&b""[..], &start[..]], 0) {
            tracing::warn!(endpoint = self.endpoint, error = %e, "replay request failed");
            return ReplayEnd::Malformed;
        }
        let mut deadline = Instant::now() + self.io.replay_timeout;
        loop {
            match self.wait(&dealer, deadline, live) {
                Wait::Ready => {}
                Wait::Pending => continue,
                Wait::TimedOut => return ReplayEnd::TimedOut,
                Wait::Aborted => return ReplayEnd::Aborted,
            }
            while let Ok(frames) = dealer.recv_multipart(zmq::DONTWAIT) {
                let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
                match wire::replay_reply(&refs) {
                    Ok(Reply::End) => return ReplayEnd::Complete,
                    Ok(Reply::Batch(s, p)) => batch(s, p),
                    Err(why) => {
                        self.io.m.frame_dropped("replay_malformed");
                        tracing::warn!(endpoint = self.endpoint, why, "malformed replay reply");
                        return ReplayEnd::Malformed;
                    }
                }
                deadline = Instant::now() + self.io.replay_timeout;
            }
        }
    }
}
