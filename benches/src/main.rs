//! wildfire's benchmark harness: `cargo run --release -p wildfire-benches -- <subcommand>`.

mod alloc;
mod comm;
mod decorator;
mod pp;
mod train;
mod train_profile;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "wildfire-benches",
    about = "wildfire benchmarks (ratios are measured side by side in one run)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Collective bandwidth of every op on the local and tcp transports, against a memcpy baseline.
    Comm(comm::CommArgs),
    /// The cost of the `Parallel<B>` decorator with no override active, against the bare backend.
    Decorator(decorator::DecoratorArgs),
    /// Training throughput of the tiny GPT on CPU (1 and 2 threads), optionally against PyTorch.
    Train(train::TrainArgs),
    /// Pipeline parallelism: measured bubble against theory; 1F1B's stored activations and
    /// memory against GPipe's.
    Pp(pp::PpArgs),
    /// Where a tiny-GPT training step spends its time, component by component.
    TrainProfile(train_profile::ProfileArgs),
    /// One measurement process of `train`.
    #[command(hide = true)]
    TrainWorker(train::WorkerArgs),
    /// One rank of a pipeline measurement (started by `pp` through the launcher).
    #[command(hide = true)]
    PpWorker(pp::WorkerArgs),
    /// One rank of a tcp measurement (started by `comm` through the launcher).
    #[command(hide = true)]
    CommWorker(comm::WorkerArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Comm(args) => comm::run(args),
        Command::CommWorker(args) => comm::worker(args),
        Command::Decorator(args) => decorator::run(args),
        Command::Pp(args) => pp::run(args),
        Command::PpWorker(args) => pp::worker(args),
        Command::Train(args) => train::run(args),
        Command::TrainWorker(args) => train::worker(args),
        Command::TrainProfile(args) => train_profile::run(args),
    }
}
