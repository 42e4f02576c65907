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

/// One engine service that carries `SubscribeKvEvents`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineService {
    /// Short name (`kvbridge subscribe --engine NAME`).
    pub engine: &'static str,
    /// Fully-qualified gRPC service name.
    pub service: &'static str,
    /// HTTP/2 path of its `SubscribeKvEvents` method.
    pub path: &'static str,
}

/// The four engine services on which `SubscribeKvEvents` is served, identically
/// (docs/smg-api.md §2). The one list of them: the server, the CLI and the bench read it, and a
/// test checks it against the generated servers.
pub const ENGINE_SERVICES: [EngineService; 4] = [
    EngineService {
        engine: "vllm",
        service: "vllm.grpc.engine.VllmEngine",
        path: "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents",
    },
    EngineService {
        engine: "sglang",
        service: "sglang.grpc.scheduler.SglangScheduler",
        path: "/sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents",
    },
    EngineService {
        engine: "tokenspeed",
        service: "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
        path: "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/SubscribeKvEvents",
    },
    EngineService {
        engine: "trtllm",
        service: "trtllm.TrtllmService",
        path: "/trtllm.TrtllmService/SubscribeKvEvents",
    },
];

/// The entry of [`ENGINE_SERVICES`] named `engine` (`vllm`, `sglang`, …).
pub fn engine_service(engine: &str) -> Option<&'static EngineService> {
    ENGINE_SERVICES.iter().find(|s| s.engine == engine)
}
