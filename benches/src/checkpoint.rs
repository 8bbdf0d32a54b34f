//! `checkpoint`: what a checkpoint save costs a training step, written synchronously and in the
//! background (`checkpoint.async`), side by side in one run. Each configuration trains the
//! same model for `steps` steps in its own processes: without periodic saves (only the final
//! one), and saving after every step, synchronously or in the background. The cost of one save
//! is the extra wall time over the run without periodic saves, divided by the `steps − 1` extra
//! saves; the median step time (from the run's metrics, which leave the save out) shows what
//! the background writer takes from the steps it runs beside.
//!
//! Two layouts: 2 data-parallel ranks under ZeRO 1 as processes, one compute thread each, which
//! keep both cores of a 2-core machine busy (the writer competes with the training for them);
//! and one rank on one compute thread, which leaves a core to the writer, as a GPU job leaves
//! its host's cores while the device computes.

use std::time::Instant;

use clap::Args;
use serde::Serialize;

use crate::dp::RecipeRun;
use crate::print_json_lines;

#[derive(Debug, Args)]
pub struct CheckpointArgs {
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
    /// Training steps per configuration.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(4..))]
    steps: u64,
    /// Measurements of each configuration (interleaved); the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

/// The model: nanoGPT's Shakespeare size (6 layers, 6 heads, 384 wide, 10.7M parameters), so a
/// checkpoint (parameters and AdamW's two moments, f32) is about 128 MB.
const MODEL: [&str; 5] = [
    "model.n_layer=6",
    "model.n_head=6",
    "model.d_model=384",
    "model.context=128",
    "train.micro_batch=8",
];

/// Where the run trains: `ranks` processes (or one), `threads` compute threads each.
struct Layout {
    name: &'static str,
    ranks: usize,
    threads: usize,
    sets: [&'static str; 2],
}

const LAYOUTS: [Layout; 2] = [
    Layout {
        name: "dp 2 (ZeRO 1), 2 processes × 1 thread",
        ranks: 2,
        threads: 1,
        sets: ["parallel.dp=2", "parallel.zero=1"],
    },
    Layout {
        name: "1 rank, 1 thread",
        ranks: 1,
        threads: 1,
        sets: ["parallel.dp=1", "parallel.zero=0"],
    },
];

const SAVES: [(&str, &[&str]); 3] = [
    ("final only", &["checkpoint.every=0"]),
    ("every step, synchronous", &["checkpoint.every=1"]),
    (
        "every step, background",
        &["checkpoint.every=1", "checkpoint.async=true"],
    ),
];

#[derive(Debug, Serialize)]
struct Row {
    layout: &'static str,
    saves: &'static str,
    wall_s: f64,
    step_ms: f64,
    save_cost_ms: Option<f64>,
}

pub fn run(args: CheckpointArgs) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for layout in &LAYOUTS {
        rows.extend(measure(layout, &args)?);
    }
    if args.json {
        return print_json_lines(&rows);
    }
    println!(
        "| layout | saves | wall ({} steps) | median step | cost of one save |",
        args.steps
    );
    println!("|---|---|---|---|---|");
    for row in &rows {
        let cost = row
            .save_cost_ms
            .map_or("—".into(), |c| format!("{c:.0} ms"));
        println!(
            "| {} | {} | {:.2} s | {:.0} ms | {cost} |",
            row.layout, row.saves, row.wall_s, row.step_ms
        );
    }
    Ok(())
}

/// Every way of saving in `layout`, interleaved `repeats` times; medians.
fn measure(layout: &Layout, args: &CheckpointArgs) -> anyhow::Result<Vec<Row>> {
    let mut walls = vec![Vec::new(); SAVES.len()];
    let mut steps_ms = vec![Vec::new(); SAVES.len()];
    for _ in 0..args.repeats {
        for (i, (name, sets)) in SAVES.iter().enumerate() {
            let mut all = vec!["checkpoint.keep_last=2".to_string()];
            let given = layout.sets.iter().chain(&MODEL).chain(sets.iter());
            all.extend(given.map(|s| s.to_string()));
            let run = RecipeRun {
                name: format!("checkpoint {} {name}", layout.ranks),
                ranks: layout.ranks,
                threads: layout.threads,
                processes: layout.ranks > 1,
                sets: all,
            };
            let started = Instant::now();
            let (_, step_ms, _) = run.measure(args.steps)?;
            walls[i].push(started.elapsed().as_secs_f64());
            steps_ms[i].push(step_ms);
        }
    }
    let wall: Vec<f64> = walls.iter_mut().map(|w| crate::median(w)).collect();
    let extra_saves = (args.steps - 1) as f64;
    Ok((SAVES.iter().enumerate())
        .map(|(i, (name, _))| Row {
            layout: layout.name,
            saves: name,
            wall_s: wall[i],
            step_ms: crate::median(&mut steps_ms[i]),
            save_cost_ms: (i > 0).then(|| 1e3 * (wall[i] - wall[0]) / extra_saves),
        })
        .collect())
}
