//! Ingest: one ZMQ SUB per engine publisher (= per DP rank), each on its own thread.
//!
//! A rank thread receives `[topic, seq, payload]` messages, validates the frames
//! ([`wire`]), runs the per-publisher state machine ([`upstream`]) — which may ask the engine's
//! replay ROUTER for missed batches over a DEALER — and hands each batch to its [`RingSink`],
//! which decodes it once, straight into ring records. Nothing downstream runs on this thread
//! except that decode-and-commit, so the SUB is drained as fast as the engine publishes (a
//! full ZMQ pipe would make the engine's PUB drop silently).

pub mod upstream;
pub mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvbridge_shm::RecordMeta;
use thiserror::Error;

use crate::config::{RankEndpoint, ServeConfig};
use crate::decode::{DecodeConfig, Decoder};
use crate::health::UpstreamState;
use crate::metrics::{Metrics, RankMetrics};
use crate::ring::{unix_nanos, ClearCause, RingHub};
use upstream::{Limits, RankState, ReplayEnd, ReplaySource, Sink};
use wire::Reply;

/// Set-up failures (reported as one line, exit code 2).
#[derive(Debug, Error)]
pub enum IngestError {
    /// A socket could not be created or configured.
    #[error("rank {rank}: {what} {endpoint}: {source}")]
    Socket {
        /// Rank.
        rank: u32,
        /// What was attempted.
        what: &'static str,
        /// Endpoint.
        endpoint: String,
        /// ZMQ error.
        source: zmq::Error,
    },
}

/// The ring(s) a rank publishes into.
#[derive(Clone)]
pub struct Targets {
    /// The merged ring every rank feeds.
    pub merged: Arc<RingHub>,
    /// Send `dp_rank` on the merged ring.
    pub merged_sends_rank: bool,
    /// The rank's own ring (metadata mode).
    pub own: Option<Arc<RingHub>>,
}

/// Running ingest threads.
pub struct Ingest {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Ingest {
    /// Creates every socket (so that a bad endpoint fails here, before anything runs), then
    /// starts one thread per rank.
    pub fn start(
        cfg: &ServeConfig,
        targets: Vec<Targets>,
        last_upstream: &std::collections::HashMap<u32, u64>,
        metrics: &Arc<Metrics>,
        upstream: Arc<UpstreamState>,
    ) -> Result<Ingest, IngestError> {
        let ctx = zmq::Context::new();
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for (rank, tgt) in cfg.ranks.iter().zip(targets) {
            let (sub, monitor) = open_sub(&ctx, rank, cfg.topic.as_bytes())?;
            let m = metrics.rank(rank.rank);
            let decoder = Decoder::new(DecodeConfig {
                split_threshold: cfg.split_threshold as usize,
                profile: cfg.profile,
                ..DecodeConfig::default()
            });
            let last = last_upstream.get(&rank.rank).copied();
            workers.push(RankWorker {
                state: RankState::new(last, Limits::default(), m.clone()),
                sink: RingSink::new(rank.rank, decoder, tgt, m.clone(), metrics.clone()),
                monitor,
                upstream: upstream.clone(),
                io: RankIo {
                    rank: rank.clone(),
                    ctx: ctx.clone(),
                    sub,
                    topic: cfg.topic.as_bytes().to_vec(),
                    stop: stop.clone(),
                    replay_timeout: cfg.replay_timeout,
                    m,
                },
            });
        }
        let threads = workers
            .into_iter()
            .map(|w| {
                std::thread::Builder::new()
                    .name(format!("ingest-rank-{}", w.io.rank.rank))
                    .spawn(move || w.run())
                    .expect("spawn ingest thread")
            })
            .collect();
        Ok(Ingest { stop, threads })
    }

    /// Stops every rank thread and waits for it (each notices within ~100 ms).
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// Socket monitor events the rank thread follows (engine-wire.md §1: the PUB side never says
/// anything, so the transport is the only sign of a publisher).
const MONITOR_EVENTS: i32 = zmq::SocketEvent::CONNECTED as i32
    | zmq::SocketEvent::ACCEPTED as i32
    | zmq::SocketEvent::DISCONNECTED as i32
    | zmq::SocketEvent::CLOSED as i32;

/// Creates the rank's SUB with a socket monitor (a PAIR receiving its connection events) attached
/// before the SUB binds or connects, so no event is missed.
fn open_sub(
    ctx: &zmq::Context,
    rank: &RankEndpoint,
    topic: &[u8],
) -> Result<(zmq::Socket, zmq::Socket), IngestError> {
    let err = |what, source| IngestError::Socket {
        rank: rank.rank,
        what,
        endpoint: rank.endpoint.clone(),
        source,
    };
    let sub = ctx.socket(zmq::SUB).map_err(|e| err("create SUB", e))?;
    // engine-wire.md §1: the engine's PUB drops silently when our pipe is full.
    sub.set_rcvhwm(100_000).map_err(|e| err("set RCVHWM", e))?;
    sub.set_linger(0).map_err(|e| err("set LINGER", e))?;
    sub.set_ipv6(true).map_err(|e| err("enable IPv6", e))?;
    sub.set_subscribe(topic).map_err(|e| err("subscribe", e))?;
    let mon_ep = format!("inproc://kvbridge-monitor-rank-{}", rank.rank);
    sub.monitor(&mon_ep, MONITOR_EVENTS)
        .map_err(|e| err("monitor", e))?;
    let monitor = ctx.socket(zmq::PAIR).map_err(|e| err("create PAIR", e))?;
    monitor.set_linger(0).map_err(|e| err("set LINGER", e))?;
    monitor
        .connect(&mon_ep)
        .map_err(|e| err("connect monitor", e))?;
    if rank.bind {
        sub.bind(&rank.endpoint).map_err(|e| err("bind", e))?;
    } else {
        sub.connect(&rank.endpoint).map_err(|e| err("connect", e))?;
    }
    Ok((sub, monitor))
}

/// Parses a socket monitor message: `[u16 event LE, u32 value LE]` then the endpoint.
pub fn parse_monitor_event(frames: &[Vec<u8>]) -> Option<(u16, String)> {
    let first = frames.first()?;
    if first.len() < 6 {
        return None;
    }
    let event = u16::from_le_bytes([first[0], first[1]]);
    let endpoint = frames
        .get(1)
        .map(|e| String::from_utf8_lossy(e).into_owned())
        .unwrap_or_default();
    Some((event, endpoint))
}

struct RankWorker {
    io: RankIo,
    monitor: zmq::Socket,
    upstream: Arc<UpstreamState>,
    state: RankState,
    sink: RingSink,
}

/// A rank's sockets and settings: what the receive loop and the replay client share.
struct RankIo {
    rank: RankEndpoint,
    ctx: zmq::Context,
    sub: zmq::Socket,
    topic: Vec<u8>,
    stop: Arc<AtomicBool>,
    replay_timeout: Duration,
    m: RankMetrics,
}

impl RankIo {
    /// The replay client, when this rank has a replay endpoint.
    fn replay(&self) -> Option<ZmqReplay<'_>> {
        let endpoint = self.rank.replay.as_deref()?;
        Some(ZmqReplay { io: self, endpoint })
    }
}

/// Receives one multipart message into reusable buffers; returns the frame count (frames past
/// the third are received into a scratch message and only counted). `Ok(None)`: nothing ready.
fn recv_message(
    sock: &zmq::Socket,
    bufs: &mut [zmq::Message; 3],
) -> Result<Option<usize>, zmq::Error> {
    let mut n = 0;
    let mut extra = zmq::Message::new();
    loop {
        let m = if n < 3 { &mut bufs[n] } else { &mut extra };
        match sock.recv(m, if n == 0 { zmq::DONTWAIT } else { 0 }) {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) if n == 0 => return Ok(None),
            Err(e) => return Err(e),
        }
        n += 1;
        if !m.get_more() {
            return Ok(Some(n));
        }
    }
}

impl RankWorker {
    fn run(mut self) {
        tracing::info!(rank = self.io.rank.rank, endpoint = %self.io.rank.endpoint, bind = self.io.rank.bind,
            replay = ?self.io.rank.replay, "ingest started");
        if let Some(mut rep) = self.io.replay() {
            self.state.catch_up(&mut self.sink, &mut rep);
        }
        let mut bufs = [
            zmq::Message::new(),
            zmq::Message::new(),
            zmq::Message::new(),
        ];
        while !self.io.stop.load(Ordering::Relaxed) {
            // Also when idle, so the exported counters catch up after a burst.
            self.sink.flush_decoder_metrics(false);
            let (data, events) = {
                let mut items = [
                    self.io.sub.as_poll_item(zmq::POLLIN),
                    self.monitor.as_poll_item(zmq::POLLIN),
                ];
                match zmq::poll(&mut items, 100) {
                    Ok(_) => (items[0].is_readable(), items[1].is_readable()),
                    Err(e) => {
                        tracing::error!(rank = self.io.rank.rank, error = %e, "poll failed");
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                }
            };
            if events {
                self.drain_monitor();
            }
            if !data {
                continue;
            }
            // Drain what is ready, then look at the stop flag again.
            for _ in 0..4096 {
                let n = match recv_message(&self.io.sub, &mut bufs) {
                    Ok(Some(n)) => n,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::error!(rank = self.io.rank.rank, error = %e, "recv failed");
                        break;
                    }
                };
                let frames: [&[u8]; 3] = [&bufs[0], &bufs[1], &bufs[2]];
                let seq = match wire::live_seq(&frames[..n.min(3)], &self.io.topic).and_then(|s| {
                    if n > 3 {
                        Err(wire::Drop::FrameCount)
                    } else {
                        Ok(s)
                    }
                }) {
                    Ok(s) => s,
                    Err(d) => {
                        self.io.m.frame_dropped(d.label());
                        self.sink
                            .warn_limited(d.label(), "dropped a malformed ZMQ message");
                        continue;
                    }
                };
                let payload: &[u8] = &bufs[2];
                let mut rep = self.io.replay();
                let rep = rep.as_mut().map(|r| r as &mut dyn ReplaySource);
                self.state.on_live(seq, payload, &mut self.sink, rep);
            }
            self.sink.flush_decoder_metrics(false);
        }
        self.sink.flush_decoder_metrics(true);
        tracing::info!(rank = self.io.rank.rank, "ingest stopped");
    }
}

impl RankWorker {
    /// Applies every pending socket monitor event to the shared upstream state and metrics.
    fn drain_monitor(&mut self) {
        while let Ok(frames) = self.monitor.recv_multipart(zmq::DONTWAIT) {
            let Some((event, endpoint)) = parse_monitor_event(&frames) else {
                continue;
            };
            let rank = self.io.rank.rank;
            match zmq::SocketEvent::from_raw(event) {
                zmq::SocketEvent::CONNECTED | zmq::SocketEvent::ACCEPTED => {
                    self.io.m.connects.inc();
                    let n = self.upstream.on_connect(rank);
                    self.io.m.connected.set(n);
                    tracing::info!(rank, %endpoint, connections = n, "engine publisher connected");
                }
                zmq::SocketEvent::DISCONNECTED => {
                    self.io.m.disconnects.inc();
                    let n = self.upstream.on_disconnect(rank);
                    self.io.m.connected.set(n);
                    tracing::warn!(rank, %endpoint, connections = n, "engine publisher disconnected");
                }
                other => {
                    tracing::debug!(rank, %endpoint, event = ?other, "socket event");
                }
            }
        }
    }
}

/// The engine's replay service, reached with a fresh DEALER per request (so a late reply to an
/// abandoned request can never be taken for part of the next one).
struct ZmqReplay<'a> {
    io: &'a RankIo,
    endpoint: &'a str,
}

impl ZmqReplay<'_> {
    fn drain_live(&self, live: &mut dyn FnMut(u64, Vec<u8>)) {
        loop {
            match self.io.sub.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => {
                    let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
                    match wire::live_seq(&refs, &self.io.topic) {
                        Ok(s) => live(s, frames.into_iter().nth(2).unwrap_or_default()),
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

/// Decodes each batch once and publishes it into the rank's ring(s).
pub struct RingSink {
    rank: u32,
    decoder: Decoder,
    targets: Targets,
    m: RankMetrics,
    metrics: Arc<Metrics>,
    warned: std::collections::HashMap<&'static str, (Instant, u64)>,
    last_flush: Instant,
}

impl RingSink {
    fn new(
        rank: u32,
        decoder: Decoder,
        targets: Targets,
        m: RankMetrics,
        metrics: Arc<Metrics>,
    ) -> Self {
        RingSink {
            rank,
            decoder,
            targets,
            m,
            metrics,
            warned: Default::default(),
            last_flush: Instant::now(),
        }
    }

    /// Logs at most one warning per kind every 10 s, with the count suppressed meanwhile.
    fn warn_limited(&mut self, kind: &'static str, msg: &str) {
        let now = Instant::now();
        let e = self
            .warned
            .entry(kind)
            .or_insert((now - Duration::from_secs(3600), 0));
        if now.duration_since(e.0) >= Duration::from_secs(10) {
            tracing::warn!(rank = self.rank, kind, suppressed = e.1, "{msg}");
            *e = (now, 0);
        } else {
            e.1 += 1;
        }
    }

    fn flush_decoder_metrics(&mut self, force: bool) {
        if !force && self.last_flush.elapsed() < Duration::from_millis(500) {
            return;
        }
        self.last_flush = Instant::now();
        for (kind, value) in self.decoder.stats().counters() {
            self.m.decoder_set(kind, value);
        }
    }

    fn ring_targets(&self) -> impl Iterator<Item = (&Arc<RingHub>, bool)> {
        std::iter::once((&self.targets.merged, self.targets.merged_sends_rank))
            .chain(self.targets.own.iter().map(|h| (h, true)))
    }
}

impl Sink for RingSink {
    fn apply(&mut self, seq: u64, payload: &[u8]) {
        self.m.batches.inc();
        if payload.is_empty() {
            // Its seq is valid, so it is a lost batch (engine-wire.md §1).
            self.m.frame_dropped("empty_payload");
            self.clear(seq, ClearCause::Undecodable);
            return;
        }
        let plan = match self.decoder.plan(payload) {
            Ok(p) => p,
            Err(e) => {
                self.m.decode_error(e.kind.label());
                let msg = format!("undecodable batch (engine seq {seq}): {e}");
                self.warn_limited("undecodable", &msg);
                self.clear(seq, ClearCause::Undecodable);
                return;
            }
        };
        if plan.lost_removals > 0 {
            // A removal the index will never see leaves a stale block that routes requests to
            // a worker that no longer holds it: reset this rank's state before the batch.
            self.warn_limited(
                "lost_removal",
                "a BlockRemoved could not be decoded; signalling a clear",
            );
            self.clear(seq, ClearCause::LostRemoval);
        }
        let batch_rank = match plan.rank {
            Some(r) => {
                if r != self.rank as i64 {
                    self.m.rank_mismatch.inc();
                }
                i32::try_from(r).unwrap_or(self.rank as i32)
            }
            None => self.rank as i32,
        };
        let meta = RecordMeta {
            dp_rank: self.rank,
            upstream_seq: seq,
            flags: 0,
            ingest_ns: unix_nanos(),
        };
        let targets: Vec<(Arc<RingHub>, bool)> =
            self.ring_targets().map(|(h, s)| (h.clone(), s)).collect();
        for (hub, sends_rank) in targets {
            let dp_rank = sends_rank.then_some(batch_rank);
            match hub.publish_batch(&self.decoder, &plan, payload, dp_rank, meta) {
                Ok(p) => {
                    if Arc::ptr_eq(&hub, &self.targets.merged) && p.records > 0 {
                        // Per record; a split batch counts its mean record size.
                        let mean = p.bytes as f64 / p.records as f64;
                        for _ in 0..p.records {
                            self.metrics.record_size.observe(mean);
                        }
                    }
                    let l = [hub.label()];
                    self.metrics
                        .ring_records
                        .with_label_values(&l)
                        .inc_by(p.records as u64);
                    self.metrics
                        .ring_bytes
                        .with_label_values(&l)
                        .inc_by(p.bytes as u64);
                }
                Err(e) => {
                    let msg = format!("ring {} write failed: {e}", hub.label());
                    self.warn_limited("ring_write", &msg);
                }
            }
        }
    }

    fn clear(&mut self, upstream_seq: u64, cause: ClearCause) {
        self.m.clear(cause.label());
        let msg = format!("signalling a cleared cache in band (engine seq {upstream_seq})");
        self.warn_limited(cause.label(), &msg);
        let targets: Vec<(Arc<RingHub>, bool)> =
            self.ring_targets().map(|(h, s)| (h.clone(), s)).collect();
        for (hub, sends_rank) in targets {
            let dp_rank = sends_rank.then_some(self.rank as i32);
            if let Err(e) = hub.publish_clear(dp_rank, self.rank, upstream_seq, cause) {
                tracing::error!(rank = self.rank, ring = hub.label(), error = %e, "cannot write the in-band clear");
            }
        }
    }
}

/// Keeps every ring's heartbeat fresh and its gauges current, until `stop`.
pub fn spawn_heartbeat(
    hubs: Vec<Arc<RingHub>>,
    metrics: Arc<Metrics>,
    stop: Arc<AtomicBool>,
) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name("ring-heartbeat".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for h in &hubs {
                    h.heartbeat();
                    let (o, n) = h.window();
                    metrics
                        .ring_oldest
                        .with_label_values(&[h.label()])
                        .set(o as i64);
                    metrics
                        .ring_newest
                        .with_label_values(&[h.label()])
                        .set(n as i64);
                    let used = h.used_bytes();
                    let l = [h.label()];
                    metrics.ring_used.with_label_values(&l).set(used as i64);
                    let cap = metrics.ring_capacity.with_label_values(&l).get();
                    if cap > 0 {
                        metrics
                            .ring_fill
                            .with_label_values(&l)
                            .set(used as f64 / cap as f64);
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
        .expect("spawn heartbeat thread")
}
