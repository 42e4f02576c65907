//! The product's `kvbridge` subcommands: `serve`, `subscribe`, `tail`. The binary (`cli/`) puts
//! the tools' (`demo`, `bench`: the `kvbridge-tools` crate) after them on one command line.
//!
//! Exit codes: 0 success; 1 a stream or run that ended badly (the status is printed); 2 a bad
//! flag, an unusable configuration, an unreachable or occupied endpoint — always one line on
//! stderr naming the problem, never a backtrace.

mod json;
mod serve;
mod subscribe;
mod subscribe_nats;
mod tail;

use clap::Subcommand;

pub use json::BatchPrinter;
pub use serve::StopSignals;

/// The product's subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the bridge: engine ZMQ → ring → gRPC fan-out.
    Serve(Box<crate::config::ServeArgs>),
    /// Subscribe over gRPC and print each batch as one line of proto3 canonical JSON.
    Subscribe(Box<subscribe::SubscribeArgs>),
    /// Read the ring directly (no socket) and print each batch as one line of JSON.
    Tail(tail::TailArgs),
}

impl Command {
    /// Runs the subcommand.
    pub fn run(self) -> Result<(), CliError> {
        match self {
            Command::Serve(a) => serve::run(*a),
            Command::Subscribe(a) => subscribe::run(*a),
            Command::Tail(a) => tail::run(a),
        }
    }
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

impl From<crate::service::SetupError> for CliError {
    fn from(e: crate::service::SetupError) -> Self {
        CliError::Setup(e.to_string())
    }
}

impl CliError {
    fn code(&self) -> i32 {
        match self {
            CliError::Setup(_) => 2,
            CliError::Failed(_) => 1,
        }
    }
}

/// The `kvbridge` command line, as built from its subcommands, made ready to parse: clap prints
/// usage errors itself and exits with 2. `serve`'s help gets each flag's default from the
/// constants (config::with_defaults): the flags have no clap defaults, so that a TOML file can
/// supply what the command line does not.
pub fn with_serve_defaults(cmd: clap::Command) -> clap::Command {
    cmd.mut_subcommand("serve", crate::config::with_defaults)
}

/// The process exit code of a command's result; a failure is printed first, on one line.
pub fn exit_code(result: Result<(), CliError>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvbridge: {e}");
            e.code()
        }
    }
}

/// A multi-threaded tokio runtime sized for a small machine.
pub fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::Setup(format!("cannot start the async runtime: {e}")))
}

/// Logs go to stderr; `RUST_LOG` overrides the default level (info). Colour only when stderr is a
/// terminal and `NO_COLOR` is unset or empty (<https://no-color.org>), so that files, pipes and
/// journald get plain text.
pub fn init_tracing(format: crate::config::LogFormat) {
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
