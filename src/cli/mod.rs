//! The `kvbridge` command: `serve`, `subscribe`, `tail`, `demo`, `bench`.
//!
//! Exit codes: 0 success; 1 a stream or run that ended badly (the status is printed); 2 a bad
//! flag, an unusable configuration, an unreachable or occupied endpoint — always one line on
//! stderr naming the problem, never a backtrace.

mod bench;
mod demo;
mod json;
mod serve;
mod subscribe;
mod subscribe_nats;
mod tail;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

pub use json::BatchPrinter;
pub use serve::{run_service, ServiceHandle};

/// Everything `kvbridge` can do.
#[derive(Parser, Debug)]
#[command(name = "kvbridge", version, about = "Engine KV-cache events → shared-memory ring → SMG SubscribeKvEvents", long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the bridge: engine ZMQ → ring → gRPC fan-out.
    Serve(Box<crate::config::ServeArgs>),
    /// Subscribe over gRPC and print each batch as one line of proto3 canonical JSON.
    Subscribe(subscribe::SubscribeArgs),
    /// Read the ring directly (no socket) and print each batch as one line of JSON.
    Tail(tail::TailArgs),
    /// Run the whole path on a built-in engine and show live stats (no engine needed).
    Demo(demo::DemoArgs),
    /// Measure latency, loss, CPU and memory under an open-loop load.
    Bench(bench::BenchArgs),
    /// What the snapshot table and its checkpoints cost a bridge holding many blocks: CPU and
    /// memory of bridges with and without it, fed the same churn in one run.
    BenchCheckpoints(bench::BenchCheckpointsArgs),
    /// One shared-memory reader process of `bench` (internal).
    #[command(hide = true)]
    BenchReader(bench::BenchReaderArgs),
    /// The sender process of `bench --floor` (internal).
    #[command(hide = true)]
    BenchFloor(bench::BenchFloorArgs),
    /// The bare JetStream publisher of `bench --nats-floor` (internal).
    #[command(hide = true)]
    BenchNatsFloor(bench::BenchNatsFloorArgs),
}

/// A failure that ends the command, with its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad configuration or set-up (exit 2).
    #[error("{0}")]
    Setup(String),
    /// The run failed after it started (exit 1).
    #[error("{0}")]
    Failed(String),
}

impl CliError {
    fn code(&self) -> i32 {
        match self {
            CliError::Setup(_) => 2,
            CliError::Failed(_) => 1,
        }
    }
}

/// Entry point used by `main`; returns the process exit code.
pub fn main() -> i32 {
    // clap prints usage errors itself and exits with 2. `serve`'s help gets each flag's default
    // from the constants (config::with_defaults): the flags have no clap defaults, so that a TOML
    // file can supply what the command line does not.
    let matches = Cli::command()
        .mut_subcommand("serve", crate::config::with_defaults)
        .get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::Serve(a) => serve::run(*a),
        Command::Subscribe(a) => subscribe::run(a),
        Command::Tail(a) => tail::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchCheckpoints(a) => bench::run_checkpoints(a),
        Command::BenchReader(a) => bench::run_reader(a),
        Command::BenchFloor(a) => bench::run_floor_sender(a),
        Command::BenchNatsFloor(a) => bench::run_nats_floor(a),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvbridge: {e}");
            e.code()
        }
    }
}

/// A multi-threaded tokio runtime sized for a small machine.
fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::Setup(format!("cannot start the async runtime: {e}")))
}

/// Logs go to stderr; `RUST_LOG` overrides the default level (info). Colour only when stderr is a
/// terminal and `NO_COLOR` is unset or empty (<https://no-color.org>), so that files, pipes and
/// journald get plain text.
fn init_tracing(format: crate::config::LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = log_colour(
        std::io::IsTerminal::is_terminal(&std::io::stderr()),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = match format {
        crate::config::LogFormat::Text => b.try_init(),
        crate::config::LogFormat::Json => b.json().try_init(),
    };
}

/// Whether logs are coloured: on a terminal, unless `NO_COLOR` has a non-empty value.
fn log_colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::log_colour;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(log_colour(true, None));
        assert!(log_colour(true, Some(OsStr::new(""))));
        assert!(!log_colour(true, Some(OsStr::new("1"))));
        assert!(!log_colour(false, None));
    }
}
