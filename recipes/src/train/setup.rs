//! Preparing a run: corpus and tokenizer, model (fresh, imported or resumed), optimizer,
//! schedule, the run directory, and burn-train's `SupervisedTraining` around [`StepLoop`].
//! Everything that can fail on bad input is checked before the run directory is touched.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::LearningRateMetric;
use burn::train::{Learner, SupervisedTraining, TrainingStrategy};

use super::{EvalLoader, GptComponents, LoopSettings, StepLoop, TrainLoader};
use crate::checkpoint::{self, Loaded, TrainState};
use crate::config::{RunConfig, check_same_model};
use crate::data::{Sampler, Splits, Tokenizer, TokenizerKind, load_text};
use crate::logging::{GradNorm, LogRenderer, Loss, MetricsSink, Mfu, StepScalar, TokensPerSec};
use crate::model::{Gpt, GptConfig, StageSpec};
use crate::optim::{MatrixDecayAdamW, SharedOptimizer, WarmupCosine};

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

/// The newest checkpoint to resume from, after refusing to start a fresh run over an existing
/// one (its checkpoints would be pruned and its metrics mixed with the new run's).
fn check_run_dir(run_dir: &Path, resume: bool) -> anyhow::Result<Option<PathBuf>> {
    let checkpoints = run_dir.join("checkpoints");
    let latest = checkpoint::store::latest_checkpoint(&checkpoints)?;
    let metrics = run_dir.join("metrics.jsonl");
    match (&latest, resume) {
        (None, true) => bail!(
            "--resume: no complete checkpoint in {}",
            checkpoints.display()
        ),
        (Some(dir), false) => bail!(
            "{} already holds checkpoints (newest: {}); pass --resume to continue that run, or \
             set run.dir to a new directory",
            checkpoints.display(),
            dir.display()
        ),
        (None, false) if metrics.exists() => bail!(
            "{} already holds a run's metrics ({}); set run.dir to a new directory or remove it",
            run_dir.display(),
            metrics.display()
        ),
        _ => Ok(latest),
    }
}

/// The corpus as tokens, with the tokenizer and the model sizes it implies.
struct Data {
    tokenizer: Tokenizer,
    model: GptConfig,
    splits: Splits,
}

fn prepare_data(config: &RunConfig, resumed: Option<&Loaded>) -> anyhow::Result<Data> {
    let text = load_text(&config.data.path)?;
    let tokenizer = match (config.data.tokenizer, resumed) {
        (TokenizerKind::Char, Some(loaded)) => Tokenizer::from_chars(&loaded.state.vocab),
        (TokenizerKind::Char, None) => Tokenizer::char_level(&text),
        (TokenizerKind::Gpt2, _) => Tokenizer::gpt2()?,
    };
    let tokens = tokenizer.encode(&text).with_context(|| {
        format!(
            "corpus {} does not fit the tokenizer",
            config.data.path.display()
        )
    })?;
    let model = config.model.resolve(tokenizer.vocab_size())?;
    if let Some(loaded) = resumed {
        check_same_model(&loaded.state.model, &model)?;
    }
    let splits = Splits::new(tokens, config.data.val_fraction, model.context)?;
    Ok(Data {
        tokenizer,
        model,
        splits,
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

/// Trains as `config` says, on backend `B`'s default device. With `resume`, continues from the
/// newest complete checkpoint of `config.run.dir` (see [`resume_config`] for its config).
pub fn run<B: AutodiffBackend>(config: RunConfig, resume: bool) -> anyhow::Result<TrainOutcome> {
    let run_dir = config.run.dir.clone();
    let resumed = check_run_dir(&run_dir, resume)?
        .map(|dir| checkpoint::load(&dir))
        .transpose()?;
    let Data {
        tokenizer,
        model: model_config,
        splits,
    } = prepare_data(&config, resumed.as_ref())?;
    let (n_train, n_val) = (splits.train.len(), splits.val.len());

    let device = B::Device::default();
    B::seed(&device, config.train.seed);
    let mut model = Gpt::<B>::new(&model_config, StageSpec::whole(&model_config), &device);
    let optimizer =
        SharedOptimizer::new(OptimizerAdaptor::from(MatrixDecayAdamW::new(&config.train)));
    let mut schedule = WarmupCosine::new(&config.train);
    let global_batch = config.train.micro_batch * config.train.grad_accum;
    let mut sampler = Sampler::new(
        n_train,
        model_config.context,
        global_batch,
        config.train.seed,
        (0, 1),
    )?;
    let mut start_step = 0;
    match (resumed, &config.run.init_from) {
        (Some(mut loaded), _) => {
            model = loaded.apply_params(model)?;
            loaded.apply_moments(&model, &optimizer)?;
            schedule.next_step = loaded.state.schedule_step;
            sampler.seek(loaded.state.cursor);
            start_step = loaded.state.step;
        }
        (None, Some(source)) => model = crate::hf::init_from(model, source)?,
        (None, None) => {}
    }

    let resolved = ResolvedConfig {
        run: &config,
        model: &model_config,
    };
    let config_toml = write_run_config(&run_dir, &resolved)?;
    let sampler = Arc::new(Mutex::new(sampler));
    let strategy = Arc::new(StepLoop {
        settings: LoopSettings {
            start_step,
            max_steps: config.train.max_steps,
            grad_accum: config.train.grad_accum,
            grad_clip: config.train.grad_clip,
            eval_every: config.train.eval_every,
            checkpoint_every: config.checkpoint.every,
            keep_last: config.checkpoint.keep_last,
            seed: config.train.seed,
            flops_per_token: model_config.flops_per_token(model_config.context),
            peak_flops: config.run.peak_flops,
        },
        optimizer: optimizer.clone(),
        sampler: sampler.clone(),
        sink: Mutex::new(MetricsSink::open(&run_dir, &config_toml, start_step)?),
        state: TrainState {
            step: start_step,
            config: config.clone(),
            model: model_config.clone(),
            tokenizer: tokenizer.kind(),
            vocab: tokenizer.vocab_string(),
            cursor: Default::default(),
            rng_seed: config.train.seed,
            schedule_step: start_step,
            optimizer_steps: Default::default(),
        },
        checkpoint_root: run_dir.join("checkpoints"),
        error: Mutex::new(None),
        losses: Mutex::new(Vec::new()),
    });

    let context = model_config.context;
    let micro = config.train.micro_batch;
    let max_steps = config.train.max_steps as usize;
    let train_loader = TrainLoader::<B>::new(
        Arc::new(splits.train),
        sampler,
        micro,
        context,
        max_steps,
        device.clone(),
    );
    let eval_batches = config.train.eval_batches;
    let eval_loader = EvalLoader::new(
        Arc::new(splits.val),
        micro,
        context,
        eval_batches,
        device_inner::<B>(&device),
    );
    let mut training = SupervisedTraining::<GptComponents<B>>::new(
        run_dir.join("burn-train"),
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
    let mfu_known = config.run.peak_flops.is_some();
    if mfu_known {
        training = training.metric_train_numeric(StepScalar::<Mfu>::default());
    }
    if !std::io::stdout().is_terminal() {
        training = training.renderer(LogRenderer::new(config.run.log_every as usize, mfu_known));
    }
    println!(
        "training {} parameters ({} layers, {} heads, d_model {}, context {}) on {n_train} train / \
         {n_val} val tokens, steps {start_step}..{max_steps}",
        model_config.parameter_count(),
        model_config.n_layer,
        model_config.n_head,
        model_config.d_model,
        model_config.context,
    );
    training.launch(Learner::new(model, optimizer, schedule));

    if let Some(error) = strategy
        .error
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
    {
        return Err(error);
    }
    let losses = std::mem::take(&mut *strategy.losses.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(TrainOutcome {
        run_dir,
        steps: start_step + losses.len() as u64,
        losses,
    })
}

/// The inner backend's device that corresponds to `device`.
fn device_inner<B: AutodiffBackend>(device: &B::Device) -> burn::tensor::Device<B::InnerBackend> {
    burn::tensor::Tensor::<B, 1>::zeros([1], device)
        .inner()
        .device()
}
