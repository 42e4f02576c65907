//! The engine's replay client: a fresh DEALER per request to the rank's replay ROUTER
//! (docs/engine-wire.md §7), draining the live SUB meanwhile so the engine's PUB never drops.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::io::RankIo;
use super::upstream::{ReplayEnd, ReplaySource};
use super::wire::{self, Reply};

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

impl ReplaySource for ZmqReplay<'_> {
    fn replay(
        &mut self,
        from: u64,
        batch: &mut dyn FnMut(u64, &[u8]),
        live: &mut dyn FnMut(u64, Vec<u8>),
    ) -> ReplayEnd {
        let dealer = match self.io.ctx.socket(zmq::DEALER).and_then(|d| {
            d.set_linger(0)?;
            d.set_ipv6(true)?;
            d.set_rcvhwm(0)?;
            // An oversized reply closes this DEALER's connection: the replay then times out.
            d.set_maxmsgsize(self.io.max_message)?;
            d.connect(self.endpoint)?;
            Ok(d)
        }) {
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
            if self.io.stop.load(Ordering::Relaxed) {
                return ReplayEnd::Aborted;
            }
            let now = Instant::now();
            if now >= deadline {
                return ReplayEnd::TimedOut;
            }
            let wait = (deadline - now).min(Duration::from_millis(100)).as_millis() as i64;
            let mut items = [
                dealer.as_poll_item(zmq::POLLIN),
                self.io.sub.as_poll_item(zmq::POLLIN),
            ];
            if zmq::poll(&mut items, wait.max(1)).is_err() {
                continue;
            }
            let (rep_ready, live_ready) = (items[0].is_readable(), items[1].is_readable());
            if live_ready {
                self.drain_live(live);
            }
            if rep_ready {
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
}
