//! Zero heap allocations per batch in steady state: after a warm-up, plan + write of 1000
//! batches of mixed layouts (all engine vectors, a large map store, split batches) into a
//! preallocated buffer allocates nothing.
use kvbridge::decode::{DecodeConfig, Decoder, Profile, RecordHeader};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);
thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if ON.with(|c| c.get()) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwards the caller's contract (non-zero-size `l`) to the system allocator.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System` with layout `l` (every allocation goes through here).
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if ON.with(|c| c.get()) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as for `dealloc`; `n` is the caller's valid new size.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

#[path = "it/vectors/mod.rs"]
mod vectors;
use vectors::{unhex, VECTORS};

/// A vLLM-0.33-style map store of `n` blocks × 16 tokens plus `r` single-hash removals.
fn big(n: u32, r: u32) -> Vec<u8> {
    use rmp::encode as e;
    let mut b = Vec::new();
    e::write_array_len(&mut b, 3).unwrap();
    e::write_f64(&mut b, 1700000000.5).unwrap();
    e::write_array_len(&mut b, 1 + r).unwrap();
    e::write_map_len(&mut b, 8).unwrap();
    for (k, v) in [
        ("type", "BlockStored"),
        ("medium", "GPU"),
        ("kv_cache_spec_kind", "full_attention"),
    ] {
        e::write_str(&mut b, k).unwrap();
        e::write_str(&mut b, v).unwrap();
    }
    e::write_str(&mut b, "block_hashes").unwrap();
    e::write_array_len(&mut b, n).unwrap();
    for i in 0..n {
        e::write_u64(&mut b, 0xDEAD_BEEF_0000_0000 + i as u64).unwrap();
    }
    e::write_str(&mut b, "parent_block_hash").unwrap();
    e::write_nil(&mut b).unwrap();
    e::write_str(&mut b, "token_ids").unwrap();
    e::write_array_len(&mut b, n * 16).unwrap();
    for i in 0..n * 16 {
        e::write_uint(&mut b, (i as u64 * 7919) % 151_000).unwrap();
    }
    e::write_str(&mut b, "block_size").unwrap();
    e::write_uint(&mut b, 16).unwrap();
    e::write_str(&mut b, "extra_keys").unwrap();
    e::write_array_len(&mut b, n).unwrap();
    for _ in 0..n {
        e::write_array_len(&mut b, 1).unwrap();
        e::write_str(&mut b, "adapter").unwrap();
    }
    for i in 0..r {
        e::write_array_len(&mut b, 3).unwrap();
        e::write_str(&mut b, "BlockRemoved").unwrap();
        e::write_array_len(&mut b, 1).unwrap();
        e::write_sint(&mut b, -(i as i64) - 1).unwrap();
        e::write_str(&mut b, "GPU").unwrap();
    }
    e::write_uint(&mut b, 0).unwrap();
    b
}

fn run(decs: &mut [Decoder], payloads: &[Vec<u8>], out: &mut [u8], rounds: usize) -> u64 {
    let mut seq = 1u64;
    let mut eid = 1u64;
    let mut total = 0u64;
    for k in 0..rounds {
        let p = &payloads[k % payloads.len()];
        let dec = &mut decs[k % 2];
        let plan = dec.plan(p).expect("plan");
        for i in 0..plan.records {
            let hdr = RecordHeader {
                sequence_number: seq,
                first_event_id: eid,
                dp_rank: Some(1),
            };
            let len = dec.record_len(i, &hdr);
            total += dec.write_record(p, i, &hdr, &mut out[..len]) as u64;
            seq += 1;
            eid += dec.record_events(i);
        }
    }
    total
}

#[test]
fn steady_state_allocates_nothing() {
    let doc: serde_json::Value = serde_json::from_str(VECTORS).unwrap();
    let mut payloads: Vec<Vec<u8>> = doc["vectors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| unhex(v["payload_hex"].as_str().unwrap()))
        .collect();
    payloads.push(big(64, 0));
    payloads.push(big(300, 200));
    payloads.push(big(8, 50));
    payloads.push(vec![0x93, 0xcb, 0x41]); // an error path too
    payloads.retain(|p| p.len() != 3);
    let mut decs = [
        Decoder::new(DecodeConfig::default()),
        Decoder::new(DecodeConfig {
            split_threshold: 4096,
            profile: Profile::All,
            ..Default::default()
        }),
    ];
    let mut out = vec![0u8; 2 << 20];
    // warm-up: every payload through both decoders
    run(&mut decs, &payloads, &mut out, payloads.len() * 2);
    ON.with(|c| c.set(true));
    let before = ALLOCS.load(Ordering::Relaxed);
    let bytes = run(&mut decs, &payloads, &mut out, 1000);
    // error paths allocate nothing either
    for _ in 0..100 {
        let _ = decs[0].plan(&[0x93, 0xcb, 0x41]);
        let _ = decs[0].plan(&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff]);
    }
    let after = ALLOCS.load(Ordering::Relaxed);
    ON.with(|c| c.set(false));
    assert!(bytes > 100_000, "{bytes}");
    assert!(decs[1].stats().split_events > 0);
    assert_eq!(after - before, 0, "heap allocations in steady state");
    // the counter works
    ON.with(|c| c.set(true));
    let v = std::hint::black_box(vec![1u8; 10]);
    ON.with(|c| c.set(false));
    drop(v);
    assert_eq!(ALLOCS.load(Ordering::Relaxed), after + 1);
}
