//! Decoder throughput (bytes of msgpack input per second) on a token-heavy batch (one store of
//! 64 blocks × 16 tokens, ids up to 151k, vLLM 0.33 map form) and a removal-heavy batch (200
//! single-hash removals, V7 array form), next to (a) a `memcpy` of the same bytes and (b) a
//! straightforward owned decode (rmp-serde into an owned value enum) + prost build + encode.
//!
//! `cargo bench --bench decode -- --warm-up-time 1 --measurement-time 3`
use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use kvbridge::decode::{DecodeConfig, Decoder, Profile, RecordHeader};
use kvbridge::proto::common::{
    kv_block_extra_key, kv_cache_event::Data, KvBlock, KvBlockExtraKey, KvBlocksRemoved,
    KvBlocksStored, KvCacheCleared, KvCacheEvent, KvEventBatch, KvMultimodalKey,
};
use prost::Message;
use rmp::encode as e;
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

// ------------------------------------------------------------------ payloads

fn token_heavy() -> Vec<u8> {
    let mut b = Vec::new();
    e::write_array_len(&mut b, 3).unwrap();
    e::write_f64(&mut b, 1700000000.5).unwrap();
    e::write_array_len(&mut b, 1).unwrap();
    b.extend_from_slice(&[0xde, 0x00, 0x0b]); // map16, as vLLM 0.33 writes it
    e::write_str(&mut b, "type").unwrap();
    e::write_str(&mut b, "BlockStored").unwrap();
    e::write_str(&mut b, "block_hashes").unwrap();
    e::write_array_len(&mut b, 64).unwrap();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..64 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        e::write_u64(&mut b, x).unwrap();
    }
    e::write_str(&mut b, "parent_block_hash").unwrap();
    e::write_u64(&mut b, 0x0123_4567_89ab_cdef).unwrap();
    e::write_str(&mut b, "token_ids").unwrap();
    e::write_array_len(&mut b, 64 * 16).unwrap();
    for i in 0..64 * 16u64 {
        e::write_uint(&mut b, (i * 7919 + 13) % 151_000).unwrap();
    }
    e::write_str(&mut b, "block_size").unwrap();
    e::write_uint(&mut b, 16).unwrap();
    e::write_str(&mut b, "lora_id").unwrap();
    e::write_nil(&mut b).unwrap();
    e::write_str(&mut b, "medium").unwrap();
    e::write_str(&mut b, "GPU").unwrap();
    e::write_str(&mut b, "lora_name").unwrap();
    e::write_nil(&mut b).unwrap();
    e::write_str(&mut b, "extra_keys").unwrap();
    e::write_nil(&mut b).unwrap();
    e::write_str(&mut b, "group_idx").unwrap();
    e::write_uint(&mut b, 0).unwrap();
    e::write_str(&mut b, "kv_cache_spec_kind").unwrap();
    e::write_str(&mut b, "full_attention").unwrap();
    e::write_uint(&mut b, 0).unwrap();
    b
}

fn removal_heavy() -> Vec<u8> {
    let mut b = Vec::new();
    e::write_array_len(&mut b, 3).unwrap();
    e::write_f64(&mut b, 1700000000.5).unwrap();
    e::write_array_len(&mut b, 200).unwrap();
    let mut x = 0xDEAD_BEEF_CAFE_F00Du64;
    for _ in 0..200 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        e::write_array_len(&mut b, 4).unwrap();
        e::write_str(&mut b, "BlockRemoved").unwrap();
        e::write_array_len(&mut b, 1).unwrap();
        e::write_u64(&mut b, x).unwrap();
        e::write_str(&mut b, "GPU").unwrap();
        e::write_uint(&mut b, 0).unwrap();
    }
    e::write_uint(&mut b, 0).unwrap();
    b
}

// ------------------------------------------------------------------ baseline (b)

/// An owned msgpack value, rmpv-style.
#[derive(Debug, Clone)]
enum Val {
    Nil,
    Bool(#[allow(dead_code)] bool),
    Int(i64),
    UInt(u64),
    F64(f64),
    Str(String),
    Bin(Vec<u8>),
    Arr(Vec<Val>),
    Map(Vec<(Val, Val)>),
}

impl<'de> Deserialize<'de> for Val {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Val, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Val;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("msgpack value")
            }
            fn visit_unit<E>(self) -> Result<Val, E> {
                Ok(Val::Nil)
            }
            fn visit_none<E>(self) -> Result<Val, E> {
                Ok(Val::Nil)
            }
            fn visit_bool<E>(self, v: bool) -> Result<Val, E> {
                Ok(Val::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Val, E> {
                Ok(Val::Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Val, E> {
                Ok(Val::UInt(v))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Val, E> {
                Ok(Val::F64(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Val, E> {
                Ok(Val::Str(v.to_owned()))
            }
            fn visit_bytes<E>(self, v: &[u8]) -> Result<Val, E> {
                Ok(Val::Bin(v.to_vec()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Val, A::Error> {
                let mut v = Vec::with_capacity(s.size_hint().unwrap_or(0).min(4096));
                while let Some(x) = s.next_element()? {
                    v.push(x);
                }
                Ok(Val::Arr(v))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Val, A::Error> {
                let mut v = Vec::new();
                while let Some(kv) = m.next_entry()? {
                    v.push(kv);
                }
                Ok(Val::Map(v))
            }
        }
        d.deserialize_any(V)
    }
}

fn h(v: &Val) -> Option<i64> {
    match v {
        Val::Int(i) => Some(*i),
        Val::UInt(u) => Some(*u as i64),
        Val::Bin(b) if !b.is_empty() => Some(
            b[b.len().saturating_sub(8)..]
                .iter()
                .fold(0u64, |a, &x| (a << 8) | x as u64) as i64,
        ),
        _ => None,
    }
}
fn s(v: Option<&Val>) -> Option<String> {
    match v {
        Some(Val::Str(s)) => Some(s.clone()),
        _ => None,
    }
}
fn u(v: Option<&Val>) -> Option<u64> {
    match v {
        Some(Val::UInt(u)) => Some(*u),
        Some(Val::Int(i)) if *i >= 0 => Some(*i as u64),
        _ => None,
    }
}
fn tier(m: &Option<String>) -> Option<i32> {
    match m.as_deref()?.to_ascii_uppercase().as_str() {
        "GPU" => Some(1),
        "CPU" | "CPU_PINNED" => Some(2),
        "DISK" | "FS" | "STORAGE" => Some(3),
        "OBJ" | "EXTERNAL" => Some(4),
        _ => None,
    }
}
fn ek(v: &Val, out: &mut Vec<KvBlockExtraKey>) {
    use kv_block_extra_key::Key;
    let k = match v {
        Val::Str(s) => Key::Text(s.clone()),
        Val::Bin(b) => Key::Blob(b.clone()),
        Val::Int(i) => Key::Number(*i),
        Val::UInt(x) => Key::Number(*x as i64),
        Val::Arr(a)
            if a.len() == 2
                && matches!((&a[0], &a[1]), (Val::Str(_), Val::Int(_) | Val::UInt(_))) =>
        {
            Key::Multimodal(KvMultimodalKey {
                identifier: s(a.first()).unwrap(),
                offset: h(&a[1]).unwrap(),
            })
        }
        Val::Arr(a) => return a.iter().for_each(|x| ek(x, out)),
        _ => return,
    };
    out.push(KvBlockExtraKey { key: Some(k) });
}

fn field<'a>(ev: &'a Val, k: &str, p: usize) -> Option<&'a Val> {
    match ev {
        Val::Arr(a) => a.get(p),
        Val::Map(m) => m
            .iter()
            .find(|(kk, _)| matches!(kk, Val::Str(s) if s == k))
            .map(|(_, v)| v),
        _ => None,
    }
}

/// Owned decode → prost message → bytes.
fn baseline(payload: &[u8], seq: u64, eid: u64) -> Vec<u8> {
    let batch: Val = rmp_serde::from_slice(payload).unwrap();
    let Val::Arr(top) = batch else { panic!() };
    let ts = match &top[0] {
        Val::F64(f) => *f,
        Val::Int(i) => *i as f64,
        Val::UInt(x) => *x as f64,
        _ => panic!(),
    };
    let Val::Arr(evs) = &top[1] else { panic!() };
    let mut out = KvEventBatch {
        sequence_number: seq,
        timestamp: ts,
        ..Default::default()
    };
    for ev in evs {
        // field accessor by array position or map key
        let tag = match ev {
            Val::Arr(a) => s(a.first()).unwrap(),
            Val::Map(_) => s(field(ev, "type", 0)).unwrap(),
            _ => continue,
        };
        let get = |k: &str, p: usize| field(ev, k, p);
        let data = match tag.as_str() {
            "BlockStored" => {
                let Some(Val::Arr(hs)) = get("block_hashes", 1) else {
                    continue;
                };
                let Some(Val::Arr(toks)) = get("token_ids", 3) else {
                    continue;
                };
                let bs = u(get("block_size", 4)).unwrap() as usize;
                let medium = s(get("medium", 6));
                let t = tier(&medium);
                let lora = get("lora_id", 5).and_then(h);
                let extra = match get("extra_keys", 8) {
                    Some(Val::Arr(x)) => Some(x),
                    _ => None,
                };
                let pair = bs > 0 && toks.len() == hs.len() * bs;
                let blocks = hs
                    .iter()
                    .enumerate()
                    .map(|(i, hv)| {
                        let mut keys = Vec::new();
                        if let Some(x) = extra.and_then(|x| x.get(i)) {
                            ek(x, &mut keys);
                        }
                        KvBlock {
                            block_hash: h(hv).unwrap(),
                            token_ids: if pair {
                                toks[i * bs..(i + 1) * bs]
                                    .iter()
                                    .map(|t| u(Some(t)).unwrap() as u32)
                                    .collect()
                            } else {
                                vec![]
                            },
                            block_size: if pair { bs as i32 } else { 0 },
                            lora_id: lora,
                            cache_level: t.map(|t| t - 1),
                            extra_keys: keys,
                        }
                    })
                    .collect();
                Data::Stored(KvBlocksStored {
                    blocks,
                    parent_block_hash: get("parent_block_hash", 2).and_then(h),
                    tier: t,
                    medium,
                    group_idx: u(get("group_idx", 9)).map(|g| g as u32),
                    kv_cache_spec_kind: s(get("kv_cache_spec_kind", 10)),
                    kv_cache_spec_sliding_window: u(get("kv_cache_spec_sliding_window", 11))
                        .map(|g| g as u32),
                    locality: None,
                    ownership: s(get("ownership", usize::MAX)),
                    session_id: s(get("session_id", usize::MAX)),
                    lora_name: s(get("lora_name", 7)),
                    cache_salt: s(get("cache_salt", usize::MAX)),
                })
            }
            "BlockRemoved" => {
                let Some(Val::Arr(hs)) = get("block_hashes", 1) else {
                    continue;
                };
                let medium = s(get("medium", 2));
                let t = tier(&medium);
                Data::Removed(KvBlocksRemoved {
                    block_hashes: hs.iter().filter_map(h).collect(),
                    cache_level: t.map(|t| t - 1),
                    tier: t,
                    medium,
                    group_idx: u(get("group_idx", 3)).map(|g| g as u32),
                    locality: None,
                    ownership: s(get("ownership", usize::MAX)),
                })
            }
            "AllBlocksCleared" => Data::Cleared(KvCacheCleared {
                ownership: s(get("ownership", usize::MAX)),
            }),
            _ => continue,
        };
        let id = eid + out.events.len() as u64;
        out.events.push(KvCacheEvent {
            event_id: id,
            data: Some(data),
        });
    }
    out.encode_to_vec()
}

// ------------------------------------------------------------------ kvbridge

fn ours(dec: &mut Decoder, payload: &[u8], out: &mut [u8]) -> usize {
    let plan = dec.plan(payload).unwrap();
    let mut n = 0;
    let mut eid = 1;
    for i in 0..plan.records {
        let hdr = RecordHeader {
            sequence_number: 1 + i as u64,
            first_event_id: eid,
            dp_rank: None,
        };
        let len = dec.record_len(i, &hdr);
        n += dec.write_record(payload, i, &hdr, &mut out[n..n + len]);
        eid += dec.record_events(i);
    }
    n
}

fn bench(c: &mut Criterion) {
    for (name, payload) in [
        ("token_heavy", token_heavy()),
        ("removal_heavy", removal_heavy()),
    ] {
        let mut dec = Decoder::new(DecodeConfig {
            profile: Profile::All,
            ..Default::default()
        });
        let mut out = vec![0u8; 1 << 20];
        // same bytes as the baseline
        let n = ours(&mut dec, &payload, &mut out);
        assert_eq!(
            &out[..n],
            &baseline(&payload, 1, 1)[..],
            "{name}: outputs differ"
        );
        let mut g = c.benchmark_group(name);
        g.throughput(Throughput::Bytes(payload.len() as u64));
        g.bench_function("kvbridge", |b| {
            b.iter(|| black_box(ours(&mut dec, black_box(&payload), &mut out)))
        });
        g.bench_function("memcpy", |b| {
            b.iter(|| {
                out[..payload.len()].copy_from_slice(black_box(&payload));
                black_box(&out);
            })
        });
        g.bench_function("rmp_serde_prost", |b| {
            b.iter(|| black_box(baseline(black_box(&payload), 1, 1)))
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
