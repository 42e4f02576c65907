//! kvbridge: an inference engine's KV-cache events, decoded once, kept in a shared-memory ring,
//! and fanned out to many readers with resume by sequence number.
//!
//! Data flows one way, and the modules are named after the stages:
//!
//! ```text
//!   ingest  ──►  decode  ──►  ring (kvbridge-shm)  ──►  fanout (gRPC)  /  local readers (tail)
//!   ZMQ SUB      msgpack →     one writer, many           SubscribeKvEvents on the
//!   per rank,    SMG protobuf  read-only readers          four SMG paths
//!   replay       bytes, in     in other processes
//!   DEALER       place
//! ```
//!
//! Beside the pipeline: [`config`] (flags + TOML), [`cli`] (the `kvbridge` command's product
//! subcommands; the load generator and the simulated engine are the `kvbridge-tools` crate),
//! [`metrics`] (Prometheus), [`health`] (upstream connections → `grpc.health.v1`), [`net`]
//! (the listeners' accept loop and the gRPC handshake deadline) and [`secrets`] (the TLS
//! certificate and token, reloaded when they rotate). The wire
//! formats are specified in docs/engine-wire.md (engine side) and
//! docs/smg-api.md (gateway side).

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
pub mod sink;
pub mod snapshot;
