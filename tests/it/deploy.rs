//! Deploying like users do: several bridges on one host with default settings, the engine's own
//! `--kv-events-config` as the only engine input, and logs fit for files, pipes and terminals.
//! The real binary throughout, its stderr read through a pipe (or a pseudo-terminal).

use crate::common;

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use kvbridge_tools::sim::Layout;

const T: Duration = Duration::from_secs(30);

/// `kvbridge serve ARGS` with stderr on a pipe (or `stderr` when given), read line by line on a
/// thread of its own.
struct Serve {
    child: Child,
    lines: mpsc::Receiver<Vec<u8>>,
    /// Every line read so far, raw.
    log: Vec<Vec<u8>>,
}

impl Serve {
    fn spawn(args: &[String], env: &[(&str, &str)]) -> Serve {
        Self::spawn_with(args, env, None)
    }

    fn spawn_with(args: &[String], env: &[(&str, &str)], tty: Option<Pty>) -> Serve {
        let mut cmd = Command::new(bin());
        cmd.arg("serve")
            .args(args)
            .env("RUST_LOG", "info")
            .env_remove("NO_COLOR")
            .stdout(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let (tx, lines) = mpsc::channel();
        let child = match tty {
            None => {
                let mut child = cmd.stderr(Stdio::piped()).spawn().expect("spawn kvbridge");
                let stderr = child.stderr.take().unwrap();
                read_lines(stderr, tx);
                child
            }
            Some(Pty { master, slave }) => {
                let child = cmd
                    .stderr(Stdio::from(slave))
                    .spawn()
                    .expect("spawn kvbridge");
                // The child holds the only slave descriptor now (ours moved into `cmd` and is
                // dropped with it), so the master reads EIO once the child is gone.
                drop(cmd);
                read_lines(std::fs::File::from(master), tx);
                child
            }
        };
        Serve {
            child,
            lines,
            log: Vec::new(),
        }
    }

    /// The first log line containing `needle`, waiting for it if need be.
    fn wait_for(&mut self, needle: &str) -> String {
        self.wait_for_nth(needle, 1)
    }

    /// Like [`Serve::addresses`], but a bridge that exits before it serves is `Err` with its
    /// log (a port taken between choosing it and binding it, say).
    fn try_addresses(&mut self) -> Result<(SocketAddr, Option<SocketAddr>), String> {
        loop {
            if self
                .log
                .iter()
                .any(|l| String::from_utf8_lossy(l).contains("serving SubscribeKvEvents"))
            {
                return Ok(self.addresses());
            }
            match self.lines.recv_timeout(T) {
                Ok(line) => self.log.push(line),
                Err(e) => return Err(format!("kvbridge did not serve ({e}):\n{}", self.text())),
            }
        }
    }

    /// The `n`-th log line containing `needle` (counting from 1, over the whole log so far),
    /// waiting for it if need be.
    fn wait_for_nth(&mut self, needle: &str, n: usize) -> String {
        let mut seen = 0;
        let mut i = 0;
        loop {
            while i < self.log.len() {
                let text = String::from_utf8_lossy(&self.log[i]).into_owned();
                i += 1;
                if text.contains(needle) {
                    seen += 1;
                    if seen == n {
                        return text;
                    }
                }
            }
            match self.lines.recv_timeout(T) {
                Ok(line) => self.log.push(line),
                Err(e) => panic!(
                    "no log line {n} with {needle:?} ({e}); log:\n{}",
                    self.text()
                ),
            }
        }
    }

    /// Where gRPC and metrics are served, from the start-up line.
    fn addresses(&mut self) -> (SocketAddr, Option<SocketAddr>) {
        let line = self.wait_for("serving SubscribeKvEvents");
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
                .to_string()
        };
        let grpc = field("grpc_addr=").parse().unwrap();
        let metrics = field("metrics=");
        let metrics = (metrics != "off").then(|| {
            metrics
                .trim_start_matches("http://")
                .trim_end_matches("/metrics")
                .parse()
                .unwrap()
        });
        (grpc, metrics)
    }

    /// SIGTERM; the exit status once the process is gone and its whole log.
    fn stop(mut self) -> (ExitStatus, String) {
        // SAFETY: kill(2) on our own child's pid; it has not been waited for, so the pid is ours.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        // The reader thread ends (and drops the sender) at end of file, when the process exits.
        loop {
            match self.lines.recv_timeout(T) {
                Ok(line) => self.log.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("kvbridge did not stop on SIGTERM; log:\n{}", self.text())
                }
            }
        }
        let status = self.child.wait().unwrap();
        (status, self.text())
    }

    fn text(&self) -> String {
        self.log
            .iter()
            .map(|l| String::from_utf8_lossy(l).into_owned())
            .collect()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_lines(src: impl Read + Send + 'static, tx: mpsc::Sender<Vec<u8>>) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        loop {
            let mut line = Vec::new();
            // A pseudo-terminal's master reports EIO, not end of file, when the child is gone.
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            }
        }
    });
}

/// A pseudo-terminal pair: the child's stderr is the slave, the test reads the master.
struct Pty {
    master: OwnedFd,
    slave: std::fs::File,
}

fn pty() -> Pty {
    // SAFETY: plain libc calls on a descriptor this function owns; `name` is NUL-terminated by
    // ptsname_r, which succeeded.
    unsafe {
        let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
        assert!(m >= 0, "posix_openpt: {}", std::io::Error::last_os_error());
        let master = OwnedFd::from_raw_fd(m);
        assert_eq!(libc::grantpt(m), 0);
        assert_eq!(libc::unlockpt(m), 0);
        let mut name = [0 as libc::c_char; 128];
        assert_eq!(libc::ptsname_r(m, name.as_mut_ptr(), name.len()), 0);
        let path = std::ffi::CStr::from_ptr(name.as_ptr())
            .to_str()
            .unwrap()
            .to_owned();
        let slave = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        Pty { master, slave }
    }
}

/// A port `p` such that `p` and `p + 1000` (its default metrics port) are both free.
fn grpc_port_with_free_metrics_port() -> u16 {
    loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p <= 64535 && std::net::TcpListener::bind(("127.0.0.1", p + 1000)).is_ok() {
            return p;
        }
    }
}

/// A default ring (`/dev/shm/kvbridge-<port>`), removed with its wake file and checkpoint when dropped, even
/// when the test fails. Declare it before the bridge using it, so that the bridge goes first.
struct DefaultRing(std::path::PathBuf);

impl DefaultRing {
    fn of(grpc_port: u16) -> DefaultRing {
        DefaultRing(format!("/dev/shm/kvbridge-{grpc_port}").into())
    }
}

impl Drop for DefaultRing {
    fn drop(&mut self) {
        let _ = kvbridge::ring::RingFiles::new(&self.0).remove();
    }
}

/// Item 1: bridges that differ only in `--zmq` and `--grpc` all start, each with its ring and its
/// metrics where the rule puts them (127.0.0.1:<gRPC port + 1000>), and each metrics page is its
/// own bridge's.
#[test]
fn three_bridges_differing_only_in_zmq_and_grpc_all_serve_metrics() {
    let engines: Vec<Engine> = (0..3).map(Engine::start).collect();
    let mut rings = Vec::new();
    let mut bridges = Vec::new();
    for e in &engines {
        // The rule under test fixes the metrics port from the gRPC port, so these are chosen
        // beforehand, not bound as port 0: a start that finds one taken meanwhile is retried.
        let (port, b, (grpc, metrics)) = retry_on_taken_port(|| {
            let port = grpc_port_with_free_metrics_port();
            let args = [
                "--zmq".to_string(),
                e.endpoint.clone(),
                "--grpc".into(),
                format!("127.0.0.1:{port}"),
            ];
            let mut b = Serve::spawn(&args, &[]);
            // (a failed start leaves no ring behind)
            let addrs = b.try_addresses()?;
            Ok((port, b, addrs))
        });
        rings.push(DefaultRing::of(port));
        assert_eq!(grpc.port(), port);
        let want: SocketAddr = format!("127.0.0.1:{}", port + 1000).parse().unwrap();
        assert_eq!(metrics, Some(want), "the documented rule");
        let ring = &rings.last().unwrap().0;
        assert!(ring.exists(), "default ring {}", ring.display());
        bridges.push((b, want));
    }
    // Bridge i gets i + 1 batches; its own page (and only its) counts them.
    for (i, (e, _)) in engines.iter().zip(&bridges).enumerate() {
        // Subscribed, not only connected: a batch published before the subscription reaches
        // the engine is dropped by its PUB, and these bridges have no replay endpoint.
        e.wait_subscribed();
        for j in 0..=i {
            e.publish(Layout::Vllm033, vec![store(j as u64 + 1, 1, None)], 0);
        }
    }
    for (i, (_, metrics)) in bridges.iter().enumerate() {
        let want = (i + 1) as f64;
        wait_metrics(*metrics, T, |p| {
            metric(p, "kvbridge_batches_received_total", &[("rank", "0")]) == want
        });
    }
    for (b, _) in bridges {
        let (status, log) = b.stop();
        assert!(status.success(), "{status:?}\n{log}");
    }
}

/// `--grpc …:0` (tests): metrics on port 0 too, both bound addresses in the log, and a ring named
/// after the bound gRPC port, so that such bridges do not share one.
#[test]
fn grpc_port_0_binds_metrics_on_port_0_and_logs_both() {
    let e = Engine::start(0);
    let args = [
        "--zmq".to_string(),
        e.endpoint.clone(),
        "--grpc".into(),
        "127.0.0.1:0".into(),
    ];
    let mut rings = Vec::new();
    let (mut a, mut b) = (Serve::spawn(&args, &[]), Serve::spawn(&args, &[]));
    for s in [&mut a, &mut b] {
        let (grpc, metrics) = s.addresses();
        rings.push(DefaultRing::of(grpc.port()));
        let metrics = metrics.expect("metrics on by default");
        assert_ne!(grpc.port(), 0);
        assert_ne!(metrics.port(), 0);
        assert!(scrape(metrics).contains("kvbridge_health_serving"));
        let ring = &rings.last().unwrap().0;
        assert!(ring.exists(), "default ring {}", ring.display());
        assert!(s.text().contains(&format!("ring={}", ring.display())));
    }
    for s in [a, b] {
        let (status, log) = s.stop();
        assert!(status.success(), "{status:?}\n{log}");
    }
}

/// Item 2: the engine's own configuration is the only engine input. Two simulated ranks bound where
/// the engine's rule puts them (port + rank, replay likewise, wildcard host), and a subscriber
/// receives both ranks' batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_config_alone_finds_every_rank() {
    // Four consecutive free ports: events at base, base + 1; replay at base + 2, base + 3 (the
    // engine's rule, so not port 0). The engines bind them in this process and hold them; a
    // taken one means another try.
    let (base, engines) = loop {
        let base = free_port();
        if base > 65530 {
            continue;
        }
        let e0 = Engine::try_start_at(&format!("tcp://*:{base}"), &format!("tcp://*:{}", base + 2));
        let e1 = Engine::try_start_at(
            &format!("tcp://*:{}", base + 1),
            &format!("tcp://*:{}", base + 3),
        );
        if let (Ok(e0), Ok(e1)) = (e0, e1) {
            break (base, [e0, e1]);
        }
    };
    let kv = format!(
        r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{base}", "replay_endpoint": "tcp://*:{}", "topic": ""}}"#,
        base + 2
    );
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--kv-events-config".to_string(),
        kv,
        "--data-parallel-size".into(),
        "2".into(),
        "--grpc".into(),
        "127.0.0.1:0".into(),
        "--metrics".into(),
        "off".into(),
        "--shm".into(),
        dir.path().join("ring").display().to_string(),
    ];
    let mut bridge = Serve::spawn(&args, &[]);
    let (grpc, _) = bridge.addresses();
    for r in 0..2 {
        let line = bridge.wait_for(&format!("ingest started rank={r}"));
        let (ep, rep) = (
            format!("endpoint=tcp://127.0.0.1:{}", base + r),
            format!("tcp://127.0.0.1:{}", base + 2 + r),
        );
        assert!(line.contains(&ep) && line.contains(&rep), "{line}");
    }
    bridge.wait_for_nth("engine publisher connected", 2);
    let mut s = subscribe(&format!("http://{grpc}"), 0).await.unwrap();
    let mut want = Vec::new();
    for (r, e) in engines.iter().enumerate() {
        let ev = store(100 + r as u64, 2, None);
        if let kvbridge_tools::sim::SimEvent::Stored { hashes, .. } = &ev {
            want.extend(hashes.iter().copied());
        }
        e.publish(Layout::Sglang0523, vec![ev], r as u32);
    }
    let got = collect_until(&mut s, T, |b| stored_hashes(b).len() >= want.len()).await;
    let mut have = stored_hashes(&got);
    have.sort_unstable();
    want.sort_unstable();
    assert_eq!(have, want, "both ranks' batches");
    assert_eq!(clears(&got), 0);
    let (status, log) = bridge.stop();
    assert!(status.success(), "{status:?}\n{log}");
}

/// `--kv-events-config` with explicit endpoints, or a configuration the engine itself would fail
/// on: one line, exit code 2.
#[test]
fn kv_events_config_errors_are_one_line_and_exit_2() {
    for (args, want) in [
        (
            vec![
                "--kv-events-config",
                r#"{"publisher": "zmq"}"#,
                "--zmq",
                "tcp://127.0.0.1:5557",
            ],
            "drop --zmq",
        ),
        (
            vec![
                "--kv-events-config",
                r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}"#,
                "--data-parallel-size",
                "2",
            ],
            r#""replay_endpoint": "tcp://*:5559""#,
        ),
        (
            vec!["--kv-events-config", "@/nonexistent/kv.json"],
            "/nonexistent/kv.json",
        ),
    ] {
        let o = Command::new(bin())
            .arg("serve")
            .args(&args)
            .args(["--metrics", "off", "--grpc", "127.0.0.1:0"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// Item 3: plain text on a pipe, colour on a terminal unless `NO_COLOR`, and a normal stop
/// (SIGTERM with an engine connected and a subscriber streaming) logs no warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_plain_off_a_terminal_and_a_normal_stop_warns_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::start(0);
    let args = |ring: &str| {
        vec![
            "--zmq".to_string(),
            e.endpoint.clone(),
            "--replay".into(),
            e.replay.clone(),
            "--grpc".into(),
            "127.0.0.1:0".into(),
            "--shm".into(),
            dir.path().join(ring).display().to_string(),
        ]
    };
    let mut bridge = Serve::spawn(&args("a"), &[]);
    let (grpc, _) = bridge.addresses();
    bridge.wait_for("engine publisher connected");
    let mut s = subscribe(&format!("http://{grpc}"), 0).await.unwrap();
    e.publish(Layout::Vllm033, vec![store(1, 2, None)], 0);
    collect_until(&mut s, T, |b| !b.is_empty()).await;
    // The subscriber stays connected through the stop.
    let (status, log) = bridge.stop();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("shutting down"), "{log}");
    assert!(!log.contains('\x1b'), "ANSI escape on a pipe:\n{log}");
    for level in [" WARN ", " ERROR "] {
        assert!(!log.contains(level), "{level} at a normal stop:\n{log}");
    }
    let end = tokio::time::timeout(T, s.message()).await.unwrap();
    assert_eq!(
        end.expect_err("ended by the stop").code(),
        tonic::Code::Unavailable
    );

    // On a terminal: colour, unless NO_COLOR has a value.
    for (no_color, ring, coloured) in [
        (None, "b", true),
        (Some("1"), "c", false),
        (Some(""), "d", true),
    ] {
        let env: Vec<(&str, &str)> = no_color.map(|v| ("NO_COLOR", v)).into_iter().collect();
        let mut b = Serve::spawn_with(&args(ring), &env, Some(pty()));
        b.wait_for("serving SubscribeKvEvents");
        let (status, log) = b.stop();
        assert!(status.success(), "{status:?}\n{log}");
        assert_eq!(
            log.contains("\x1b["),
            coloured,
            "NO_COLOR={no_color:?} on a terminal:\n{log}"
        );
    }
}
