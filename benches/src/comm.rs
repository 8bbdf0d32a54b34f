//! `comm`: time per op, algorithm bandwidth and bus bandwidth (nccl-tests' definitions) of every
//! collective, on every transport (local threads, shared memory and tcp between processes), at
//! the tensor API, with a single-thread memcpy baseline from
//! the same run.
//!
//! - algbw = bytes / time, where bytes is the whole buffer: the all-reduce, broadcast, all-to-all
//!   and send/recv input, the all-gather output, the reduce-scatter input.
//! - busbw = algbw × factor: all-reduce 2(n−1)/n; all-gather, reduce-scatter and all-to-all
//!   (n−1)/n; broadcast and send/recv 1. It is comparable across rank counts.
//!
//! Each iteration builds a fresh input tensor (not timed), then times the collective alone. The
//! iteration count comes from the slowest rank's warm-up, so all ranks run the same number, and
//! the reported time is the slowest rank's mean.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use clap::Args;
use serde::{Deserialize, Serialize};
use wildfire_backend::comm::{
    CommOptions, HostTensor, LaunchEnv, LaunchFlags, ProcessGroup, ReduceOp, TRANSPORT_ENV,
};
use wildfire_backend::launch::{LaunchConfig, launch};

const OPS: [&str; 7] = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "send_recv",
    "barrier",
];

#[derive(Debug, Args)]
pub struct CommArgs {
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
    /// Message sizes, powers of 4 from 1 KiB up to this many MiB.
    #[arg(long, default_value_t = 64)]
    max_mib: usize,
    /// Rank counts to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [2, 4])]
    ranks: Vec<usize>,
    /// Transports to measure.
    /// `gloo` is PyTorch's (benches/reference/comm_gloo.py), measured when python3 has torch.
    #[arg(long, value_delimiter = ',', default_values_t = ["local", "shm", "tcp", "gloo"].map(String::from))]
    transports: Vec<String>,
    /// Ops to measure.
    #[arg(long, value_delimiter = ',', default_values_t = OPS.map(String::from))]
    ops: Vec<String>,
    /// Seconds of timed iterations per measurement (at least 3 iterations).
    #[arg(long, default_value_t = 0.25)]
    seconds: f64,
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
    #[arg(long)]
    seconds: f64,
    /// Rank 0 writes its results here, one JSON object per line.
    #[arg(long)]
    out: PathBuf,
}

/// One measurement, as printed with `--json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    op: String,
    transport: String,
    ranks: usize,
    bytes: usize,
    time_s: f64,
    #[serde(rename = "algbw_GBps")]
    algbw: f64,
    #[serde(rename = "busbw_GBps")]
    busbw: f64,
    #[serde(rename = "memcpy_GBps")]
    memcpy: f64,
}

fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "all_to_all" => (n - 1.0) / n,
        _ => 1.0,
    }
}

fn sizes(max_mib: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut bytes = 1024;
    while bytes <= max_mib << 20 {
        out.push(bytes);
        bytes *= 4;
    }
    out
}

/// Single-thread memcpy bandwidth (GB/s) of a 64 MiB buffer: the median of 15 copies.
fn memcpy_baseline() -> f64 {
    let len = 64 << 20;
    let src = vec![1u8; len];
    let mut dst = vec![0u8; len];
    let mut rates: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            len as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

pub fn run(args: CommArgs) -> anyhow::Result<()> {
    for op in &args.ops {
        if !OPS.contains(&op.as_str()) {
            bail!("unknown op {op:?}; known ops: {}", OPS.join(", "));
        }
    }
    if let Some(n) = args.ranks.iter().find(|n| **n < 2) {
        bail!("--ranks {n}: collectives need at least 2 ranks");
    }
    let memcpy = memcpy_baseline();
    let sizes = sizes(args.max_mib);
    if !args.json {
        println!("single-thread memcpy baseline: {memcpy:.2} GB/s (64 MiB, median of 15)");
        println!(
            "{:<15} {:<9} {:>5} {:>10} {:>12} {:>11} {:>11} {:>10}",
            "op", "transport", "ranks", "bytes", "time", "algbw GB/s", "busbw GB/s", "busbw/cpy"
        );
    }
    for transport in &args.transports {
        for &n in &args.ranks {
            let records = match transport.as_str() {
                "local" => measure_local(n, &sizes, &args.ops, args.seconds)?,
                "tcp" | "shm" => measure_processes(transport, n, &sizes, &args.ops, args.seconds)?,
                "gloo" => measure_gloo(n, &sizes, &args.ops, args.seconds)?,
                other => bail!("unknown transport {other:?}; known: local, shm, tcp, gloo"),
            };
            for mut record in records {
                record.memcpy = memcpy;
                print_record(&record, args.json)?;
            }
        }
    }
    Ok(())
}

fn print_record(r: &Record, json: bool) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", serde_json::to_string(r)?)?;
    } else {
        let ratio = if r.bytes > 0 {
            format!("{:.3}", r.busbw / r.memcpy)
        } else {
            "-".into()
        };
        writeln!(
            out,
            "{:<15} {:<9} {:>5} {:>10} {:>10.1}us {:>11.3} {:>11.3} {:>10}",
            r.op,
            r.transport,
            r.ranks,
            r.bytes,
            r.time_s * 1e6,
            r.algbw,
            r.busbw,
            ratio
        )?;
    }
    Ok(())
}

fn measure_local(
    n: usize,
    sizes: &[usize],
    ops: &[String],
    seconds: f64,
) -> anyhow::Result<Vec<Record>> {
    let worlds = ProcessGroup::local_world(n, CommOptions::default())?;
    let handles: Vec<_> = worlds
        .into_iter()
        .map(|world| {
            let (sizes, ops) = (sizes.to_vec(), ops.to_vec());
            std::thread::spawn(move || sweep(&world, &sizes, &ops, seconds))
        })
        .collect();
    let mut results = Vec::new();
    for handle in handles {
        results.push(
            handle
                .join()
                .map_err(|_| anyhow::anyhow!("a rank panicked"))??,
        );
    }
    Ok(results.swap_remove(0))
}

/// `n` processes started by the launcher, on `transport` (`tcp` or `shm`).
fn measure_processes(
    transport: &str,
    n: usize,
    sizes: &[usize],
    ops: &[String],
    seconds: f64,
) -> anyhow::Result<Vec<Record>> {
    let out = std::env::temp_dir().join(format!(
        "wildfire-comm-bench-{}-{n}.jsonl",
        std::process::id()
    ));
    let exe = std::env::current_exe().context("locating this benchmark binary")?;
    let join = |v: Vec<String>| v.join(",");
    let port = std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()?
        .port();
    let config = LaunchConfig {
        nproc_per_node: n,
        master_port: port,
        command: vec![
            "env".into(),
            format!("{TRANSPORT_ENV}={transport}"),
            exe.display().to_string(),
            "comm-worker".into(),
            "--sizes".into(),
            join(sizes.iter().map(|s| s.to_string()).collect()),
            "--ops".into(),
            join(ops.to_vec()),
            "--seconds".into(),
            seconds.to_string(),
            "--out".into(),
            out.display().to_string(),
        ],
        ..Default::default()
    };
    launch(&config)?;
    let text =
        std::fs::read_to_string(&out).with_context(|| format!("reading {}", out.display()))?;
    let _ = std::fs::remove_file(&out);
    text.lines().map(|l| Ok(serde_json::from_str(l)?)).collect()
}

/// What `comm_gloo.py` prints per measurement.
#[derive(Debug, Deserialize)]
struct GlooLine {
    op: String,
    ranks: usize,
    bytes: usize,
    time_s: f64,
}

/// PyTorch's gloo on `n` processes (`benches/reference/comm_gloo.py`), or nothing, with a note
/// on stderr, where python3 lacks torch. Gloo has no reduce-scatter.
fn measure_gloo(
    n: usize,
    sizes: &[usize],
    ops: &[String],
    seconds: f64,
) -> anyhow::Result<Vec<Record>> {
    let has_torch = std::process::Command::new("python3")
        .args(["-c", "import torch.distributed"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !has_torch {
        eprintln!("gloo: skipped (python3 with torch not found; pip install torch)");
        return Ok(Vec::new());
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("reference/comm_gloo.py");
    let join = |v: Vec<String>| v.join(",");
    let output = std::process::Command::new("python3")
        .arg(&script)
        .args(["--ranks", &n.to_string(), "--seconds", &seconds.to_string()])
        .args([
            "--sizes",
            &join(sizes.iter().map(|s| s.to_string()).collect()),
        ])
        .args(["--ops", &join(ops.to_vec())])
        .output()
        .context("running python3")?;
    if !output.status.success() {
        bail!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let stdout = String::from_utf8(output.stdout)?;
    let lines = stdout.lines().filter(|l| l.starts_with('{'));
    lines
        .map(|line| {
            let g: GlooLine = serde_json::from_str(line)?;
            let algbw = g.bytes as f64 / g.time_s / 1e9;
            Ok(Record {
                busbw: algbw * bus_factor(&g.op, g.ranks),
                op: g.op,
                transport: "gloo".into(),
                ranks: g.ranks,
                bytes: g.bytes,
                time_s: g.time_s,
                algbw,
                memcpy: 0.0,
            })
        })
        .collect()
}

pub fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    let env = LaunchEnv::detect(&LaunchFlags::default())?;
    let world = ProcessGroup::init(&env, CommOptions::from_env()?)?;
    let records = sweep(&world, &args.sizes, &args.ops, args.seconds)?;
    if world.rank() == 0 {
        let mut file = std::fs::File::create(&args.out)?;
        for r in &records {
            writeln!(file, "{}", serde_json::to_string(r)?)?;
        }
    }
    Ok(())
}

/// All ops × sizes on one rank; every rank returns the same records.
fn sweep(
    world: &ProcessGroup,
    sizes: &[usize],
    ops: &[String],
    seconds: f64,
) -> anyhow::Result<Vec<Record>> {
    let mut records = Vec::new();
    for op in ops {
        let op_sizes = if op == "barrier" {
            vec![0]
        } else {
            sizes.to_vec()
        };
        for &bytes in &op_sizes {
            let time_s = time_op(world, op, bytes, seconds)?;
            let algbw = bytes as f64 / time_s / 1e9;
            records.push(Record {
                op: op.clone(),
                transport: world.transport_name().into(),
                ranks: world.size(),
                bytes,
                time_s,
                algbw,
                busbw: algbw * bus_factor(op, world.size()),
                memcpy: 0.0,
            });
        }
    }
    Ok(records)
}

/// Mean seconds per call of `op` on `bytes`, the slowest rank's.
fn time_op(world: &ProcessGroup, op: &str, bytes: usize, seconds: f64) -> anyhow::Result<f64> {
    let n = world.size();
    // Per-rank input elements (f32): all-gather's `bytes` is its output.
    let elems = if op == "all_gather" {
        bytes / 4 / n
    } else {
        bytes / 4
    };
    let values = vec![0.0f32; elems];
    let once = || -> anyhow::Result<Duration> {
        let x = Tensor::<Flex, 1>::from_data(
            TensorData::new(values.clone(), [elems]),
            &Default::default(),
        );
        let start = Instant::now();
        let output = run_op(world, op, x)?;
        let elapsed = start.elapsed();
        drop(output); // freeing the result is the caller's business, not the collective's
        Ok(elapsed)
    };
    world.barrier()?;
    let warmup = (0..2).map(|_| once()).sum::<anyhow::Result<Duration>>()? / 2;
    let warmup = slowest(world, warmup.as_secs_f64())?;
    let iters = ((seconds / warmup.max(1e-9)) as usize).clamp(3, 2000);
    world.barrier()?;
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        total += once()?;
    }
    slowest(world, total.as_secs_f64() / iters as f64)
}

/// The largest of every rank's `secs`.
fn slowest(world: &ProcessGroup, secs: f64) -> anyhow::Result<f64> {
    let t = world.all_reduce_host(HostTensor::new(vec![secs], vec![1]), ReduceOp::Max)?;
    Ok(t.data[0])
}

/// Runs one collective and returns its output (none for the barrier).
fn run_op(
    world: &ProcessGroup,
    op: &str,
    x: Tensor<Flex, 1>,
) -> anyhow::Result<Option<Tensor<Flex, 1>>> {
    let n = world.size();
    Ok(Some(match op {
        "all_reduce" => world.all_reduce(x, ReduceOp::Sum)?,
        "all_gather" => world.all_gather(x, 0)?,
        "reduce_scatter" => world.reduce_scatter(x, 0, ReduceOp::Sum)?,
        "broadcast" => world.broadcast(x, 0)?,
        "all_to_all" => world.all_to_all(x, 0, 0)?,
        "send_recv" => {
            let (next, prev) = ((world.rank() + 1) % n, (world.rank() + n - 1) % n);
            world.send(x, next, 0)?;
            world.recv::<Flex, 1, burn::tensor::Float>(prev, 0, &Default::default())?
        }
        "barrier" => {
            world.barrier()?;
            return Ok(None);
        }
        other => bail!("unknown op {other:?}"),
    }))
}
