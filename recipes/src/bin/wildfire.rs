//! The `wildfire` binary: parses the command line and hands over to `wildfire_recipes::cli`.

use clap::Parser;
use wildfire_recipes::alloc::CountingAlloc;

/// Counts the heap, for the per-step memory metric (three relaxed atomic operations per
/// allocation).
#[global_allocator]
static HEAP: CountingAlloc = CountingAlloc::new();

fn main() {
    wildfire_recipes::alloc::keep_freed_memory();
    wildfire_recipes::alloc::register(&HEAP);
    match wildfire_recipes::cli::run(wildfire_recipes::cli::Cli::parse()) {
        Ok(code) => std::process::exit(code),
        Err(error) => {
            // The whole chain of causes, without a backtrace: these are user-facing errors.
            eprintln!("error: {error:#}");
            std::process::exit(1)
        }
    }
}
