//! `tp`: tensor-parallel training throughput (forward, backward and update) of the recipe's GPT
//! at tp = 2 against tp = 1, on the tiny and gpt2 presets. tp = 1 is one process on one core,
//! and on both cores (the baseline); tp = 2 is two processes of one core each (through the
//! launcher, on its default transport: shared memory on one host), with and without sequence parallelism. From each run's own metrics: median tokens/s and step time
//! after 3 warm-up steps, and the share of step time rank 0 spends in collectives (the
//! tensor-parallel ones inside the forward and backward, and the sequence-parallel gradient
//! sums).

use anyhow::bail;
use clap::Args;
use serde::Serialize;

use crate::dp::RecipeRun;
use crate::print_json_lines;

#[derive(Debug, Args)]
pub struct TpArgs {
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
    /// Training steps per configuration of the tiny preset (the first 3 are warm-up).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(5..))]
    steps: u64,
    /// Training steps per configuration of the gpt2 preset (the first 3 are warm-up).
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u64).range(5..))]
    gpt2_steps: u64,
}

/// A model to measure: its name, config overrides and steps.
struct Model {
    name: &'static str,
    sets: Vec<String>,
    steps: u64,
}

#[derive(Debug, Serialize)]
struct Row {
    model: &'static str,
    layout: &'static str,
    tokens_per_sec: f64,
    step_ms: f64,
    comm_share: f64,
    /// tokens/s ÷ tokens/s of tp 1 on both cores, on the same model.
    speedup: f64,
}

/// (name, tp, sequence parallelism, compute threads per process); the second is the baseline.
const LAYOUTS: [(&str, usize, bool, usize); 4] = [
    ("tp 1, 1 core", 1, false, 1),
    ("tp 1, 2 cores", 1, false, 2),
    ("tp 2, processes", 2, false, 1),
    ("tp 2 + SP, processes", 2, true, 1),
];

pub fn run(args: TpArgs) -> anyhow::Result<()> {
    let models = [
        Model {
            name: "tiny",
            sets: Vec::new(),
            steps: args.steps,
        },
        Model {
            name: "gpt2",
            sets: [
                "model.preset=\"gpt2\"",
                "data.tokenizer=\"gpt2\"",
                "model.context=128",
                "train.micro_batch=4",
            ]
            .map(String::from)
            .into(),
            steps: args.gpt2_steps,
        },
    ];
    let mut rows: Vec<Row> = Vec::new();
    for model in &models {
        let first = rows.len();
        for (layout, tp, sequence_parallel, threads) in LAYOUTS {
            let mut sets = model.sets.clone();
            sets.push(format!("parallel.tp={tp}"));
            sets.push(format!("parallel.sequence_parallel={sequence_parallel}"));
            let run = RecipeRun {
                name: format!("tp-{}-{layout}", model.name),
                ranks: tp,
                threads,
                processes: tp > 1,
                sets,
            };
            let (tokens_per_sec, step_ms, comm_share) = run.measure(model.steps)?;
            rows.push(Row {
                model: model.name,
                layout,
                tokens_per_sec,
                step_ms,
                comm_share,
                speedup: f64::NAN,
            });
        }
        let baseline = rows[first + 1].tokens_per_sec;
        for row in &mut rows[first..] {
            row.speedup = row.tokens_per_sec / baseline;
        }
    }
    if rows.is_empty() {
        bail!("no configuration ran");
    }
    if args.json {
        return print_json_lines(&rows);
    }
    println!(
        "| model | layout | tokens/s | step | collective share | vs tp 1 on 2 cores |\n|---|---|---|---|---|---|"
    );
    for row in &rows {
        println!(
            "| {} | {} | {:.0} | {:.0} ms | {:.1}% | {:.2}× |",
            row.model,
            row.layout,
            row.tokens_per_sec,
            row.step_ms,
            100.0 * row.comm_share,
            row.speedup
        );
    }
    Ok(())
}
