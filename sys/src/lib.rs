//! The OS calls kvbridge needs that no safe binding offers, each behind a safe function with the
//! proof of its safety beside the call. Everything else goes through `rustix` (and the ring's own
//! calls live in `kvbridge-shm`); the `kvbridge` crate itself forbids `unsafe`.

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs, unreachable_pub)]

/// Returns the allocator's free pages to the system (glibc's `malloc_trim(0)`); elsewhere a
/// no-op. It walks the heap, so call it rarely and off the async workers.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer and only returns free pages of the
    // allocator's own heaps to the system; glibc makes it thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
