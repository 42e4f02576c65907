//! Thin, audited wrappers over the few syscalls the ring needs.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Nanoseconds since the Unix epoch (CLOCK_REALTIME, vDSO, no syscall).
pub(crate) fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime only writes it.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Coarse nanoseconds since the Unix epoch (CLOCK_REALTIME_COARSE: a few ns,
/// jiffy resolution) — plenty for a heartbeat judged at 250 ms granularity.
pub(crate) fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime only writes it.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Try to take the exclusive writer lock without blocking. The kernel drops
/// it when the last descriptor of the open file description is closed, which
/// includes the holder's death by SIGKILL.
pub(crate) fn try_lock_exclusive(f: &std::fs::File) -> io::Result<bool> {
    // SAFETY: flock on a descriptor we own; no memory is passed.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Allocate the file's blocks now, so that a full tmpfs fails here with
/// ENOSPC instead of SIGBUS on first touch of the mapping.
pub(crate) fn fallocate(f: &std::fs::File, len: u64) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor we own.
    let r = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len as libc::off_t) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(r))
    }
}

/// Inode of this process's pid namespace (0 if unknown).
pub(crate) fn pidns_ino() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino())
        .unwrap_or(0)
}

/// `Some(false)` when `pid` certainly does not exist, `Some(true)` when it
/// exists, `None` when we cannot tell.
pub(crate) fn pid_exists(pid: u32) -> Option<bool> {
    if pid == 0 || pid > i32::MAX as u32 {
        return None;
    }
    // SAFETY: signal 0 performs only the existence/permission check.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if r == 0 {
        return Some(true);
    }
    match io::Error::last_os_error().raw_os_error() {
        Some(libc::ESRCH) => Some(false),
        Some(libc::EPERM) => Some(true),
        _ => None,
    }
}

/// A random, non-zero ring id.
pub(crate) fn random_u64() -> u64 {
    let mut v: u64 = 0;
    // SAFETY: getrandom writes at most 8 bytes into `v`, which is 8 bytes.
    let n = unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, 0) };
    if n != 8 {
        v = now_ns() ^ ((std::process::id() as u64) << 32);
    }
    if v == 0 {
        1
    } else {
        v
    }
}

/// FUTEX_WAIT (shared, i.e. *without* FUTEX_PRIVATE_FLAG: the key is the
/// file page, so waiters in other processes match) while `*word == expected`.
/// Works on a read-only mapping: the kernel only reads the word.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 that stays mapped for the call
    // (the borrow outlives it); `ts` is a valid relative timeout. The kernel
    // reads the word and may sleep; it writes no user memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// FUTEX_WAKE every waiter on `word` (shared futex, see [`futex_wait`]).
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32 in a live mapping; FUTEX_WAKE
    // does not access user memory beyond resolving the key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// The design rests on this: FUTEX_WAIT (shared) on a PROT_READ mapping
    /// works, and a FUTEX_WAKE through another (RW) mapping of the same file
    /// page wakes it.
    #[test]
    fn futex_wait_on_read_only_mapping() {
        let dir = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .unwrap();
        let p = dir.path().join("futex");
        std::fs::write(&p, [0u8; 4096]).unwrap();
        let rw_file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        // SAFETY: test-private file, accessed only through atomics.
        let rw = unsafe { memmap2::MmapMut::map_mut(&rw_file) }.unwrap();
        let ro_file = std::fs::File::open(&p).unwrap();
        // SAFETY: as above; read-only mapping.
        let ro = unsafe { memmap2::Mmap::map(&ro_file) }.unwrap();
        let waiter = std::thread::spawn(move || {
            // SAFETY: page-aligned mapping of 4096 bytes; offset 0 is aligned.
            let word = unsafe { &*(ro.as_ptr() as *const AtomicU32) };
            let t = Instant::now();
            futex_wait(word, 0, Duration::from_secs(5));
            t.elapsed()
        });
        std::thread::sleep(Duration::from_millis(150));
        // SAFETY: as above, through the RW mapping.
        let word = unsafe { &*(rw.as_ptr() as *const AtomicU32) };
        word.store(1, std::sync::atomic::Ordering::SeqCst);
        futex_wake_all(word);
        let waited = waiter.join().unwrap();
        // < 100 ms would mean FUTEX_WAIT failed at once (e.g. EFAULT on a
        // read-only page); ~5 s would mean the wake did not reach it.
        assert!(waited >= Duration::from_millis(100), "{waited:?}");
        assert!(waited < Duration::from_secs(3), "{waited:?}");
    }
}
