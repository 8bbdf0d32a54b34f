//! The `wildfire` binary: parses the command line and hands over to `wildfire_recipes::cli`.

use clap::Parser;

fn main() {
    wildfire_recipes::alloc::keep_freed_memory();
    match wildfire_recipes::cli::run(wildfire_recipes::cli::Cli::parse()) {
        Ok(code) => std::process::exit(code),
        Err(error) => {
            // The whole chain of causes, without a backtrace: these are user-facing errors.
            eprintln!("error: {error:#}");
            std::process::exit(1)
        }
    }
}
