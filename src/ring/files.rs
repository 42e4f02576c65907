//! A ring's files, named and removed in one place. Beside the ring file `<ring>` kvbridge keeps:
//!
//! | file | written by | what |
//! |---|---|---|
//! | `<ring>` | the ring writer (`kvbridge-shm`) | the ring itself (shm `LAYOUT.md`) |
//! | `<ring>.wake` | the ring writer | the futex waiter count readers sleep on |
//! | `<ring>.tmp.<pid>.<id>` | the ring writer, while creating a ring | renamed to `<ring>` when complete |
//! | `<ring>.snapshot` | the snapshot table (`crate::snapshot`) | the table's checkpoint (src/snapshot/LAYOUT.md) |
//! | `<ring>.snapshot.tmp.<pid>` | the snapshot table, while writing a checkpoint | renamed over `<ring>.snapshot` |
//!
//! and with `--dp-mode metadata` one ring per rank, `<shm>-rank<r>`, with the same files beside
//! it. Every name is derived here and every removal happens here, so that a ring removed on a
//! reset or by the demo leaves nothing behind on tmpfs (which is memory).

use std::io;
use std::path::{Path, PathBuf};

/// The files of one ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingFiles {
    ring: PathBuf,
}

impl RingFiles {
    /// The files of the ring at `ring` (the merged ring: `--shm`).
    pub fn new(ring: impl Into<PathBuf>) -> Self {
        RingFiles { ring: ring.into() }
    }

    /// The files of rank `rank`'s own ring beside the merged ring `shm`: `<shm>-rank<r>`.
    pub fn rank(shm: &Path, rank: u32) -> Self {
        RingFiles::new(suffixed(shm, &format!("-rank{rank}")))
    }

    /// The merged ring at `shm` and every per-rank ring found beside it (ranks of earlier runs
    /// included), in path order.
    pub fn with_rank_rings_beside(shm: &Path) -> Vec<RingFiles> {
        let mut rings = vec![RingFiles::new(shm)];
        if let (Some(name), Some(dir)) = (shm.file_name().and_then(|n| n.to_str()), shm.parent()) {
            let prefix = format!("{name}-rank");
            let ranks = std::fs::read_dir(dir_or_cwd(dir))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| {
                    let n = e.file_name();
                    let rest = n.to_str()?.strip_prefix(&prefix)?;
                    let digits = rest.split(|c: char| !c.is_ascii_digit()).next()?;
                    digits.parse::<u32>().ok()
                });
            rings.extend(ranks.map(|r| RingFiles::rank(shm, r)));
        }
        rings.sort_by(|a, b| a.ring.cmp(&b.ring));
        rings.dedup();
        rings
    }

    /// The ring file.
    pub fn path(&self) -> &Path {
        &self.ring
    }

    /// The futex side file ([`kvbridge_shm::wake_path`]).
    pub fn wake(&self) -> PathBuf {
        kvbridge_shm::wake_path(&self.ring)
    }

    /// The snapshot table's checkpoint: `<ring>.snapshot`.
    pub fn checkpoint(&self) -> PathBuf {
        suffixed(&self.ring, ".snapshot")
    }

    /// Removes the ring with everything kvbridge keeps beside it: the ring and its wake file
    /// ([`kvbridge_shm::remove_ring`]), the checkpoint, and any checkpoint a killed writer left
    /// half written. A checkpoint without its ring is useless (it restores a table only
    /// together with the ring's tail). A file already gone is not an error; the first other
    /// error is returned after every removal was tried. Call it after the ring's writer closed.
    pub fn remove(&self) -> io::Result<()> {
        let ring = kvbridge_shm::remove_ring(&self.ring);
        let cp = self.checkpoint();
        let checkpoint = match std::fs::remove_file(&cp) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            r => r,
        };
        remove_tmps_of(&cp);
        ring.and(checkpoint)
    }

    /// Removes what a crashed run left that nothing uses any more
    /// ([`kvbridge_shm::remove_stale_files`]: a wake file without its ring, a ring a writer died
    /// creating), and returns what was removed. Runs before the ring is opened.
    pub fn remove_stale(&self) -> io::Result<Vec<kvbridge_shm::StaleFile>> {
        kvbridge_shm::remove_stale_files(&self.ring)
    }
}

/// The temporary name `file` is written under by this process before it is renamed into place:
/// `<file>.tmp.<pid>`.
pub fn tmp_of(file: &Path) -> PathBuf {
    suffixed(file, &format!(".tmp.{}", std::process::id()))
}

/// Removes every `<file>.tmp.*` left by a writer that was killed before its rename.
pub fn remove_tmps_of(file: &Path) {
    let (Some(dir), Some(name)) = (file.parent(), file.file_name().and_then(|n| n.to_str())) else {
        return;
    };
    let prefix = format!("{name}.tmp.");
    if let Ok(rd) = std::fs::read_dir(dir_or_cwd(dir)) {
        for e in rd.flatten() {
            if e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(&prefix))
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

fn suffixed(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// A relative file's directory: `""` is the current one.
fn dir_or_cwd(dir: &Path) -> &Path {
    if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_removal_cover_every_file_beside_a_ring() {
        let dir = tempfile::tempdir().unwrap();
        let shm = dir.path().join("kvb");
        let merged = RingFiles::new(&shm);
        let r1 = RingFiles::rank(&shm, 1);
        assert_eq!(r1.path(), dir.path().join("kvb-rank1"));
        assert_eq!(merged.checkpoint(), dir.path().join("kvb.snapshot"));
        assert_eq!(merged.wake(), dir.path().join("kvb.wake"));
        for f in [
            shm.clone(),
            merged.wake(),
            merged.checkpoint(),
            suffixed(&merged.checkpoint(), ".tmp.999999"),
            r1.path().to_path_buf(),
        ] {
            std::fs::write(&f, b"x").unwrap();
        }
        assert_eq!(
            RingFiles::with_rank_rings_beside(&shm),
            vec![merged.clone(), r1.clone()]
        );
        merged.remove().unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left, ["kvb-rank1"], "only the other ring is left");
        r1.remove().unwrap();
        r1.remove().unwrap();
        assert_eq!(
            tmp_of(&shm),
            suffixed(&shm, &format!(".tmp.{}", std::process::id()))
        );
    }
}
