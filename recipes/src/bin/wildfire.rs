//! The `wildfire` binary: parses the command line and hands over to `wildfire_recipes::cli`.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    wildfire_recipes::alloc::keep_freed_memory();
    let code = wildfire_recipes::cli::run(wildfire_recipes::cli::Cli::parse())?;
    std::process::exit(code)
}
