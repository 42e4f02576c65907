//! What kvbridge may hold for its clients' forwarded streams: a budget per client connection
//! (`--sidecar-connection-buffer`) and one for the process (`--sidecar-buffer`).
//!
//! **What is held, and why it is bounded.** A forwarded stream's bytes are held by kvbridge
//! between arriving from one peer and being accepted by the other. kvbridge gives a peer
//! HTTP/2 flow-control capacity back only for bytes the other side has accepted (sent within
//! the other peer's window: [`crate::net::h2io::Pipe`] releases as it sends), so what a stream holds
//! is at most what its sender may send before that: a client's request bytes within the client
//! connection's window, an engine's response bytes within the stream's window on the engine
//! connection ([`STREAM_WINDOW`]), plus what h2 buffers for sending on each side
//! ([`SEND_BUFFER`] per stream). So:
//! - a client connection's request bytes: at most its connection window, which is taken from
//!   the process budget when the connection opens ([`Budgets::connection`]);
//! - each forwarded stream: a fixed [`STREAM_SHARE`] (the engine's window for it and both send
//!   buffers), taken from its connection's budget and the process budget before the call goes to
//!   the engine and given back when the stream ends. A stream that finds no share left waits
//!   (its client's stream is open, nothing is sent to the engine), so N connections that never
//!   read cost at most the budgets, and a stream never stalls halfway for another's sake.
//!
//! No counting per DATA frame: the bound comes from the windows; the budgets only count streams
//! and connections, with a semaphore's lock-free fast path.
//!
//! **Giving the memory back.** glibc's allocator keeps freed memory for reuse: after clients
//! that made kvbridge hold tens of MiB leave, the process would stay that large. When a
//! connection whose streams held at least [`TRIM_AFTER`] closes, kvbridge asks the allocator to
//! return free memory to the system (`malloc_trim`, on a blocking thread).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::ProxyMetrics;

/// HTTP/2 receive window per forwarded stream (the response side): what the engine may send a
/// stream before kvbridge has passed it on to the client, and so what a client that never reads
/// can make kvbridge hold per stream (below). HTTP/2's default: ample on the loopback or
/// a pod network, where a window is returned within tens of microseconds.
pub(crate) const STREAM_WINDOW: u32 = 64 << 10;

/// Budgets are counted in KiB: a semaphore takes a `u32` of permits at a time.
const UNIT: u64 = 1 << 10;
/// What h2 may buffer for sending per stream, on each side (its `max_send_buffer_size`):
/// bytes already accepted by the receiver's window, waiting for the socket.
pub(crate) const SEND_BUFFER: usize = 32 << 10;
/// What one forwarded stream may make kvbridge hold: the engine's window for its response, and
/// the send buffers on both sides.
pub(crate) const STREAM_SHARE: u64 = STREAM_WINDOW as u64 + 2 * SEND_BUFFER as u64;
/// The part of a connection's budget that is its request-side window: an eighth, leaving the
/// rest for its streams' shares.
const WINDOW_PART: u64 = 8;
/// The smallest connection window taken from a process budget that is running out; below it a
/// connection gets HTTP/2's initial 65,535 bytes, which a peer cannot be refused.
const MIN_WINDOW: u64 = 256 << 10;
/// HTTP/2's initial connection window (RFC 9113 §6.9.2).
const HTTP2_INITIAL_WINDOW: u32 = 65_535;
/// Stream shares a connection must have held at its peak for its end to trim the heap.
const TRIM_AFTER: u64 = 8 << 20;
/// How long a trim waits for other connections closing at the same time.
const TRIM_DELAY: Duration = Duration::from_millis(200);

/// One budget: a semaphore of KiB, and how many streams are waiting on it.
struct Pool {
    sem: Arc<Semaphore>,
    /// Its size, KiB.
    size: usize,
    waiting: AtomicUsize,
    /// The most KiB taken at once.
    peak: AtomicUsize,
}

impl Pool {
    fn new(bytes: u64) -> Arc<Self> {
        let size = (bytes / UNIT) as usize;
        Arc::new(Pool {
            sem: Arc::new(Semaphore::new(size)),
            size,
            waiting: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        })
    }

    fn note_peak(&self) {
        let used = self.size.saturating_sub(self.sem.available_permits());
        self.peak.fetch_max(used, Ordering::Relaxed);
    }

    /// `kib` permits: at once if there are, else in turn (the semaphore is fair), counted as
    /// waiting meanwhile. The second value says whether it waited.
    async fn take(self: &Arc<Self>, kib: u32) -> (OwnedSemaphorePermit, bool) {
        if let Ok(p) = self.sem.clone().try_acquire_many_owned(kib) {
            return (p, false);
        }
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _w = Waiting(&self.waiting);
        let p = self
            .sem
            .clone()
            .acquire_many_owned(kib)
            .await
            .expect("a budget's semaphore is never closed");
        (p, true)
    }

    fn contended(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) > 0
    }
}

/// The process's budget and the per-connection size (`--sidecar-buffer`,
/// `--sidecar-connection-buffer`).
pub(crate) struct Budgets {
    total: Arc<Pool>,
    connection: u64,
    /// How long a call that moves nothing keeps its share while others wait.
    pub(crate) stall: Option<Duration>,
    metrics: Arc<ProxyMetrics>,
}

impl Budgets {
    pub(crate) fn new(
        connection: u64,
        total: u64,
        stall: Option<Duration>,
        metrics: Arc<ProxyMetrics>,
    ) -> Self {
        Budgets {
            total: Pool::new(total),
            connection,
            stall,
            metrics,
        }
    }

    /// A new client connection's budget: its request-side window (taken from the process
    /// budget now: all of [`WINDOW_PART`], or less if the process budget is running out) and a
    /// pool for its streams' shares.
    pub(crate) fn connection(&self) -> ConnectionBudget {
        let want = (self.connection / WINDOW_PART).max(MIN_WINDOW);
        let mut try_kib = (want / UNIT) as u32;
        let mut window = None;
        while u64::from(try_kib) * UNIT >= MIN_WINDOW {
            if let Ok(p) = self.total.sem.clone().try_acquire_many_owned(try_kib) {
                window = Some(p);
                break;
            }
            try_kib /= 2;
        }
        let bytes = window.as_ref().map_or(0, |p| p.num_permits() as u64 * UNIT);
        self.metrics.buffer_reserved.add(bytes as i64);
        ConnectionBudget {
            streams: Pool::new(self.connection.saturating_sub(want)),
            total: self.total.clone(),
            window: window.map(|p| (p, bytes)),
            stall: self.stall,
            metrics: self.metrics.clone(),
        }
    }
}

/// One client connection's budget; dropped with the connection.
pub(crate) struct ConnectionBudget {
    streams: Arc<Pool>,
    total: Arc<Pool>,
    /// The request-side window's share of the process budget.
    window: Option<(OwnedSemaphorePermit, u64)>,
    pub(crate) stall: Option<Duration>,
    metrics: Arc<ProxyMetrics>,
}

impl ConnectionBudget {
    /// The connection's HTTP/2 receive window: what its clients may send before kvbridge has
    /// passed it on.
    pub(crate) fn window(&self) -> u32 {
        let taken = self.window.as_ref().map_or(0, |(_, b)| *b);
        u32::try_from(taken)
            .unwrap_or(u32::MAX >> 1)
            .clamp(HTTP2_INITIAL_WINDOW, (1 << 31) - 1)
    }

    /// A forwarded stream's share, once there is one (from this connection's budget, then the
    /// process's).
    pub(crate) async fn share(&self) -> Share {
        let kib = (STREAM_SHARE / UNIT) as u32;
        let (conn, waited_conn) = self.streams.take(kib).await;
        let (total, waited_total) = self.total.take(kib).await;
        self.streams.note_peak();
        if waited_conn || waited_total {
            self.metrics
                .buffer_events
                .with_label_values(&["waited"])
                .inc();
        }
        self.metrics.buffer_reserved.add(STREAM_SHARE as i64);
        Share {
            _permits: (conn, total),
            conn: self.streams.clone(),
            total: self.total.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

impl Drop for ConnectionBudget {
    fn drop(&mut self) {
        if let Some((_, bytes)) = &self.window {
            self.metrics.buffer_reserved.sub(*bytes as i64);
        }
        if self.streams.peak.load(Ordering::Relaxed) as u64 * UNIT >= TRIM_AFTER {
            trim_heap();
        }
    }
}

/// A forwarded stream's share of the budgets, given back when dropped.
pub(crate) struct Share {
    _permits: (OwnedSemaphorePermit, OwnedSemaphorePermit),
    conn: Arc<Pool>,
    total: Arc<Pool>,
    metrics: Arc<ProxyMetrics>,
}

impl Share {
    /// Whether another stream is waiting for a share this one could free.
    pub(crate) fn contended(&self) -> bool {
        self.conn.contended() || self.total.contended()
    }

    /// Counts a stream reset for moving nothing while others waited.
    pub(crate) fn count_stall_reset(&self) {
        self.metrics
            .buffer_events
            .with_label_values(&["stall_reset"])
            .inc();
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.metrics.buffer_reserved.sub(STREAM_SHARE as i64);
    }
}

/// Asks the allocator to return free memory to the system: [`TRIM_DELAY`] from now (so that
/// connections closing together, and what they free, make one trim), on a blocking thread (it
/// walks the heap).
fn trim_heap() {
    static PENDING: AtomicBool = AtomicBool::new(false);
    if PENDING.swap(true, Ordering::Relaxed) {
        return;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        PENDING.store(false, Ordering::Relaxed);
        return;
    };
    rt.spawn(async {
        tokio::time::sleep(TRIM_DELAY).await;
        PENDING.store(false, Ordering::Relaxed);
        let _ = tokio::task::spawn_blocking(kvbridge_sys::trim_heap).await;
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn shares_wait_for_one_another_and_the_window_shrinks_when_the_process_runs_out() {
        let metrics = Arc::new(ProxyMetrics::for_tests());
        // Room for the window (1 MiB) and 7 shares on the connection; 2 MiB in all.
        let b = Budgets::new(8 << 20, 2 << 20, None, metrics.clone());
        let c = b.connection();
        assert_eq!(c.window(), 1 << 20);
        let kib = (STREAM_SHARE / UNIT) as usize;
        let mut shares = Vec::new();
        for _ in 0..(1 << 10) / kib {
            shares.push(c.share().await);
        }
        // The process budget is spent: the next share waits, and says so.
        let mut next = Box::pin(c.share());
        assert!(futures_util::poll!(next.as_mut()).is_pending());
        assert!(shares[0].contended());
        drop(shares.pop());
        let s = next.await;
        assert!(!s.contended());
        // A second connection gets HTTP/2's initial window only.
        let c2 = b.connection();
        assert_eq!(c2.window(), HTTP2_INITIAL_WINDOW);
        assert_eq!(
            metrics.buffer_reserved.get(),
            (2 << 20) as i64,
            "reserved = everything"
        );
        drop((s, shares, c));
        assert_eq!(metrics.buffer_reserved.get(), 0);
    }
}
