//! STUB: the API contract of the shm issue; replaced by the real crate on merge.
#![allow(unused_variables, missing_docs)]
use std::path::Path;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("stub")]
    Stub,
    #[error("record of {len} bytes is larger than the ring's maximum {max}")]
    RecordTooLarge { len: usize, max: usize },
}
#[derive(Debug, thiserror::Error)]
pub enum SeekError {
    #[error("too old")]
    TooOld {
        requested: u64,
        oldest: u64,
        newest: u64,
    },
    #[error("future")]
    Future { requested: u64, newest: u64 },
}
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordMeta {
    pub dp_rank: u32,
    pub upstream_seq: u64,
    pub flags: u32,
    pub ingest_ns: u64,
}
#[derive(Clone, Debug)]
pub struct WriterOptions {
    pub capacity: usize,
    pub seq_base: Option<u64>,
    pub group_read: bool,
}
impl Default for WriterOptions {
    fn default() -> Self {
        Self {
            capacity: 64 << 20,
            seq_base: None,
            group_read: false,
        }
    }
}
pub struct RingWriter;
impl RingWriter {
    pub fn open(path: &Path, opts: &WriterOptions) -> Result<RingWriter, ShmError> {
        unimplemented!()
    }
    pub fn ring_id(&self) -> u64 {
        unimplemented!()
    }
    pub fn adopted(&self) -> bool {
        unimplemented!()
    }
    pub fn next_seq(&self) -> u64 {
        unimplemented!()
    }
    pub fn oldest(&self) -> u64 {
        unimplemented!()
    }
    pub fn newest(&self) -> u64 {
        unimplemented!()
    }
    pub fn max_record_len(&self) -> usize {
        unimplemented!()
    }
    pub fn reserve(&mut self, len: usize) -> Result<Reservation<'_>, ShmError> {
        unimplemented!()
    }
    pub fn heartbeat(&self) {
        unimplemented!()
    }
}
pub struct Reservation<'a>(&'a mut [u8]);
impl Reservation<'_> {
    pub fn seq(&self) -> u64 {
        unimplemented!()
    }
    pub fn buf(&mut self) -> &mut [u8] {
        unimplemented!()
    }
    pub fn commit(self, meta: RecordMeta) {
        unimplemented!()
    }
}
#[derive(Clone)]
pub struct RingReader;
impl RingReader {
    pub fn open(path: &Path) -> Result<RingReader, ShmError> {
        unimplemented!()
    }
    pub fn ring_id(&self) -> u64 {
        unimplemented!()
    }
    pub fn oldest(&self) -> u64 {
        unimplemented!()
    }
    pub fn newest(&self) -> u64 {
        unimplemented!()
    }
    pub fn position(&self) -> u64 {
        unimplemented!()
    }
    pub fn seek(&mut self, seq: u64) -> Result<(), SeekError> {
        unimplemented!()
    }
    pub fn next(&mut self) -> ReadOutcome<'_> {
        unimplemented!()
    }
    pub fn next_blocking(&mut self, timeout: Duration) -> ReadOutcome<'_> {
        unimplemented!()
    }
    pub fn writer_alive(&self) -> bool {
        unimplemented!()
    }
}
pub enum ReadOutcome<'a> {
    Record(RecordView<'a>),
    Empty,
    Lapped { missed: u64, resume_at: u64 },
    RingReset { new_ring_id: u64 },
    WriterGone,
}
pub struct RecordView<'a>(&'a [u8]);
impl RecordView<'_> {
    pub fn seq(&self) -> u64 {
        unimplemented!()
    }
    pub fn meta(&self) -> RecordMeta {
        unimplemented!()
    }
    pub fn payload(&self) -> &[u8] {
        unimplemented!()
    }
    pub fn is_intact(&self) -> bool {
        unimplemented!()
    }
    pub fn copy_to(&self, out: &mut Vec<u8>) -> bool {
        unimplemented!()
    }
}
