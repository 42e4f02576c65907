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
    /// Its other methods, as SMG's published stubs define them (PyPI `smg-grpc-proto` 0.4.28;
    /// `tests/it/interop.rs` checks this list against the package): the calls a sidecar forwards
    /// to the engine, each a `method` label of `kvbridge_proxy_calls_total` from the start.
    pub methods: &'static [&'static str],
}

/// The four engine services on which `SubscribeKvEvents` is served, identically
/// (docs/smg-api.md §2). The one list of them: the server, the CLI and the bench read it, and a
/// test checks it against the generated servers.
pub const ENGINE_SERVICES: [EngineService; 4] = [
    EngineService {
        engine: "vllm",
        service: "vllm.grpc.engine.VllmEngine",
        path: "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents",
        methods: &[
            "Generate",
            "Embed",
            "HealthCheck",
            "FlushCache",
            "StartProfile",
            "StopProfile",
            "Abort",
            "GetModelInfo",
            "GetServerInfo",
            "GetLoads",
            "GetTokenizer",
        ],
    },
    EngineService {
        engine: "sglang",
        service: "sglang.grpc.scheduler.SglangScheduler",
        path: "/sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents",
        methods: &[
            "Generate",
            "Embed",
            "HealthCheck",
            "Abort",
            "GetModelInfo",
            "GetServerInfo",
            "GetLoads",
            "FlushCache",
            "StartProfile",
            "StopProfile",
            "GetTokenizer",
            "LoadLoRAAdapter",
            "UnloadLoRAAdapter",
            "ListLoadedLoRAAdapters",
        ],
    },
    EngineService {
        engine: "tokenspeed",
        service: "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
        path: "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/SubscribeKvEvents",
        methods: &[
            "Generate",
            "HealthCheck",
            "Abort",
            "GetModelInfo",
            "GetServerInfo",
            "GetLoads",
            "FlushCache",
            "StartProfile",
            "StopProfile",
            "GetTokenizer",
        ],
    },
    EngineService {
        engine: "trtllm",
        service: "trtllm.TrtllmService",
        path: "/trtllm.TrtllmService/SubscribeKvEvents",
        methods: &[
            "Generate",
            "Embed",
            "HealthCheck",
            "Abort",
            "GetModelInfo",
            "GetServerInfo",
            "GetTokenizer",
        ],
    },
];

/// The HTTP/2 path of every method of the engine services but `SubscribeKvEvents`: what a
/// sidecar forwards by name (any other path is `other` in its metrics).
pub fn forwarded_methods() -> impl Iterator<Item = String> {
    ENGINE_SERVICES
        .iter()
        .flat_map(|s| s.methods.iter().map(move |m| format!("/{}/{m}", s.service)))
}

/// The entry of [`ENGINE_SERVICES`] named `engine` (`vllm`, `sglang`, …).
pub fn engine_service(engine: &str) -> Option<&'static EngineService> {
    ENGINE_SERVICES.iter().find(|s| s.engine == engine)
}
