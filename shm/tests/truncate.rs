//! A ring file truncated under a reader process is an error the reader reports
//! (`ReadOutcome::Truncated`), not `SIGBUS`.
//!
//! The reader runs in a child process (this test binary re-executed with `KVB_TRUNC_PATH` set;
//! `trunc_child` is a no-op test without it), because without the guard the truncation kills the
//! reading process.
#![cfg(not(loom))]

mod common;

use common::*;
use kvbridge_shm::*;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The child: read the ring over and over (from the oldest record to the newest, then wait at the
/// tail) until the reader reports the truncation; print what happened.
#[test]
fn trunc_child() {
    let Ok(path) = std::env::var("KVB_TRUNC_PATH") else {
        return;
    };
    let mut r = RingReader::open(Path::new(&path)).unwrap();
    println!("ready");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = Vec::new();
    while Instant::now() < deadline {
        let oldest = r.oldest();
        if r.seek(oldest).is_err() {
            continue;
        }
        loop {
            match r.next_blocking(Duration::from_millis(5)) {
                ReadOutcome::Record(v) => {
                    let _ = v.copy_to(&mut buf);
                }
                ReadOutcome::Truncated => {
                    assert!(r.truncated());
                    // Final: it stays truncated and touches nothing.
                    assert!(matches!(r.next(), ReadOutcome::Truncated));
                    println!("truncated");
                    std::process::exit(0);
                }
                ReadOutcome::Empty | ReadOutcome::WriterGone => break,
                _ => {}
            }
        }
    }
    println!("no truncation seen");
    std::process::exit(3);
}

fn spawn_reader(path: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "trunc_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("KVB_TRUNC_PATH", path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The child's stdout, once it said it has the ring open.
fn when_ready(c: &mut Child) -> BufReader<std::process::ChildStdout> {
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            panic!("reader child exited before it was ready: {:?}", c.wait());
        }
        // libtest prints "test trunc_child ... " before the test's own output, on the same line.
        if line.trim_end().ends_with("ready") {
            return out;
        }
    }
}

fn truncated_under_a_reader(new_len: u64) {
    let d = tmpdir();
    let path = ring_path(&d);
    let mut w = RingWriter::open(
        &path,
        &WriterOptions {
            capacity: 1 << 20,
            seq_base: Some(1),
            group_read: false,
        },
    )
    .unwrap();
    // Fill the whole data area, so that the reader's passes touch every page.
    for _ in 0..600 {
        write(&mut w, 3000);
    }
    let mut child = spawn_reader(&path);
    let mut out = when_ready(&mut child);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(new_len).unwrap();
    // The writer must notice too before it is dropped (its clean close would touch the mapping).
    assert!(matches!(w.check(), Err(ShmError::Truncated { .. })));
    drop(w);
    let status = child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert!(
        status.success(),
        "reader child after truncation to {new_len} bytes: {status:?} (signal {:?}), said {rest:?}",
        status.signal()
    );
    assert!(
        rest.lines().any(|l| l.trim_end().ends_with("truncated")),
        "{rest:?}"
    );
}

#[test]
fn a_ring_truncated_to_zero_under_a_reader_process_is_reported_not_sigbus() {
    truncated_under_a_reader(0);
}

#[test]
fn a_ring_truncated_into_its_data_under_a_reader_process_is_reported_not_sigbus() {
    // Header intact, the second half of the data area gone.
    truncated_under_a_reader(layout::HEADER_LEN + (1 << 19));
}
