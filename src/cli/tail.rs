//! `kvbridge tail`: reads the ring file directly, from another process, without a socket.

use std::path::PathBuf;
use std::time::Duration;

use kvbridge_shm::{ReadOutcome, RingReader, SeekError};

use super::{BatchPrinter, CliError};

/// `kvbridge tail` flags.
#[derive(clap::Args, Debug)]
pub struct TailArgs {
    /// Ring file written by `kvbridge serve`.
    #[arg(long, value_name = "PATH")]
    shm: PathBuf,
    /// Resume cursor S, as for `subscribe`: 0 = oldest retained; S > 0 = records after S.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Stop after this many records.
    #[arg(long)]
    count: Option<u64>,
    /// Prefix each line with the record's ring metadata (seq, rank, engine seq, latency).
    #[arg(long)]
    meta: bool,
    /// With `--from 0`: first the snapshot chunks of the checkpoint beside the ring (the live
    /// block table at its cut N), then the ring from N + 1.
    #[arg(long)]
    snapshot: bool,
}

pub(super) fn run(a: TailArgs) -> Result<(), CliError> {
    let mut reader = RingReader::open(&a.shm)
        .map_err(|e| CliError::Setup(format!("--shm {}: {e}", a.shm.display())))?;
    let printer = BatchPrinter::new();
    let mut seen = 0u64;
    let mut target = if a.from == 0 {
        reader.oldest()
    } else {
        a.from + 1
    };
    if a.snapshot && a.from == 0 {
        let chunks = crate::snapshot::from_checkpoint(&a.shm)
            .map_err(|e| CliError::Failed(format!("--snapshot: {e}")))?;
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        for c in chunks
            .chunks
            .iter()
            .take(a.count.unwrap_or(u64::MAX) as usize)
        {
            let json = printer.to_json(c).map_err(CliError::Failed)?;
            if writeln!(out, "{json}").and_then(|_| out.flush()).is_err() {
                return Ok(());
            }
            seen += 1;
        }
        target = chunks.cut + 1;
    }
    reader.seek(target).map_err(|e| seek_error(&a, target, e))?;
    let mut buf = Vec::new();
    let mut gone_reported = false;
    use std::io::Write;
    let stdout = std::io::stdout();
    while a.count.is_none_or(|c| seen < c) {
        match reader.next_blocking(Duration::from_millis(500)) {
            ReadOutcome::Record(v) => {
                let (seq, meta) = (v.seq(), v.meta());
                if !v.copy_to(&mut buf) {
                    continue; // overwritten while copying; the next read reports the lap
                }
                let json = printer.to_json(&buf).map_err(CliError::Failed)?;
                let mut out = stdout.lock();
                let r = if a.meta {
                    let lat_us =
                        crate::clock::unix_nanos().saturating_sub(meta.ingest_ns) as f64 / 1e3;
                    writeln!(
                        out,
                        "{{\"seq\":{seq},\"rank\":{},\"engineSeq\":{},\"flags\":{},\"ageUs\":{lat_us:.1},\"batch\":{json}}}",
                        meta.dp_rank, meta.upstream_seq, meta.flags
                    )
                } else {
                    writeln!(out, "{json}")
                };
                if r.and_then(|_| out.flush()).is_err() {
                    return Ok(());
                }
                gone_reported = false;
                seen += 1;
            }
            ReadOutcome::Empty => {}
            ReadOutcome::Lapped { missed, resume_at } => {
                eprintln!("kvbridge tail: lapped by the writer: {missed} records missed, resuming at {resume_at}");
            }
            ReadOutcome::Corrupt { seq, resume_at } => {
                eprintln!("kvbridge tail: corrupt record {seq} (checksum mismatch or damaged header; the ring file was modified outside its writer): skipped, resuming at {resume_at}");
            }
            ReadOutcome::WriterGone => {
                if !gone_reported {
                    eprintln!(
                        "kvbridge tail: the ring's writer is gone; waiting for it to come back"
                    );
                    gone_reported = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            ReadOutcome::Truncated => {
                return Err(CliError::Failed(format!(
                    "--shm {}: the ring file was truncated while it was being read (something other than its writer shrank it)",
                    a.shm.display()
                )));
            }
            ReadOutcome::RingReset { new_ring_id } => {
                eprintln!("kvbridge tail: the ring was re-created (id {new_ring_id:#x}); reading it from its oldest record");
                reader = RingReader::open(&a.shm)
                    .map_err(|e| CliError::Failed(format!("--shm {}: {e}", a.shm.display())))?;
            }
        }
    }
    Ok(())
}

/// The error for a ring that cannot be read from `target`, the record after `--from` (or, with
/// `--snapshot`, after the checkpoint's cut).
fn seek_error(a: &TailArgs, target: u64, e: SeekError) -> CliError {
    match e {
        SeekError::TooOld { oldest, newest, .. } if a.snapshot => CliError::Failed(format!(
            "--snapshot: the ring no longer holds the record after the checkpoint's cut {}              (window [{oldest}, {newest}]); run it again",
            target - 1
        )),
        SeekError::TooOld { oldest, newest, .. } => CliError::Failed(format!(
            "--from {}: older than the retained window [{oldest}, {newest}]",
            a.from
        )),
        SeekError::Future { newest, .. } => {
            CliError::Failed(format!("--from {}: ahead of newest {newest}", a.from))
        }
    }
}
