//! One writer process, three reader processes, SIGKILL of the writer
//! mid-stream, restart (adoption, N + 1), and no corrupt record accepted.
//!
//! The processes are this test binary re-executed with `KVB_MP_ROLE` set
//! (`mp_child` is a no-op test unless that variable is present).
#![cfg(not(loom))]

use kvbridge_shm::*;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const FINAL: u32 = 1 << 31;

fn fnv(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in data {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// payload = [fnv(rest) u64][seq u64][body]
fn fill(buf: &mut [u8], seq: u64) {
    buf[8..16].copy_from_slice(&seq.to_le_bytes());
    let mut x = seq.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    for b in buf[16..].iter_mut() {
        x = xorshift(x);
        *b = x as u8;
    }
    let h = fnv(&buf[8..]);
    buf[..8].copy_from_slice(&h.to_le_bytes());
}

fn verify(p: &[u8], seq: u64, meta: &RecordMeta) -> Result<(), String> {
    if p.len() < 16 {
        return Err(format!("seq {seq}: short payload {}", p.len()));
    }
    let h = u64::from_le_bytes(p[..8].try_into().unwrap());
    if h != fnv(&p[8..]) {
        return Err(format!("seq {seq}: checksum mismatch"));
    }
    let s = u64::from_le_bytes(p[8..16].try_into().unwrap());
    if s != seq {
        return Err(format!("seq {seq}: payload names seq {s}"));
    }
    if meta.upstream_seq != seq ^ 0x5555
        || meta.dp_rank != (seq % 8) as u32
        || meta.flags & !FINAL != p.len() as u32
    {
        return Err(format!("seq {seq}: metadata mismatch {meta:?}"));
    }
    Ok(())
}

fn len_for(seq: u64) -> usize {
    16 + (xorshift(seq | 1) % 3000) as usize
}

fn run_writer(path: PathBuf) {
    let count: u64 = std::env::var("KVB_MP_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX);
    let opts = WriterOptions {
        capacity: 64 * 1024,
        seq_base: Some(1),
        group_read: false,
    };
    let mut w = RingWriter::open(&path, &opts).unwrap();
    println!("READY adopted={} next={}", w.adopted(), w.next_seq());
    std::io::stdout().flush().unwrap();
    for i in 0..=count {
        let seq = w.next_seq();
        let len = len_for(seq);
        let last = i == count;
        let mut r = w.reserve(len).unwrap();
        let buf = r.buf();
        if seq % 97 == 0 {
            // Linger half-written so that SIGKILL often lands mid-record.
            buf[..len / 2].fill(0xEE);
            std::thread::sleep(Duration::from_millis(1));
        }
        fill(buf, seq);
        r.commit(RecordMeta {
            dp_rank: (seq % 8) as u32,
            upstream_seq: seq ^ 0x5555,
            flags: len as u32 | if last { FINAL } else { 0 },
            ingest_ns: 0,
            upstream_digest: 0,
        });
        if seq % 8 == 0 {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

fn run_reader(path: PathBuf) {
    let mut r = RingReader::open(&path).unwrap();
    let start = Instant::now();
    let (mut accepted, mut laps, mut missed_total, mut gone_episodes) = (0u64, 0u64, 0u64, 0u64);
    let mut torn_views = 0u64;
    let mut expected: Option<u64> = None;
    let mut in_gone = false;
    let mut buf = Vec::new();
    let fail = |msg: String| -> ! {
        println!("CORRUPT {msg}");
        std::io::stdout().flush().unwrap();
        std::process::exit(3);
    };
    loop {
        if start.elapsed() > Duration::from_secs(60) {
            fail("reader timed out".into());
        }
        match r.next_blocking(Duration::from_millis(50)) {
            ReadOutcome::Record(v) => {
                in_gone = false;
                let (seq, meta) = (v.seq(), v.meta());
                if !v.copy_to(&mut buf) {
                    torn_views += 1; // next() reports the lap
                    continue;
                }
                if let Some(e) = expected {
                    if seq != e {
                        fail(format!("expected {e}, got {seq}"));
                    }
                }
                if let Err(m) = verify(&buf, seq, &meta) {
                    fail(m);
                }
                accepted += 1;
                expected = Some(seq + 1);
                if meta.flags & FINAL != 0 {
                    break;
                }
            }
            ReadOutcome::Lapped { missed, resume_at } => {
                if let Some(e) = expected {
                    if resume_at != e + missed {
                        fail(format!("lap arithmetic: {e} + {missed} != {resume_at}"));
                    }
                }
                laps += 1;
                missed_total += missed;
                expected = Some(resume_at);
            }
            ReadOutcome::WriterGone => {
                if !in_gone {
                    gone_episodes += 1;
                    in_gone = true;
                }
            }
            ReadOutcome::Empty => {}
            ReadOutcome::RingReset { new_ring_id } => {
                fail(format!("unexpected reset {new_ring_id}"))
            }
            // Nothing corrupts this ring: laps and a SIGKILLed writer must never look like it.
            ReadOutcome::Corrupt { seq, .. } => fail(format!("spurious corrupt record {seq}")),
            // Nor shrinks the file.
            ReadOutcome::Truncated => fail("spurious truncation".to_string()),
        }
    }
    println!(
        "RESULT accepted={accepted} laps={laps} missed={missed_total} gone={gone_episodes} torn_views={torn_views} last={}",
        expected.unwrap_or(0) - 1
    );
}

#[test]
fn mp_child() {
    let Ok(role) = std::env::var("KVB_MP_ROLE") else {
        return;
    };
    let path = PathBuf::from(std::env::var("KVB_MP_PATH").unwrap());
    match role.as_str() {
        "writer" => run_writer(path),
        "reader" => run_reader(path),
        r => panic!("unknown role {r}"),
    }
}

fn spawn(role: &str, path: &std::path::Path, count: Option<u64>) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "mp_child", "--nocapture", "--test-threads=1"])
        .env("KVB_MP_ROLE", role)
        .env("KVB_MP_PATH", path)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(n) = count {
        c.env("KVB_MP_COUNT", n.to_string());
    }
    c.spawn().unwrap()
}

/// Read stdout lines until one starts with `prefix`.
fn line_with(child: &mut Child, prefix: &str) -> String {
    let out = child.stdout.as_mut().unwrap();
    let mut rd = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        if rd.read_line(&mut line).unwrap() == 0 {
            panic!("child exited before printing {prefix}");
        }
        if let Some(i) = line.find("CORRUPT") {
            panic!("child reported: {}", line[i..].trim());
        }
        if let Some(i) = line.find(prefix) {
            return line[i..].trim().to_string();
        }
    }
}

#[test]
fn writer_sigkill_restart_three_readers() {
    let d = tempfile::Builder::new()
        .prefix("kvbshm-mp")
        .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm"
        } else {
            "/tmp"
        })
        .unwrap();
    let path = d.path().join("mp.ring");
    let mut w1 = spawn("writer", &path, None);
    let ready = line_with(&mut w1, "READY");
    assert_eq!(ready, "READY adopted=false next=1");
    let mut readers: Vec<Child> = (0..3).map(|_| spawn("reader", &path, None)).collect();
    std::thread::sleep(Duration::from_millis(400));
    w1.kill().unwrap(); // SIGKILL
    w1.wait().unwrap();
    let probe = RingReader::open(&path).unwrap();
    let n_at_death = probe.newest();
    assert!(n_at_death > 100, "writer made progress: {n_at_death}");
    // Long enough for the heartbeat to age past 250 ms: readers see WriterGone.
    std::thread::sleep(Duration::from_millis(800));
    assert!(!probe.writer_alive());
    let mut w2 = spawn("writer", &path, Some(5000));
    let ready = line_with(&mut w2, "READY");
    assert_eq!(ready, format!("READY adopted=true next={}", n_at_death + 1));
    assert!(w2.wait().unwrap().success());
    let final_seq = probe.newest();
    assert_eq!(final_seq, n_at_death + 1 + 5000);
    for mut r in readers.drain(..) {
        let res = line_with(&mut r, "RESULT");
        let status = r.wait().unwrap();
        eprintln!("{res}");
        assert!(status.success(), "reader failed: {res}");
        let field = |k: &str| -> u64 {
            res.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
                .unwrap()
                .parse()
                .unwrap()
        };
        assert!(field("accepted") > 100);
        assert!(
            field("gone") >= 1,
            "reader saw WriterGone while dead: {res}"
        );
        assert_eq!(field("last"), final_seq);
    }
}
