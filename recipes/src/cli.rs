//! The `wildfire` command line: argument definitions and the commands behind them.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use burn::backend::Flex;
use clap::{Args, Parser, Subcommand};
use wildfire_backend::comm::{self, CommOptions, LaunchEnv, LaunchFlags, ProcessGroup, selfcheck};
use wildfire_backend::launch::{self, LaunchConfig};

use wildfire_backend::kernels::matmul::MatmulPrecision;
use wildfire_parallel::precision::Precision;

use wildfire_backend::device::DeviceSpec;

use crate::config::RunConfig;
use crate::config::{ActivationCheckpointing, Transport};
use crate::device::{DeviceBackend, DeviceJob, on_device, process_device};
use crate::{data, generate, hf, train};

#[derive(Debug, Parser)]
#[command(name = "wildfire", version, about = "Distributed LLM training on Burn")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start one process per local rank with torchrun's variables and supervise them.
    Launch(LaunchArgs),
    /// Check every collective with rank-stamped data, exactly, and the reductions' order with
    /// seeded non-integer data, bit for bit against the serial fold, on this job's ranks.
    CommCheck(CommCheckArgs),
    /// Tokenise text files, directories and JSON lines into token shards that `train --data`
    /// reads through memory maps.
    Prepare(PrepareArgs),
    /// Train a GPT (default: the tiny model on the bundled Shakespeare, on CPU).
    Train(TrainArgs),
    /// Sample text from a checkpoint.
    Generate(GenerateArgs),
    /// Write a checkpoint's model in another format.
    Export(ExportArgs),
}

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// Text files (one document each), directories (their files in path order) and `.jsonl`
    /// files (one document per line); repeatable.
    #[arg(long = "input", value_name = "PATH", required = true, num_args = 1..)]
    pub inputs: Vec<PathBuf>,
    /// The directory to write; it must not exist yet.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// char, gpt2, or hf:PATH (a Hugging Face tokenizer.json, or a model directory holding one).
    #[arg(long, default_value = "gpt2", value_name = "char|gpt2|hf:PATH", value_parser = data::TokenizerKind::parse_flag)]
    pub tokenizer: (data::TokenizerKind, Option<PathBuf>),
    /// Fraction of the documents held out for validation (drawn per document from --seed).
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// The field of a JSON line that holds the document's text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Skip documents that are not UTF-8 (counted in the manifest) instead of failing.
    #[arg(long)]
    pub skip_invalid: bool,
    /// Token ids as `u16` or `u32` (default: the narrowest that holds the vocabulary).
    #[arg(long, value_parser = ["u16", "u32"])]
    pub dtype: Option<String>,
    /// Tokens per shard file at most.
    #[arg(long, default_value_t = 1 << 28)]
    pub shard_tokens: u64,
    /// Encoding threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Config file (TOML); default: the built-in recipes/configs/shakespeare-char.toml.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one key, `section.key=value` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Continue the run in RUN_DIR (default: run.dir) from its newest complete checkpoint, with
    /// the config saved there; --set still applies, except to keys the continuation depends on.
    /// `--resume auto`: continue run.dir's run when it has a checkpoint, else start it (anew).
    #[arg(long, value_name = "RUN_DIR", num_args = 0..=1)]
    pub resume: Option<Option<PathBuf>>,
    /// The corpus: a text file, a directory of them, or a directory `wildfire prepare` wrote
    /// (sets data.path).
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// Start from Hugging Face GPT-2 or Llama weights: `hf:DIR` (sizes from DIR/config.json)
    /// or `hf:FILE` (.safetensors or index; sizes from the config) (sets run.init_from).
    #[arg(long, value_name = "hf:PATH")]
    pub init_from: Option<String>,
    /// The tokenizer: char, gpt2, or hf:PATH (a Hugging Face tokenizer.json, or a model
    /// directory holding one) (sets data.tokenizer and data.tokenizer_file).
    #[arg(long, value_name = "char|gpt2|hf:PATH", value_parser = data::TokenizerKind::parse_flag)]
    pub tokenizer: Option<(data::TokenizerKind, Option<PathBuf>)>,
    /// Data-parallel ranks (sets parallel.dp).
    #[arg(long)]
    pub dp: Option<usize>,
    /// ZeRO stage over the data-parallel ranks: 0 (DDP), 1, 2 or 3 (FSDP) (sets parallel.zero).
    #[arg(long)]
    pub zero: Option<u8>,
    /// Gradient bucket size in MiB (sets parallel.bucket_mb).
    #[arg(long)]
    pub bucket_mb: Option<f64>,
    /// Keep ZeRO's optimizer state in host memory (sets parallel.offload_optimizer).
    #[arg(long)]
    pub offload_optimizer: bool,
    /// Sequences per step over all data-parallel ranks; must equal micro_batch × grad_accum ×
    /// dp (sets train.global_batch).
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Tensor-parallel ranks (sets parallel.tp).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Sequence parallelism between the tensor-parallel layers (sets
    /// parallel.sequence_parallel).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Pipeline-parallel ranks (sets parallel.pp).
    #[arg(long)]
    pub pp: Option<usize>,
    /// Micro-batches per step, the pipeline's micro-batches (sets train.grad_accum).
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Pipeline schedule: gpipe, 1f1b or interleaved (sets parallel.schedule).
    #[arg(long)]
    pub schedule: Option<String>,
    /// Model chunks per pipeline rank, for the interleaved schedule (sets
    /// parallel.virtual_stages).
    #[arg(long)]
    pub virtual_stages: Option<usize>,
    /// Blocks of each pipeline stage, e.g. 1,2,1 (sets parallel.stage_layers).
    #[arg(long, value_delimiter = ',')]
    pub stage_layers: Option<Vec<usize>>,
    /// Compute precision: fp32, bf16 or fp16 (fp32 master weights and optimizer state, fp16
    /// with dynamic loss scaling) (sets precision.compute).
    #[arg(long, value_name = "fp32|bf16|fp16")]
    pub precision: Option<Precision>,
    /// Matmul precision of an fp32 run: off, bf16 or f16 (inputs rounded to that type, products
    /// accumulated in f32), or tf32 (TF32 tensor cores; cuda only) (sets precision.matmul).
    #[arg(long, value_name = "off|bf16|f16|tf32")]
    pub matmul_precision: Option<MatmulPrecision>,
    /// Activation checkpointing: none, full (recompute each block) or selective (recompute the
    /// memory-bound operations) (sets train.activation_checkpointing).
    #[arg(long, value_enum)]
    pub activation_checkpointing: Option<ActivationCheckpointing>,
    /// The device: cpu, wgpu or cuda (each rank of a launched job on local device LOCAL_RANK),
    /// or cuda:N / wgpu:N for a single process (sets run.device).
    #[arg(long, value_name = "cpu|wgpu|cuda[:N]")]
    pub device: Option<DeviceSpec>,
    /// Print a table of the kernels of each of this many steps after the first (wgpu and cuda;
    /// sets run.profile).
    #[arg(long, value_name = "STEPS")]
    pub profile: Option<u64>,
    /// Where the ranks run: `launch` (one process each, as `wildfire launch` starts them) or
    /// `local` (threads of this process) (sets parallel.transport).
    #[arg(long, value_enum)]
    pub transport: Option<Transport>,
}

impl TrainArgs {
    /// The `--set` overrides the dedicated flags stand for.
    fn flag_overrides(&self) -> Vec<String> {
        let quoted = |value: &str| toml::Value::String(value.to_string()).to_string();
        let mut overrides = Vec::new();
        let mut set = |key: &str, value: Option<String>| {
            if let Some(value) = value {
                overrides.push(format!("{key}={value}"));
            }
        };
        set("run.init_from", self.init_from.as_deref().map(quoted));
        set(
            "data.path",
            self.data.as_ref().map(|p| quoted(&p.display().to_string())),
        );
        if let Some((kind, file)) = &self.tokenizer {
            set("data.tokenizer", Some(quoted(&kind.to_string())));
            set(
                "data.tokenizer_file",
                file.as_ref().map(|p| quoted(&p.display().to_string())),
            );
        }
        set("parallel.dp", self.dp.map(|n| n.to_string()));
        set("parallel.zero", self.zero.map(|n| n.to_string()));
        set("parallel.bucket_mb", self.bucket_mb.map(|n| n.to_string()));
        set(
            "parallel.offload_optimizer",
            self.offload_optimizer.then(|| "true".to_string()),
        );
        set(
            "train.global_batch",
            self.global_batch.map(|n| n.to_string()),
        );
        set("parallel.tp", self.tp.map(|n| n.to_string()));
        set(
            "parallel.sequence_parallel",
            self.sequence_parallel.then(|| "true".to_string()),
        );
        set("parallel.pp", self.pp.map(|n| n.to_string()));
        set("train.grad_accum", self.microbatches.map(|n| n.to_string()));
        set("parallel.schedule", self.schedule.as_deref().map(quoted));
        set(
            "parallel.virtual_stages",
            self.virtual_stages.map(|n| n.to_string()),
        );
        set(
            "parallel.stage_layers",
            self.stage_layers.as_ref().map(|list| format!("{list:?}")),
        );
        set(
            "train.activation_checkpointing",
            self.activation_checkpointing
                .map(|a| quoted(&a.to_string())),
        );
        set(
            "precision.compute",
            self.precision.map(|p| quoted(&p.to_string())),
        );
        set(
            "precision.matmul",
            self.matmul_precision.map(|p| quoted(&p.to_string())),
        );
        set("run.device", self.device.map(|d| quoted(&d.to_string())));
        set("run.profile", self.profile.map(|n| n.to_string()));
        set(
            "parallel.transport",
            self.transport
                .map(|t| quoted(&format!("{t:?}").to_lowercase())),
        );
        overrides
    }
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A checkpoint directory, or a run directory (its newest checkpoint is used).
    #[arg(
        long,
        required_unless_present = "init_from",
        conflicts_with = "init_from"
    )]
    pub checkpoint: Option<PathBuf>,
    /// Hugging Face weights instead of a checkpoint: `hf:DIR`, a GPT-2 or Llama model directory
    /// (sizes from its config.json; tokenizer from its tokenizer.json, or GPT-2's own for a GPT-2
    /// of 50,257 tokens without one).
    #[arg(long, value_name = "hf:DIR")]
    pub init_from: Option<String>,
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    #[arg(long, default_value_t = 500)]
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample among the k most likely tokens only.
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Run the whole window for every token instead of reusing the earlier positions' keys and
    /// values (the same text, more work).
    #[arg(long)]
    pub no_kv_cache: bool,
    /// The device: cpu, wgpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_name = "cpu|wgpu|cuda[:N]")]
    pub device: DeviceSpec,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ExportFormat {
    /// Hugging Face GPT2LMHeadModel or LlamaForCausalLM: safetensors (one file, or shards and
    /// model.safetensors.index.json) + config.json, and the run's tokenizer.json when it
    /// trained with a Hugging Face tokenizer.
    HfSafetensors,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    #[arg(long, value_enum)]
    pub format: ExportFormat,
    /// A checkpoint directory, or a run directory (its newest checkpoint is used).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Output: a directory, or a path ending in .safetensors (config.json goes beside it).
    #[arg(long)]
    pub out: PathBuf,
    /// Largest shard written into a directory, in bytes (suffixes KB, MB, GB: powers of 1000,
    /// as Hugging Face's max_shard_size); a model above it is written as shards.
    #[arg(long, default_value = "5GB", value_parser = parse_bytes)]
    pub max_shard_size: u64,
    /// The device: cpu, wgpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_name = "cpu|wgpu|cuda[:N]")]
    pub device: DeviceSpec,
}

#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Processes (ranks) to start on this node.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
    /// Nodes in the job; run one launcher per node.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index in 0..nnodes.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0, where rank 0 serves the rendezvous store.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the rendezvous store.
    #[arg(long, default_value_t = comm::DEFAULT_MASTER_PORT)]
    pub master_port: u16,
    /// Address the store and the ranks' listeners bind instead of --master-addr's and the one
    /// each rank advertises (0.0.0.0 for every interface); sets WILDFIRE_BIND for the ranks.
    #[arg(long, value_name = "IP")]
    pub bind: Option<std::net::IpAddr>,
    /// Restart the whole group this many times when a rank fails.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// Seconds ranks get to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = 5.0)]
    pub grace_secs: f64,
    /// The command each rank runs.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// Where this process sits in the job, when no launcher says so.
#[derive(Debug, Args)]
pub struct RankArgs {
    /// This process's rank (overrides RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK).
    #[arg(long)]
    pub rank: Option<usize>,
    /// Number of ranks in the job (overrides WORLD_SIZE and friends).
    #[arg(long)]
    pub world_size: Option<usize>,
    #[arg(long)]
    pub local_rank: Option<usize>,
    /// Rendezvous host (overrides MASTER_ADDR).
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Rendezvous port (overrides MASTER_PORT).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Deadline of every blocking communication call, in seconds (overrides WILDFIRE_COMM_TIMEOUT; default 300).
    #[arg(long)]
    pub comm_timeout: Option<f64>,
}

impl RankArgs {
    fn flags(&self) -> LaunchFlags {
        LaunchFlags {
            rank: self.rank,
            world_size: self.world_size,
            local_rank: self.local_rank,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
        }
    }

    fn options(&self) -> anyhow::Result<CommOptions> {
        let mut options = CommOptions::from_env()?;
        if let Some(secs) = self.comm_timeout {
            options.timeout = comm::timeout_from_secs(secs).with_context(|| {
                format!("--comm-timeout {secs} is not a number of seconds between 0 and one year")
            })?;
        }
        Ok(options)
    }
}

#[derive(Debug, Args)]
pub struct CommCheckArgs {
    #[command(flatten)]
    pub ranks: RankArgs,
    /// Run this many ranks as threads of this process (local transport) instead of joining a
    /// launched job.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Skip the 4 MiB size (quicker).
    #[arg(long)]
    pub small: bool,
    /// Where the checked tensors live: `cpu`, or `cuda` (GPU LOCAL_RANK; builds with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Runs the command; returns the process exit code.
pub fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Launch(args) => run_launch(args),
        Command::CommCheck(args) => run_comm_check(args),
        Command::Prepare(args) => run_prepare(args),
        Command::Train(args) => run_train(args),
        Command::Generate(args) => run_generate(args),
        Command::Export(args) => run_export(args),
    }
}

/// Sizes the CPU backend's thread pool (once per process).
fn set_threads(threads: Option<usize>) -> anyhow::Result<()> {
    if let Some(n) = threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .with_context(|| format!("run.threads = {n}: the thread pool is already running"))?;
    }
    Ok(())
}

fn run_prepare(args: PrepareArgs) -> anyhow::Result<i32> {
    use std::io::IsTerminal;
    set_threads(args.threads)?;
    let options = data::PrepareOptions {
        inputs: args.inputs,
        out: args.out,
        tokenizer: args.tokenizer.0,
        tokenizer_file: args.tokenizer.1,
        val_fraction: args.val_fraction,
        seed: args.seed,
        text_field: args.text_field,
        skip_invalid: args.skip_invalid,
        dtype: args.dtype.map(|d| match d.as_str() {
            "u16" => data::TokenDtype::U16,
            _ => data::TokenDtype::U32,
        }),
        shard_tokens: args.shard_tokens,
        progress: std::io::stderr().is_terminal(),
    };
    let manifest = data::prepare(&options)?;
    println!(
        "prepared {} training and {} validation documents ({} and {} tokens, {:?}, {} shards; \
         {} skipped) into {}",
        manifest.documents.train,
        manifest.documents.val,
        manifest.tokens(data::Split::Train),
        manifest.tokens(data::Split::Val),
        manifest.dtype,
        manifest.shards.len(),
        manifest.skipped_documents,
        options.out.display()
    );
    Ok(0)
}

fn run_train(args: TrainArgs) -> anyhow::Result<i32> {
    let mut overrides = args.overrides.clone();
    overrides.extend(args.flag_overrides());
    let given = RunConfig::load(args.config.as_deref(), &overrides)?;
    let resume = args.resume.as_ref().map(Option::as_deref);
    let (config, start) = train::start(given, &overrides, resume)?;
    set_threads(config.run.threads)?;
    let outcome = train::run_on_device(config, start)?;
    match outcome.losses.last() {
        Some(loss) => println!(
            "trained to step {} in {}; last loss {loss:.4}",
            outcome.steps,
            outcome.run_dir.display()
        ),
        None => println!(
            "{} is already trained to step {} (train.max_steps); nothing to do (raise \
             train.max_steps with --resume --set train.max_steps=N to train longer)",
            outcome.run_dir.display(),
            outcome.steps
        ),
    }
    Ok(0)
}

fn run_generate(args: GenerateArgs) -> anyhow::Result<i32> {
    struct Generate(GenerateArgs);
    impl DeviceJob for Generate {
        type Output = String;
        fn run<B: DeviceBackend>(self) -> anyhow::Result<String> {
            let args = self.0;
            let device = process_device::<B>(args.device)?;
            let (model, tokenizer, config) = match (&args.checkpoint, &args.init_from) {
                (_, Some(source)) => generate::load_hugging_face::<B>(source, &device)?,
                (Some(checkpoint), None) => generate::load_model::<B>(checkpoint, &device)?,
                (None, None) => bail!("give --checkpoint or --init-from"),
            };
            let sampling = generate::Sampling {
                max_new_tokens: args.max_new_tokens,
                temperature: args.temperature,
                top_k: args.top_k,
                seed: args.seed,
                kv_cache: !args.no_kv_cache,
            };
            let prompt = args.prompt.replace("\\n", "\n");
            generate::generate(&model, &tokenizer, &prompt, &sampling, config.context)
        }
    }
    println!("{}", on_device(args.device.kind, Generate(args))?);
    Ok(0)
}

/// `5GB`, `500MB`, `10KB` or a plain number of bytes (powers of 1000).
fn parse_bytes(text: &str) -> Result<u64, String> {
    let upper = text.trim().to_ascii_uppercase();
    let (digits, unit) = match upper.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => upper.split_at(at),
        None => (upper.as_str(), ""),
    };
    let unit = match unit {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => {
            return Err(format!(
                "{text:?}: expected bytes, or a number with KB, MB or GB"
            ));
        }
    };
    match digits.parse::<u64>() {
        Ok(n) if n > 0 => Ok(n * unit),
        _ => Err(format!(
            "{text:?}: expected a positive whole number of bytes, KB, MB or GB"
        )),
    }
}

fn run_export(args: ExportArgs) -> anyhow::Result<i32> {
    struct Export(ExportArgs);
    impl DeviceJob for Export {
        type Output = PathBuf;
        fn run<B: DeviceBackend>(self) -> anyhow::Result<PathBuf> {
            let args = self.0;
            let device = process_device::<B>(args.device)?;
            let (model, tokenizer, config) = generate::load_model::<B>(&args.checkpoint, &device)?;
            match args.format {
                ExportFormat::HfSafetensors => {
                    hf::export(&model, &config, &tokenizer, &args.out, args.max_shard_size)
                }
            }
        }
    }
    let path = on_device(args.device.kind, Export(args))?;
    println!(
        "wrote {} (and config.json beside it, with tokenizer.json for a Hugging Face tokenizer)",
        path.display()
    );
    Ok(0)
}

fn run_launch(args: LaunchArgs) -> anyhow::Result<i32> {
    if !(args.grace_secs.is_finite() && args.grace_secs >= 0.0) {
        bail!(
            "--grace-secs {} must be a non-negative number",
            args.grace_secs
        );
    }
    let config = LaunchConfig {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        bind: args.bind,
        max_restarts: args.max_restarts,
        grace: Duration::from_secs_f64(args.grace_secs),
        command: args.command,
    };
    match launch::launch(&config) {
        Ok(()) => Ok(0),
        Err(e) => {
            eprintln!("wildfire launch: {e}");
            Ok(e.exit_code())
        }
    }
}

fn run_comm_check(args: CommCheckArgs) -> anyhow::Result<i32> {
    match args.device.as_str() {
        "cpu" => {}
        // Without a driver, a clear error here rather than a panic inside the CUDA runtime.
        #[cfg(feature = "cuda")]
        "cuda" => wildfire_backend::comm::nccl_device::check_cuda_driver()?,
        #[cfg(not(feature = "cuda"))]
        "cuda" => bail!("--device cuda needs a build with `--features cuda`"),
        other => bail!("--device {other:?}: expected cpu or cuda"),
    }
    let options = args.ranks.options()?;
    let worlds = match args.threads {
        Some(n) => ProcessGroup::local_world(n, options)?,
        None => vec![ProcessGroup::init(
            &LaunchEnv::detect(&args.ranks.flags())?,
            options,
        )?],
    };
    let large = !args.small;
    let device = args.device.clone();
    let handles: Vec<_> = worlds
        .into_iter()
        .map(|world| {
            let device = device.clone();
            std::thread::spawn(move || check_one(&world, &device, large))
        })
        .collect();
    let mut failed = false;
    for handle in handles {
        match handle.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                eprintln!("comm-check FAILED: {e}");
                failed = true;
            }
            Err(_) => {
                eprintln!("comm-check FAILED: a rank panicked");
                failed = true;
            }
        }
    }
    Ok(i32::from(failed))
}

fn check_one(world: &ProcessGroup, device: &str, large: bool) -> Result<(), String> {
    let started = std::time::Instant::now();
    let summary = match device {
        "cpu" => selfcheck::run::<Flex>(world, &Default::default(), large)?,
        #[cfg(feature = "cuda")]
        "cuda" => {
            // One GPU per rank: the launcher's LOCAL_RANK, or the rank when ranks are threads.
            let ordinal = std::env::var("LOCAL_RANK")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(world.rank());
            if world.size() == 1 {
                // Groups of one skip NCCL, so exercise it here with a one-rank communicator.
                let timeout = world.options().timeout;
                let probe = wildfire_backend::comm::nccl_device::probe_one_rank(ordinal, timeout);
                println!("comm-check: {}", probe.map_err(|e| e.to_string())?);
            }
            let device = burn::backend::cuda::CudaDevice::new(ordinal);
            selfcheck::run::<wildfire_backend::device::FusedCuda>(world, &device, large)?
        }
        other => return Err(format!("--device {other:?} is not available in this build")),
    };
    println!(
        "comm-check passed: rank {} of {} ({} transport, {device} tensors), {} exact checks \
         ({} of them folds of seeded non-integer values, bit for bit) in {:.2} s{}",
        world.rank(),
        world.size(),
        world.transport_name(),
        summary.checks,
        summary.fold_checks,
        started.elapsed().as_secs_f64(),
        if summary.skipped.is_empty() {
            String::new()
        } else {
            format!("; skipped: {}", summary.skipped.join("; "))
        }
    );
    Ok(())
}
