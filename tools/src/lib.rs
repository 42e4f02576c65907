//! kvbridge's tooling, kept apart from the product library: the built-in engine ([`sim`]), the
//! load generator and measurer ([`bench`](mod@bench)), and the `kvbridge` subcommands that run
//! them ([`cli`]: `demo`, `bench`, `bench-checkpoints` and the helper processes `bench` starts).
//!
//! It uses the bridge only through the `kvbridge` library's public API; the `kvbridge` binary
//! (`cli/`) puts these subcommands after the product's on one command line.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod bench;
pub mod cli;
pub mod sim;
