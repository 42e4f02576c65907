//! Atomics shim: the protocol in [`crate::protocol`] is written once and runs
//! over `std` atomics in production and over `loom` atomics under `--cfg loom`,
//! where loom explores every interleaving (and every stale-read the C++11
//! memory model allows for the orderings we chose).

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU64, Ordering};

#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicU64, Ordering};
