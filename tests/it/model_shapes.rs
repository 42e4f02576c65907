//! The KV-cache event shapes of real models and connectors, **published by vLLM's own classes
//! and publisher** (vLLM 0.32.0's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`,
//! `KVEventBatch`, `ZmqEventPublisher`: `tests/real_engine/publish_shapes.py`, in the
//! real-engine venv), read by a `--profile smg` and a `--profile all` kvbridge.
//!
//! Why these shapes: each is one where a reader that takes a store for "these tokens are now on
//! the GPU under these hashes" indexes something wrong (docs/engine-wire.md §9, §9.1):
//!
//! - **CPU offloading** (vLLM's OffloadingConnector, vLLM #43468 / #48679; the Mooncake store and
//!   KVCR tiers): legacy placeholders (`token_ids []`, `block_size 0`, no parent: "this key is
//!   in that tier"), self-describing chunk stores and whole-chunk removals, `STORAGE`, lowercase
//!   `cpu`, a chunk stored as one block of four device blocks' size, `ownership` `kvcr`,
//!   `locality` `REMOTE`, beside the GPU's own stores and removals of the same hashes.
//! - **DeepSeek-V4's fp4 indexer cache** (llm-d-router #2362, #2363, #2679): `mla_attention`
//!   stores of block size 4 under the group index of the dense MLA cache (block size 256): an
//!   accepted kind that makes a router learn the wrong block size and chain blocks to unknown
//!   parents.
//! - **Hybrid groups** (a sliding-window group and a full group storing the same hashes,
//!   removals that name their group but not its kind, vllm-project/aibrix#2285): a sliding
//!   eviction must not drop the full group's block; a group never stored has an unknown kind.
//! - a prefix-cache reset (`AllBlocksCleared`) in the middle, which forgets no group.
//!
//! One stream of one engine holds them all, so the groups need indices of their own: the
//! hybrid pair is 0 and 1 as vLLM numbers it for Gemma-3, and DeepSeek-V4's dense MLA cache and
//! its indexer share index 2 (in DeepSeek-V4 alone they share 0; the rule is about sharing).
//!
//! The expectations are computed here from the documented rules, not by kvbridge: the script's
//! events as vLLM's own decoder reads them back from the publisher's replay (seqs 0 … N−1), then
//! what `smg` forwards and counts (§9.1's table; docs/smg-api.md §5: first reason counted, in
//! its order), what `all` forwards (everything, unpairable stores and placeholders hash-only),
//! and the live set per (group, tier, hash) those events leave. Checked: each profile's gRPC
//! stream from 0, event for event (hashes, parent, each block's tokens or hash-only, medium,
//! tier, group, kind, window, locality, ownership); the `filtered_*` counters on each metrics
//! page; for `all`, its `--publish-zmq` replay read back with vLLM's classes (from 1: the same
//! events; from 0: the state, the live set) and its snapshot (the checkpoint written at
//! SIGTERM: the live set).
//!
//! Peer: the real engine's venv (`scripts/vllm-engine-venv.sh`), of which only
//! `vllm.distributed.kv_events` is used: one python process publishes and then decodes.

use crate::common;

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use common::real_engine::{quiet_port, replay, VllmDecoder};
use common::{assert_contiguous, collect_until, metric, scrape, subscribe, wait_metrics, Bridge};
use kvbridge::proto::common::{kv_cache_event::Data, KvCacheLocality, KvCacheTier, KvEventBatch};
use prost::Message;
use serde_json::Value;

/// How long kvbridge may take to show what was published (well under a second normally).
const T: Duration = Duration::from_secs(30);
/// The publisher script (tests/real_engine/).
const SCRIPT: &str = "publish_shapes.py";
/// Main-attention kinds (docs/engine-wire.md §9.1): their groups' stores reach SMG.
const MAIN_ATTENTION: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];
/// The ownership SMG's gateway skips (docs/smg-api.md §4).
const KVCR: &str = "kvcr";
/// The `filtered_*` decoder counters (`kvbridge_decoder_events_total{kind}`), in the order
/// docs/smg-api.md §5 lists the reasons.
const FILTERED: [&str; 7] = [
    "filtered_tier",
    "filtered_group",
    "filtered_group_unknown",
    "filtered_group_conflict",
    "filtered_remote",
    "filtered_ownership",
    "filtered_unpairable",
];

/// One event as a cache-aware router reads it.
#[derive(Clone, Debug, PartialEq)]
enum Ev {
    Store(Store),
    Remove { hashes: Vec<u64>, attrs: Attrs },
    Clear,
}

#[derive(Clone, Debug, PartialEq)]
struct Store {
    /// Each block's hash and tokens (`None`: hash-only).
    blocks: Vec<(u64, Option<Vec<u32>>)>,
    parent: Option<u64>,
    kind: Option<String>,
    window: Option<u32>,
    attrs: Attrs,
}

/// What stores and removals share.
#[derive(Clone, Debug, PartialEq)]
struct Attrs {
    group: Option<u32>,
    medium: Option<String>,
    tier: Option<KvCacheTier>,
    locality: Option<KvCacheLocality>,
    ownership: Option<String>,
}

/// The tier of a `medium` (docs/engine-wire.md §9: compared case-insensitively; absent or
/// unknown: unset).
fn tier_of(medium: Option<&str>) -> Option<KvCacheTier> {
    Some(match medium?.to_ascii_uppercase().as_str() {
        "GPU" => KvCacheTier::Device,
        "CPU" | "CPU_PINNED" => KvCacheTier::Host,
        "DISK" | "FS" | "STORAGE" => KvCacheTier::Disk,
        "OBJ" | "EXTERNAL" => KvCacheTier::External,
        _ => return None,
    })
}

/// `LOCAL` / `REMOTE`; any other value unset (docs/smg-api.md §5).
fn locality_of(l: Option<&str>) -> Option<KvCacheLocality> {
    match l?.to_ascii_uppercase().as_str() {
        "LOCAL" => Some(KvCacheLocality::Local),
        "REMOTE" => Some(KvCacheLocality::Remote),
        _ => None,
    }
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Whether a store's tokens pair with its hashes (docs/engine-wire.md §9): block i owns
/// `token_ids[i·bs .. (i+1)·bs]` only when there are exactly `hashes × bs` of them.
fn pairable(e: &Value) -> bool {
    let bs = e["block_size"].as_u64().unwrap() as usize;
    let (n, tokens) = (
        e["block_hashes"].as_array().unwrap().len(),
        e["token_ids"].as_array().unwrap().len(),
    );
    bs > 0 && tokens == n * bs
}

/// An event as vLLM's decoder read it (tests/real_engine/vllm_ops.py), as a reader of the
/// engine wire must take it: an unpairable store (a placeholder, a compacted hash list) is
/// hash-only.
fn from_vllm(e: &Value) -> Ev {
    let s = |k: &str| e[k].as_str().map(str::to_string);
    let attrs = Attrs {
        group: e["group_idx"].as_u64().map(|g| g as u32),
        medium: s("medium"),
        tier: tier_of(e["medium"].as_str()),
        locality: locality_of(e["locality"].as_str()),
        ownership: s("ownership"),
    };
    match e["type"].as_str().unwrap() {
        "BlockStored" => {
            let hashes = u64s(&e["block_hashes"]);
            let tokens: Vec<u32> = u64s(&e["token_ids"]).iter().map(|&t| t as u32).collect();
            let bs = e["block_size"].as_u64().unwrap() as usize;
            let paired = pairable(e);
            Ev::Store(Store {
                blocks: hashes
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| (h, paired.then(|| tokens[i * bs..(i + 1) * bs].to_vec())))
                    .collect(),
                parent: e["parent_block_hash"].as_u64(),
                kind: s("kv_cache_spec_kind"),
                window: e["kv_cache_spec_sliding_window"].as_u64().map(|w| w as u32),
                attrs,
            })
        }
        "BlockRemoved" => Ev::Remove {
            hashes: u64s(&e["block_hashes"]),
            attrs,
        },
        "AllBlocksCleared" => Ev::Clear,
        other => panic!("vLLM decoded an unexpected event {other}"),
    }
}

/// The events of kvbridge's gRPC batches (stream or snapshot chunks), checking on the way that
/// every block with tokens has `block_size` of them and that `cache_level` follows the tier
/// (docs/smg-api.md §1, §5).
fn from_grpc(batches: &[KvEventBatch]) -> Vec<Ev> {
    let tier = |t: Option<i32>| t.map(|t| KvCacheTier::try_from(t).expect("a KvCacheTier"));
    let level = |t: Option<KvCacheTier>| t.map(|t| t as i32 - 1);
    let locality =
        |l: Option<i32>| l.map(|l| KvCacheLocality::try_from(l).expect("a KvCacheLocality"));
    let mut out = Vec::new();
    for b in batches {
        for e in &b.events {
            out.push(match e.data.as_ref().expect("an event with data") {
                Data::Stored(s) => {
                    let tier = tier(s.tier);
                    let blocks = s
                        .blocks
                        .iter()
                        .map(|k| {
                            assert_eq!(k.cache_level, level(tier), "cache_level of {s:?}");
                            let hash_only = k.block_size == 0 && k.token_ids.is_empty();
                            if !hash_only {
                                assert_eq!(k.block_size as usize, k.token_ids.len(), "{s:?}");
                            }
                            (
                                k.block_hash as u64,
                                (!hash_only).then(|| k.token_ids.clone()),
                            )
                        })
                        .collect();
                    Ev::Store(Store {
                        blocks,
                        parent: s.parent_block_hash.map(|p| p as u64),
                        kind: s.kv_cache_spec_kind.clone(),
                        window: s.kv_cache_spec_sliding_window,
                        attrs: Attrs {
                            group: s.group_idx,
                            medium: s.medium.clone(),
                            tier,
                            locality: locality(s.locality),
                            ownership: s.ownership.clone(),
                        },
                    })
                }
                Data::Removed(r) => {
                    let tier = tier(r.tier);
                    assert_eq!(r.cache_level, level(tier), "cache_level of {r:?}");
                    Ev::Remove {
                        hashes: r.block_hashes.iter().map(|&h| h as u64).collect(),
                        attrs: Attrs {
                            group: r.group_idx,
                            medium: r.medium.clone(),
                            tier,
                            locality: locality(r.locality),
                            ownership: r.ownership.clone(),
                        },
                    }
                }
                Data::Cleared(_) => Ev::Clear,
            });
        }
    }
    out
}

/// What one group is pinned to by its first store (docs/engine-wire.md §9.1): its kind and its
/// block size on the device tier.
#[derive(Default)]
struct Pin {
    kind: Option<String>,
    device_block_size: Option<u64>,
}

fn is_main(kind: &str) -> bool {
    MAIN_ATTENTION.iter().any(|k| k.eq_ignore_ascii_case(kind))
}

/// What `--profile smg` forwards of the script's events and the `filtered_*` counts, from
/// docs/engine-wire.md §9.1 and docs/smg-api.md §5 (the first reason in §5's order counts).
fn smg_profile(script: &[Value]) -> (Vec<Ev>, BTreeMap<&'static str, u64>) {
    let mut pins: BTreeMap<u64, Pin> = BTreeMap::new();
    let mut counts: BTreeMap<&'static str, u64> = FILTERED.iter().map(|k| (*k, 0)).collect();
    let mut kept = Vec::new();
    for e in script {
        let ev = from_vllm(e);
        let group = e["group_idx"].as_u64();
        let tier = tier_of(e["medium"].as_str());
        let offtier = matches!(tier, Some(KvCacheTier::Disk | KvCacheTier::External));
        let remote = locality_of(e["locality"].as_str()) == Some(KvCacheLocality::Remote);
        let kvcr = e["ownership"]
            .as_str()
            .is_some_and(|o| o.eq_ignore_ascii_case(KVCR));
        let why = match &ev {
            Ev::Store(_) => {
                let kind = e["kv_cache_spec_kind"].as_str().map(str::to_string);
                let bs = e["block_size"].as_u64().unwrap();
                let device = matches!(tier, None | Some(KvCacheTier::Device));
                let device_bs = (device && bs > 0).then_some(bs);
                // The group's kind as this store is filtered by, and whether it contradicts the
                // group's pin (another cache under the same index; nothing learnt from it).
                let (group_kind, conflict) = match group {
                    None => (kind.clone(), false),
                    Some(g) => match pins.get_mut(&g) {
                        None => {
                            let pin = Pin {
                                kind: kind.clone(),
                                device_block_size: device_bs,
                            };
                            let k = pin.kind.clone();
                            pins.insert(g, pin);
                            (k, false)
                        }
                        Some(pin) => {
                            let kind_differs = matches!((&kind, &pin.kind),
                                (Some(k), Some(p)) if !k.eq_ignore_ascii_case(p));
                            let size_differs = matches!((device_bs, pin.device_block_size),
                                (Some(b), Some(p)) if b != p);
                            let conflict = kind_differs || size_differs;
                            if !conflict {
                                pin.kind = pin.kind.take().or(kind.clone());
                                pin.device_block_size = pin.device_block_size.or(device_bs);
                            }
                            (kind.clone().or(pin.kind.clone()), conflict)
                        }
                    },
                };
                if offtier {
                    Some("filtered_tier")
                } else if conflict {
                    Some("filtered_group_conflict")
                } else if group_kind.is_some_and(|k| !is_main(&k)) {
                    Some("filtered_group")
                } else if remote {
                    Some("filtered_remote")
                } else if kvcr {
                    Some("filtered_ownership")
                } else if !pairable(e) {
                    Some("filtered_unpairable")
                } else {
                    None
                }
            }
            Ev::Remove { .. } => {
                // A removal carries no kind: its group's pinned one, if a store of it was seen.
                let pin = group.map(|g| pins.get(&g));
                let group_kind = pin.flatten().and_then(|p| p.kind.clone());
                if offtier {
                    Some("filtered_tier")
                } else if group_kind.is_some_and(|k| !is_main(&k)) {
                    Some("filtered_group")
                } else if matches!(pin, Some(None)) {
                    Some("filtered_group_unknown")
                } else if remote {
                    Some("filtered_remote")
                } else if kvcr {
                    Some("filtered_ownership")
                } else {
                    None
                }
            }
            // A clear covers the rank; only its ownership could keep it from SMG.
            Ev::Clear => kvcr.then_some("filtered_ownership"),
        };
        match why {
            Some(reason) => *counts.get_mut(reason).unwrap() += 1,
            None => kept.push(ev),
        }
    }
    (kept, counts)
}

/// A held block: (group, tier, hash).
type Key = (Option<u32>, Option<KvCacheTier>, u64);

/// What a held block carries: medium, kind, tokens (`None`: hash-only), locality, ownership.
type Held = (
    Option<String>,
    Option<String>,
    Option<Vec<u32>>,
    Option<KvCacheLocality>,
    Option<String>,
);

/// The blocks `events` leave, per (group, tier, hash) (docs/engine-wire.md §9.1): a removal
/// drops its hashes from its own group and tier only, a clear drops everything; and the blocks
/// stored while held already. The script stores none such (what a second store means differs
/// between docs/engine-wire.md §9, idempotent, and docs/subscribers.md, another copy), so in
/// kvbridge's output one is a block listed twice.
fn live(events: &[Ev]) -> (BTreeMap<Key, Held>, Vec<Key>) {
    let mut held = BTreeMap::new();
    let mut twice = Vec::new();
    for e in events {
        match e {
            Ev::Store(s) => {
                for (h, tokens) in &s.blocks {
                    let a = &s.attrs;
                    let v = (
                        a.medium.clone(),
                        s.kind.clone(),
                        tokens.clone(),
                        a.locality,
                        a.ownership.clone(),
                    );
                    let key = (a.group, a.tier, *h);
                    if held.insert(key, v).is_some() {
                        twice.push(key);
                    }
                }
            }
            Ev::Remove { hashes, attrs } => {
                for h in hashes {
                    held.remove(&(attrs.group, attrs.tier, *h));
                }
            }
            Ev::Clear => held.clear(),
        }
    }
    (held, twice)
}

/// A hash as the script names it (prompt letter and block, tests/real_engine/publish_shapes.py's
/// `blk`), for failure messages.
fn name(h: u64) -> String {
    if h >> 48 == 0xF00D {
        format!("{}{}", ((h >> 16) & 0xff) as u8 as char, h & 0xffff)
    } else {
        format!("{h:#x}")
    }
}

fn names(hs: impl IntoIterator<Item = u64>) -> String {
    hs.into_iter().map(name).collect::<Vec<_>>().join(",")
}

impl fmt::Display for Attrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "group {:?} medium {:?} tier {:?}",
            self.group, self.medium, self.tier
        )?;
        if let Some(l) = self.locality {
            write!(f, " {l:?}")?;
        }
        if let Some(o) = &self.ownership {
            write!(f, " ownership {o}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Ev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ev::Store(s) => {
                let tokens: Vec<String> = s
                    .blocks
                    .iter()
                    .map(|(_, t)| t.as_ref().map_or("-".into(), |t| t.len().to_string()))
                    .collect();
                write!(
                    f,
                    "store [{}] parent {} tokens [{}] {} kind {:?} window {:?}",
                    names(s.blocks.iter().map(|b| b.0)),
                    s.parent.map_or("-".into(), name),
                    tokens.join(","),
                    s.attrs,
                    s.kind,
                    s.window
                )
            }
            Ev::Remove { hashes, attrs } => {
                write!(f, "remove [{}] {attrs}", names(hashes.iter().copied()))
            }
            Ev::Clear => write!(f, "CLEAR"),
        }
    }
}

/// Where `got` differs from `want`, for the failure report.
fn diff_events(what: &str, got: &[Ev], want: &[Ev]) -> Option<String> {
    if got == want {
        return None;
    }
    let first = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let list = |evs: &[Ev]| {
        evs.iter()
            .enumerate()
            .map(|(i, e)| format!("    {}#{i} {e}", if i == first { "> " } else { "  " }))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let detail = match (got.get(first), want.get(first)) {
        (Some(g), Some(w)) => format!("\n  kvbridge #{first}: {g:?}\n  expected #{first}: {w:?}"),
        _ => String::new(),
    };
    Some(format!(
        "{what}: {} events, expected {}; first difference at #{first}{detail}\n  kvbridge:\n{}\n  expected:\n{}",
        got.len(),
        want.len(),
        list(got),
        list(want)
    ))
}

fn key_name(k: &Key) -> String {
    format!("(group {:?}, {:?}, {})", k.0, k.1, name(k.2))
}

/// Where the live set of kvbridge's `events` differs from the expected one.
fn diff_live(what: &str, events: &[Ev], want: &BTreeMap<Key, Held>) -> Option<String> {
    let (got, twice) = live(events);
    if got == *want && twice.is_empty() {
        return None;
    }
    let mut lines = Vec::new();
    for k in &twice {
        lines.push(format!("    listed twice {}", key_name(k)));
    }
    for (k, w) in want {
        match got.get(k) {
            None => lines.push(format!("    missing {}: {w:?}", key_name(k))),
            Some(g) if g != w => lines.push(format!(
                "    differs {}:\n      kvbridge {g:?}\n      expected {w:?}",
                key_name(k)
            )),
            Some(_) => {}
        }
    }
    for (k, g) in &got {
        if !want.contains_key(k) {
            lines.push(format!("    stale {}: {g:?}", key_name(k)));
        }
    }
    Some(format!(
        "{what}: {} blocks, expected {}\n{}",
        got.len(),
        want.len(),
        lines.join("\n")
    ))
}

fn decoder_count(page: &str, kind: &str) -> f64 {
    metric(
        page,
        "kvbridge_decoder_events_total",
        &[("rank", "0"), ("kind", kind)],
    )
}

/// One kvbridge on the script's publisher, with metrics.
struct Instance {
    name: &'static str,
    ring: std::path::PathBuf,
    bridge: Bridge,
    metrics: std::net::SocketAddr,
}

impl Instance {
    fn start(
        dir: &std::path::Path,
        name: &'static str,
        upstream: &[String],
        extra: &[&str],
    ) -> Self {
        let ring = dir.join(format!("ring-{name}"));
        let mut args = upstream.to_vec();
        args.extend(["--profile", name].map(String::from));
        args.extend(extra.iter().map(|s| s.to_string()));
        let (bridge, metrics) = Bridge::start_with_metrics(dir, &ring, &args);
        Instance {
            name,
            ring,
            bridge,
            metrics,
        }
    }

    /// Waits until kvbridge has applied the publisher's last seq and decoded each of `events`;
    /// returns the metrics page then.
    fn wait_caught_up(&self, last_seq: u64, script: &[Value]) -> String {
        let count = |t: &str| script.iter().filter(|e| e["type"] == t).count() as f64;
        let (stored, removed, cleared) = (
            count("BlockStored"),
            count("BlockRemoved"),
            count("AllBlocksCleared"),
        );
        wait_metrics(self.metrics, T, |p| {
            metric(p, "kvbridge_last_upstream_seq", &[("rank", "0")]) == last_seq as f64
                && decoder_count(p, "stored_events") == stored
                && decoder_count(p, "removed_events") == removed
                && decoder_count(p, "cleared_events") == cleared
        })
    }

    /// Its whole gRPC stream from 0: every record the ring holds (`page`: metrics once caught up).
    async fn stream(&self, page: &str) -> Vec<KvEventBatch> {
        let records = metric(page, "kvbridge_ring_records_total", &[]) as usize;
        let mut s = subscribe(&self.bridge.url(), 0).await.unwrap();
        let got = collect_until(&mut s, T, |g| g.len() >= records).await;
        assert_contiguous(&got);
        assert!(
            got.iter().all(|b| b.snapshot.is_none()),
            "[{}] a snapshot chunk where the window was expected",
            self.name
        );
        got
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_published_model_shapes_under_both_profiles() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let (pub_port, replay_port) = (quiet_port(), quiet_port());
    // Publishes its batches, then decodes for us (one import of vLLM).
    let mut vllm = VllmDecoder::run(SCRIPT, &[pub_port.to_string(), replay_port.to_string()]);
    let published = vllm.ready["batches"]
        .as_u64()
        .expect("batches in the ready line");
    let t_script = t0.elapsed();

    // The script's events as the publisher's replay from 0 holds them, read by vLLM.
    let ctx = zmq::Context::new();
    let history = replay(&ctx, &format!("tcp://127.0.0.1:{replay_port}"), 0)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        history.iter().map(|b| b.0).collect::<Vec<_>>(),
        (0..published).collect::<Vec<_>>(),
        "the publisher's replay from 0 is its batches"
    );
    let script = vllm.json_events(&history);
    let want_all: Vec<Ev> = script.iter().map(from_vllm).collect();
    let (want_smg, want_counts) = smg_profile(&script);
    let (want_live, twice) = live(&want_all);
    assert!(
        twice.is_empty(),
        "the script stores a held block again: {twice:?}"
    );
    // The scenario itself: every rule it is about comes up.
    for (reason, n) in &want_counts {
        assert!(*n > 0, "the script has no event {reason} under smg");
    }
    let hash_only = |evs: &[Ev]| {
        evs.iter()
            .filter(|e| matches!(e, Ev::Store(s) if s.blocks.iter().any(|b| b.1.is_none())))
            .count()
    };
    assert!(hash_only(&want_all) > 0 && want_all.contains(&Ev::Clear));

    let upstream: Vec<String> = [
        "--zmq".to_string(),
        format!("tcp://127.0.0.1:{pub_port}"),
        "--replay".into(),
        format!("tcp://127.0.0.1:{replay_port}"),
        "--seq-base".into(),
        "1".into(),
    ]
    .into();
    let smg = Instance::start(dir.path(), "smg", &upstream, &[]);
    let all = Instance::start(
        dir.path(),
        "all",
        &upstream,
        &[
            "--publish-zmq",
            "tcp://127.0.0.1:0",
            "--publish-zmq-replay",
            "tcp://127.0.0.1:0",
        ],
    );

    let mut fails = Vec::new();
    let mut all_stream = Vec::new();
    for (inst, want) in [(&smg, &want_smg), (&all, &want_all)] {
        let page = inst.wait_caught_up(published - 1, &script);
        let got = from_grpc(&inst.stream(&page).await);
        let what = format!("[{}] gRPC stream from 0", inst.name);
        fails.extend(diff_events(&what, &got, want));
        for reason in FILTERED {
            let want = if inst.name == "smg" {
                want_counts[reason]
            } else {
                0
            };
            let got = decoder_count(&page, reason);
            if got != want as f64 {
                fails.push(format!("[{}] {reason} {got}, expected {want}", inst.name));
            }
        }
        if inst.name == "all" {
            all_stream = got;
        }
    }

    // `all` re-published on the engine wire, read back with vLLM's classes.
    let (_, replay_ep) = all.bridge.publish_zmq[0].clone();
    let replay_ep = replay_ep.expect("--publish-zmq-replay bound");
    let window = common::eventually("the re-publish has every record", T, || {
        let evs: Vec<Ev> = vllm
            .json_events(&replay(&ctx, &replay_ep, 1).unwrap_or_else(|e| panic!("{e}")))
            .iter()
            .map(from_vllm)
            .collect();
        if evs.len() >= all_stream.len() {
            Ok(evs)
        } else {
            Err(evs.len())
        }
    });
    fails.extend(diff_events(
        "[all] --publish-zmq replay from 1, read by vLLM, vs its gRPC stream",
        &window,
        &all_stream,
    ));
    let state: Vec<Ev> = vllm
        .json_events(&replay(&ctx, &replay_ep, 0).unwrap_or_else(|e| panic!("{e}")))
        .iter()
        .map(from_vllm)
        .collect();
    if state.first() != Some(&Ev::Clear) {
        fails.push(format!(
            "[all] --publish-zmq replay from 0 does not start with AllBlocksCleared: {:?}",
            state.first()
        ));
    }
    fails.extend(diff_live(
        "[all] --publish-zmq replay from 0 (the state), read by vLLM",
        &state,
        &want_live,
    ));

    // `all`'s snapshot: the checkpoint SIGTERM writes (what a late joiner gets).
    let Instance {
        bridge, ring, name, ..
    } = all;
    let log = bridge.log();
    assert!(
        bridge.stop().success(),
        "[{name}] exit on SIGTERM; log:\n{log}"
    );
    let chunks = kvbridge::snapshot::from_checkpoint(&ring).expect("a checkpoint");
    assert_eq!(chunks.unknown_before, 0, "the snapshot is complete");
    let chunks: Vec<KvEventBatch> = chunks
        .chunks
        .iter()
        .map(|c| KvEventBatch::decode(c.as_ref()).unwrap())
        .collect();
    fails.extend(diff_live(
        "[all] snapshot (checkpoint)",
        &from_grpc(&chunks),
        &want_live,
    ));
    let smg_page = scrape(smg.metrics);

    eprintln!(
        "model_shapes: {} batches, {} events ({} forwarded under smg, {} live blocks at the end); \
         script ready after {:.1?}, all checks done after {:.1?}",
        published,
        want_all.len(),
        want_smg.len(),
        want_live.len(),
        t_script,
        t0.elapsed()
    );
    assert!(
        fails.is_empty(),
        "{} checks failed:\n\n{}\n\nsmg metrics (decoder):\n{}",
        fails.len(),
        fails.join("\n\n"),
        smg_page
            .lines()
            .filter(|l| l.starts_with("kvbridge_decoder_events_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
