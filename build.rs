//! Compiles `proto/` with protox (a pure-Rust protobuf compiler), so neither a developer nor CI
//! needs `protoc`. proto3 `optional` fields (used throughout the SMG superset) need protoc ≥ 3.15,
//! which a fresh machine does not have.
//!
//! Two generations from one descriptor set:
//! - `OUT_DIR/*.rs`: the messages and the four clients (tests, `kvbridge subscribe`);
//! - `OUT_DIR/server/*.rs`: the four servers, with `KvEventBatch` mapped to
//!   `crate::fanout::EncodedBatch` — bytes the decoder already encoded once at ingest, which the
//!   server copies to the socket as they are (no per-subscriber re-encode).
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
        .compile_fds(fds.clone())?;

    let server_out = out.join("server");
    std::fs::create_dir_all(&server_out)?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(false)
        .out_dir(&server_out)
        .extern_path(
            ".smg.grpc.common.KvEventBatch",
            "crate::fanout::EncodedBatch",
        )
        .extern_path(".smg.grpc.common", "crate::proto::common")
        .compile_fds(fds)?;
    Ok(())
}
