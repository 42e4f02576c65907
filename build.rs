//! Compiles `proto/` with protox (a pure-Rust protobuf compiler), so neither a developer nor CI
//! needs `protoc`. proto3 `optional` fields (used throughout the SMG superset) need protoc ≥ 3.15,
//! which a fresh machine does not have.
//!
//! It generates the messages and the four clients (tests, `kvbridge subscribe`). No servers: the
//! one call is served by hand (`src/fanout/service.rs`), since its responses are records the
//! decoder encoded once at ingest and the ring framed once at commit.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/smg/grpc/common.proto",
        "proto/services/sglang_scheduler.proto",
        "proto/services/vllm_engine.proto",
        "proto/services/tokenspeed_scheduler.proto",
        "proto/services/trtllm_service.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // The descriptor set also feeds gRPC server reflection and canonical JSON output.
    std::fs::write(
        out.join("kvbridge_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
