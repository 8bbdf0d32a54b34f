//! Reading prepared data: the batches per second that the sampler and the memory-mapped shards
//! of a `wildfire prepare` directory deliver (random windows → the token tensors a step takes,
//! on Flex), for `benches/data.sh`, which sets them beside the batches per second training
//! consumes.

use std::path::PathBuf;
use std::time::Instant;

use burn::backend::Flex;
use wildfire_recipes::data::{Prepared, Sampler};
use wildfire_recipes::train::TokenBatch;

#[derive(Debug, clap::Args)]
pub struct DataArgs {
    /// A directory `wildfire prepare` wrote.
    #[arg(long)]
    prepared: PathBuf,
    /// Tokens per window (the tiny preset's context).
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Windows per batch (the default config's micro-batch).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 2000)]
    batches: usize,
}

pub fn run(args: DataArgs) -> anyhow::Result<()> {
    let prepared = Prepared::open(&args.prepared)?;
    let tokens = &prepared.train;
    let mut sampler = Sampler::new(tokens.len(), args.context, args.batch, 1, (0, 1))?;
    let device = Default::default();
    let start = Instant::now();
    for _ in 0..args.batches {
        let starts = sampler.next_batch();
        let batch = TokenBatch::<Flex>::from_windows(tokens, &starts, args.context, &device);
        std::hint::black_box(batch);
    }
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "sampler: {} batches of {} × {} tokens from {} training tokens in {seconds:.3} s: {:.0} \
         batches/s",
        args.batches,
        args.batch,
        args.context + 1,
        tokens.len(),
        args.batches as f64 / seconds
    );
    Ok(())
}
