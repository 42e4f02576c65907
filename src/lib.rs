//! kvbridge: an inference engine's KV-cache events, decoded once, kept in a shared-memory ring,
//! and fanned out to many readers with resume by sequence number.
//!
//! Data flows one way, and the modules are named after the stages:
//!
//! ```text
//!   ingest  ──►  decode  ──►  ring (kvbridge-shm)  ──►  edges, each a reader of the ring
//!   ZMQ SUB      msgpack →     one writer, many
//!   per rank,    SMG protobuf  read-only readers
//!   replay       bytes, in     in other processes
//!   DEALER       place
//! ```
//!
//! The edges, each a reader of the ring:
//!
//! - [`fanout`] — gRPC `SubscribeKvEvents` on the four SMG paths.
//! - [`snapshot`] — the live block table (snapshots for subscribers from 0, checkpoints).
//! - [`proxy`] — sidecar mode, the engine's gRPC server behind the same port.
//! - [`sink`] — NATS JetStream.
//! - [`publish_zmq`] — the ring re-published on the engines' own ZMQ wire, for Dynamo and llm-d.
//! - the shared-memory readers in other processes (`kvbridge-shm`: Rust, Python, C;
//!   `kvbridge tail`).
//!
//! Beside the pipeline:
//!
//! - [`service`] — the running service: every stage and edge started in data-flow order and
//!   stopped in reverse, on one signal.
//! - [`config`] — flags + TOML.
//! - [`cli`] — the `kvbridge` command's product subcommands (the load generator and the simulated
//!   engine are the `kvbridge-tools` crate).
//! - [`metrics`] — Prometheus.
//! - [`health`] — upstream connections → `grpc.health.v1`.
//! - [`net`] — the listeners' accept loop and the gRPC handshake deadline.
//! - [`secrets`] — the TLS certificate and token, reloaded when they rotate.
//!
//! The wire formats are specified in docs/engine-wire.md (engine side) and docs/smg-api.md
//! (gateway side).

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod cli;
pub mod clock;
pub mod config;
pub mod decode;
pub mod fanout;
pub mod health;
pub mod ingest;
#[cfg(test)]
mod layers;
pub mod metrics;
pub mod net;
pub mod proto;
pub mod proxy;
pub mod publish_zmq;
pub mod ring;
pub mod secrets;
pub mod service;
pub mod sink;
pub mod snapshot;
