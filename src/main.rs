use std::io::IsTerminal;

use clap::Parser;
use nodelb::cli::{Cli, Command, LogFormat};
use nodelb::commands;
use tracing_subscriber::EnvFilter;

/// mimalloc, not the C library's malloc: a sync of many Services frees and allocates a great many
/// small objects, and glibc's malloc spends much of the agent's CPU on them (`malloc_consolidate`
/// walking its fast bins on every large allocation); docs/benchmarks.md, "Memory".
/// The feature `system-allocator` leaves it out, so that heaptrack (which hooks malloc) sees every
/// allocation of a heap profile (docs/benchmarks.md, "How to rerun": how to take one).
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse_from(nodelb::cli::command_line(std::env::args_os()));
    let filter = EnvFilter::try_from_env("NODELB_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour only for a person at a terminal: a log file or a pipe (kubectl logs, journald)
    // would carry the escape sequences as text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match cli.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    for name in nodelb::cli::unknown_env(std::env::vars_os().filter_map(|(k, _)| k.into_string().ok())) {
        tracing::warn!(
            variable = %name,
            "environment variable {name} is not read by nodelb (misspelt? `nodelb run --help` names each flag's variable)"
        );
    }
    match cli.command {
        Command::Run(args) => commands::run(*args).await,
        Command::Plan(args) => commands::plan(*args).await,
        Command::Controller(args) => commands::controller(*args).await,
        Command::Cleanup => commands::cleanup(),
        Command::Status(args) if args.cluster => commands::status_cluster(args).await,
        Command::Status(args) => commands::status(args),
        Command::Crd => {
            print!("{}", nodelb::core::decisions::pool::crd_yaml());
            Ok(())
        }
        Command::Completion { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "nodelb", &mut std::io::stdout());
            Ok(())
        }
    }
}
