//! One rank's thread: its SUB (with a socket monitor), the poll loop, frame validation, and
//! hand-off of each valid batch to the state machine.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::handoff::RingHandoff;
use super::io::RankIo;
use super::upstream::{Pos, RankState, ReplaySource};
use super::RankEndpoint;
use super::{wire, IngestError};
use crate::health::UpstreamState;

/// Socket monitor events the rank thread follows (docs/engine-wire.md §1: the PUB side never says
/// anything, so the transport is the only sign of a publisher).
const MONITOR_EVENTS: i32 = zmq::SocketEvent::CONNECTED as i32
    | zmq::SocketEvent::ACCEPTED as i32
    | zmq::SocketEvent::DISCONNECTED as i32
    | zmq::SocketEvent::CLOSED as i32
    | zmq::SocketEvent::CONNECT_DELAYED as i32
    | zmq::SocketEvent::CONNECT_RETRIED as i32
    | zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32;

/// When, after a publisher connection's handshake, kvbridge asks the engine's replay service for
/// what follows `last` if no live message has arrived on it meanwhile (a tail probe). A PUB
/// forwards only what is published after it has read the SUB's subscription, and nothing tells
/// the SUB when that was; a batch published between kvbridge's catch-up replay and that moment
/// is lost to the live stream, and no later batch may come to reveal it as a gap (an idle
/// engine). The first probe covers an ordinary machine, the second a loaded one; a live message
/// makes both unnecessary (anything lost before it is a gap the state machine fills).
const PROBE_AFTER: [Duration; 2] = [Duration::from_millis(200), Duration::from_secs(2)];

/// How long a connecting SUB may stay disconnected with no reconnect attempt from libzmq before
/// kvbridge connects it again. libzmq schedules its own reconnect (`CONNECT_RETRIED`) within
/// milliseconds of an ordinary disconnect, but gives a connection up for good after a protocol
/// error, such as a message above `ZMQ_MAXMSGSIZE`.
const REJOIN_AFTER: Duration = Duration::from_secs(1);

/// Creates the rank's SUB with a socket monitor (a PAIR receiving its connection events) attached
/// before the SUB binds or connects, so no event is missed.
pub(super) fn open_sub(
    ctx: &zmq::Context,
    rank: &RankEndpoint,
    topic: &[u8],
    max_message: i64,
) -> Result<(zmq::Socket, zmq::Socket), IngestError> {
    let err = |what, source| IngestError::Socket {
        rank: rank.rank,
        what,
        endpoint: rank.endpoint.clone(),
        source,
    };
    let sub = ctx.socket(zmq::SUB).map_err(|e| err("create SUB", e))?;
    // docs/engine-wire.md §1: the engine's PUB drops silently when our pipe is full.
    sub.set_rcvhwm(100_000).map_err(|e| err("set RCVHWM", e))?;
    // A larger message is refused before it is allocated, and its connection dropped.
    sub.set_maxmsgsize(max_message)
        .map_err(|e| err("set MAXMSGSIZE", e))?;
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
fn parse_monitor_event(frames: &[Vec<u8>]) -> Option<(u16, String)> {
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

/// One rank's thread state.
pub(super) struct RankWorker {
    pub(super) io: RankIo,
    pub(super) monitor: zmq::Socket,
    /// Connecting SUB only: when the publisher connection dropped with no reconnect under way.
    pub(super) lost_since: Option<Instant>,
    /// The newest publisher handshake, while no live message has arrived since: the tail probes
    /// of [`PROBE_AFTER`] still due are those past `probes_done`.
    pub(super) handshake: Option<Instant>,
    /// Tail probes made since `handshake`.
    pub(super) probes_done: usize,
    pub(super) upstream: Arc<UpstreamState>,
    pub(super) state: RankState,
    pub(super) handoff: RingHandoff,
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
    pub(super) fn run(mut self) {
        tracing::info!(rank = self.io.rank.rank, endpoint = %self.io.rank.endpoint, bind = self.io.rank.bind,
            replay = ?self.io.rank.replay, "ingest started");
        if let Some(mut rep) = self.io.replay() {
            self.state.catch_up(&mut self.handoff, &mut rep);
        }
        let mut bufs = [
            zmq::Message::new(),
            zmq::Message::new(),
            zmq::Message::new(),
        ];
        while !self.io.stop.load(Ordering::Relaxed) {
            // Also when idle, so the exported counters catch up after a burst.
            self.handoff.flush_decoder_metrics(false);
            let (data, events) = {
                let mut items = [
                    self.io.sub.as_poll_item(zmq::POLLIN),
                    self.monitor.as_poll_item(zmq::POLLIN),
                ];
                match zmq::poll(&mut items, self.poll_timeout()) {
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
            self.rejoin_if_abandoned();
            self.probe_if_due();
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
                // More than 3 frames is the first thing wrong with such a message, whatever
                // its first three hold.
                let checked = if n > 3 {
                    Err(wire::FrameDrop::FrameCount)
                } else {
                    wire::live_seq(&frames[..n], &self.io.topic)
                };
                let live = match checked {
                    Ok(s) => s,
                    Err(d) => {
                        self.io.m.frame_dropped(d.label());
                        self.handoff
                            .warn_limited(d.label(), "dropped a malformed ZMQ message");
                        continue;
                    }
                };
                // The subscription is live: nothing before this message needs a probe.
                self.handshake = None;
                let payload: &[u8] = &bufs[2];
                if matches!(self.state.pos(), Pos::Last(l) if live.seq <= l) {
                    // Repeat or restart depends on whether the publisher reconnected meanwhile:
                    // make sure its connection events are in before deciding (the monitor sees
                    // a connection before any message can arrive on it).
                    self.drain_monitor();
                }
                let mut rep = self.io.replay();
                let rep = rep.as_mut().map(|r| r as &mut dyn ReplaySource);
                self.state
                    .on_live(live.seq, live.epoch, payload, &mut self.handoff, rep);
            }
            self.handoff.flush_decoder_metrics(false);
        }
        self.handoff.flush_decoder_metrics(true);
        tracing::info!(rank = self.io.rank.rank, "ingest stopped");
    }
}

impl RankWorker {
    /// The poll's wait: 100 ms, or less when a tail probe falls due sooner.
    fn poll_timeout(&self) -> i64 {
        let due = self
            .handshake
            .and_then(|t| PROBE_AFTER.get(self.probes_done).map(|d| t + *d));
        match due {
            Some(at) => {
                (at.saturating_duration_since(Instant::now()).as_millis() as i64).clamp(1, 100)
            }
            None => 100,
        }
    }

    /// Asks the engine's replay service for what follows `last` when a tail probe is due (see
    /// [`PROBE_AFTER`]).
    fn probe_if_due(&mut self) {
        let Some(t) = self.handshake else { return };
        let Some(after) = PROBE_AFTER.get(self.probes_done) else {
            self.handshake = None;
            return;
        };
        if t.elapsed() < *after {
            return;
        }
        self.probes_done += 1;
        let Some(mut rep) = self.io.replay() else {
            self.handshake = None;
            return;
        };
        tracing::debug!(
            rank = self.io.rank.rank,
            probe = self.probes_done,
            "tail probe"
        );
        self.state.probe(&mut self.handoff, &mut rep);
    }

    /// Connects the SUB again when libzmq gave its connection up (see [`REJOIN_AFTER`]).
    fn rejoin_if_abandoned(&mut self) {
        if self.lost_since.is_none_or(|t| t.elapsed() < REJOIN_AFTER) {
            return;
        }
        self.lost_since = None;
        let (rank, endpoint) = (self.io.rank.rank, self.io.rank.endpoint.as_str());
        // The old session is gone already; disconnecting only clears its endpoint entry.
        let _ = self.io.sub.disconnect(endpoint);
        match self.io.sub.connect(endpoint) {
            Ok(()) => {
                self.io.m.rejoins.inc();
                tracing::warn!(rank, endpoint,
                    "reconnecting to the engine publisher: libzmq dropped the connection for a protocol error (a message above --max-engine-message?)");
            }
            Err(e) => {
                tracing::error!(rank, endpoint, error = %e, "cannot reconnect to the engine publisher");
                self.lost_since = Some(Instant::now());
            }
        }
    }

    /// Applies every pending socket monitor event to the shared upstream state and metrics.
    fn drain_monitor(&mut self) {
        while let Ok(frames) = self.monitor.recv_multipart(zmq::DONTWAIT) {
            let Some((event, endpoint)) = parse_monitor_event(&frames) else {
                continue;
            };
            let rank = self.io.rank.rank;
            match zmq::SocketEvent::from_raw(event) {
                zmq::SocketEvent::CONNECTED | zmq::SocketEvent::ACCEPTED => {
                    self.lost_since = None;
                    self.io.m.connects.inc();
                    self.state.on_reconnect();
                    let n = self.upstream.on_connect(rank);
                    self.io.m.connected.set(n);
                    tracing::info!(rank, %endpoint, connections = n, "engine publisher connected");
                }
                zmq::SocketEvent::DISCONNECTED => {
                    if !self.io.rank.bind {
                        self.lost_since = Some(Instant::now());
                    }
                    self.io.m.disconnects.inc();
                    let n = self.upstream.on_disconnect(rank);
                    self.io.m.connected.set(n);
                    if self.io.stop.load(Ordering::Relaxed) {
                        // Our own shutdown closing the connection is not an upstream problem.
                        tracing::debug!(rank, %endpoint, connections = n, "engine publisher disconnected");
                    } else {
                        tracing::warn!(rank, %endpoint, connections = n,
                            "engine publisher disconnected (engine gone, or a message above --max-engine-message)");
                    }
                }
                zmq::SocketEvent::HANDSHAKE_SUCCEEDED => {
                    self.handshake = Some(Instant::now());
                    self.probes_done = 0;
                }
                zmq::SocketEvent::CONNECT_DELAYED | zmq::SocketEvent::CONNECT_RETRIED => {
                    // libzmq is reconnecting by itself.
                    self.lost_since = None;
                }
                other => {
                    tracing::debug!(rank, %endpoint, event = ?other, "socket event");
                }
            }
        }
    }
}
