//! A ring file truncated under a reader is an error, not `SIGBUS`.
//!
//! Readers map the ring file read-only and never own it: anyone with write access to the file
//! can `ftruncate` it while a reader has it mapped, and the next touch of a page past the new end
//! raises `SIGBUS`, which kills the process (a `kvbridge tail`, a Python router, a C reader)
//! however carefully it checks what it reads. Checking the file's length before each access
//! would cost a system call per record and still leave a window between the check and the load.
//!
//! So the faults themselves are turned into data. Each reader mapping registers its address
//! range here. A process-wide `SIGBUS` handler, installed the first time a range is registered,
//! looks the faulting address up: inside a registered range, it maps one anonymous, zero-filled,
//! read-only page over the faulting page (`MAP_FIXED`), marks the range as faulted and returns,
//! so the load is retried and reads zeros. The reader checks the mark (one relaxed load) after
//! every read and before trusting any bytes, reports [`ReadOutcome::Truncated`] and from then on
//! never touches the mapping again. A fault anywhere else is not ours: the handler hands it to
//! whatever handler was installed before it, or restores the default action so that the retried
//! access kills the process exactly as it would have without this module.
//!
//! Everything the handler touches is a static of atomics (no allocation, no lock): it may run
//! on any thread, at any instruction. `mmap` is a plain system call; POSIX does not list it as
//! async-signal-safe, but it takes no user-space lock (the same approach as the JVM's handling
//! of faults in mapped buffers).
//!
//! [`ReadOutcome::Truncated`]: crate::ReadOutcome::Truncated

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

/// How many reader mappings can be guarded at once in one process. Past that, a mapping is
/// still usable but unguarded (a truncation under it is `SIGBUS`, as before this module).
const SLOTS: usize = 256;

/// One guarded address range. `end == 0` means free. A slot is claimed by CAS on `end` from 0
/// to a sentinel, then `start` and `faulted` are set and `end` published with `Release`; the
/// handler reads `end` with `Acquire` first, so it sees a consistent range or a free slot.
struct Slot {
    start: AtomicUsize,
    end: AtomicUsize,
    faulted: AtomicBool,
}

/// `end` of a slot being claimed or released; the handler skips a slot whose `end` is not above
/// it.
const CLAIMING: usize = 1;

#[allow(clippy::declare_interior_mutable_const)] // only used to initialise the array below
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};
static RANGES: [Slot; SLOTS] = [FREE; SLOTS];
static PAGE: AtomicUsize = AtomicUsize::new(4096);
static INSTALL: Once = Once::new();
/// Whether our handler is installed (it may not be, if `sigaction` failed).
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The `SIGBUS` action that was in place before ours, for faults that are not ours. Written
/// once, before our handler is installed; read only by the handler.
struct Previous(std::cell::UnsafeCell<std::mem::MaybeUninit<libc::sigaction>>);
// SAFETY: written exactly once inside `INSTALL.call_once`, before the handler that reads it is
// installed (so before any concurrent reader exists); read-only afterwards.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(std::cell::UnsafeCell::new(std::mem::MaybeUninit::zeroed()));

/// A registered mapping range. Drop it *before* unmapping the range.
#[derive(Debug)]
pub(crate) struct Guard {
    slot: Option<usize>,
}

impl Guard {
    /// Whether a page of the range faulted (the file is shorter than the mapping): the
    /// mapping's contents are no longer the file's and must not be used.
    pub(crate) fn faulted(&self) -> bool {
        self.slot
            .is_some_and(|s| RANGES[s].faulted.load(Ordering::Relaxed))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(s) = self.slot {
            let slot = &RANGES[s];
            slot.end.store(CLAIMING, Ordering::Release);
            slot.start.store(0, Ordering::Relaxed);
            slot.faulted.store(false, Ordering::Relaxed);
            slot.end.store(0, Ordering::Release);
        }
    }
}

/// Guards `[start, start + len)` (a reader's mapping) against truncation faults.
pub(crate) fn guard(start: *const u8, len: usize) -> Guard {
    INSTALL.call_once(install);
    let start = start as usize;
    if !INSTALLED.load(Ordering::Acquire) || len == 0 {
        return Guard { slot: None };
    }
    for (i, slot) in RANGES.iter().enumerate() {
        if slot
            .end
            .compare_exchange(0, CLAIMING, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            slot.start.store(start, Ordering::Relaxed);
            slot.faulted.store(false, Ordering::Relaxed);
            slot.end.store(start + len, Ordering::Release);
            return Guard { slot: Some(i) };
        }
    }
    Guard { slot: None }
}

fn install() {
    // SAFETY: sysconf has no memory arguments.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        PAGE.store(page as usize, Ordering::Relaxed);
    }
    // SAFETY: `sa` is a zeroed sigaction (a valid value) that we fill in; `sigemptyset` writes
    // only its mask. `PREVIOUS` is written here, before the handler that reads it exists (see
    // its `Sync` impl), and `sigaction` writes only through the two pointers it is given.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
        libc::sigemptyset(&mut sa.sa_mask);
        let prev = (*PREVIOUS.0.get()).as_mut_ptr();
        if libc::sigaction(libc::SIGBUS, &sa, prev) == 0 {
            INSTALLED.store(true, Ordering::Release);
        }
    }
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // Only a fault the kernel raised (not `kill -BUS`, whose si_code is ≤ 0) has an address.
    if code > 0 {
        for slot in RANGES.iter() {
            let end = slot.end.load(Ordering::Acquire);
            let start = slot.start.load(Ordering::Relaxed);
            if end > CLAIMING && start <= addr && addr < end {
                let page = PAGE.load(Ordering::Relaxed);
                let at = addr & !(page - 1);
                // SAFETY: `at` is a page inside a mapping this process made and still holds
                // (its `Guard`, which is dropped before the unmap, is registered). Replacing it
                // with an anonymous read-only page changes only what that reader sees there,
                // which it treats as lost from now on (`faulted`).
                let p = unsafe {
                    libc::mmap(
                        at as *mut libc::c_void,
                        page,
                        libc::PROT_READ,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                        -1,
                        0,
                    )
                };
                if p != libc::MAP_FAILED {
                    slot.faulted.store(true, Ordering::Relaxed);
                    return;
                }
                break;
            }
        }
    }
    // Not ours: what would have happened without this handler.
    // SAFETY: `PREVIOUS` was written before this handler was installed and is read-only now.
    // Calling the previous handler with the arguments we got is what the kernel would have
    // done; restoring the default action makes the retried access raise SIGBUS again, with the
    // default disposition (terminate with a core dump).
    unsafe {
        let prev = &*(*PREVIOUS.0.get()).as_ptr();
        let h = prev.sa_sigaction;
        if h == libc::SIG_DFL || h == libc::SIG_IGN {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigemptyset(&mut dfl.sa_mask);
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            if code <= 0 {
                // A sent signal is not retried by returning: send it again to ourselves.
                libc::raise(sig);
            }
        } else if prev.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(h);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(h);
            f(sig);
        }
    }
}
