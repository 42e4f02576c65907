//! The floor's third sender, `h2-writev` (a prototype): the blocking floor's shape with
//! real HTTP/2 and gRPC framing written by hand. Each connection gets a real HTTP/2 server
//! handshake (preface, SETTINGS both ways, the client's request HEADERS, a `200` response with
//! `content-type: application/grpc`); then, per batch, every connection gets ONE non-blocking
//! `writev` of two iovecs: a 14-byte header (the 9-byte DATA frame header and the 5-byte gRPC
//! prefix) and the batch's payload, one `Bytes` shared by all the connections.
//!
//! Flow control is honoured, not assumed: the connection and stream send windows start at what
//! the client's SETTINGS say, nothing is written past them, and the client's WINDOW_UPDATE frames
//! are read (non-blocking) between batches once a window has fallen below half, as an
//! epoll-driven server would be woken to read them. A full socket (EAGAIN or a short write) parks
//! the connection's remainder, which goes first in its next `writev`. The counters
//! ([`H2Counters`]) say how often either happened.
//!
//! The receiving side is a real HTTP/2 client per connection (the `h2` crate, with the generous
//! windows a gRPC client sets), which splits the gRPC messages by their prefix and measures them
//! as the other floor receivers do.

use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use super::floor_msg::{clocked, stamp, Received, HEADER};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_ACK: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
/// The 9-byte DATA frame header and the 5-byte gRPC prefix, one iovec.
pub(super) const FRAMING: usize = 14;

/// What the sender counted over its whole run (printed as one JSON line on its stdout).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct H2Counters {
    /// `writev` calls on the connections after the handshakes.
    pub writes: u64,
    /// Writes that took only part of what was offered (the rest parked).
    pub partial_writes: u64,
    /// Writes that found the socket full (EAGAIN; everything parked).
    pub would_block: u64,
    /// Times a connection had bytes owed that its flow-control windows did not allow.
    pub window_stalls: u64,
    /// Non-blocking reads (for WINDOW_UPDATE and other control frames).
    pub reads: u64,
}

impl H2Counters {
    fn add(&mut self, o: &H2Counters) {
        self.writes += o.writes;
        self.partial_writes += o.partial_writes;
        self.would_block += o.would_block;
        self.window_stalls += o.window_stalls;
        self.reads += o.reads;
    }
}

fn frame_header(len: usize, ty: u8, flags: u8, stream: u32) -> [u8; 9] {
    let l = (len as u32).to_be_bytes();
    let s = stream.to_be_bytes();
    [l[1], l[2], l[3], ty, flags, s[0], s[1], s[2], s[3]]
}

fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Bytes {
    let mut v = frame_header(payload.len(), ty, flags, stream).to_vec();
    v.extend_from_slice(payload);
    Bytes::from(v)
}

/// Bytes owed to a socket: a small inline header (no allocation per batch) or shared bytes.
enum Chunk {
    Head { buf: [u8; FRAMING], len: u8, at: u8 },
    Shared(Bytes),
}

impl Chunk {
    fn head(bytes: &[u8]) -> Chunk {
        let mut buf = [0u8; FRAMING];
        buf[..bytes.len()].copy_from_slice(bytes);
        Chunk::Head {
            buf,
            len: bytes.len() as u8,
            at: 0,
        }
    }
    fn bytes(&self) -> &[u8] {
        match self {
            Chunk::Head { buf, len, at } => &buf[*at as usize..*len as usize],
            Chunk::Shared(b) => b,
        }
    }
    fn advance(&mut self, n: usize) {
        match self {
            Chunk::Head { at, .. } => *at += n as u8,
            Chunk::Shared(b) => *b = b.slice(n..),
        }
    }
}

/// One HTTP/2 server connection carrying one response stream.
struct Conn {
    s: TcpStream,
    /// The client's request stream (0 until its HEADERS are complete).
    stream: u32,
    /// A stream whose HEADERS await CONTINUATION frames.
    pending_stream: u32,
    conn_window: i64,
    conn_peak: i64,
    stream_window: i64,
    initial_window: i64,
    max_frame: usize,
    inbuf: Vec<u8>,
    /// gRPC bytes (prefixes and payloads) not yet framed: the windows did not allow them.
    owed: VecDeque<Chunk>,
    owed_len: usize,
    /// Framed bytes the socket has not taken yet.
    out: VecDeque<Chunk>,
    n: H2Counters,
}

impl Conn {
    fn new(s: TcpStream) -> Conn {
        Conn {
            s,
            stream: 0,
            pending_stream: 0,
            conn_window: 65_535,
            conn_peak: 65_535,
            stream_window: 65_535,
            initial_window: 65_535,
            max_frame: 16_384,
            inbuf: Vec::with_capacity(16 * 1024),
            owed: VecDeque::new(),
            owed_len: 0,
            out: VecDeque::new(),
            n: H2Counters::default(),
        }
    }

    /// Reads what the socket has (blocking or not, as the socket is set).
    fn read_some(&mut self) -> std::io::Result<usize> {
        let at = self.inbuf.len();
        self.inbuf.resize(at + 64 * 1024, 0);
        let r = self.s.read(&mut self.inbuf[at..]);
        self.inbuf.truncate(at + *r.as_ref().unwrap_or(&0));
        match r {
            Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
            r => r,
        }
    }

    /// Handles every complete frame in the input buffer.
    fn on_frames(&mut self) -> Result<(), String> {
        let mut at = 0;
        while self.inbuf.len() - at >= 9 {
            let h = &self.inbuf[at..at + 9];
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            if self.inbuf.len() - at < 9 + len {
                break;
            }
            let (ty, flags) = (h[3], h[4]);
            let id = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            let payload = self.inbuf[at + 9..at + 9 + len].to_vec();
            at += 9 + len;
            self.on_frame(ty, flags, id, &payload)?;
        }
        self.inbuf.drain(..at);
        Ok(())
    }

    fn on_frame(&mut self, ty: u8, flags: u8, id: u32, p: &[u8]) -> Result<(), String> {
        match ty {
            SETTINGS if flags & FLAG_ACK == 0 => {
                for e in p.chunks_exact(6) {
                    let v = u32::from_be_bytes([e[2], e[3], e[4], e[5]]);
                    match u16::from_be_bytes([e[0], e[1]]) {
                        // SETTINGS_INITIAL_WINDOW_SIZE changes open streams' windows by the delta.
                        0x4 => {
                            self.stream_window += v as i64 - self.initial_window;
                            self.initial_window = v as i64;
                        }
                        0x5 => self.max_frame = v as usize,
                        _ => {}
                    }
                }
                self.out
                    .push_back(Chunk::Shared(frame(SETTINGS, FLAG_ACK, 0, &[])));
            }
            WINDOW_UPDATE if p.len() == 4 => {
                let inc = (u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff) as i64;
                if id == 0 {
                    self.conn_window += inc;
                    self.conn_peak = self.conn_peak.max(self.conn_window);
                } else if id == self.stream {
                    self.stream_window += inc;
                }
            }
            PING if flags & FLAG_ACK == 0 => {
                self.out
                    .push_back(Chunk::Shared(frame(PING, FLAG_ACK, 0, p)));
            }
            HEADERS if flags & FLAG_END_HEADERS != 0 => self.stream = id,
            HEADERS => self.pending_stream = id,
            CONTINUATION if flags & FLAG_END_HEADERS != 0 => self.stream = self.pending_stream,
            RST_STREAM if id == self.stream => return Err("the client reset the stream".into()),
            GOAWAY => return Err("the client sent GOAWAY".into()),
            // The request's body (if any), SETTINGS ACK, PRIORITY: nothing to do.
            _ => {}
        }
        Ok(())
    }

    /// Writes everything framed so far, blocking (handshake and end of run only).
    fn flush_blocking(&mut self) -> Result<(), String> {
        while let Some(c) = self.out.pop_front() {
            self.s
                .write_all(c.bytes())
                .map_err(|e| format!("write: {e}"))?;
        }
        Ok(())
    }

    /// Frames as much of what is owed as the windows and the peer's frame size allow.
    fn frame_owed(&mut self) {
        while self.owed_len > 0 {
            let room = self.conn_window.min(self.stream_window);
            if room <= 0 {
                self.n.window_stalls += 1;
                return;
            }
            let n = self.owed_len.min(self.max_frame).min(room as usize);
            self.conn_window -= n as i64;
            self.stream_window -= n as i64;
            self.owed_len -= n;
            self.frame_one(n);
        }
    }

    /// One DATA frame of the next `n` owed bytes. A gRPC prefix right after the frame header
    /// joins it in one 14-byte iovec; shared payloads are sliced, never copied.
    fn frame_one(&mut self, n: usize) {
        let mut head = [0u8; FRAMING];
        head[..9].copy_from_slice(&frame_header(n, DATA, 0, self.stream));
        let (mut head_len, mut head_out, mut left) = (9, false, n);
        while left > 0 {
            let mut front = self.owed.pop_front().expect("owed bytes");
            let avail = front.bytes().len();
            let take = avail.min(left);
            left -= take;
            let part = match &mut front {
                Chunk::Head { .. } if !head_out && head_len + take <= FRAMING => {
                    head[head_len..head_len + take].copy_from_slice(&front.bytes()[..take]);
                    head_len += take;
                    None
                }
                Chunk::Head { .. } => Some(Chunk::head(&front.bytes()[..take])),
                Chunk::Shared(b) if take < avail => Some(Chunk::Shared(b.split_to(take))),
                Chunk::Shared(b) => Some(Chunk::Shared(std::mem::take(b))),
            };
            if let Some(part) = part {
                if !head_out {
                    self.out.push_back(Chunk::head(&head[..head_len]));
                    head_out = true;
                }
                self.out.push_back(part);
            }
            if take < avail {
                if let Chunk::Head { .. } = front {
                    front.advance(take);
                }
                self.owed.push_front(front);
            }
        }
        if !head_out {
            self.out.push_back(Chunk::head(&head[..head_len]));
        }
    }

    /// ONE non-blocking `writev` of everything framed; what the socket does not take stays parked.
    fn flush(&mut self) -> Result<(), String> {
        if self.out.is_empty() {
            return Ok(());
        }
        let slices: Vec<IoSlice> = self
            .out
            .iter()
            .take(64)
            .map(|c| IoSlice::new(c.bytes()))
            .collect();
        let offered: usize = slices.iter().map(|s| s.len()).sum();
        self.n.writes += 1;
        let mut wrote = match self.s.write_vectored(&slices) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                self.n.would_block += 1;
                return Ok(());
            }
            Err(e) => return Err(format!("writev: {e}")),
        };
        if wrote < offered || self.out.len() > 64 {
            self.n.partial_writes += 1;
        }
        while wrote > 0 {
            let c = self.out.front_mut().expect("written bytes were queued");
            let len = c.bytes().len();
            if wrote >= len {
                self.out.pop_front();
                wrote -= len;
            } else {
                c.advance(wrote);
                wrote = 0;
            }
        }
        Ok(())
    }

    /// Whether to read the socket before this batch: a window below half (the client's
    /// WINDOW_UPDATE is due) or bytes owed that the windows held back.
    fn wants_read(&self) -> bool {
        self.owed_len > 0
            || self.stream_window < self.initial_window / 2
            || self.conn_window < self.conn_peak / 2
    }

    /// Reads (non-blocking) what the client sent and handles it.
    fn poll_read(&mut self) -> Result<(), String> {
        self.n.reads += 1;
        match self.read_some() {
            Ok(_) => self.on_frames(),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(format!("read: {e}")),
        }
    }

    /// One batch: the gRPC message (prefix and the shared payload), framed within the windows,
    /// then one `writev`.
    fn send(&mut self, payload: &Bytes) -> Result<(), String> {
        if self.wants_read() {
            self.poll_read()?;
        }
        let mut prefix = [0u8; 5];
        prefix[1..].copy_from_slice(&(payload.len() as u32).to_be_bytes());
        self.owed.push_back(Chunk::head(&prefix));
        self.owed.push_back(Chunk::Shared(payload.clone()));
        self.owed_len += 5 + payload.len();
        self.frame_owed();
        self.flush()
    }

    /// After the last batch: everything owed, then the trailers (`grpc-status: 0`) with
    /// END_STREAM, then waits for the client to close.
    fn finish(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while (self.owed_len > 0 || !self.out.is_empty()) && Instant::now() < deadline {
            self.poll_read()?;
            self.frame_owed();
            self.flush()?;
            std::thread::sleep(Duration::from_millis(1));
        }
        self.s.set_nonblocking(false).map_err(|e| e.to_string())?;
        let mut block = vec![0x00, 11];
        block.extend_from_slice(b"grpc-status");
        block.extend_from_slice(&[1, b'0']);
        let flags = FLAG_END_HEADERS | FLAG_END_STREAM;
        self.out
            .push_back(Chunk::Shared(frame(HEADERS, flags, self.stream, &block)));
        self.flush_blocking()?;
        let _ = self.s.shutdown(std::net::Shutdown::Write);
        let _ = self.s.set_read_timeout(Some(Duration::from_secs(2)));
        let mut sink = [0u8; 4096];
        while matches!(self.s.read(&mut sink), Ok(n) if n > 0) {}
        Ok(())
    }
}

/// The server side of the HTTP/2 handshake, by hand: the client's preface and SETTINGS, ours
/// (and the ACK of theirs), the client's request HEADERS, our response HEADERS.
fn handshake(s: TcpStream) -> Result<Conn, String> {
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .map_err(|e| e.to_string())?;
    let mut c = Conn::new(s);
    let mut preface = [0u8; 24];
    c.s.read_exact(&mut preface)
        .map_err(|e| format!("h2 preface: {e}"))?;
    if preface != PREFACE {
        return Err("not an HTTP/2 client preface".into());
    }
    c.out.push_back(Chunk::Shared(frame(SETTINGS, 0, 0, &[])));
    c.flush_blocking()?;
    while c.stream == 0 {
        c.read_some().map_err(|e| format!("h2 handshake: {e}"))?;
        c.on_frames()?;
    }
    // `:status: 200` (static index 8) and `content-type: application/grpc` (a literal with the
    // static name 31, incremental indexing).
    let mut block = vec![0x88, 0x40 | 31, 16];
    block.extend_from_slice(b"application/grpc");
    c.out.push_back(Chunk::Shared(frame(
        HEADERS,
        FLAG_END_HEADERS,
        c.stream,
        &block,
    )));
    c.flush_blocking()?;
    c.s.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(c)
}

/// The `h2-writev` sender: handshakes every connection, then two threads (as the blocking
/// sender has), each with half of them, one `writev` per connection per batch. Prints its
/// [`H2Counters`] as one JSON line.
pub(super) fn h2_writev(
    socks: Vec<TcpStream>,
    rate: u64,
    bytes: usize,
    run: Duration,
) -> Result<(), String> {
    let mut halves: [Vec<Conn>; 2] = [Vec::new(), Vec::new()];
    for (i, s) in socks.into_iter().enumerate() {
        halves[i % 2].push(handshake(s)?);
    }
    let payload_len = bytes.saturating_sub(FRAMING).max(HEADER);
    let threads: Vec<_> = halves
        .into_iter()
        .map(|mut conns| {
            std::thread::spawn(move || {
                clocked(rate, run, |seq, at| {
                    let mut msg = BytesMut::zeroed(payload_len);
                    stamp(&mut msg, seq, at);
                    let payload = msg.freeze();
                    conns.iter_mut().try_for_each(|c| c.send(&payload))
                })?;
                let mut n = H2Counters::default();
                for c in &mut conns {
                    c.finish()?;
                    n.add(&c.n);
                }
                Ok::<_, String>(n)
            })
        })
        .collect();
    let mut total = H2Counters::default();
    for t in threads {
        let n = t
            .join()
            .map_err(|_| "a sender thread panicked".to_string())??;
        total.add(&n);
    }
    println!("{}", serde_json::to_string(&total).expect("serializable"));
    Ok(())
}

/// The receiving side: an HTTP/2 client (the windows a gRPC client sets) sends the request,
/// then splits the response's DATA into gRPC messages, measured as the other floors' are.
pub(super) async fn receive(s: tokio::net::TcpStream, measuring: Arc<AtomicBool>) -> Received {
    let mut out = Received::new();
    if let Err(e) = receive_into(s, &measuring, &mut out).await {
        // The sender ends the stream with trailers; anything else before that is reported.
        if !e.is_io() && !e.is_go_away() {
            eprintln!("floor (h2-writev): {e}");
        }
    }
    out
}

async fn receive_into(
    s: tokio::net::TcpStream,
    measuring: &AtomicBool,
    out: &mut Received,
) -> Result<(), h2::Error> {
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(2 << 20)
        .initial_connection_window_size(4 << 20)
        .handshake::<_, Bytes>(s)
        .await?;
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut client = client.ready().await?;
    let req = http::Request::builder()
        .method("POST")
        .uri("http://kvbridge-floor/kvbridge.bench/Floor")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a valid request");
    let (resp, send) = client.send_request(req, true)?;
    drop(send);
    let mut body = resp.await?.into_body();
    let mut buf = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        buf.extend_from_slice(&chunk);
        let now = kvbridge::clock::unix_seconds();
        let on = measuring.load(Ordering::Relaxed);
        while buf.len() >= 5 {
            let len = u32::from_be_bytes(buf[1..5].try_into().expect("4 bytes")) as usize;
            if buf.len() < 5 + len {
                break;
            }
            let m = buf.split_to(5 + len);
            out.note(&m[5..], now, on);
        }
    }
    // With no stream and no handle left the connection closes, which ends the sender's wait.
    drop((body, client));
    let _ = driver.await;
    Ok(())
}
