//! The `kvbridge` command: the product's subcommands (`kvbridge::cli`: `serve`, `subscribe`,
//! `tail`) and, after them, the tools' (`kvbridge_tools::cli`: `demo`, `bench`, …) on one
//! command line.

#![forbid(unsafe_code)]

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// Everything `kvbridge` can do.
#[derive(Parser, Debug)]
#[command(name = "kvbridge", version, about = "Engine KV-cache events → shared-memory ring → SMG SubscribeKvEvents", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    #[command(flatten)]
    Product(kvbridge::cli::Command),
    #[command(flatten)]
    Tools(kvbridge_tools::cli::Command),
}

fn main() {
    let matches = kvbridge::cli::with_serve_defaults(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::Product(c) => c.run(),
        Command::Tools(c) => c.run(),
    };
    std::process::exit(kvbridge::cli::exit_code(result));
}
