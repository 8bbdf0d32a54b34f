//! Preparing a run: corpus and tokenizer, model (fresh, imported or resumed), optimizer,
//! schedule, the run directory, and burn-train's `SupervisedTraining` around [`StepLoop`].
//! Everything that can fail on bad input is checked before the run directory is touched.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::train::metric::LearningRateMetric;
use burn::train::{Learner, SupervisedTraining, TrainingStrategy};

use burn::backend::Flex;
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType};
use serde::{Deserialize, Serialize};
use wildfire_backend::comm::LaunchSource;
use wildfire_backend::comm::{CommOptions, LaunchEnv, LaunchFlags, ProcessGroup, split_ranges};
use wildfire_backend::device::{DeviceKind, measure_matmul_flops};
use wildfire_backend::kernels::matmul::{MatmulPrecision, set_matmul_precision};
use wildfire_backend::kernels::route::describe_kernel_paths;
use wildfire_backend::profile::profile_kernels_into;
use wildfire_parallel::dp::FlatLayout;
use wildfire_parallel::fsdp::{Placeholders, ZeroStage};
use wildfire_parallel::mesh::{Mesh, ParallelDims, PipelinePlan};
use wildfire_parallel::paths::param_values;
use wildfire_parallel::pp::graphs_lock;

use super::{
    EvalLoader, GptComponents, LoopSettings, Optimizers, RankContext, StepLoop, TrainLoader,
    counted_elsewhere, zero_layout,
};
use wildfire_parallel::learner_update::LearnerUpdate;
use wildfire_parallel::precision::DynamicLossScaler;
use wildfire_parallel::replicas::verify_replicas;
use wildfire_parallel::split::ModelSplit;
use wildfire_parallel::update::{Update, UpdateGroups, inner_device_of, lock, zero_optimizer};

use crate::TrainBackend;
use crate::checkpoint::ModuleLayout;
use crate::checkpoint::{self, Loaded, TrainState};
use crate::config::ActivationCheckpointing;
use crate::config::{RunConfig, Transport, check_same_model};
use crate::data::{self, Sampler, Splits, Tokenizer, TokenizerKind, Tokens, load_text};
use crate::device::{DeviceBackend, DeviceJob, on_device};
use crate::logging::{
    Bubble, GradNorm, LogRenderer, Loss, MetricsSink, Mfu, StepScalar, TokensPerSec,
};
use crate::model::{
    Gpt, GptChunks, GptConfig, SEQUENCE_DIM, StageSpec, TIED_COPY, TOKEN_EMBEDDING, tp_rules,
    whole_model_rules,
};
use crate::optim::{MatrixDecayAdamW, WarmupCosine};
use wildfire_backend::kernels::choice::FusedOp;
use wildfire_parallel::tp::{SequencePartial, TpPlan, apply_plan};

/// What a finished (or stopped) run reports to its caller.
#[derive(Debug)]
pub struct TrainOutcome {
    pub run_dir: PathBuf,
    /// Steps completed, counting those before a resume.
    pub steps: u64,
    /// Mean loss of each step this process ran.
    pub losses: Vec<f64>,
}

/// The config to resume the run in `run_dir` with: the one saved in its newest checkpoint, with
/// `overrides` on top (see [`RunConfig::for_resume`]) and `run.dir` pointing at `run_dir`.
pub fn resume_config(run_dir: &Path, overrides: &[String]) -> anyhow::Result<RunConfig> {
    let checkpoints = run_dir.join("checkpoints");
    let Some(dir) = checkpoint::store::latest_checkpoint(&checkpoints)? else {
        bail!(
            "--resume: no complete checkpoint in {}",
            checkpoints.display()
        );
    };
    let manifest = checkpoint::store::read_manifest(&dir)?;
    let state: TrainState = serde_json::from_value(manifest.state)
        .with_context(|| format!("checkpoint {} has an unreadable state", dir.display()))?;
    let mut config = RunConfig::for_resume(&state.config, overrides)?;
    config.run.dir = run_dir.to_path_buf();
    Ok(config)
}

/// How a run treats its run directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// A new run: the directory holds no checkpoint and no metrics.
    Fresh,
    /// Continue from the directory's newest complete checkpoint.
    Resume,
    /// A new run in place of one that was stopped before its first checkpoint (a restarted
    /// job's): that run's metrics are dropped, as a resume drops those after its checkpoint.
    Restart,
}

/// The config and start of `wildfire train`, from the `given` config (with `overrides`) and
/// its `--resume` flag:
/// - `--resume [DIR]` continues the run in `DIR` (default `run.dir`) with the config saved in
///   its newest checkpoint ([`resume_config`]);
/// - `--resume auto` continues `run.dir`'s run when it has a complete checkpoint and starts it
///   anew otherwise (what a restarted job runs: before the first checkpoint there is nothing
///   to continue);
/// - without `--resume`, a `run.dir` whose newest checkpoint was saved with exactly the given
///   config continues (the same command run twice goes on, or finds the run finished); another
///   config there is refused when the run starts.
pub fn start(
    given: RunConfig,
    overrides: &[String],
    resume: Option<Option<&Path>>,
) -> anyhow::Result<(RunConfig, Start)> {
    let run_dir = given.run.dir.clone();
    let has_checkpoint = || checkpoint::store::latest_checkpoint(&run_dir.join("checkpoints"));
    match resume {
        Some(Some(dir)) if dir == Path::new("auto") => match has_checkpoint()? {
            Some(_) => Ok((resume_config(&run_dir, overrides)?, Start::Resume)),
            None => Ok((given, Start::Restart)),
        },
        Some(dir) => {
            let config = resume_config(dir.unwrap_or(&run_dir), overrides)?;
            Ok((config, Start::Resume))
        }
        None => match has_checkpoint()? {
            Some(_) if resume_config(&run_dir, &[])? == given => Ok((given, Start::Resume)),
            _ => Ok((given, Start::Fresh)),
        },
    }
}

/// The newest checkpoint to resume from, after refusing to start a fresh run over an existing
/// one (its checkpoints would be pruned and its metrics mixed with the new run's).
fn check_run_dir(run_dir: &Path, start: Start) -> anyhow::Result<Option<PathBuf>> {
    let checkpoints = run_dir.join("checkpoints");
    let latest = checkpoint::store::latest_checkpoint(&checkpoints)?;
    let metrics = run_dir.join("metrics.jsonl");
    match (&latest, start) {
        (None, Start::Resume) => bail!(
            "--resume: no complete checkpoint in {}",
            checkpoints.display()
        ),
        (Some(dir), Start::Fresh | Start::Restart) => bail!(
            "{} already holds checkpoints (newest: {}) of a run with another config; pass \
             --resume to continue that run (with its config), or set run.dir to a new directory",
            checkpoints.display(),
            dir.display()
        ),
        (None, Start::Fresh) if metrics.exists() => bail!(
            "{} already holds a run's metrics ({}) but no checkpoint; set run.dir to a new \
             directory, remove it, or pass --resume auto to start that run again",
            run_dir.display(),
            metrics.display()
        ),
        _ => Ok(latest),
    }
}

/// The training and validation tokens, with the tokenizer and the model sizes they imply.
struct Data {
    tokenizer: Tokenizer,
    model: GptConfig,
    train: Tokens,
    val: Tokens,
    /// The manifest hash of prepared data (none for a text corpus).
    hash: Option<String>,
    /// A blend's datasets, `(tokens, base, weight)` in `train` (see `Sampler::blended`).
    blend: Option<Vec<(usize, usize, f64)>>,
}

/// The config's data: a prepared directory (see [`data::Prepared`]), or a text corpus
/// tokenised here, its last `data.val_fraction` of tokens held out.
fn prepare_data(config: &RunConfig, resumed: Option<&Loaded>) -> anyhow::Result<Data> {
    let path = &config.data.path;
    if data::is_prepared(path) {
        let prepared = data::Prepared::open(path)?;
        let (train, val) = (prepared.train, prepared.val);
        return prepared_data(
            config,
            resumed,
            &prepared.manifest,
            (train, val),
            prepared.hash,
        );
    }
    let blend = (!path.exists())
        .then(|| path.to_str().and_then(data::Blend::parse))
        .flatten();
    if let Some(spec) = blend {
        let blend = data::Blend::open(&spec)?;
        let parts = (blend.parts.iter().zip(&blend.bases).zip(&blend.weights))
            .map(|((part, &base), &weight)| (part.train.len(), base, weight))
            .collect();
        let manifest = &blend.parts[0].manifest;
        let tokens = (blend.train.clone(), blend.val.clone());
        let mut data = prepared_data(config, resumed, manifest, tokens, blend.hash.clone())?;
        data.blend = Some(parts);
        return Ok(data);
    }
    if let Some(hash) = resumed.and_then(|loaded| loaded.state.data_hash.as_ref()) {
        bail!(
            "the run was trained on prepared data (manifest sha256 {hash}), but data.path {} is \
             not a prepared directory: resume with the data it was trained on",
            config.data.path.display()
        );
    }
    let text = load_text(&config.data.path)?;
    let tokenizer = match (config.data.tokenizer, resumed) {
        (kind, Some(loaded)) => Tokenizer::stored(kind, &loaded.state.vocab)?,
        (TokenizerKind::Char, None) => Tokenizer::char_level(&text),
        (TokenizerKind::Gpt2, None) => Tokenizer::gpt2()?,
        (TokenizerKind::Hf, None) => Tokenizer::hugging_face(&config.tokenizer_file()?)?,
    };
    let tokens = tokenizer.encode(&text).with_context(|| {
        format!(
            "corpus {} does not fit the tokenizer",
            config.data.path.display()
        )
    })?;
    let model = config.model(tokenizer.vocab_size())?;
    if let Some(loaded) = resumed {
        check_same_model(&loaded.state.model, &model)?;
    }
    let splits = Splits::new(tokens, config.data.val_fraction, model.context)?;
    Ok(Data {
        tokenizer,
        model,
        train: Tokens::Memory(Arc::new(splits.train)),
        val: Tokens::Memory(Arc::new(splits.val)),
        hash: None,
        blend: None,
    })
}

/// Prepared data (one directory, or a blend) as the run's: its tokenizer (from `manifest`) must
/// be the config's, and a resumed run's data must be the data it trained on (`hash` names every
/// shard's hash).
fn prepared_data(
    config: &RunConfig,
    resumed: Option<&Loaded>,
    manifest: &data::Manifest,
    (train, val): (Tokens, Tokens),
    hash: String,
) -> anyhow::Result<Data> {
    let path = &config.data.path;
    if manifest.tokenizer != config.data.tokenizer {
        bail!(
            "data.path {} was prepared with the {} tokenizer, but data.tokenizer = {}: set \
             data.tokenizer = \"{}\"",
            path.display(),
            manifest.tokenizer,
            config.data.tokenizer,
            manifest.tokenizer
        );
    }
    if let Some(loaded) = resumed {
        let trained_on = loaded.state.data_hash.as_deref();
        if trained_on != Some(hash.as_str()) {
            bail!(
                "data.path {} was prepared differently from the data this run trained on \
                 (manifest sha256 {hash}, the checkpoint's {}): resume with the data it trained \
                 on",
                path.display(),
                trained_on.unwrap_or("none: it trained on a text corpus")
            );
        }
    }
    let tokenizer = Tokenizer::stored(manifest.tokenizer, &manifest.vocab)?;
    let model = config.model(tokenizer.vocab_size())?;
    if let Some(loaded) = resumed {
        check_same_model(&loaded.state.model, &model)?;
    }
    let window = model.context + 1;
    let (n_train, n_val) = (train.len(), val.len());
    if n_train < window || (config.train.eval_every > 0 && n_val < window) {
        bail!(
            "data.path {} holds {n_train} training and {n_val} validation tokens; each needs at \
             least context + 1 = {window} (prepare with a larger --val-fraction, or set \
             train.eval_every = 0 to train without evaluation)",
            path.display()
        );
    }
    Ok(Data {
        tokenizer,
        model,
        train,
        val,
        hash: Some(hash),
        blend: None,
    })
}

/// The run's configuration as saved: the file's sections plus the resolved model sizes.
#[derive(Debug, serde::Serialize)]
struct ResolvedConfig<'a> {
    #[serde(flatten)]
    run: &'a RunConfig,
    #[serde(rename = "resolved_model")]
    model: &'a GptConfig,
}

/// Creates the run directory and writes `config.json`; returns the config as TOML text.
fn write_run_config(run_dir: &Path, resolved: &ResolvedConfig) -> anyhow::Result<String> {
    std::fs::create_dir_all(run_dir)
        .with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
    let path = run_dir.join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(resolved)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(toml::to_string_pretty(resolved)?)
}

/// [`run`] on the backend of `run.device`, with Burn's checkpointing strategy when the config
/// asks for selective activation checkpointing.
pub fn run_on_device(config: RunConfig, start: Start) -> anyhow::Result<TrainOutcome> {
    struct Train(RunConfig, Start);
    impl DeviceJob for Train {
        type Output = TrainOutcome;
        fn run<P: DeviceBackend>(self) -> anyhow::Result<TrainOutcome> {
            let Train(config, start) = self;
            match config.train.activation_checkpointing {
                ActivationCheckpointing::Selective => run::<P::TrainSelective>(config, start),
                _ => run::<P::Train>(config, start),
            }
        }
    }
    on_device(config.run.device.kind, Train(config, start))
}

/// Trains as `config` says, on backend `B`'s devices (one per rank, see `DeviceSpec::ordinal`):
/// on one rank, or on every rank of the parallel layout (`parallel.transport`: the processes of
/// a launched job, or threads of this process). [`Start::Resume`] continues from the newest
/// complete checkpoint of `config.run.dir` (see [`resume_config`] for its config). Returns rank
/// 0's outcome. `B`'s autodiff must use Burn's `BalancedCheckpointing` exactly when
/// `train.activation_checkpointing = selective`.
pub fn run<B: TrainBackend>(config: RunConfig, start: Start) -> anyhow::Result<TrainOutcome> {
    let options = CommOptions::from_env()?;
    profile_kernels::<B>(&config)?;
    match config.parallel.transport {
        Transport::Launch => {
            let launched = LaunchEnv::detect(&LaunchFlags::default())?;
            let place = HostPlace {
                local_rank: (launched.source != LaunchSource::Single)
                    .then_some(launched.local_rank),
                thread_rank: 0,
                ranks_on_host: launched.local_world_size,
            };
            let world = ProcessGroup::init(&launched, options)?;
            run_rank::<B>(config, start, world, place)
        }
        Transport::Local => {
            let launched = LaunchEnv::detect(&LaunchFlags::default())?;
            if launched.world_size > 1 {
                bail!(
                    "parallel.transport = local runs every rank as a thread of this process, but \
                     this process was launched as rank {} of {}: pass --transport launch (a run \
                     saved with local keeps it on --resume)",
                    launched.rank,
                    launched.world_size
                );
            }
            if config.parallel.tp > 1 {
                bail!(
                    "parallel.tp = {} needs one process per rank (--transport launch, under \
                     `wildfire launch --nproc-per-node N`): thread ranks share one autodiff lock, \
                     and a tensor-parallel collective inside a forward or backward would wait \
                     on a rank that cannot take it",
                    config.parallel.tp
                );
            }
            let ranks = config.parallel.dp * config.parallel.tp * config.parallel.pp;
            let worlds = ProcessGroup::local_world(ranks, options)?;
            let ranks = worlds
                .into_iter()
                .map(|world| {
                    let config = config.clone();
                    let place = HostPlace {
                        local_rank: None,
                        thread_rank: world.rank(),
                        ranks_on_host: ranks,
                    };
                    std::thread::Builder::new()
                        .name(format!("rank-{}", world.rank()))
                        .spawn(move || run_rank::<B>(config, start, world, place))
                })
                .collect::<std::io::Result<Vec<_>>>()?;
            first_outcome(ranks.into_iter().map(|rank| rank.join()))
        }
    }
}

/// Under `run.profile`: CubeCL's kernel profiling on for this process, into
/// [`kernel_profile_file`], before any device starts. Refused on the CPU, which runs no CubeCL
/// kernels.
fn profile_kernels<B: TrainBackend>(config: &RunConfig) -> anyhow::Result<()> {
    if config.run.profile == 0 {
        return Ok(());
    }
    if B::KIND == DeviceKind::Cpu {
        bail!(
            "run.profile = {} profiles CubeCL's kernels, which the cpu device does not run: \
             profile on --device wgpu or cuda",
            config.run.profile
        );
    }
    profile_kernels_into(&kernel_profile_file()).map_err(anyhow::Error::msg)
}

/// Where this process's kernel profile goes: a file of the system's temporary folder, named
/// after the process.
fn kernel_profile_file() -> PathBuf {
    std::env::temp_dir().join(format!("wildfire-kernels-{}.log", std::process::id()))
}

/// Where a rank sits on its host: what picks its device (see `DeviceSpec::ordinal`) and how
/// many ranks share the host (and so a CPU's cores, for MFU).
#[derive(Debug, Clone, Copy)]
struct HostPlace {
    /// The launcher's `LOCAL_RANK`, for a launched process.
    local_rank: Option<usize>,
    /// The rank's index among the threads of this process.
    thread_rank: usize,
    ranks_on_host: usize,
}

/// Rank 0's outcome when every rank succeeded; otherwise every failure, by rank.
fn first_outcome(
    results: impl Iterator<Item = std::thread::Result<anyhow::Result<TrainOutcome>>>,
) -> anyhow::Result<TrainOutcome> {
    let mut outcomes = Vec::new();
    let mut failures = Vec::new();
    for (rank, result) in results.enumerate() {
        match result {
            Ok(Ok(outcome)) => outcomes.push(outcome),
            Ok(Err(error)) => failures.push(format!("rank {rank}: {error:#}")),
            Err(_) => failures.push(format!("rank {rank}: panicked")),
        }
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    outcomes
        .into_iter()
        .next()
        .context("a parallel run with no ranks")
}

/// This rank's part of the run: its place in the layout, the checked run directory and data,
/// the model and its optimizer, then burn-train's loop around [`StepLoop`].
fn run_rank<B: TrainBackend>(
    config: RunConfig,
    start: Start,
    world: ProcessGroup,
    place: HostPlace,
) -> anyhow::Result<TrainOutcome> {
    let device = rank_device::<B>(&config, place)?;
    check_precision::<B>(&config, &device)?;
    let dims = parallel_dims(&config)?;
    let train = &config.train;
    let global_batch =
        dims.global_batch(train.global_batch, train.micro_batch, train.grad_accum)?;
    let bucket_bytes = config.parallel.bucket_bytes()?;
    let mesh = Mesh::new(world, dims)?;
    let resumed = open_run_dir(&config.run.dir, start, mesh.world())?;
    let data = prepare_data(&config, resumed.as_ref())?;
    check_model_settings::<B>(&config, &data.model, dims)?;
    let parallel = &config.parallel;
    let plan = dims.pipeline(
        parallel.schedule_kind()?,
        parallel.virtual_stages,
        config.train.grad_accum,
        data.model.n_layer,
        &parallel.stage_layers,
    )?;
    // Every rank has checked the run directory before rank 0 writes into it.
    mesh.world().barrier()?;
    // Process-wide: ranks that are threads of this process set the same value.
    set_matmul_precision(config.precision.matmul);
    let peak = device_peak::<B>(&config, &device, place, mesh.world())?;
    let (layout, model) = build_model::<B>(
        &config,
        &data.model,
        resumed.as_ref(),
        &mesh,
        &plan,
        &device,
    )?;
    // Threads share the RNG: no rank may reseed it (each step does) while another still draws.
    mesh.world().barrier()?;
    verify_replicas(&model, mesh.data())?;
    let progress = Progress::new(&config, &data, resumed.as_ref(), &mesh, global_batch)?;
    let (model, optimizers) = build_optimizers(
        &config,
        model,
        &layout,
        resumed.as_ref(),
        &mesh,
        bucket_bytes,
        &device,
    )?;
    let offload = parallel.offload_optimizer;
    report_state_bytes(mesh.world(), &optimizers, dims.zero, offload)?;
    let rank = rank_context(&mesh, &data.model, plan, layout, &model)?;
    let optimizer = LearnerUpdate::new(
        optimizers,
        UpdateGroups::from(&mesh),
        config.train.grad_clip,
        counted_elsewhere(&model, &rank.layout),
    );
    let strategy = Arc::new(StepLoop {
        settings: loop_settings(
            &config,
            &data.model,
            dims,
            progress.start_step,
            peak.as_ref(),
        ),
        optimizer: optimizer.clone(),
        sampler: progress.sampler.clone(),
        scaler: loss_scaler(&config, resumed.as_ref())?.map(Mutex::new),
        sink: open_metrics(&config, &data.model, mesh.world(), progress.start_step)?,
        state: checkpoint_template(&config, &data, progress.start_step),
        checkpoint_root: config.run.dir.join("checkpoints"),
        writer: Default::default(),
        rank,
        error: Mutex::new(None),
        losses: Mutex::new(Vec::new()),
        interval: Default::default(),
        profile_offset: Mutex::new(0),
    });
    if mesh.world().rank() == 0 {
        describe_run(&config, &data, &strategy.rank.split.plan, dims, &progress);
        describe_peak(&config, peak.as_ref());
    }
    // Everything the checkpoint held is in the model and optimizer now.
    drop(resumed);
    let training = supervised_training(&config, data, &progress, &strategy, &device);
    training.launch(Learner::new(model, optimizer, progress.schedule));
    if mesh.world().rank() == 0 {
        // Which implementation each fused op's calls took in this process: never silently the
        // reference.
        for line in describe_kernel_paths() {
            println!("kernel path: {line}");
        }
    }
    outcome(&strategy, config.run.dir, progress.start_step)
}

/// The layout the config's `[parallel]` section asks for.
fn parallel_dims(config: &RunConfig) -> anyhow::Result<ParallelDims> {
    let parallel = &config.parallel;
    Ok(ParallelDims {
        dp: parallel.dp,
        tp: parallel.tp,
        pp: parallel.pp,
        zero: parallel.zero_stage()?,
        sequence_parallel: parallel.sequence_parallel,
    })
}

/// The checkpoint to resume from, if any (see [`check_run_dir`]), once rank 0 has removed what
/// a stopped run's unfinished saves left (before any rank writes).
fn open_run_dir(
    run_dir: &Path,
    start: Start,
    world: &ProcessGroup,
) -> anyhow::Result<Option<Loaded>> {
    if world.rank() == 0 {
        let stale = checkpoint::store::remove_stale(&run_dir.join("checkpoints"))?;
        if !stale.is_empty() {
            println!(
                "removed {} unfinished checkpoint writes: {stale:?}",
                stale.len()
            );
        }
    }
    check_run_dir(run_dir, start)?
        .map(|dir| checkpoint::load(&dir))
        .transpose()
}

/// Refuses model settings the layout or the backend cannot train as asked: heads or context
/// that tensor parallelism cannot split, activation checkpointing the backend's autodiff does
/// not do, and dropout where a block's forward is recomputed (full checkpointing, ZeRO 3).
fn check_model_settings<B: TrainBackend>(
    config: &RunConfig,
    model: &GptConfig,
    dims: ParallelDims,
) -> anyhow::Result<()> {
    dims.check_tensor_parallel(model.n_head, model.context)?;
    let (kv_heads, tp) = (model.n_kv_head, dims.tp);
    if !kv_heads.is_multiple_of(tp) && !tp.is_multiple_of(kv_heads) {
        bail!(
            "model.n_kv_head = {kv_heads} and parallel.tp = {tp} do not divide one another: \
             each rank holds whole key/value heads (tp dividing them) or one key/value head \
             shared with other ranks (they dividing tp)"
        );
    }
    let checkpointing = config.train.activation_checkpointing;
    if (checkpointing == ActivationCheckpointing::Selective) != B::RECOMPUTES_MEMORY_BOUND_OPS {
        bail!(
            "train.activation_checkpointing = {checkpointing} needs a backend whose autodiff \
             {} Burn's BalancedCheckpointing (`train::run_on_device` picks the right one)",
            if B::RECOMPUTES_MEMORY_BOUND_OPS {
                "does not use"
            } else {
                "uses"
            }
        );
    }
    if checkpointing == ActivationCheckpointing::Full && model.dropout > 0.0 {
        bail!(
            "train.activation_checkpointing = full recomputes each block in the backward, which \
             would draw new dropout masks: it needs model.dropout = 0, not {} (selective \
             checkpointing keeps the masks)",
            model.dropout
        );
    }
    if dims.zero == ZeroStage::ShardParameters && model.dropout > 0.0 {
        bail!(
            "ZeRO stage 3 recomputes each block's forward in its backward, which draws new \
             dropout masks: it needs model.dropout = 0, not {}",
            model.dropout
        );
    }
    Ok(())
}

/// This rank's device: `run.device`'s kind, at the index its place picks (see
/// `DeviceSpec::ordinal`).
fn rank_device<B: TrainBackend>(config: &RunConfig, place: HostPlace) -> anyhow::Result<B::Device> {
    let ordinal = config
        .run
        .device
        .ordinal(place.local_rank, place.thread_rank)?;
    Ok(B::device_at(ordinal)?)
}

/// Refuses a precision the device cannot compute in: half-precision compute or matmul inputs
/// on a device without that type's arithmetic, TF32 off CUDA.
fn check_precision<B: TrainBackend>(config: &RunConfig, device: &B::Device) -> anyhow::Result<()> {
    let (precision, device_spec) = (&config.precision, config.run.device);
    let compute = ("precision.compute", precision.compute.to_string());
    let matmul = ("precision.matmul", precision.matmul.to_string());
    let half = [
        (compute, Some(precision.compute.compute_dtype())),
        (matmul, precision.matmul.compute_dtype()),
    ];
    for ((key, value), dtype) in half {
        let Some(dtype) = dtype.filter(|&d| d != FloatDType::F32) else {
            continue;
        };
        if !B::supports_dtype(device, DType::from(dtype)) {
            bail!(
                "{key} = \"{value}\" needs {value} arithmetic, which --device {device_spec} does \
                 not have (use fp32 / off there, or another device)"
            );
        }
    }
    if precision.matmul == MatmulPrecision::Tf32 && B::KIND != DeviceKind::Cuda {
        bail!(
            "precision.matmul = \"tf32\" runs on CUDA tensor cores; --device {device_spec} has \
             none (use off, bf16 or f16 there)"
        );
    }
    Ok(())
}

/// The peak FLOP/s of one rank's device that MFU divides by, and where it comes from.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct DevicePeak {
    flops: f64,
    source: String,
}

/// One rank's peak: `run.peak_flops` when given, else a known GPU's data-sheet peak, else
/// (cpu, wgpu) the f32 matmul rate rank 0 measures while the other ranks wait, split evenly
/// between the ranks that share its host. `None` on a GPU wildfire does not know.
fn device_peak<B: TrainBackend>(
    config: &RunConfig,
    device: &B::Device,
    place: HostPlace,
    world: &ProcessGroup,
) -> anyhow::Result<Option<DevicePeak>> {
    if let Some(flops) = config.run.peak_flops {
        let source = "run.peak_flops".to_string();
        return Ok(Some(DevicePeak { flops, source }));
    }
    if let Some((name, flops)) = B::data_sheet_peak(device) {
        let source = format!("{name}'s dense bf16 peak");
        return Ok(Some(DevicePeak { flops, source }));
    }
    if B::KIND == DeviceKind::Cuda {
        return Ok(None);
    }
    world.barrier()?;
    let measured = (world.rank() == 0).then(|| {
        let machine = measure_matmul_flops::<B::InnerBackend>(device, 512, PEAK_PROBE_TIME);
        DevicePeak {
            flops: machine / place.ranks_on_host as f64,
            source: format!(
                "this machine's measured f32 matmul on {} ({:.1} GFLOP/s) over its {} rank(s)",
                config.run.device,
                machine / 1e9,
                place.ranks_on_host
            ),
        }
    });
    Ok(Some(world.broadcast_json(measured.as_ref())?))
}

/// How long rank 0 multiplies matrices to measure a CPU or wgpu device's peak.
const PEAK_PROBE_TIME: std::time::Duration = std::time::Duration::from_millis(300);

/// The chunks of the GPT this rank trains, and the layout of its parameters in the whole
/// model: the whole model drawn from the seed (the same on every rank), loaded from the
/// checkpoint or Hugging Face weights, split by the tensor-parallel plan, and cut into this
/// pipeline rank's chunks (one block per chunk under ZeRO 3, whose units they are).
fn build_model<B: TrainBackend>(
    config: &RunConfig,
    model_config: &GptConfig,
    resumed: Option<&Loaded>,
    mesh: &Mesh,
    plan: &PipelinePlan,
    device: &B::Device,
) -> anyhow::Result<(ModuleLayout, GptChunks<B>)> {
    let tensor = mesh.tensor();
    let (tp_rank, tp_size) = (tensor.rank(), tensor.size());
    let sequence_dim = config.parallel.sequence_parallel.then_some(SEQUENCE_DIM);
    let rules = tp_rules(model_config);
    let tp_plan = TpPlan::new(&rules, tp_rank, tp_size).with_sequence_parallel(sequence_dim);
    // Ranks that are threads share the backend's RNG and autodiff registry: seeding, drawing
    // the model and making its parameters (which registers them) happen under the pipeline's
    // lock, so every rank draws the same model and no graph is cleaned meanwhile.
    let fused_ops = config.train.fused_ops(B::KIND);
    let _lock = graphs_lock();
    B::seed(device, config.train.seed);
    let whole = Gpt::<B>::new(model_config, StageSpec::whole(model_config), device)
        .with_precision(config.precision.compute)
        .with_fused_ops(fused_ops)
        .with_recomputed_blocks(
            config.train.activation_checkpointing == ActivationCheckpointing::Full,
        );
    let whole = match (resumed, &config.run.init_from) {
        (Some(loaded), _) => loaded.apply_params(whole)?,
        (None, Some(source)) => crate::hf::init_from(whole, model_config, source)?,
        (None, None) if B::KIND != DeviceKind::Cpu => drawn_on_cpu(whole, model_config, config)?,
        (None, None) => whole,
    };
    let layout = match model_config.tie_embeddings {
        true => ModuleLayout::of(&whole, tp_plan).with_copy(TIED_COPY, TOKEN_EMBEDDING)?,
        false => ModuleLayout::of(&whole, tp_plan),
    };
    let split_plan = TpPlan::new(&whole_model_rules(model_config), tp_rank, tp_size)
        .with_sequence_parallel(sequence_dim);
    let whole = apply_plan(whole, &split_plan, tensor)?;
    let chunks = match mesh.dims().zero {
        // ZeRO 3 runs one block per unit (see `run_sharded_step`).
        ZeroStage::ShardParameters => {
            let blocks: Vec<_> = (0..model_config.n_layer).map(|b| b..b + 1).collect();
            GptChunks::for_rank(whole, &blocks, 1, 0)
        }
        _ => {
            let pipe_rank = mesh.pipeline().rank();
            GptChunks::for_rank(whole, &plan.stages, mesh.dims().pp, pipe_rank)
        }
    };
    Ok((layout, chunks))
}

/// `whole` with the parameters the CPU backend draws from the run's seed: every device starts
/// from the same model (backends' random generators differ), so a run on wgpu or CUDA follows
/// the CPU run's trajectory up to rounding.
fn drawn_on_cpu<B: Backend>(
    whole: Gpt<B>,
    model_config: &GptConfig,
    config: &RunConfig,
) -> anyhow::Result<Gpt<B>> {
    let cpu = Default::default();
    Flex::seed(&cpu, config.train.seed);
    let drawn = Gpt::<Flex>::new(model_config, StageSpec::whole(model_config), &cpu);
    Ok(ModuleLayout::load_whole(whole, &param_values(&drawn))?)
}

/// Where the run stands: the learning-rate schedule, the sampler of this data-parallel rank's
/// windows (shared by the train loader and the loop, which checkpoints its cursor), the first
/// step, and the global batch in sequences.
#[derive(Clone)]
struct Progress {
    schedule: WarmupCosine,
    sampler: Arc<Mutex<Sampler>>,
    start_step: u64,
    global_batch: usize,
}

impl Progress {
    /// At step 0, or where the resumed checkpoint left the schedule and the sampler.
    fn new(
        config: &RunConfig,
        data: &Data,
        resumed: Option<&Loaded>,
        mesh: &Mesh,
        global_batch: usize,
    ) -> anyhow::Result<Self> {
        let train = &config.train;
        let ranks = (mesh.data().rank(), mesh.dims().dp);
        let (context, seed) = (data.model.context, train.seed);
        let mut sampler = match &data.blend {
            None => Sampler::new(data.train.len(), context, global_batch, seed, ranks)?,
            Some(parts) => Sampler::blended(parts, context, global_batch, seed, ranks)?,
        };
        let mut schedule = WarmupCosine::new(train);
        let mut start_step = 0;
        if let Some(loaded) = resumed {
            schedule.next_step = loaded.state.schedule_step;
            sampler.seek(loaded.state.cursor);
            start_step = loaded.state.step;
        }
        Ok(Self {
            schedule,
            sampler: Arc::new(Mutex::new(sampler)),
            start_step,
            global_batch,
        })
    }
}

/// The optimizer of `model` under the layout's ZeRO stage, with the resumed checkpoint's
/// moments: Burn's AdamW adaptor over DDP's buckets at stage 0, the sharded AdamW otherwise.
/// Under ZeRO 3 the optimizer holds the parameters, and the returned chunks keep placeholders.
fn build_optimizers<B: TrainBackend>(
    config: &RunConfig,
    model: GptChunks<B>,
    layout: &ModuleLayout,
    resumed: Option<&Loaded>,
    mesh: &Mesh,
    bucket_bytes: usize,
    device: &B::Device,
) -> anyhow::Result<(GptChunks<B>, Optimizers<B>)> {
    let stage = mesh.dims().zero;
    let fused = config.train.fused_ops(B::KIND).is_fused(FusedOp::Adamw);
    let adamw = MatrixDecayAdamW::new(&config.train, fused);
    if stage == ZeroStage::Replicated {
        let mut optimizer = OptimizerAdaptor::from(adamw);
        if let Some(loaded) = resumed {
            optimizer = loaded.apply_moments(&model, optimizer, layout)?;
        }
        let buckets = FlatLayout::of_module(&model, bucket_bytes);
        return Ok((model, Optimizers::replicated(optimizer, buckets)));
    }
    let mut zero = zero_optimizer(
        &model,
        stage,
        mesh.data().clone(),
        zero_layout(&model, stage, bucket_bytes),
        adamw.halves(),
        config.parallel.offload_optimizer,
    );
    if let Some(loaded) = resumed {
        zero.set_moments(&loaded.moments_by_id(&model, layout)?)?;
    }
    let model = match stage {
        ZeroStage::ShardParameters => {
            let _lock = graphs_lock();
            model.map(&mut Placeholders {
                device: device.clone(),
            })
        }
        _ => model,
    };
    Ok((model, Update::sharded(zero)))
}

/// The loop's outcome once burn-train returns: its first error, or the steps it ran and their
/// losses.
fn outcome<B: TrainBackend>(
    strategy: &StepLoop<B>,
    run_dir: PathBuf,
    start_step: u64,
) -> anyhow::Result<TrainOutcome> {
    if let Some(error) = lock(&strategy.error).take() {
        let rank = strategy.rank.world.rank();
        return Err(error.context(format!("rank {rank}")));
    }
    let losses = std::mem::take(&mut *lock(&strategy.losses));
    Ok(TrainOutcome {
        run_dir,
        steps: start_step + losses.len() as u64,
        losses,
    })
}

/// The loop's fixed settings.
fn loop_settings(
    config: &RunConfig,
    model: &GptConfig,
    dims: ParallelDims,
    start_step: u64,
    peak: Option<&DevicePeak>,
) -> LoopSettings {
    LoopSettings {
        start_step,
        max_steps: config.train.max_steps,
        grad_accum: config.train.grad_accum,
        eval_every: config.train.eval_every,
        log_every: config.run.log_every,
        profile_steps: config.run.profile,
        profile_file: (config.run.profile > 0).then(kernel_profile_file),
        checkpoint_every: config.checkpoint.every,
        keep_last: config.checkpoint.keep_last,
        checkpoint_in_background: config.checkpoint.in_background,
        seed: config.train.seed,
        flops_per_token: model.flops_per_token(model.context),
        peak_flops: peak.map(|peak| peak.flops),
        dp: dims.dp,
    }
}

/// fp16's loss scaler, with the config's settings; a resumed run continues from its saved scale.
fn loss_scaler(
    config: &RunConfig,
    resumed: Option<&Loaded>,
) -> anyhow::Result<Option<DynamicLossScaler>> {
    let saved = resumed.and_then(|r| r.state.loss_scaler.as_ref());
    Ok(match (config.precision.scaler()?, saved) {
        (Some(scaler), Some(saved)) => Some(scaler.continuing(saved)),
        (scaler, _) => scaler,
    })
}

/// Rank 0's metric files, in the run directory it creates (with `config.json`); none elsewhere.
fn open_metrics(
    config: &RunConfig,
    model: &GptConfig,
    world: &ProcessGroup,
    start_step: u64,
) -> anyhow::Result<Option<Mutex<MetricsSink>>> {
    if world.rank() != 0 {
        return Ok(None);
    }
    let resolved = ResolvedConfig { run: config, model };
    let config_toml = write_run_config(&config.run.dir, &resolved)?;
    let sink = MetricsSink::open(&config.run.dir, &config_toml, start_step)?;
    Ok(Some(Mutex::new(sink)))
}

/// What every checkpoint of the run holds besides its step-dependent fields.
fn checkpoint_template(config: &RunConfig, data: &Data, start_step: u64) -> TrainState {
    TrainState {
        step: start_step,
        config: config.clone(),
        model: data.model.clone(),
        tokenizer: data.tokenizer.kind(),
        vocab: data.tokenizer.definition(),
        data_hash: data.hash.clone(),
        cursor: Default::default(),
        rng_seed: config.train.seed,
        schedule_step: start_step,
        optimizer_steps: Default::default(),
        flat_shapes: Default::default(),
        loss_scaler: None,
    }
}

/// This rank's place in the run (see [`RankContext`]).
fn rank_context<B: TrainBackend>(
    mesh: &Mesh,
    model_config: &GptConfig,
    plan: PipelinePlan,
    layout: ModuleLayout,
    model: &GptChunks<B>,
) -> anyhow::Result<RankContext> {
    let tied = model_config.tie_embeddings.then(|| model.tied_embedding());
    let sequence_partial =
        model.param_ids_where(|name, dims| layout.plan.is_sequence_partial(name, dims));
    let split = ModelSplit::new(mesh, plan, tied, SequencePartial::new(sequence_partial))?;
    Ok(RankContext {
        world: mesh.world().clone(),
        data: mesh.data().clone(),
        replica: mesh.replica().clone(),
        split,
        layout,
    })
}

/// burn-train's `SupervisedTraining` around `strategy`: the loaders of `data`, the step
/// metrics, and the renderer (rank 0 draws progress; other ranks stay quiet).
fn supervised_training<B: TrainBackend>(
    config: &RunConfig,
    data: Data,
    progress: &Progress,
    strategy: &Arc<StepLoop<B>>,
    device: &B::Device,
) -> SupervisedTraining<GptComponents<B>> {
    let rank = strategy.rank.world.rank();
    let (micro, context) = (config.train.micro_batch, data.model.context);
    let max_steps = config.train.max_steps as usize;
    let sampler = progress.sampler.clone();
    let train_loader = TrainLoader::<B>::new(
        data.train,
        sampler,
        micro,
        context,
        max_steps,
        device.clone(),
    );
    let eval_batches = config.train.eval_batches;
    let eval_device = inner_device_of::<B>(device);
    let eval_loader = EvalLoader::new(data.val, micro, context, eval_batches, eval_device);
    let burn_dir = match strategy.rank.world.size() {
        1 => config.run.dir.join("burn-train"),
        _ => config
            .run
            .dir
            .join("burn-train")
            .join(format!("rank-{rank}")),
    };
    let mut training = SupervisedTraining::<GptComponents<B>>::new(
        burn_dir,
        Arc::new(train_loader),
        Arc::new(eval_loader),
    )
    .metric_train_numeric(StepScalar::<Loss>::default())
    .metric_train_numeric(LearningRateMetric::new())
    .metric_train_numeric(StepScalar::<GradNorm>::default())
    .metric_train_numeric(StepScalar::<TokensPerSec>::default())
    .metric_valid_numeric(StepScalar::<Loss>::default())
    .with_application_logger(None)
    .with_training_strategy(TrainingStrategy::Custom(strategy.clone()));
    let mfu_known = strategy.settings.peak_flops.is_some();
    if mfu_known {
        training = training.metric_train_numeric(StepScalar::<Mfu>::default());
    }
    if strategy.rank.split.plan.schedule.num_stages() > 1 {
        training = training.metric_train_numeric(StepScalar::<Bubble>::default());
    }
    if rank != 0 {
        training = training.renderer(LogRenderer::quiet());
    } else if !std::io::stdout().is_terminal() {
        training = training.renderer(LogRenderer::new(config.run.log_every as usize, mfu_known));
    }
    training
}

/// Prints the device and what MFU divides by.
fn describe_peak(config: &RunConfig, peak: Option<&DevicePeak>) {
    match peak {
        Some(peak) => println!(
            "device {}; MFU against {:.3e} FLOP/s per rank: {}",
            config.run.device, peak.flops, peak.source
        ),
        None => println!(
            "device {}; MFU n/a: a GPU without a known peak (set run.peak_flops)",
            config.run.device
        ),
    }
}

/// Prints what the run trains, on what, and over which layout.
fn describe_run(
    config: &RunConfig,
    data: &Data,
    plan: &PipelinePlan,
    dims: ParallelDims,
    progress: &Progress,
) {
    let (model, parallel) = (&data.model, &config.parallel);
    println!(
        "training a {} of {} parameters ({} layers, {} heads{}, d_model {}, context {}) on {} \
         train / {} val tokens, steps {}..{}",
        model.kind,
        model.parameter_count(),
        model.n_layer,
        model.n_head,
        match model.n_kv_head == model.n_head {
            true => String::new(),
            false => format!(" sharing {} key/value heads", model.n_kv_head),
        },
        model.d_model,
        model.context,
        data.train.len(),
        data.val.len(),
        progress.start_step,
        config.train.max_steps,
    );
    let kind = config.run.device.kind;
    println!(
        "fused ops on {}: {}",
        kind.name(),
        config.train.fused_ops(kind)
    );
    if plan.schedule.num_stages() > 1 {
        println!("{}", describe_pipeline(plan));
    }
    if dims.tp > 1 {
        let vocab = split_ranges(model.vocab_size, dims.tp);
        println!(
            "tensor parallel: {} ranks{}, {} of {} heads and {}–{} of {} vocabulary rows per \
             rank",
            dims.tp,
            if parallel.sequence_parallel {
                " with sequence parallelism"
            } else {
                ""
            },
            model.n_head / dims.tp,
            model.n_head,
            vocab.iter().map(|r| r.len()).min().unwrap_or(0),
            vocab.iter().map(|r| r.len()).max().unwrap_or(0),
            model.vocab_size,
        );
    }
    let stage = dims.zero;
    if dims.dp > 1 || stage != ZeroStage::Replicated {
        println!(
            "data parallel: {} ranks, {stage}{}, global batch {} sequences ({} per rank per \
             step), gradient buckets of {:.1} MiB",
            dims.dp,
            if parallel.offload_optimizer {
                " with optimizer offload"
            } else {
                ""
            },
            progress.global_batch,
            progress.global_batch / dims.dp,
            parallel.bucket_mb,
        );
    }
}

/// Prints (rank 0) the bytes every rank holds for its model state.
fn report_state_bytes<B: TrainBackend>(
    world: &ProcessGroup,
    optimizers: &Optimizers<B>,
    stage: ZeroStage,
    offload: bool,
) -> anyhow::Result<()> {
    let all = optimizers.state_bytes().gather(world)?;
    if world.rank() == 0 {
        let offload = if offload { ", offload" } else { "" };
        for (rank, bytes) in all.iter().enumerate() {
            println!("model state, rank {rank} ({stage}{offload}): {bytes}");
        }
    }
    Ok(())
}

/// One line on the pipeline: its shape, schedule, stages and theoretical bubble.
fn describe_pipeline(plan: &PipelinePlan) -> String {
    let schedule = &plan.schedule;
    let stages: Vec<String> = plan
        .stages
        .iter()
        .map(|r| format!("{}..{}", r.start, r.end))
        .collect();
    format!(
        "pipeline: {} ranks × {} chunks, {} schedule, {} micro-batches, blocks per stage [{}], \
         ideal bubble {:.1}%, peak stored activations per rank {:?}",
        schedule.stages,
        schedule.virtual_stages,
        schedule.kind,
        schedule.microbatches,
        stages.join(", "),
        100.0 * plan.ideal_bubble,
        plan.peak_in_flight,
    )
}
