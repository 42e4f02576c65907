//! Generated protobuf types for the SMG messages (`proto/`), used by clients, tests and the
//! `subscribe` command. The server never builds these structs on its hot path: the decoder
//! writes the same wire encoding directly into ring records.

// Modules mirror the protobuf packages, because generated code refers across packages by
// relative paths (`super::super::smg::grpc::common`).
#[allow(missing_docs, clippy::all)]
pub mod smg {
    pub mod grpc {
        pub mod common {
            tonic::include_proto!("smg.grpc.common");
        }
    }
}
#[allow(missing_docs, clippy::all)]
pub mod sglang {
    pub mod grpc {
        pub mod scheduler {
            tonic::include_proto!("sglang.grpc.scheduler");
        }
    }
}
#[allow(missing_docs, clippy::all)]
pub mod vllm {
    pub mod grpc {
        pub mod engine {
            tonic::include_proto!("vllm.grpc.engine");
        }
    }
}
#[allow(missing_docs, clippy::all)]
pub mod tokenspeed {
    pub mod grpc {
        pub mod scheduler {
            tonic::include_proto!("tokenspeed.grpc.scheduler");
        }
    }
}
#[allow(missing_docs, clippy::all)]
pub mod trtllm {
    tonic::include_proto!("trtllm");
}

/// `smg.grpc.common`: the KV-event messages.
pub use smg::grpc::common;

/// The encoded `FileDescriptorSet` of `proto/`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/kvbridge_descriptor.bin"));

/// The four HTTP/2 paths on which `SubscribeKvEvents` is served, identically.
pub const SUBSCRIBE_PATHS: [&str; 4] = [
    "/sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents",
    "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/SubscribeKvEvents",
    "/trtllm.TrtllmService/SubscribeKvEvents",
];
