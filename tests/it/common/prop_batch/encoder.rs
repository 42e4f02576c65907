//! The independent encoder: writes a [`Batch`] as msgpack with `rmp::encode`, in array or map
//! form, with random int/str/array widths, random unknown keys, tags and trailing elements, and
//! returns the model as the chosen form can represent it.

use super::{Batch, Ev, Item, Leaf, H};
use rmp::encode as e;

// ---------------------------------------------------------------- the independent encoder

/// Writes one map entry (key + value).
pub type FieldFn = Box<dyn Fn(&mut Enc)>;

pub struct Enc {
    pub b: Vec<u8>,
    pub rng: u64,
    pub unknown_keys: u64,
    pub unknown_tags: u64,
}

impl Enc {
    pub fn r(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }
    pub fn coin(&mut self, n: u64) -> bool {
        self.r() % n == 0
    }
    pub fn uint(&mut self, v: u64) {
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
    pub fn sint(&mut self, v: i64) {
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
    pub fn str(&mut self, s: &str) {
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
    pub fn opt_str(&mut self, s: &Option<String>) {
        match s {
            Some(s) => self.str(s),
            None => e::write_nil(&mut self.b).unwrap(),
        }
    }
    pub fn arr(&mut self, n: u32) {
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
    pub fn map(&mut self, n: u32) {
        if self.coin(3) {
            self.b.push(0xde);
            self.b.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            e::write_map_len(&mut self.b, n).unwrap();
        }
    }
    pub fn nil(&mut self) {
        e::write_nil(&mut self.b).unwrap();
    }
    pub fn hash(&mut self, h: &H) {
        match h {
            H::U(v) => self.uint(*v),
            H::I(v) => self.sint(*v),
            H::Bin(b) => {
                e::write_bin(&mut self.b, b).unwrap();
            }
        }
    }
    pub fn opt_hash(&mut self, h: &Option<H>) {
        match h {
            Some(h) => self.hash(h),
            None => self.nil(),
        }
    }
    pub fn opt_u(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }
    pub fn opt_i(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.sint(v),
            None => self.nil(),
        }
    }
    /// A random junk value (depth ≤ 3) for unknown keys/elements.
    pub fn junk(&mut self, depth: u32) {
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
    pub fn leaf(&mut self, l: &Leaf) {
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
    pub fn extra(&mut self, x: &Option<Vec<Option<Vec<Item>>>>) {
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
    pub fn s_(&mut self, v: String) {
        self.str(&v)
    }
    pub fn u_(&mut self, v: u32) {
        self.uint(v as u64)
    }
    pub fn x_(&mut self, v: Vec<Option<Vec<Item>>>) {
        self.extra(&Some(v))
    }
}

/// Array layouts of BlockStored (lengths incl. tag).
pub const STORE_LENS: [u32; 8] = [5, 6, 7, 8, 9, 10, 12, 12];

/// Encodes one event; returns the model as representable in the chosen form (None = unknown).
pub fn enc_event(en: &mut Enc, ev: &Ev, map: bool, lay: u8) -> Option<Ev> {
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
pub fn write_map_fields(en: &mut Enc, mut fields: Vec<FieldFn>) {
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

pub fn encode(b: &Batch) -> (Vec<u8>, Vec<Ev>, Enc) {
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

pub fn expected_ts(b: &Batch) -> f64 {
    match b.ts_form {
        0 => b.ts,
        1 => b.ts as f32 as f64,
        _ => b.ts.trunc(),
    }
}
