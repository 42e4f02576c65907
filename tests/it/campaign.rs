//! The fault campaign: seeded random schedules of faults against a **real** engine with kvbridge
//! in front and traffic between the faults, one invariant checked after every step. A fixed list
//! of scenarios (`real_engine`) proves the orders someone thought of; a schedule drawn from a
//! seed proves the ones nobody did, and a failing seed is a bug report that reproduces with one
//! command (`scripts/campaign.sh --seed S`). docs/testing.md says what runs in CI and how a long
//! campaign is run.
//!
//! **The invariant**, at every quiescent point (the engine idle, kvbridge caught up): each
//! consumer's applied block set is the engine's live block set, or the rank says `degraded` on
//! `/health` with its causes and the consumer was told (an in-band clear, a snapshot that starts
//! with one, or an error status that made it join again). The engine's truth is its own PUB read
//! by a plain SUB connected before it started (the engine binds), or its replay from 0 (the
//! engine connects; its replay buffer then holds every batch). The consumers:
//!
//! - a gRPC subscriber resumed by sequence number after every step (a new connection each time,
//!   as a gateway that lost its connection), that joins again from 0 with snapshots when told to;
//! - a late joiner with snapshots, new at every check;
//! - the engine-wire re-publish (`--publish-zmq-replay`) replayed from 0 (the consumer restarted
//!   from nothing at every check), decoded by kvbridge's decoder;
//! - a shm reader of the ring file, new at every check: the checkpoint beside the ring, then the
//!   ring's records after its cut.
//!
//! A silent divergence (the rank `exact` and a consumer's blocks not the engine's, or a consumer
//! that went from exact to degraded without being told) fails the run with the seed, the schedule
//! and the first step after which it broke.

use crate::common;

use std::collections::BTreeSet;
use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::real_engine::{
    engine_ops, prompt, replay, Endpoint, EngineKind, EngineOpts, RealEngine,
};
use common::{http_get, metric, scrape, Bridge};
use kvbridge::proto::common::{kv_cache_event::Data, KvEventBatch};

/// How long kvbridge and its consumers may take to show what the engine published.
const SETTLE: Duration = Duration::from_secs(30);
/// Tokens generated per request (with a 70-word `prompt`, 3 blocks of 32, as `real_engine`).
const MAX_TOKENS: usize = 30;
/// The engine's replay buffer when it binds: a burst passes it, so that a kvbridge down or paused
/// meanwhile finds history missing.
const SMALL_BUFFER: u32 = 24;

/// A small, seedable generator (splitmix64): the same seed draws the same schedule everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

/// How a process is stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sig {
    Term,
    Kill,
}

/// One step of a schedule. Every step that can make the engine publish ends with traffic, so
/// that a restart is visible on the wire before the check (an engine that restarted and has not
/// published yet is indistinguishable, on today's wire, from one that did not restart).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// `n` requests (new prompts).
    Traffic(u32),
    /// Many new prompts: the engine evicts, and passes its replay buffer.
    Burst(u32),
    /// The engine stopped and started again under kvbridge.
    EngineRestart(Sig),
    /// kvbridge stopped, `n` requests meanwhile, started again on its ring.
    BridgeRestart(Sig, u32),
    /// kvbridge down while the engine restarts and serves `n` requests.
    BridgeDownAcrossEngineRestart(Sig, Sig, u32),
    /// kvbridge paused (SIGSTOP) for `n` requests, then continued.
    BridgePause(u32),
    /// The engine's own cache reset (and a request, which carries its clear out on vLLM).
    EngineReset,
    /// kvbridge stopped, its ring file removed, `n` requests, kvbridge started on a new ring.
    RingRemoved(Sig, u32),
    /// The resumed subscriber's connection dropped mid-traffic and resumed from its last seq.
    SubscriberResume(u32),
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// A schedule: the engine's endpoint mode, the requests before kvbridge first starts (past the
/// replay buffer, a late start), then the steps.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub engine: EngineKind,
    pub seed: u64,
    pub endpoint: Endpoint,
    pub before_start: u32,
    pub steps: Vec<Step>,
}

impl Schedule {
    /// The schedule seed `seed` draws: 20 to 50 steps (`max_steps` caps it).
    pub fn draw(engine: EngineKind, seed: u64, max_steps: usize) -> Schedule {
        let mut r = Rng(seed);
        let endpoint = if r.below(3) == 0 {
            Endpoint::Connecting
        } else {
            Endpoint::Bound
        };
        let bound = endpoint == Endpoint::Bound;
        let sig = |r: &mut Rng| if r.coin() { Sig::Term } else { Sig::Kill };
        let n = (20 + r.below(31) as usize).min(max_steps);
        let before_start = if r.coin() { 2 } else { 5 + r.below(20) as u32 };
        let mut steps = Vec::with_capacity(n);
        while steps.len() < n {
            let s = match r.below(100) {
                0..=24 => Step::Traffic(1 + r.below(4) as u32),
                25..=32 => Step::Burst(if bound { 12 + r.below(20) as u32 } else { 8 }),
                33..=42 => Step::EngineRestart(sig(&mut r)),
                43..=54 => Step::BridgeRestart(sig(&mut r), r.below(4) as u32),
                55..=62 => Step::BridgeDownAcrossEngineRestart(
                    sig(&mut r),
                    sig(&mut r),
                    1 + r.below(if bound { 20 } else { 6 }) as u32,
                ),
                63..=70 => Step::BridgePause(if bound { 4 + r.below(20) as u32 } else { 3 }),
                71..=80 => Step::EngineReset,
                81..=87 => Step::RingRemoved(sig(&mut r), r.below(4) as u32),
                _ => Step::SubscriberResume(1 + r.below(3) as u32),
            };
            steps.push(s);
        }
        Schedule {
            engine,
            seed,
            endpoint,
            before_start,
            steps,
        }
    }

    fn describe(&self) -> String {
        let steps: Vec<String> = self
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| format!("  {:>2}. {s}", i + 1))
            .collect();
        format!(
            "{:?} seed {} ({:?} endpoint, {} requests before kvbridge starts):\n{}",
            self.engine,
            self.seed,
            self.endpoint,
            self.before_start,
            steps.join("\n")
        )
    }
}

/// What a schedule's run saw, for the campaign's figures.
#[derive(Default, Debug)]
pub struct Tally {
    pub steps: u64,
    pub faults: std::collections::BTreeMap<String, u64>,
    /// Checks at which the rank was degraded, by causes.
    pub degraded: std::collections::BTreeMap<String, u64>,
    pub checks: u64,
    /// Exact checks at which each consumer was compared with the engine.
    pub compared: std::collections::BTreeMap<&'static str, u64>,
}

/// The consumers' block sets, by hash (as SMG keys them).
type Blocks = BTreeSet<u64>;

fn apply(blocks: &mut Blocks, batches: &[KvEventBatch]) -> bool {
    let mut told = false;
    for b in batches {
        for e in &b.events {
            match &e.data {
                Some(Data::Stored(s)) => {
                    blocks.extend(s.blocks.iter().map(|b| b.block_hash as u64))
                }
                Some(Data::Removed(r)) => {
                    for h in &r.block_hashes {
                        blocks.remove(&(*h as u64));
                    }
                }
                Some(Data::Cleared(_)) => {
                    blocks.clear();
                    told = true;
                }
                _ => {}
            }
        }
    }
    told
}

/// The gRPC subscriber resumed by sequence number: its blocks, the last seq it applied, the ring
/// it follows.
#[derive(Default)]
struct Resumed {
    blocks: Blocks,
    last: u64,
    ring_id: String,
    /// Told of a loss since the last check (a clear, a snapshot, an error, another ring).
    told: bool,
    /// What it read since the last check, for a failure's message.
    seen: Vec<String>,
    /// Clears it read since the last check on the same ring.
    clears: usize,
}

/// A run of one schedule.
struct Run {
    dir: tempfile::TempDir,
    ring: PathBuf,
    engine: RealEngine,
    bridge: Option<Bridge>,
    bridge_args: Option<(std::net::SocketAddr, Vec<String>)>,
    rt: tokio::runtime::Runtime,
    sub: Resumed,
    next_prompt: u64,
    was_exact: bool,
    /// The last step restarted the engine under a running kvbridge: the resumed subscriber must
    /// get exactly one clear for it (not one of kvbridge's and then the engine's own).
    one_clear: bool,
    tally: Tally,
}

impl Run {
    fn new(sched: &Schedule) -> Run {
        let dir = tempfile::tempdir().unwrap();
        let engine = RealEngine::start(
            dir.path(),
            EngineOpts {
                engine: sched.engine,
                endpoint: sched.endpoint,
                buffer_steps: match sched.endpoint {
                    Endpoint::Bound => SMALL_BUFFER,
                    // No truth SUB: the replay from 0 is the truth, so it must hold everything.
                    Endpoint::Connecting => 100_000,
                },
                ..Default::default()
            },
        );
        Run {
            ring: dir.path().join("ring"),
            dir,
            engine,
            bridge: None,
            bridge_args: None,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            sub: Resumed::default(),
            next_prompt: sched.seed * 1000,
            was_exact: true,
            one_clear: false,
            tally: Tally::default(),
        }
    }

    fn load(&mut self, n: u32) {
        for _ in 0..n {
            let p = prompt(self.next_prompt);
            self.next_prompt += 1;
            self.engine.complete(&p, MAX_TOKENS);
        }
    }

    fn start_bridge(&mut self) {
        let b = match &self.bridge_args {
            None => {
                let (grpc, args) = self.engine.serve_args(&self.ring, true);
                let b = Bridge::start_args(self.dir.path(), grpc, &self.ring, args);
                self.bridge_args = Some((b.grpc, b.args.clone()));
                b
            }
            Some((grpc, args)) => {
                Bridge::start_args(self.dir.path(), *grpc, &self.ring, args.clone())
            }
        };
        self.bridge = Some(b);
    }

    fn stop_bridge(&mut self, how: Sig) {
        let b = self.bridge.take().expect("kvbridge running");
        match how {
            Sig::Term => {
                let st = b.stop();
                assert!(st.success(), "kvbridge exited with {st:?} on SIGTERM");
            }
            Sig::Kill => b.kill(),
        }
    }

    fn signal_bridge(&self, sig: i32) {
        let pid = self.bridge.as_ref().expect("kvbridge running").child.id() as i32;
        // SAFETY: kill(2) on our own child, not yet waited for, so the pid is still ours.
        unsafe { libc::kill(pid, sig) };
    }

    fn stop_engine(&mut self, how: Sig) {
        match how {
            Sig::Term => self.engine.terminate(),
            Sig::Kill => self.engine.kill(),
        }
    }

    fn count(&mut self, what: &str) {
        *self.tally.faults.entry(what.to_string()).or_default() += 1;
    }

    fn run_step(&mut self, step: &Step) {
        match *step {
            Step::Traffic(n) => self.load(n),
            Step::Burst(n) => {
                self.count("burst");
                self.load(n)
            }
            Step::EngineRestart(how) => {
                self.count(&format!("engine {how:?}"));
                self.stop_engine(how);
                self.engine.restart();
                self.load(2);
                self.one_clear = true;
            }
            Step::BridgeRestart(how, n) => {
                self.count(&format!("kvbridge {how:?}"));
                self.stop_bridge(how);
                self.load(n);
                self.start_bridge();
                self.load(1);
            }
            Step::BridgeDownAcrossEngineRestart(b, e, n) => {
                self.count("kvbridge down across an engine restart");
                self.stop_bridge(b);
                self.stop_engine(e);
                self.engine.restart();
                self.load(n);
                self.start_bridge();
                self.load(1);
            }
            Step::BridgePause(n) => {
                self.count("kvbridge paused");
                self.signal_bridge(libc::SIGSTOP);
                self.load(n);
                self.signal_bridge(libc::SIGCONT);
                self.load(1);
            }
            Step::EngineReset => {
                self.count("engine cache reset");
                self.engine.reset_prefix_cache();
                self.load(1);
            }
            Step::RingRemoved(how, n) => {
                self.count("ring file removed");
                self.stop_bridge(how);
                std::fs::remove_file(&self.ring).unwrap();
                self.load(n);
                self.start_bridge();
                self.load(1);
            }
            Step::SubscriberResume(n) => {
                self.count("subscriber resumed");
                // Half now (the subscriber resumes below, mid-traffic), half after.
                self.load(n);
                if let Err(e) = self.resume_subscriber() {
                    panic!("resume: {e}");
                }
                self.load(n);
            }
        }
    }

    fn bridge(&self) -> &Bridge {
        self.bridge.as_ref().expect("kvbridge running")
    }

    /// The ring's newest record (0: empty).
    fn newest(&self) -> u64 {
        let page = scrape(self.bridge().metrics.unwrap());
        metric(&page, "kvbridge_ring_newest_seq", &[]) as u64
    }

    /// Subscribes with S = `start` (the batches numbered above it; 0: from the current state,
    /// snapshots taken) and reads up to `until` (0: nothing, only the ring id).
    fn read(&self, start: u64, until: u64) -> Result<(Vec<KvEventBatch>, String), String> {
        let url = self.bridge().url();
        self.rt.block_on(async {
            let (mut s, id) = common::subscribe_with_ring_id(&url, start)
                .await
                .map_err(|st| format!("{:?}: {}", st.code(), st.message()))?;
            let mut got: Vec<KvEventBatch> = Vec::new();
            let deadline = tokio::time::Instant::now() + SETTLE;
            while until > 0 && got.last().is_none_or(|l| l.sequence_number < until) {
                match tokio::time::timeout_at(deadline, s.message()).await {
                    Ok(Ok(Some(b))) => got.push(b),
                    Ok(Ok(None)) => return Err(format!("the stream from {start} ended")),
                    Ok(Err(st)) => return Err(format!("{:?}: {}", st.code(), st.message())),
                    Err(_) => {
                        return Err(format!(
                            "the stream from {start} reached {:?} of {until} in {SETTLE:?}",
                            got.last().map(|l| l.sequence_number)
                        ))
                    }
                }
            }
            Ok((got, id))
        })
    }

    /// The resumed subscriber connects again from its last seq + 1 and applies what it gets; an
    /// error status, or another ring, makes it join again from 0 (snapshot, then the window).
    fn resume_subscriber(&mut self) -> Result<(), String> {
        let newest = self.newest();
        if newest == 0 {
            return Ok(());
        }
        // S: the batches numbered above S (0: from the current state).
        let start = self.sub.last;
        // Up to date (or the ring is another one, with fewer records): only its id is read.
        let resumed = self.read(start, if newest > start { newest } else { 0 });
        match resumed {
            Ok((got, id)) if id == self.sub.ring_id || self.sub.ring_id.is_empty() => {
                self.sub.ring_id = id;
                self.sub.seen.push(format!(
                    "resumed from {start}: seqs {:?}, {} clears",
                    got.first()
                        .zip(got.last())
                        .map(|(a, b)| (a.sequence_number, b.sequence_number)),
                    common::clears(&got)
                ));
                self.sub.told |= apply(&mut self.sub.blocks, &got);
                self.sub.clears += common::clears(&got);
                if let Some(l) = got.last() {
                    self.sub.last = l.sequence_number;
                }
                Ok(())
            }
            other => {
                self.sub.seen.push(format!(
                    "resumed from {start}: {}",
                    match other {
                        Ok((_, id)) => format!("another ring {id}"),
                        Err(e) => e,
                    }
                ));
                // Told: another ring, or an error status. Join again from nothing.
                let (got, id) = self.read(0, newest)?;
                let seen = std::mem::take(&mut self.sub.seen);
                self.sub = Resumed {
                    ring_id: id,
                    told: true,
                    seen,
                    ..Resumed::default()
                };
                apply(&mut self.sub.blocks, &got);
                self.sub.last = got.last().map_or(0, |l| l.sequence_number);
                Ok(())
            }
        }
    }

    /// Waits (up to [`SETTLE`]) until kvbridge's last upstream seq is the engine's newest; the
    /// invariant decides what follows, whether it got there or not (a batch dropped as a copy
    /// never moves it).
    fn wait_applied(&self, truth_newest: Option<u64>) {
        let Some(seq) = truth_newest else { return };
        let m = self.bridge().metrics.unwrap();
        let deadline = Instant::now() + SETTLE;
        while Instant::now() < deadline
            && metric(&scrape(m), "kvbridge_last_upstream_seq", &[("rank", "0")]) != seq as f64
        {
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The rank's freshness from `/health`: its causes (empty: exact).
    fn causes(&self) -> Vec<String> {
        let page = http_get(self.bridge().metrics.unwrap(), "/health");
        let body = page.split("\r\n\r\n").last().unwrap_or(&page);
        let v: serde_json::Value = serde_json::from_str(body.trim())
            .unwrap_or_else(|e| panic!("/health is not JSON ({e}): {page}"));
        v["ranks"][0]["causes"]
            .as_array()
            .expect("causes")
            .iter()
            .map(|c| c.as_str().unwrap().to_string())
            .collect()
    }

    /// Every consumer's blocks but the resumed subscriber's (which is kept up to date apart).
    fn fresh_consumers(&self) -> Result<Vec<(&'static str, Blocks)>, String> {
        let newest = self.newest();
        let joiner = if newest == 0 {
            Blocks::new()
        } else {
            let (got, _) = self.read(0, newest)?;
            let mut b = Blocks::new();
            apply(&mut b, &got);
            b
        };
        let ctx = zmq::Context::new();
        let ep = self.bridge().publish_zmq[0]
            .1
            .clone()
            .expect("replay bound");
        let wire = replay(&ctx, &ep, 0)?;
        let mut consumers = vec![
            ("late joiner with snapshots", joiner),
            (
                "engine-wire replay from 0",
                common::real_engine::block_set(&engine_ops(&wire)),
            ),
        ];
        if let Some(b) = self.shm_reader()? {
            consumers.push(("shm reader (checkpoint, then the ring)", b));
        }
        Ok(consumers)
    }

    /// The ring file as a reader in another process sees it (`kvbridge tail --shm --snapshot`,
    /// the Python and C readers): the checkpoint beside it (the block table at its cut), then the
    /// ring's records after the cut; without a checkpoint yet, the ring from its first record.
    /// `None` when neither is there to read (no checkpoint, and the ring no longer holds its
    /// first record).
    fn shm_reader(&self) -> Result<Option<Blocks>, String> {
        use kvbridge_shm::{ReadOutcome, RingReader};
        use prost::Message;
        let decode = |b: &[u8]| KvEventBatch::decode(b).map_err(|e| format!("shm reader: {e}"));
        let mut reader = RingReader::open(&self.ring).map_err(|e| format!("shm reader: {e}"))?;
        let mut blocks = Blocks::new();
        let start = match kvbridge::snapshot::from_checkpoint(&self.ring) {
            Ok(c) => {
                let chunks = c.chunks.iter().map(|b| decode(b));
                apply(&mut blocks, &chunks.collect::<Result<Vec<_>, _>>()?);
                c.cut + 1
            }
            Err(_) if reader.oldest() <= 1 => reader.oldest(),
            Err(_) => return Ok(None),
        };
        if start > reader.newest() {
            return Ok(Some(blocks));
        }
        if reader.seek(start).is_err() {
            // The ring moved past the checkpoint's cut meanwhile (a burst): nothing to compare.
            return Ok(None);
        }
        let mut buf = Vec::new();
        loop {
            match reader.next() {
                ReadOutcome::Record(v) => {
                    if !v.copy_to(&mut buf) {
                        return Ok(None);
                    }
                    apply(&mut blocks, &[decode(&buf)?]);
                }
                ReadOutcome::Empty | ReadOutcome::WriterGone => return Ok(Some(blocks)),
                // (a burst lapped the reader, or a restart made a new ring, while it read)
                ReadOutcome::Lapped { .. } | ReadOutcome::RingReset { .. } => return Ok(None),
                other => return Err(format!("shm reader: {other:?}")),
            }
        }
    }

    /// The invariant (module doc). `Err` describes a silent divergence. Consumers are read again
    /// until they agree or [`SETTLE`] has passed: kvbridge's last upstream seq can equal the
    /// engine's newest before it has applied that batch (an earlier incarnation's seq).
    fn check(&mut self) -> Result<(), String> {
        self.tally.checks += 1;
        let truth = self.engine.truth();
        let want: Blocks = common::real_engine::block_set(&engine_ops(&truth));
        self.wait_applied(truth.last().map(|b| b.0));
        let deadline = Instant::now() + SETTLE;
        let mut names = Vec::new();
        let (causes, fails) = loop {
            self.resume_subscriber()?;
            let causes = self.causes();
            let mut fails = Vec::new();
            names.clear();
            if causes.is_empty() {
                let mut consumers = vec![("resumed gRPC subscriber", self.sub.blocks.clone())];
                consumers.extend(self.fresh_consumers()?);
                for (name, got) in consumers {
                    names.push(name);
                    if got != want {
                        fails.push(format!(
                            "{name}: {} blocks, the engine holds {}: {} missing, {} stale (rank exact on /health)",
                            got.len(),
                            want.len(),
                            want.difference(&got).count(),
                            got.difference(&want).count()
                        ));
                    }
                }
            }
            if fails.is_empty() || Instant::now() > deadline {
                break (causes, fails);
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        let mut fails = fails;
        let exact = causes.is_empty();
        for name in names {
            *self.tally.compared.entry(name).or_default() += 1;
        }
        if !exact {
            *self.tally.degraded.entry(causes.join("+")).or_default() += 1;
            if self.was_exact && !self.sub.told {
                fails.push(format!(
                    "the rank became degraded ({causes:?}) and the resumed subscriber was not told: {:?}",
                    self.sub.seen
                ));
            }
        }
        if std::mem::take(&mut self.one_clear) && exact && self.sub.clears != 1 {
            fails.push(format!(
                "the engine restarted under kvbridge and the resumed subscriber got {} clears, not one: {:?}",
                self.sub.clears, self.sub.seen
            ));
        }
        self.was_exact = exact;
        self.sub.told = false;
        self.sub.clears = 0;
        self.sub.seen.clear();
        if fails.is_empty() {
            Ok(())
        } else {
            Err(fails.join("\n"))
        }
    }
}

/// Runs one schedule; on a silent divergence, panics with the seed, the schedule, the step and
/// the command that reproduces it.
pub fn run(sched: Schedule) -> Tally {
    let t0 = Instant::now();
    let desc = sched.describe();
    eprintln!("campaign: {desc}");
    let mut run = Run::new(&sched);
    run.load(sched.before_start);
    run.start_bridge();
    run.load(1);
    let fail = |at: &str, e: String, run: &Run| -> ! {
        let log = run.bridge.as_ref().map(|b| b.log()).unwrap_or_default();
        let log: Vec<&str> = log.lines().collect();
        panic!(
            "campaign: INVARIANT BROKEN after {at}\n{e}\n\n{desc}\n\nreproduce: scripts/campaign.sh --engine {} --seed {}\n\nkvbridge's log (last lines):\n  {}",
            engine_flag(sched.engine),
            sched.seed,
            log[log.len().saturating_sub(20)..].join("\n  ")
        )
    };
    if let Err(e) = run.check() {
        fail("the start", e, &run);
    }
    for (i, step) in sched.steps.iter().enumerate() {
        let t = Instant::now();
        run.run_step(step);
        run.tally.steps += 1;
        if let Err(e) = run.check() {
            fail(&format!("step {} ({step})", i + 1), e, &run);
        }
        eprintln!(
            "campaign seed {}: step {:>2} {step} ok ({:.1} s)",
            sched.seed,
            i + 1,
            t.elapsed().as_secs_f64()
        );
    }
    eprintln!(
        "campaign seed {}: {} steps, {} checks, {:.0} s; faults {:?}; degraded checks {:?}; consumers compared {:?}",
        sched.seed,
        run.tally.steps,
        run.tally.checks,
        t0.elapsed().as_secs_f64(),
        run.tally.faults,
        run.tally.degraded,
        run.tally.compared
    );
    run.tally
}

/// Seeds from `KVBRIDGE_CAMPAIGN_SEEDS` (`7`, `1,5,9` or `1..200`), else `default`.
fn seeds(default: &[u64]) -> Vec<u64> {
    match std::env::var("KVBRIDGE_CAMPAIGN_SEEDS") {
        Ok(s) if s.contains("..") => {
            let (a, b) = s.split_once("..").unwrap();
            (a.trim().parse().unwrap()..b.trim().parse().unwrap()).collect()
        }
        Ok(s) => s.split(',').map(|x| x.trim().parse().unwrap()).collect(),
        Err(_) => default.to_vec(),
    }
}

fn engine_flag(e: EngineKind) -> &'static str {
    match e {
        EngineKind::Vllm => "vllm",
        EngineKind::Sglang => "sglang",
    }
}

/// The first seed that broke (reduced to four steps): kvbridge started past the engine's replay
/// buffer records the engine's first seqs as lost; the engine's cache reset makes the rank
/// exact again; then the engine is SIGKILLed and restarted under kvbridge, and its new seqs 0..
/// must be a restart, not copies of the lost batches.
fn lost_seqs_then_an_engine_restart(engine: EngineKind) {
    run(Schedule {
        engine,
        seed: 0,
        endpoint: Endpoint::Bound,
        before_start: 2,
        steps: vec![
            Step::Burst(30),
            Step::BridgeDownAcrossEngineRestart(Sig::Kill, Sig::Kill, 20),
            Step::EngineReset,
            Step::EngineRestart(Sig::Kill),
        ],
    });
}

/// The ordinary production form of the same: a late start past the replay buffer, then an
/// engine restart.
fn a_late_start_past_the_buffer_then_an_engine_restart(engine: EngineKind) {
    run(Schedule {
        engine,
        seed: 0,
        endpoint: Endpoint::Bound,
        before_start: 20,
        steps: vec![Step::Traffic(2), Step::EngineRestart(Sig::Term)],
    });
}

/// Seed 3's first failure (vLLM), reduced: the engine's PUB connects to kvbridge, and a request
/// runs before kvbridge's first start. A batch published after kvbridge's catch-up replay but
/// before the PUB's connection (and subscription) took effect is in neither, and no later batch
/// reveals it: only the tail probe after the connection's handshake finds it. (The window is a
/// matter of timing: the full seed 3 failed on every run before the probe.)
fn a_connecting_engine_publishing_across_the_first_start(engine: EngineKind) {
    run(Schedule {
        engine,
        seed: 0,
        endpoint: Endpoint::Connecting,
        before_start: 2,
        steps: vec![Step::Traffic(1)],
    });
}

/// The seeded schedules: `default` seeds, or `KVBRIDGE_CAMPAIGN_SEEDS`; a long campaign is
/// `scripts/campaign.sh --seeds N` (docs/testing.md).
fn seeded_schedules(engine: EngineKind, default: &[u64]) {
    let max_steps = std::env::var("KVBRIDGE_CAMPAIGN_MAX_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let deadline = std::env::var("KVBRIDGE_CAMPAIGN_MINUTES")
        .ok()
        .and_then(|m| m.parse::<u64>().ok())
        .map(|m| Instant::now() + Duration::from_secs(m * 60));
    // A long run goes on past a failing seed and reports every one at the end.
    let keep_going = std::env::var_os("KVBRIDGE_CAMPAIGN_KEEP_GOING").is_some();
    let mut total = Tally::default();
    let mut schedules = 0;
    let mut failed = Vec::new();
    for seed in seeds(default) {
        if deadline.is_some_and(|d| Instant::now() > d) {
            break;
        }
        let sched = Schedule::draw(engine, seed, max_steps);
        schedules += 1;
        let t = if keep_going {
            match std::panic::catch_unwind(|| run(sched)) {
                Ok(t) => t,
                Err(_) => {
                    failed.push(seed);
                    continue;
                }
            }
        } else {
            run(sched)
        };
        total.steps += t.steps;
        total.checks += t.checks;
        for (k, v) in t.faults {
            *total.faults.entry(k).or_default() += v;
        }
        for (k, v) in t.degraded {
            *total.degraded.entry(k).or_default() += v;
        }
        for (k, v) in t.compared {
            *total.compared.entry(k).or_default() += v;
        }
    }
    eprintln!(
        "campaign total ({engine:?}): {schedules} schedules ({} passed), {} steps, {} checks; faults {:?}; degraded checks by causes {:?}; consumers compared at exact checks {:?}; failed seeds {failed:?}",
        schedules - failed.len(), total.steps, total.checks, total.faults, total.degraded, total.compared
    );
    assert!(
        failed.is_empty(),
        "failed seeds (each printed its schedule above): {failed:?}"
    );
}

#[test]
fn vllm_lost_seqs_then_an_engine_restart() {
    lost_seqs_then_an_engine_restart(EngineKind::Vllm);
}

#[test]
fn sglang_lost_seqs_then_an_engine_restart() {
    lost_seqs_then_an_engine_restart(EngineKind::Sglang);
}

#[test]
fn vllm_a_late_start_past_the_buffer_then_an_engine_restart() {
    a_late_start_past_the_buffer_then_an_engine_restart(EngineKind::Vllm);
}

#[test]
fn sglang_a_late_start_past_the_buffer_then_an_engine_restart() {
    a_late_start_past_the_buffer_then_an_engine_restart(EngineKind::Sglang);
}

#[test]
fn vllm_a_connecting_engine_publishing_across_the_first_start() {
    a_connecting_engine_publishing_across_the_first_start(EngineKind::Vllm);
}

#[test]
fn vllm_seeded_schedules() {
    seeded_schedules(EngineKind::Vllm, &[1]);
}

#[test]
fn sglang_seeded_schedules() {
    seeded_schedules(EngineKind::Sglang, &[1]);
}
