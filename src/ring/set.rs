//! Every ring one bridge writes, opened together: the merged ring at `--shm` and, with
//! `--dp-mode metadata`, one ring per DP rank beside it ([`RingFiles::rank`]).
//!
//! Opening the set is all-or-nothing: a ring this start created (rather than adopted) is removed
//! again, with everything beside it, if a later ring — or a later part of the service — fails,
//! so that a failed start leaves nothing on tmpfs (which is memory).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvbridge_shm::WriterOptions;

use super::{Recovered, RingError, RingFiles, RingHub, RingMetrics};

/// The rings of one bridge.
pub struct RingSet {
    /// The merged ring: every rank's batches under one counter.
    pub merged: Arc<RingHub>,
    /// What the merged ring held when it was opened (each rank's last batch, writer notes).
    pub recovered: Recovered,
    /// Rank r's own ring at index r (`--dp-mode metadata`; empty otherwise).
    pub rank_hubs: Vec<Arc<RingHub>>,
    /// Whether rank r's ring was adopted, at index r.
    pub rank_adopted: Vec<bool>,
    /// The engine DP ranks ingest reads, in `--zmq` order.
    pub ingest_ranks: Vec<u32>,
    shm: PathBuf,
    created: Vec<RingFiles>,
}

impl RingSet {
    /// Opens the merged ring at `shm` and, when `per_rank`, one ring per rank of `ingest_ranks`
    /// beside it; first removes what earlier runs left of them ([`RingFiles::remove_stale`]).
    /// On an error, the rings opened so far that this call created are removed again.
    pub fn open(
        shm: &Path,
        ingest_ranks: Vec<u32>,
        per_rank: bool,
        opts: &WriterOptions,
        metrics: &RingMetrics,
    ) -> Result<RingSet, RingError> {
        remove_stale_ring_files(shm);
        let mut created = Vec::new();
        let opened = open_all(shm, &ingest_ranks, per_rank, opts, metrics, &mut created);
        match opened {
            Ok((merged, recovered, rank_hubs, rank_adopted)) => {
                tracing::info!(path = %shm.display(), adopted = recovered.adopted,
                    window = ?merged.window(), "ring ready");
                Ok(RingSet {
                    merged,
                    recovered,
                    rank_hubs,
                    rank_adopted,
                    ingest_ranks,
                    shm: shm.to_path_buf(),
                    created,
                })
            }
            Err(e) => {
                remove_all(&created);
                Err(e)
            }
        }
    }

    /// The merged ring's path (`--shm`, or derived from the gRPC port).
    pub fn path(&self) -> &Path {
        &self.shm
    }

    /// The files of rank `rank`'s own ring.
    pub fn rank_files(&self, rank: u32) -> RingFiles {
        RingFiles::rank(&self.shm, rank)
    }

    /// Every ring, the merged one first.
    pub fn hubs(&self) -> Vec<Arc<RingHub>> {
        std::iter::once(self.merged.clone())
            .chain(self.rank_hubs.iter().cloned())
            .collect()
    }

    /// Every ring with the last token of its name on the outputs that name rings (`merged`, or
    /// the rank number).
    pub fn named(&self) -> Vec<(String, Arc<RingHub>)> {
        let mut rings = vec![("merged".to_string(), self.merged.clone())];
        for (hub, r) in self.rank_hubs.iter().zip(&self.ingest_ranks) {
            rings.push((r.to_string(), hub.clone()));
        }
        rings
    }

    /// Wakes every in-process reader of every ring (at shutdown, so that they see the stop).
    pub fn wake_all(&self) {
        for h in std::iter::once(&self.merged).chain(&self.rank_hubs) {
            h.wake_all();
        }
    }

    /// Removes the rings this start created (not the ones it adopted), with their files: for a
    /// start that failed after the rings were opened. Call after their writers are gone.
    pub fn remove_created(&self) {
        remove_all(&self.created);
    }
}

type Opened = (Arc<RingHub>, Recovered, Vec<Arc<RingHub>>, Vec<bool>);

fn open_all(
    shm: &Path,
    ingest_ranks: &[u32],
    per_rank: bool,
    opts: &WriterOptions,
    metrics: &RingMetrics,
    created: &mut Vec<RingFiles>,
) -> Result<Opened, RingError> {
    let (merged, recovered) = RingHub::open("merged", shm, opts, metrics)?;
    if !recovered.adopted {
        created.push(RingFiles::new(shm));
    }
    let mut rank_hubs = Vec::new();
    let mut rank_adopted = Vec::new();
    if per_rank {
        for &rank in ingest_ranks {
            let files = RingFiles::rank(shm, rank);
            let (hub, rec) = RingHub::open(&format!("rank-{rank}"), files.path(), opts, metrics)?;
            if !rec.adopted {
                created.push(files);
            }
            rank_adopted.push(rec.adopted);
            rank_hubs.push(hub);
        }
    }
    Ok((merged, recovered, rank_hubs, rank_adopted))
}

fn remove_all(created: &[RingFiles]) {
    for files in created {
        if let Err(e) = files.remove() {
            tracing::warn!(path = %files.path().display(), error = %e,
                "cannot remove the ring this failed start created");
        }
    }
}

/// Removes leftovers of this bridge's rings from earlier runs (see
/// [`kvbridge_shm::remove_stale_files`]): a `.wake` file whose ring was removed, a ring file a
/// crashed writer was still creating. Covers the merged ring `<shm>` and every per-rank ring
/// `<shm>-rank<r>` found beside it (ranks of earlier runs included). Runs before any ring is
/// opened.
fn remove_stale_ring_files(shm: &Path) {
    for ring in RingFiles::with_rank_rings_beside(shm) {
        match ring.remove_stale() {
            Ok(removed) => {
                for f in removed {
                    tracing::info!(path = %f.path.display(), reason = f.reason, "removed a stale ring file");
                }
            }
            Err(e) => {
                tracing::warn!(ring = %ring.path().display(), error = %e, "cannot look for stale ring files")
            }
        }
    }
}
