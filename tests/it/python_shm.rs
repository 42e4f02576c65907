//! The Python ring reader (`pip install ./python`, package `kvbridge_shm`) against a running
//! `kvbridge serve` fed by a simulated engine. The wheel is built into a pinned venv by
//! `scripts/python-shm-venv.sh` (maturin; rebuilt only when its sources change); the Python side
//! of each test is `python/tests/reader_check.py`, which prints one JSON line per step and waits
//! for cues on stdin where the test must act in between (publish, SIGKILL, restart).
//!
//! * every record read in Python equals, byte for byte, the message gRPC delivers for the same
//!   sequence number (raw-bytes gRPC client), metadata included; reading resumes from the middle
//!   (`seek`); `parse_batch` decodes through the published smg-grpc-proto classes; waiting
//!   releases the GIL; the ring file is mapped read-only in the Python process;
//! * a reader lapped by the writer gets `Lapped` with `resume_at` = the oldest retained record
//!   and `missed` = `resume_at - wanted`, then reads `resume_at`;
//! * the writer SIGKILLed → `WriterGone` carrying the position; the reader then waits (60 s
//!   timeout) while the writer is still dead, is woken by the restarted writer on the same ring
//!   and continues at N + 1 without a gap.

use crate::common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use kvbridge::proto::common::SubscribeKvEventsRequest;
use kvbridge_shm::RingReader;
use kvbridge_tools::bench::RawCodec;
use kvbridge_tools::sim::Layout;
use prost::Message;
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

/// Runs `scripts/python-shm-venv.sh` (builds and installs the wheel when its sources changed)
/// and returns the venv's python. Fails, never skips, when that is impossible.
fn venv_python() -> PathBuf {
    common::setup_script(
        "python-shm-venv.sh",
        &[("PYSHM_VENV", common::target_dir().join("pyshm-venv"))],
        "Python >= 3.10 with pip, PyPI and crates.io access",
    )
}

/// `python/tests/reader_check.py MODE ARGS…` with line-wise stdout and a stdin for cues.
struct PyReader {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl PyReader {
    fn spawn(py: &Path, args: &[String]) -> PyReader {
        let mut child = Command::new(py)
            .arg(repo().join("python/tests/reader_check.py"))
            .args(args)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn python reader_check.py");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        PyReader {
            child,
            stdin,
            lines,
            seen: Vec::new(),
        }
    }

    /// The next JSON line; on timeout or exit, fails with everything the script printed.
    fn next(&mut self) -> Value {
        match self.lines.recv_timeout(T) {
            Ok(l) => {
                self.seen.push(l.clone());
                serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l}"))
            }
            Err(e) => {
                let _ = self.child.kill();
                let mut err = String::new();
                if let Some(mut s) = self.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut s, &mut err);
                }
                panic!(
                    "reader_check.py: {e:?} after\n{}\n--- stderr\n{err}",
                    self.seen.join("\n")
                );
            }
        }
    }

    /// The next line, which must be `event`.
    fn expect(&mut self, event: &str) -> Value {
        let v = self.next();
        assert_eq!(v["event"], event, "unexpected line {v}");
        v
    }

    fn cue(&mut self, s: &str) {
        writeln!(self.stdin, "{s}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn finish(mut self) {
        self.expect("done");
        let st = self.child.wait().unwrap();
        assert!(st.success(), "reader_check.py exited with {st:?}");
    }
}

/// The first `count` messages of a gRPC subscription with `start_sequence_number = start` (the
/// records above `start`; 0: from the oldest retained), as raw bytes, by sequence.
async fn grpc_raw(url: &str, start: u64, count: usize) -> BTreeMap<u64, Vec<u8>> {
    let ch = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static(kvbridge::proto::ENGINE_SERVICES[0].path);
    let req = SubscribeKvEventsRequest {
        start_sequence_number: start,
        load_records_before_first_batch: true,
    };
    let mut s = grpc
        .server_streaming(tonic::Request::new(req), path, RawCodec)
        .await
        .expect("subscribe")
        .into_inner();
    let mut out = BTreeMap::new();
    while out.len() < count {
        let b = tokio::time::timeout(T, s.message())
            .await
            .expect("gRPC timed out")
            .expect("gRPC failed")
            .expect("gRPC stream ended");
        let batch = kvbridge::proto::common::KvEventBatch::decode(b.clone()).unwrap();
        out.insert(batch.sequence_number as u64, b.to_vec());
    }
    out
}

fn rank_args(e: &Engine) -> Vec<String> {
    vec![
        "--zmq".into(),
        e.endpoint.clone(),
        "--replay".into(),
        e.replay.clone(),
        "--seq-base".into(),
        "1".into(),
    ]
}

const LAYOUTS: [Layout; 3] = [Layout::Vllm0102, Layout::Vllm022, Layout::Vllm033];

/// Publishes batches `from..to` (a store of `blocks` blocks each) and waits until the ring's
/// newest record is `to` (sequence numbers start at 1 and follow the engine's batches).
fn publish_until(e: &Engine, ring: &Path, from: u64, to: u64, blocks: usize) {
    for i in from..to {
        e.publish(LAYOUTS[i as usize % 3], vec![store(i + 1, blocks, None)], 0);
    }
    let newest = common::eventually(
        &format!("the ring reaches {to}"),
        T,
        || match RingReader::open(ring).map(|r| r.newest()) {
            Ok(n) if n >= to => Ok(n),
            other => Err(other.map_err(|e| e.to_string())),
        },
    );
    assert_eq!(newest, to, "more records than batches published");
}

fn s(x: impl ToString) -> String {
    x.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_reader_equals_grpc_bytes_resumes_from_the_middle_and_maps_read_only() {
    let py = venv_python();
    let dir = tempfile::tempdir().unwrap();
    let dirp = dir.path().canonicalize().unwrap();
    let ring = dirp.join("ring");
    let e = Engine::start(0);
    let bridge = Bridge::start(&dirp, &ring, &rank_args(&e));
    e.wait_subscribed();
    let n = 30u64;
    publish_until(&e, &ring, 0, n, 3);
    let want = grpc_raw(&bridge.url(), 0, n as usize).await;
    assert_eq!(
        want.keys().copied().collect::<Vec<_>>(),
        (1..=n).collect::<Vec<_>>()
    );

    // From the oldest record, then again from the middle.
    for (start, count) in [(None, n), (Some(17u64), n - 16)] {
        let mut args = vec![
            s("dump"),
            s("--ring"),
            s(ring.display()),
            s("--count"),
            s(count),
        ];
        if let Some(st) = start {
            args.extend([s("--start"), s(st)]);
        }
        let mut p = PyReader::spawn(&py, &args);
        let w = p.expect("window");
        assert_eq!(
            (w["oldest"].as_u64(), w["newest"].as_u64()),
            (Some(1), Some(n))
        );
        assert_eq!(w["position"], 1, "a new reader starts at the oldest record");
        assert_eq!(w["path"], ring.display().to_string());
        assert_eq!(w["alive"], true);
        let first = start.unwrap_or(1);
        for seq in first..=n {
            let r = p.expect("record");
            assert_eq!(r["seq"], seq);
            let payload = hex_decode(r["payload"].as_str().unwrap());
            assert_eq!(
                payload, want[&seq],
                "record {seq}: ring bytes != gRPC bytes"
            );
            assert_eq!(r["dp_rank"], 0);
            assert_eq!(r["upstream_seq"], seq - 1, "engine seq of batch {seq}");
            assert!(r["ingest_ns"].as_u64().unwrap() > 1_600_000_000_000_000_000);
        }
        let se = p.expect("seek_error");
        assert_eq!(
            (
                se["requested"].as_u64(),
                se["oldest"].as_u64(),
                se["newest"].as_u64()
            ),
            (Some(n + 5), Some(1), Some(n))
        );
        let gil = p.expect("gil");
        assert!(
            gil["spins"].as_u64().unwrap() > 1000 && gil["busy"].as_u64().unwrap() > 0,
            "another Python thread ran while a reader waited (GIL released), and was refused \
             the busy reader: {gil}"
        );
        let maps = p.expect("maps");
        let ring_maps = maps["ring"].as_array().unwrap();
        assert!(!ring_maps.is_empty(), "the ring is not mapped: {maps}");
        for m in ring_maps {
            let m = m.as_str().unwrap();
            assert!(m.starts_with("r-") && !m.contains('w'), "ring mapped {m}");
        }
        p.finish();
    }
    // Nothing the reader did disturbed the ring.
    assert_eq!(grpc_raw(&bridge.url(), 0, n as usize).await, want);
    assert!(bridge.stop().success());
}

fn hex_decode(h: &str) -> Vec<u8> {
    (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_reader_lapped_by_the_writer_gets_lapped_with_the_resume_point() {
    let py = venv_python();
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let e = Engine::start(0);
    let mut args = rank_args(&e);
    args.extend([s("--ring-size"), s("1MiB")]);
    let bridge = Bridge::start(dir.path(), &ring, &args);
    e.wait_subscribed();
    publish_until(&e, &ring, 0, 5, 2);
    let mut p = PyReader::spawn(&py, &[s("lap"), s("--ring"), s(ring.display())]);
    let ready = p.expect("ready");
    let wanted = ready["position"].as_u64().unwrap();
    assert_eq!(wanted, 6);
    // ~3 KiB per batch: 600 batches overwrite the 1 MiB ring about twice.
    let last = 5 + 600;
    publish_until(&e, &ring, 5, last, 64);
    let r = RingReader::open(&ring).unwrap();
    let oldest = r.oldest();
    assert!(
        oldest > wanted,
        "the writer did not lap the reader (oldest {oldest})"
    );
    p.cue("go");
    let lap = p.expect("lapped");
    assert_eq!(lap["wanted"], wanted);
    assert_eq!(
        lap["resume_at"], oldest,
        "resume at the oldest retained record"
    );
    assert_eq!(lap["missed"], oldest - wanted);
    assert_eq!(
        lap["position"], oldest,
        "the reader is already at resume_at"
    );
    let rec = p.expect("record");
    assert_eq!(rec["seq"], oldest);
    let want = grpc_raw(&bridge.url(), oldest - 1, 1).await;
    assert_eq!(
        hex_decode(rec["payload"].as_str().unwrap()),
        want[&oldest],
        "the record after the lap equals gRPC's"
    );
    p.finish();
    assert!(bridge.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_reader_sees_writer_gone_on_sigkill_and_continues_at_n_plus_1_after_restart() {
    let py = venv_python();
    let dir = tempfile::tempdir().unwrap();
    let ring = dir.path().join("ring");
    let e = Engine::start(0);
    let mut bridge = Bridge::start(dir.path(), &ring, &rank_args(&e));
    e.wait_subscribed();
    let n = 12u64;
    publish_until(&e, &ring, 0, n, 2);
    let more = 8u64;
    let mut p = PyReader::spawn(
        &py,
        &[
            s("kill"),
            s("--ring"),
            s(ring.display()),
            s("--start"),
            s(4),
            s("--count"),
            s(n - 3),
            s("--more"),
            s(more),
        ],
    );
    for seq in 4..=n {
        assert_eq!(p.expect("record")["seq"], seq);
    }
    let c = p.expect("caught_up");
    assert_eq!(c["position"], n + 1);
    assert_eq!(c["alive"], true);
    // No shutdown path at all: the kernel releases the writer lock.
    bridge.child.kill().unwrap();
    bridge.child.wait().unwrap();
    let gone = p.expect("gone");
    assert_eq!(gone["resume_at"], n + 1, "WriterGone carries the position");
    assert_eq!(gone["alive"], false);
    let (grpc, args) = (bridge.grpc, bridge.args.clone());
    let seen = e.subscriptions();
    drop(bridge);
    let bridge = Bridge::start_args(dir.path(), grpc, &ring, args);
    e.wait_subscribed_after(seen);
    publish_until(&e, &ring, n, n + more, 2);
    let want = grpc_raw(&bridge.url(), n, more as usize).await;
    for seq in n + 1..=n + more {
        let r = p.expect("record");
        assert_eq!(r["seq"], seq, "continues at N + 1 without a gap");
        assert_eq!(hex_decode(r["payload"].as_str().unwrap()), want[&seq]);
    }
    p.finish();
    assert!(bridge.stop().success());
}
