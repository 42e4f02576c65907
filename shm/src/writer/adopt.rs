//! Adopting the ring file a previous writer left: validate its header, walk and repair its
//! committed records, or retire it and say what to re-create it with.

use super::{map_rw, open_wake, Opened, Replaced, RingWriter};
use crate::error::ShmError;
use crate::layout::*;
use crate::map::{parse_header, Base, Geometry};
use crate::protocol::{Ring, WriterCursor};
use crate::sys;
use std::fs::File;
use std::path::Path;
use std::sync::atomic::Ordering;

/// Validate the locked file; adopt it or say what to re-create with.
pub(super) fn try_adopt(path: &Path, file: File, cap: u64, mode: u32) -> Result<Opened, ShmError> {
    let len = file.metadata().map_err(|e| ShmError::io(path, e))?.len();
    if len < HEADER_LEN {
        return Ok(Opened::Recreate {
            high_water: None,
            old: file,
            why: Replaced::Damaged(format!(
                "truncated: {len} bytes, shorter than the {HEADER_LEN}-byte header"
            )),
        });
    }
    let map = map_rw(path, &file)?;
    let base = Base::new(&map);
    let high_water = |b: Base<'_>| {
        if b.load(OFF_MAGIC) == MAGIC && b.load32(OFF_VERSION) == LAYOUT_VERSION {
            Some(
                b.load(OFF_NEWEST)
                    .max(b.load(OFF_SEQ_BASE).saturating_sub(1)),
            )
        } else {
            None
        }
    };
    // A retired file was already replaced; never bring it back to life.
    let why = match parse_header(path, base) {
        Ok(g) if g.cap != cap => Err(Replaced::Capacity {
            found: g.cap,
            requested: cap,
        }),
        Ok(_) if base.load32(OFF_STATE) == STATE_RETIRED => Err(Replaced::Retired),
        Ok(g) => Ok(g),
        Err(e) => Err(match e {
            ShmError::BadVersion { found, .. } => Replaced::Version { found },
            ShmError::BadMagic { found, .. } => {
                Replaced::Damaged(format!("not a kvbridge ring (first 8 bytes {found:#018x})"))
            }
            ShmError::TooSmall { len, need, .. } => {
                Replaced::Damaged(format!("truncated: {len} bytes, its header needs {need}"))
            }
            ShmError::Corrupt { reason, .. } => {
                Replaced::Damaged(format!("inconsistent header: {reason}"))
            }
            other => Replaced::Damaged(other.to_string()),
        }),
    };
    let geo = match why {
        Ok(g) => g,
        Err(why) => {
            let hw = high_water(base);
            retire(base);
            return Ok(Opened::Recreate {
                high_water: hw,
                old: file,
                why,
            });
        }
    };
    let ring = base.ring(&geo);
    let cur = match walk(&ring, &geo) {
        Ok(c) => c,
        Err(why) => {
            let hw = high_water(base);
            retire(base);
            return Ok(Opened::Recreate {
                high_water: hw,
                old: file,
                why: Replaced::Damaged(format!("records do not validate: {why}")),
            });
        }
    };
    // Adopt: publish the repaired cursors, claim the header.
    let o = Ordering::Release;
    ring.oldest.store(cur.oldest, o);
    ring.newest.store(cur.next_seq - 1, o);
    base.u64_at(OFF_HEARTBEAT_NS).store(sys::now_ns(), o);
    base.u64_at(OFF_PIDNS_INO).store(sys::pidns_ino(), o);
    base.u32_at(OFF_STATE).store(STATE_ACTIVE, o);
    base.u32_at(OFF_WRITER_PID).store(std::process::id(), o);
    let wake = open_wake(path, mode);
    Ok(Opened::Adopt(RingWriter {
        path: path.into(),
        file,
        map,
        geo,
        cur,
        adopted: true,
        replaced: None,
        truncated: None,
        wake,
    }))
}

/// Mark an old file as replaced and wake its sleepers so that they notice.
fn retire(b: Base<'_>) {
    // Only touch files that are kvbridge rings: a foreign file is left as is.
    if b.len >= HEADER_LEN as usize && b.load(OFF_MAGIC) == MAGIC {
        b.u32_at(OFF_STATE).store(STATE_RETIRED, Ordering::Release);
        let n = b.u32_at(OFF_NOTIFY);
        n.fetch_add(1, Ordering::Release);
        sys::futex_wake_all(n);
    }
}

/// Walk the committed records [head, tail) of a ring left by a dead writer;
/// return the cursor to continue with, or why the ring is unusable. Data past
/// `tail` (an uncommitted record) is ignored: it was never visible.
fn walk(ring: &Ring<'_>, g: &Geometry) -> Result<WriterCursor, &'static str> {
    let r = Ordering::Acquire;
    let (tail, head, intent) = (ring.tail.load(r), ring.head.load(r), ring.intent.load(r));
    let (newest, oldest) = (ring.newest.load(r), ring.oldest.load(r));
    let cap = g.cap;
    if head > tail || tail - head > cap || tail % 8 != 0 || head % 8 != 0 {
        return Err("head/tail out of order");
    }
    if intent < tail || intent > head + cap {
        return Err("overwrite horizon inconsistent with head/tail");
    }
    if oldest == 0 || oldest > newest + 2 {
        return Err("oldest/newest out of order");
    }
    let hdr = RECORD_HEADER_LEN as u64;
    // Pass 1: structure and contiguity.
    let mut first = None;
    let mut expected: Option<u64> = None;
    let mut p = head;
    let mut records: Vec<(u64, u64)> = Vec::new();
    while p < tail {
        let off = p & (cap - 1);
        let room = cap - off;
        if room < hdr {
            p += room;
            continue;
        }
        let w1 = ring.data[(off / 8 + 1) as usize].load(r);
        let (len, kind) = (w1 as u32 as usize, (w1 >> 32) as u32);
        if kind == KIND_PAD {
            if len as u64 + hdr != room {
                return Err("bad padding record");
            }
            p += room;
            continue;
        }
        if kind != KIND_RECORD || len > g.max_payload {
            return Err("bad record header");
        }
        let size = record_size(len);
        if off + size > cap || p + size > tail {
            return Err("record crosses the end of the area or the tail");
        }
        let seq = ring.data[(off / 8) as usize].load(r);
        if expected.is_some_and(|e| e != seq) || seq == 0 {
            return Err("sequence numbers not contiguous");
        }
        first.get_or_insert(seq);
        expected = Some(seq + 1);
        records.push((seq, p));
        p += size;
    }
    if p != tail {
        return Err("walk overran the tail");
    }
    let n = match expected {
        Some(e) => e - 1,
        None => newest,
    };
    // A writer killed between its `tail` and `newest` stores leaves n = N + 1.
    if n != newest && n != newest + 1 {
        return Err("newest does not match the records");
    }
    let o = oldest
        .max(first.unwrap_or(n + 1))
        .max((n + 1).saturating_sub(g.slots))
        .min(n + 1);
    // Pass 2: repair index slots of retained records (identical values are
    // left alone so concurrent readers never see a transient change).
    for &(seq, pos) in records.iter().filter(|(s, _)| *s >= o) {
        let slot = &ring.index[(seq & (g.slots - 1)) as usize];
        if slot.load(r) != pos {
            slot.store(pos, Ordering::Release);
        }
    }
    Ok(WriterCursor {
        tail,
        head,
        oldest: o,
        intent,
        next_seq: n + 1,
    })
}
