//! Property tests: random batches written by an independent msgpack encoder (`rmp::encode`,
//! array and map events, random int/str/array widths, random unknown keys, tags and trailing
//! elements) decode to the same meaning; random split thresholds reassemble to the input.
use kvbridge::decode::{DecodeConfig, Decoder, Profile, RecordHeader};
use kvbridge::proto::common::{
    kv_block_extra_key::Key, kv_cache_event::Data, KvBlock, KvBlockExtraKey, KvBlocksRemoved,
    KvBlocksStored, KvCacheCleared, KvEventBatch, KvMultimodalKey,
};
use proptest::collection::vec;
use proptest::prelude::*;
use prost::Message;
use rmp::encode as e;

// ---------------------------------------------------------------- model

#[derive(Clone, Debug)]
enum H {
    U(u64),
    I(i64),
    Bin(Vec<u8>),
}
impl H {
    fn bits(&self) -> i64 {
        match self {
            H::U(v) => *v as i64,
            H::I(v) => *v,
            H::Bin(b) => {
                let t = &b[b.len().saturating_sub(8)..];
                t.iter().fold(0u64, |a, &x| (a << 8) | x as u64) as i64
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Leaf {
    Text(String),
    Blob(Vec<u8>),
    Num(i64),
    Mm(String, i64),
}
#[derive(Clone, Debug)]
enum Item {
    Leaf(Leaf),
    List(Vec<Leaf>),
}

#[derive(Clone, Debug, Default)]
struct Store {
    hashes: Vec<H>,
    parent: Option<H>,
    tokens: Vec<u32>,
    bs: u32,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra: Option<Vec<Option<Vec<Item>>>>,
    group: Option<u32>,
    kind: Option<String>,
    sliding: Option<u32>,
    locality: Option<String>,
    ownership: Option<String>,
    session: Option<String>,
    salt: Option<String>,
}

#[derive(Clone, Debug, Default)]
struct Removal {
    hashes: Vec<H>,
    medium: Option<String>,
    group: Option<u32>,
    locality: Option<String>,
    ownership: Option<String>,
}

#[derive(Clone, Debug)]
enum Ev {
    Stored(Store),
    Removed(Removal),
    Cleared(Option<String>),
    Unknown,
}

#[derive(Clone, Debug)]
struct Batch {
    ts: f64,
    ts_form: u8,
    shape: u8, // 0: [ts, ev], 1: [ts, ev, rank], 2: + trailing, 3: map
    rank: Option<i64>,
    events: Vec<(
        Ev,
        bool, /* map form */
        u8,   /* array layout choice */
    )>,
    seed: u64,
}

// ---------------------------------------------------------------- strategies

fn arb_h() -> impl Strategy<Value = H> {
    prop_oneof![
        any::<u64>().prop_map(H::U),
        (i64::MIN..0i64).prop_map(H::I),
        vec(any::<u8>(), 1..33).prop_map(H::Bin),
        (0u64..300).prop_map(H::U),
    ]
}
fn arb_str() -> impl Strategy<Value = String> {
    prop_oneof!["[a-z_]{0,12}", "[a-zé✓]{0,40}", Just(String::new())]
}
fn arb_medium() -> impl Strategy<Value = Option<String>> {
    proptest::option::of(prop_oneof![
        Just("GPU".to_string()),
        Just("cpu".to_string()),
        Just("CPU_PINNED".to_string()),
        Just("DISK".to_string()),
        Just("STORAGE".to_string()),
        Just("OBJ".to_string()),
        Just("EXTERNAL".to_string()),
        Just("LMCACHE_X".to_string()),
    ])
}
fn arb_locality() -> impl Strategy<Value = Option<String>> {
    proptest::option::of(prop_oneof![
        Just("LOCAL".to_string()),
        Just("REMOTE".to_string()),
        Just("ELSEWHERE".to_string())
    ])
}
fn arb_leaf() -> impl Strategy<Value = Leaf> {
    prop_oneof![
        arb_str().prop_map(Leaf::Text),
        vec(any::<u8>(), 0..20).prop_map(Leaf::Blob),
        any::<i64>().prop_map(Leaf::Num),
        (arb_str(), any::<i64>()).prop_map(|(s, o)| Leaf::Mm(s, o)),
    ]
}
fn arb_item() -> impl Strategy<Value = Item> {
    prop_oneof![
        3 => arb_leaf().prop_map(Item::Leaf),
        1 => prop_oneof![vec(arb_leaf(), 1..2), vec(arb_leaf(), 3..5)].prop_map(Item::List),
    ]
}
/// A (str, int) pair at entry level would read as one multimodal key: avoid generating it.
fn fix_entry(mut v: Vec<Item>) -> Vec<Item> {
    if v.len() == 2 {
        if let (Item::Leaf(Leaf::Text(_)), Item::Leaf(Leaf::Num(_))) = (&v[0], &v[1]) {
            v.swap(0, 1);
        }
    }
    v
}

fn arb_store() -> impl Strategy<Value = Store> {
    let shape = (
        1usize..10,
        prop_oneof![Just(1u32), Just(4), Just(16)],
        0u8..10,
    );
    let tok = prop_oneof![0u32..128, 0u32..70000, any::<u32>()];
    (
        shape,
        vec(tok, 800),
        vec(arb_h(), 80),
        proptest::option::of(arb_h()),
    )
        .prop_flat_map(|((n, bs, pairing), toks, hs, parent)| {
            let n = if pairing == 9 { n * 8 } else { n }; // sometimes big
            let hashes: Vec<H> = hs.into_iter().cycle().take(n).collect();
            let (tokens, bs) = match pairing {
                0 => (vec![], 0), // placeholder
                1 => (
                    toks.iter()
                        .cycle()
                        .take(n * bs as usize + 1)
                        .copied()
                        .collect(),
                    bs,
                ), // mismatch
                2 => (toks.iter().cycle().take(n).copied().collect(), 0), // bs 0 with tokens
                _ => (
                    toks.iter().cycle().take(n * bs as usize).copied().collect(),
                    bs,
                ),
            };
            let extra = proptest::option::of(vec(
                proptest::option::of(vec(arb_item(), 0..4).prop_map(fix_entry)),
                n..=n,
            ));
            let opts = (
                proptest::option::of(any::<i64>()),
                arb_medium(),
                proptest::option::of(arb_str()),
                proptest::option::of(0u32..8),
                proptest::option::of(prop_oneof![
                    Just("full_attention".to_string()),
                    Just("sliding_window".to_string())
                ]),
                proptest::option::of(any::<u32>()),
            );
            let opts2 = (
                arb_locality(),
                proptest::option::of(arb_str()),
                proptest::option::of(arb_str()),
                proptest::option::of(arb_str()),
            );
            (Just((hashes, parent, tokens, bs)), extra, opts, opts2)
        })
        .prop_map(|((hashes, parent, tokens, bs), extra, o, o2)| Store {
            hashes,
            parent,
            tokens,
            bs,
            lora_id: o.0,
            medium: o.1,
            lora_name: o.2,
            extra,
            group: o.3,
            kind: o.4,
            sliding: o.5,
            locality: o2.0,
            ownership: o2.1,
            session: o2.2,
            salt: o2.3,
        })
}

fn arb_removal() -> impl Strategy<Value = Removal> {
    (
        prop_oneof![vec(arb_h(), 1..4), vec(arb_h(), 100..700)],
        arb_medium(),
        proptest::option::of(0u32..8),
        arb_locality(),
        proptest::option::of(arb_str()),
    )
        .prop_map(|(hashes, medium, group, locality, ownership)| Removal {
            hashes,
            medium,
            group,
            locality,
            ownership,
        })
}

fn arb_ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        5 => arb_store().prop_map(Ev::Stored),
        3 => arb_removal().prop_map(Ev::Removed),
        1 => proptest::option::of(arb_str()).prop_map(Ev::Cleared),
        1 => Just(Ev::Unknown),
    ]
}

fn arb_batch() -> impl Strategy<Value = Batch> {
    (
        prop_oneof![
            Just(1700000000.5f64),
            (0u32..2_000_000_000).prop_map(|v| v as f64 + 0.25)
        ],
        0u8..3,
        0u8..4,
        proptest::option::of(-3i64..300),
        vec((arb_ev(), any::<bool>(), 0u8..8), 0..8),
        any::<u64>(),
    )
        .prop_map(|(ts, ts_form, shape, rank, events, seed)| Batch {
            ts,
            ts_form,
            shape,
            rank,
            events,
            seed,
        })
}

// ---------------------------------------------------------------- the independent encoder

/// Writes one map entry (key + value).
type FieldFn = Box<dyn Fn(&mut Enc)>;

struct Enc {
    b: Vec<u8>,
    rng: u64,
    unknown_keys: u64,
    unknown_tags: u64,
}

impl Enc {
    fn r(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }
    fn coin(&mut self, n: u64) -> bool {
        self.r() % n == 0
    }
    fn uint(&mut self, v: u64) {
        let b = &mut self.b;
        match self.rng % 5 {
            0 if v <= 0xff => e::write_u8(b, v as u8).unwrap(),
            1 if v <= 0xffff => e::write_u16(b, v as u16).unwrap(),
            2 if v <= 0xffff_ffff => e::write_u32(b, v as u32).unwrap(),
            3 if v <= i64::MAX as u64 => e::write_i64(b, v as i64).unwrap(),
            4 => e::write_u64(b, v).unwrap(),
            _ => {
                e::write_uint(b, v).unwrap();
            }
        }
        self.r();
    }
    fn sint(&mut self, v: i64) {
        if v >= 0 {
            return self.uint(v as u64);
        }
        let b = &mut self.b;
        match self.rng % 3 {
            0 => e::write_i64(b, v).unwrap(),
            1 if v >= i32::MIN as i64 => e::write_i32(b, v as i32).unwrap(),
            _ => {
                e::write_sint(b, v).unwrap();
            }
        }
        self.r();
    }
    fn str(&mut self, s: &str) {
        match self.r() % 4 {
            0 if s.len() < 256 => {
                self.b.push(0xd9);
                self.b.push(s.len() as u8);
                self.b.extend_from_slice(s.as_bytes());
            }
            1 => {
                self.b.push(0xda);
                self.b.extend_from_slice(&(s.len() as u16).to_be_bytes());
                self.b.extend_from_slice(s.as_bytes());
            }
            _ => e::write_str(&mut self.b, s).unwrap(),
        }
    }
    fn opt_str(&mut self, s: &Option<String>) {
        match s {
            Some(s) => self.str(s),
            None => e::write_nil(&mut self.b).unwrap(),
        }
    }
    fn arr(&mut self, n: u32) {
        match self.r() % 4 {
            0 => {
                self.b.push(0xdc);
                self.b.extend_from_slice(&(n as u16).to_be_bytes());
            }
            1 => {
                self.b.push(0xdd);
                self.b.extend_from_slice(&n.to_be_bytes());
            }
            _ => {
                e::write_array_len(&mut self.b, n).unwrap();
            }
        }
    }
    fn map(&mut self, n: u32) {
        if self.coin(3) {
            self.b.push(0xde);
            self.b.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            e::write_map_len(&mut self.b, n).unwrap();
        }
    }
    fn nil(&mut self) {
        e::write_nil(&mut self.b).unwrap();
    }
    fn hash(&mut self, h: &H) {
        match h {
            H::U(v) => self.uint(*v),
            H::I(v) => self.sint(*v),
            H::Bin(b) => {
                e::write_bin(&mut self.b, b).unwrap();
            }
        }
    }
    fn opt_hash(&mut self, h: &Option<H>) {
        match h {
            Some(h) => self.hash(h),
            None => self.nil(),
        }
    }
    fn opt_u(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }
    fn opt_i(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.sint(v),
            None => self.nil(),
        }
    }
    /// A random junk value (depth ≤ 3) for unknown keys/elements.
    fn junk(&mut self, depth: u32) {
        match self.r() % if depth >= 3 { 5 } else { 7 } {
            0 => self.nil(),
            1 => self.uint(self.rng % 100000),
            2 => self.str("junk"),
            3 => e::write_f64(&mut self.b, 1.5).unwrap(),
            4 => e::write_bin(&mut self.b, &[1, 2, 3]).unwrap(),
            5 => {
                let n = (self.r() % 4) as u32;
                self.arr(n);
                for _ in 0..n {
                    self.junk(depth + 1);
                }
            }
            _ => {
                let n = (self.r() % 3) as u32;
                self.map(n);
                for _ in 0..n {
                    self.str("k");
                    self.junk(depth + 1);
                }
            }
        }
    }
    fn leaf(&mut self, l: &Leaf) {
        match l {
            Leaf::Text(s) => self.str(s),
            Leaf::Blob(b) => {
                e::write_bin(&mut self.b, b).unwrap();
            }
            Leaf::Num(n) => self.sint(*n),
            Leaf::Mm(s, o) => {
                self.arr(2);
                self.str(s);
                self.sint(*o);
            }
        }
    }
    fn extra(&mut self, x: &Option<Vec<Option<Vec<Item>>>>) {
        let Some(x) = x else { return self.nil() };
        self.arr(x.len() as u32);
        for ent in x {
            match ent {
                None => self.nil(),
                Some(items) => {
                    self.arr(items.len() as u32);
                    for it in items {
                        match it {
                            Item::Leaf(l) => self.leaf(l),
                            Item::List(ls) => {
                                self.arr(ls.len() as u32);
                                for l in ls {
                                    self.leaf(l);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

impl Enc {
    fn s_(&mut self, v: String) {
        self.str(&v)
    }
    fn u_(&mut self, v: u32) {
        self.uint(v as u64)
    }
    fn x_(&mut self, v: Vec<Option<Vec<Item>>>) {
        self.extra(&Some(v))
    }
}

/// Array layouts of BlockStored (lengths incl. tag).
const STORE_LENS: [u32; 8] = [5, 6, 7, 8, 9, 10, 12, 12];

/// Encodes one event; returns the model as representable in the chosen form (None = unknown).
fn enc_event(en: &mut Enc, ev: &Ev, map: bool, lay: u8) -> Option<Ev> {
    match ev {
        Ev::Unknown => {
            en.unknown_tags += 1;
            if map {
                en.map(2);
                en.str("type");
                en.str("BlockPinned"); // a tag no engine sends
                en.str("block_hashes");
                en.junk(0);
            } else {
                en.arr(3);
                en.str("SnapshotChunk");
                en.junk(0);
                en.junk(0);
            }
            None
        }
        Ev::Cleared(own) => {
            if map {
                let n = 1 + own.is_some() as u32;
                en.map(n);
                if let Some(o) = own {
                    en.str("ownership");
                    en.str(o);
                }
                en.str("type");
                en.str("AllBlocksCleared");
                Some(Ev::Cleared(own.clone()))
            } else {
                en.arr(1);
                en.str("AllBlocksCleared");
                Some(Ev::Cleared(None))
            }
        }
        Ev::Removed(r) => {
            let mut r = r.clone();
            if map {
                let mut fields: Vec<FieldFn> = Vec::new();
                let rr = r.clone();
                fields.push(Box::new(|en: &mut Enc| {
                    en.str("type");
                    en.str("BlockRemoved");
                }));
                let hs = rr.hashes.clone();
                fields.push(Box::new(move |en: &mut Enc| {
                    en.str("block_hashes");
                    en.arr(hs.len() as u32);
                    for h in &hs {
                        en.hash(h);
                    }
                }));
                let m = rr.medium.clone();
                fields.push(Box::new(move |en: &mut Enc| {
                    en.str("medium");
                    en.opt_str(&m);
                }));
                if let Some(g) = rr.group {
                    fields.push(Box::new(move |en: &mut Enc| {
                        en.str("group_idx");
                        en.uint(g as u64);
                    }));
                }
                if let Some(l) = rr.locality.clone() {
                    fields.push(Box::new(move |en: &mut Enc| {
                        en.str("locality");
                        en.str(&l);
                    }));
                }
                if let Some(o) = rr.ownership.clone() {
                    fields.push(Box::new(move |en: &mut Enc| {
                        en.str("ownership");
                        en.str(&o);
                    }));
                }
                write_map_fields(en, fields);
            } else {
                let len = 2 + (lay % 3) as u32; // 2, 3, 4
                                                // trailing unknown elements only after the longest layout (else positional)
                let extra = (len == 4 && en.r() % 2 == 0) as u32;
                en.unknown_keys += extra as u64;
                en.arr(len + extra);
                en.str("BlockRemoved");
                en.arr(r.hashes.len() as u32);
                for h in &r.hashes {
                    en.hash(h);
                }
                if len > 2 {
                    en.opt_str(&r.medium);
                } else {
                    r.medium = None;
                }
                if len > 3 {
                    en.opt_u(r.group.map(u64::from));
                } else {
                    r.group = None;
                }
                r.locality = None;
                r.ownership = None;
                for _ in 0..extra {
                    en.junk(0);
                }
            }
            Some(Ev::Removed(r))
        }
        Ev::Stored(s) => {
            let mut s = s.clone();
            if map {
                let mut fields: Vec<FieldFn> = Vec::new();
                fields.push(Box::new(|en: &mut Enc| {
                    en.str("type");
                    en.str("BlockStored");
                }));
                let ss = s.clone();
                fields.push(Box::new(move |en: &mut Enc| {
                    en.str("block_hashes");
                    en.arr(ss.hashes.len() as u32);
                    for h in &ss.hashes {
                        en.hash(h);
                    }
                }));
                let ss = s.clone();
                fields.push(Box::new(move |en: &mut Enc| {
                    en.str("parent_block_hash");
                    en.opt_hash(&ss.parent);
                }));
                let ss = s.clone();
                fields.push(Box::new(move |en: &mut Enc| {
                    en.str("token_ids");
                    en.arr(ss.tokens.len() as u32);
                    for &t in &ss.tokens {
                        en.uint(t as u64);
                    }
                }));
                let ss = s.clone();
                fields.push(Box::new(move |en: &mut Enc| {
                    en.str("block_size");
                    en.uint(ss.bs as u64);
                }));
                let ss = s.clone();
                fields.push(Box::new(move |en: &mut Enc| {
                    en.str("lora_id");
                    en.opt_i(ss.lora_id);
                }));
                macro_rules! opt_field {
                    ($name:literal, $v:expr, $w:ident) => {
                        if let Some(v) = $v.clone() {
                            fields.push(Box::new(move |en: &mut Enc| {
                                en.str($name);
                                en.$w(v.clone());
                            }));
                        } else if en.coin(3) {
                            fields.push(Box::new(move |en: &mut Enc| {
                                en.str($name);
                                en.nil();
                            }));
                        }
                    };
                }
                opt_field!("medium", s.medium, s_);
                opt_field!("lora_name", s.lora_name, s_);
                opt_field!("extra_keys", s.extra, x_);
                opt_field!("group_idx", s.group, u_);
                opt_field!("kv_cache_spec_kind", s.kind, s_);
                opt_field!("kv_cache_spec_sliding_window", s.sliding, u_);
                opt_field!("locality", s.locality, s_);
                opt_field!("ownership", s.ownership, s_);
                opt_field!("session_id", s.session, s_);
                opt_field!("cache_salt", s.salt, s_);
                if en.coin(4) {
                    fields.push(Box::new(|en: &mut Enc| {
                        en.str("lookahead_token_ids");
                        en.arr(1);
                        en.arr(2);
                        en.uint(5);
                        en.uint(6);
                    }));
                }
                write_map_fields(en, fields);
            } else {
                let len = STORE_LENS[lay as usize];
                let extra = (len == 12 && en.r() % 2 == 0) as u32;
                en.unknown_keys += extra as u64;
                en.arr(len + extra);
                en.str("BlockStored");
                en.arr(s.hashes.len() as u32);
                for h in &s.hashes {
                    en.hash(h);
                }
                en.opt_hash(&s.parent);
                en.arr(s.tokens.len() as u32);
                for &t in &s.tokens {
                    en.uint(t as u64);
                }
                en.uint(s.bs as u64);
                if len > 5 {
                    en.opt_i(s.lora_id)
                } else {
                    s.lora_id = None
                }
                if len > 6 {
                    en.opt_str(&s.medium)
                } else {
                    s.medium = None
                }
                if len > 7 {
                    if s.lora_name.is_none() && s.salt.is_some() {
                        // SGLang metadata map
                        en.map(1 + (lay % 2) as u32);
                        en.str("cache_salt");
                        en.opt_str(&s.salt);
                        if lay % 2 == 1 {
                            en.str("other");
                            en.junk(0);
                            en.unknown_keys += 1;
                        }
                    } else {
                        en.opt_str(&s.lora_name);
                        s.salt = None;
                    }
                } else {
                    s.lora_name = None;
                    s.salt = None;
                }
                if len > 8 {
                    en.extra(&s.extra)
                } else {
                    s.extra = None
                }
                if len > 9 {
                    en.opt_u(s.group.map(u64::from))
                } else {
                    s.group = None
                }
                if len > 10 {
                    en.opt_str(&s.kind);
                    en.opt_u(s.sliding.map(u64::from));
                } else {
                    s.kind = None;
                    s.sliding = None;
                }
                s.locality = None;
                s.ownership = None;
                s.session = None;
                for _ in 0..extra {
                    en.junk(0);
                }
            }
            Some(Ev::Stored(s))
        }
    }
}

/// Writes map fields in a random order with random unknown keys mixed in.
fn write_map_fields(en: &mut Enc, mut fields: Vec<FieldFn>) {
    // shuffle
    for i in (1..fields.len()).rev() {
        let j = (en.r() % (i as u64 + 1)) as usize;
        fields.swap(i, j);
    }
    let unknown = (en.r() % 3) as usize;
    en.unknown_keys += unknown as u64;
    en.map((fields.len() + unknown) as u32);
    for _ in 0..unknown {
        en.str("zz_future_field");
        en.junk(0);
    }
    for f in fields {
        f(en);
    }
}

fn encode(b: &Batch) -> (Vec<u8>, Vec<Ev>, Enc) {
    let mut en = Enc {
        b: Vec::new(),
        rng: b.seed | 1,
        unknown_keys: 0,
        unknown_tags: 0,
    };
    let mut model = Vec::new();
    let write_ts = |en: &mut Enc| match b.ts_form {
        0 => e::write_f64(&mut en.b, b.ts).unwrap(),
        1 => e::write_f32(&mut en.b, b.ts as f32).unwrap(),
        _ => en.uint(b.ts as u64),
    };
    let write_events = |en: &mut Enc, model: &mut Vec<Ev>| {
        en.arr(b.events.len() as u32);
        for (ev, map, lay) in &b.events {
            if let Some(m) = enc_event(en, ev, *map, *lay) {
                model.push(m);
            }
        }
    };
    match b.shape {
        3 => {
            en.map(3);
            en.str("events");
            write_events(&mut en, &mut model);
            en.str("attn_dp_rank");
            en.opt_i(b.rank);
            en.str("ts");
            write_ts(&mut en);
        }
        s => {
            let extra = if s == 2 { 2 } else { 0 };
            en.arr(2 + (s >= 1) as u32 + extra);
            write_ts(&mut en);
            write_events(&mut en, &mut model);
            if s >= 1 {
                en.opt_i(b.rank);
            }
            for _ in 0..extra {
                en.junk(0);
            }
            en.unknown_keys += extra as u64;
        }
    }
    let buf = std::mem::take(&mut en.b);
    (buf, model, en)
}

fn expected_ts(b: &Batch) -> f64 {
    match b.ts_form {
        0 => b.ts,
        1 => b.ts as f32 as f64,
        _ => b.ts.trunc(),
    }
}

// ---------------------------------------------------------------- expected meaning

fn tier(m: &Option<String>) -> Option<i32> {
    match m.as_deref()?.to_ascii_uppercase().as_str() {
        "GPU" => Some(1),
        "CPU" | "CPU_PINNED" => Some(2),
        "DISK" | "FS" | "STORAGE" => Some(3),
        "OBJ" | "EXTERNAL" => Some(4),
        _ => None,
    }
}
fn loc(l: &Option<String>) -> Option<i32> {
    match l.as_deref()? {
        "LOCAL" => Some(1),
        "REMOTE" => Some(2),
        _ => None,
    }
}
fn leaf_key(l: &Leaf) -> KvBlockExtraKey {
    KvBlockExtraKey {
        key: Some(match l {
            Leaf::Text(s) => Key::Text(s.clone()),
            Leaf::Blob(b) => Key::Blob(b.clone()),
            Leaf::Num(n) => Key::Number(*n),
            Leaf::Mm(s, o) => Key::Multimodal(KvMultimodalKey {
                identifier: s.clone(),
                offset: *o,
            }),
        }),
    }
}
fn entry_keys(items: &[Item]) -> Vec<KvBlockExtraKey> {
    let mut v = Vec::new();
    for it in items {
        match it {
            Item::Leaf(l) => v.push(leaf_key(l)),
            Item::List(ls) => v.extend(ls.iter().map(leaf_key)),
        }
    }
    v
}

fn expect(ev: &Ev) -> Option<Data> {
    Some(match ev {
        Ev::Stored(s) => {
            let bs = s.bs as usize;
            let pair = bs > 0 && s.tokens.len() == s.hashes.len() * bs;
            let t = tier(&s.medium);
            Data::Stored(KvBlocksStored {
                blocks: s
                    .hashes
                    .iter()
                    .enumerate()
                    .map(|(i, h)| KvBlock {
                        block_hash: h.bits(),
                        token_ids: if pair {
                            s.tokens[i * bs..(i + 1) * bs].to_vec()
                        } else {
                            vec![]
                        },
                        block_size: if pair { bs as i32 } else { 0 },
                        lora_id: s.lora_id,
                        cache_level: t.map(|t| t - 1),
                        extra_keys: match &s.extra {
                            Some(x) => x[i].as_deref().map(entry_keys).unwrap_or_default(),
                            None => vec![],
                        },
                    })
                    .collect(),
                parent_block_hash: s.parent.as_ref().map(H::bits),
                tier: t,
                medium: s.medium.clone(),
                group_idx: s.group,
                kv_cache_spec_kind: s.kind.clone(),
                kv_cache_spec_sliding_window: s.sliding,
                locality: loc(&s.locality),
                ownership: s.ownership.clone(),
                session_id: s.session.clone(),
                lora_name: s.lora_name.clone(),
                cache_salt: s.salt.clone(),
            })
        }
        Ev::Removed(r) => {
            let t = tier(&r.medium);
            Data::Removed(KvBlocksRemoved {
                block_hashes: r.hashes.iter().map(H::bits).collect(),
                cache_level: t.map(|t| t - 1),
                tier: t,
                medium: r.medium.clone(),
                group_idx: r.group,
                locality: loc(&r.locality),
                ownership: r.ownership.clone(),
            })
        }
        Ev::Cleared(o) => Data::Cleared(KvCacheCleared {
            ownership: o.clone(),
        }),
        Ev::Unknown => return None,
    })
}

/// Plans + writes all records; checks canonical bytes, lengths, ids; returns records.
fn decode_all(dec: &mut Decoder, payload: &[u8], thr: usize) -> Vec<KvEventBatch> {
    let plan = dec.plan(payload).expect("plan");
    let mut eid = 100;
    let mut out = Vec::new();
    for i in 0..plan.records {
        let hdr = RecordHeader {
            sequence_number: u64::MAX - i as u64,
            first_event_id: eid,
            dp_rank: Some(-1),
        };
        let len = dec.record_len(i, &hdr);
        assert!(len <= thr, "record {len} > {thr}");
        let mut buf = vec![0u8; len];
        dec.write_record(payload, i, &hdr, &mut buf);
        let m = KvEventBatch::decode(&buf[..]).unwrap();
        assert_eq!(m.encode_to_vec(), buf);
        for (k, e) in m.events.iter().enumerate() {
            assert_eq!(e.event_id, eid + k as u64);
        }
        eid += dec.record_events(i);
        out.push(m);
    }
    out
}

fn cfg(thr: usize) -> DecodeConfig {
    DecodeConfig {
        split_threshold: thr,
        profile: Profile::All,
        ..Default::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_batches_decode_to_their_meaning(b in arb_batch()) {
        let (payload, model, en) = encode(&b);
        let mut dec = Decoder::new(cfg(1 << 30));
        let recs = decode_all(&mut dec, &payload, 1 << 30);
        let exp: Vec<Data> = model.iter().filter_map(expect).collect();
        let plan_rank = dec.plan(&payload).unwrap().rank;
        prop_assert_eq!(plan_rank, if b.shape == 0 { None } else { b.rank });
        if exp.is_empty() {
            prop_assert!(recs.is_empty());
        } else {
            prop_assert_eq!(recs.len(), 1);
            prop_assert_eq!(recs[0].timestamp, expected_ts(&b));
            let got: Vec<Data> = recs[0].events.iter().map(|e| e.data.clone().unwrap()).collect();
            prop_assert_eq!(got, exp);
        }
        let st = dec.stats();
        prop_assert_eq!(st.unknown_tags, 2 * en.unknown_tags);
        prop_assert_eq!(st.unknown_keys, 2 * en.unknown_keys);
        prop_assert_eq!(st.malformed_events, 0);
        prop_assert_eq!(st.extra_key_shapes_skipped, 0);
        prop_assert_eq!(st.map_batches, 2 * (b.shape == 3) as u64);
    }

    #[test]
    fn random_splits_reassemble(b in arb_batch(), thr in 4096usize..20000) {
        let (payload, _model, _) = encode(&b);
        let whole = decode_all(&mut Decoder::new(cfg(1 << 30)), &payload, 1 << 30);
        let whole: Vec<Data> = whole.into_iter().flat_map(|r| r.events).map(|e| e.data.unwrap()).collect();
        let mut dec = Decoder::new(cfg(thr));
        let parts = decode_all(&mut dec, &payload, thr);
        for r in &parts {
            prop_assert_eq!(r.timestamp, expected_ts(&b));
        }
        let mut it = parts.into_iter().flat_map(|r| r.events).map(|e| e.data.unwrap()).peekable();
        for w in whole {
            match w {
                Data::Stored(ws) => {
                    let mut got: Vec<KvBlock> = Vec::new();
                    let mut parent = ws.parent_block_hash;
                    while got.len() < ws.blocks.len() {
                        let Some(Data::Stored(p)) = it.next() else { panic!("missing store part") };
                        prop_assert!(!p.blocks.is_empty());
                        prop_assert_eq!(p.parent_block_hash, parent);
                        let same = KvBlocksStored { blocks: vec![], parent_block_hash: None, ..p.clone() };
                        let wsame = KvBlocksStored { blocks: vec![], parent_block_hash: None, ..ws.clone() };
                        prop_assert_eq!(same, wsame);
                        parent = Some(p.blocks.last().unwrap().block_hash);
                        got.extend(p.blocks);
                    }
                    prop_assert_eq!(got, ws.blocks);
                }
                Data::Removed(wr) => {
                    let mut got = Vec::new();
                    while got.len() < wr.block_hashes.len() {
                        let Some(Data::Removed(p)) = it.next() else { panic!("missing removal part") };
                        prop_assert!(!p.block_hashes.is_empty());
                        let same = KvBlocksRemoved { block_hashes: vec![], ..p.clone() };
                        prop_assert_eq!(same, KvBlocksRemoved { block_hashes: vec![], ..wr.clone() });
                        got.extend(p.block_hashes);
                    }
                    prop_assert_eq!(got, wr.block_hashes);
                }
                c => prop_assert_eq!(it.next(), Some(c)),
            }
        }
        prop_assert!(it.next().is_none());
    }
}
