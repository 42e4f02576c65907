//! gRPC fan-out.
