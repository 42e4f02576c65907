//! The tools' subcommands of `kvbridge`: `demo`, `bench`, `bench-checkpoints`, and the hidden
//! helper processes `bench` starts.

mod bench;
mod demo;

use kvbridge::cli::CliError;

/// The tools' subcommands; the `kvbridge` binary lists them after the product's.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Run the whole path on a built-in engine and show live stats (no engine needed).
    Demo(demo::DemoArgs),
    /// Measure latency, loss, CPU and memory under an open-loop load.
    Bench(Box<bench::BenchArgs>),
    /// What the snapshot table and its checkpoints cost a bridge holding many blocks: CPU and
    /// memory of bridges with and without it, fed the same churn in one run.
    BenchCheckpoints(bench::BenchCheckpointsArgs),
    /// One shared-memory reader process of `bench` (internal).
    #[command(hide = true)]
    BenchReader(bench::BenchReaderArgs),
    /// The sender process of `bench --floor` (internal).
    #[command(hide = true)]
    BenchFloor(bench::BenchFloorArgs),
    /// The bare ZMQ relay of `bench --zmq-subscribers` (internal).
    #[command(hide = true)]
    BenchZmqRelay(bench::BenchZmqRelayArgs),
    /// The bare JetStream publisher of `bench --nats-floor` (internal).
    #[command(hide = true)]
    BenchNatsFloor(bench::BenchNatsFloorArgs),
}

impl Command {
    /// Runs the subcommand.
    pub fn run(self) -> Result<(), CliError> {
        match self {
            Command::Demo(a) => demo::run(a),
            Command::Bench(a) => bench::run(*a),
            Command::BenchCheckpoints(a) => bench::run_checkpoints(a),
            Command::BenchReader(a) => bench::run_reader(a),
            Command::BenchFloor(a) => bench::run_floor_sender(a),
            Command::BenchZmqRelay(a) => bench::run_zmq_relay(a),
            Command::BenchNatsFloor(a) => bench::run_nats_floor(a),
        }
    }
}
