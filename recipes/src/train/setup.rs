//! Preparing a run: corpus and tokenizer, model (fresh, imported or resumed), optimizer,
//! schedule, the run directory, and burn-train's `SupervisedTraining` around [`StepLoop`].

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::LearningRateMetric;
use burn::train::{Learner, SupervisedTraining, TrainingStrategy};

use super::{EvalLoader, GptComponents, LoopSettings, StepLoop, TrainLoader};
use crate::checkpoint::{self, TrainState};
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

/// The tokenizer of a run: the checkpoint's when resuming, else built from the corpus.
fn tokenizer(
    kind: TokenizerKind,
    text: &str,
    saved_vocab: Option<&str>,
) -> anyhow::Result<Tokenizer> {
    Ok(match (kind, saved_vocab) {
        (TokenizerKind::Char, Some(vocab)) => Tokenizer::from_chars(vocab),
        (TokenizerKind::Char, None) => Tokenizer::char_level(text),
        (TokenizerKind::Gpt2, _) => Tokenizer::gpt2()?,
    })
}

/// Refuses to start a fresh run over an existing one's checkpoints (it would prune them).
fn check_run_dir(checkpoints: &Path, resume: bool) -> anyhow::Result<Option<PathBuf>> {
    let latest = checkpoint::store::latest_checkpoint(checkpoints)?;
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
        _ => Ok(latest),
    }
}

/// Trains as `config` says, on backend `B`'s default device. With `resume`, continues from the
/// newest complete checkpoint of `config.run.dir`.
pub fn run<B: AutodiffBackend>(config: RunConfig, resume: bool) -> anyhow::Result<TrainOutcome> {
    let run_dir = config.run.dir.clone();
    let checkpoints = run_dir.join("checkpoints");
    let resumed = check_run_dir(&checkpoints, resume)?
        .map(|dir| checkpoint::load(&dir))
        .transpose()?;

    let text = load_text(&config.data.path)?;
    let saved_vocab = resumed.as_ref().map(|l| l.state.vocab.as_str());
    let tokenizer = tokenizer(config.data.tokenizer, &text, saved_vocab)?;
    let tokens = tokenizer.encode(&text).with_context(|| {
        format!(
            "corpus {} does not fit the tokenizer",
            config.data.path.display()
        )
    })?;
    let model_config = config.model.resolve(tokenizer.vocab_size())?;
    if let Some(loaded) = &resumed {
        check_same_model(&loaded.state.model, &model_config)?;
    }
    let splits = Splits::new(tokens, config.data.val_fraction, model_config.context)?;
    let (n_train, n_val) = (splits.train.len(), splits.val.len());

    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
    let resolved = ResolvedConfig {
        run: &config,
        model: &model_config,
    };
    let config_json = serde_json::to_string_pretty(&resolved)?;
    std::fs::write(run_dir.join("config.json"), &config_json)
        .with_context(|| format!("cannot write {}", run_dir.join("config.json").display()))?;

    let device = B::Device::default();
    B::seed(&device, config.train.seed);
    let mut model = Gpt::<B>::new(&model_config, StageSpec::whole(&model_config), &device);
    if let Some(source) = &config.run.init_from {
        model = crate::hf::init_from(model, source)?;
    }
    let optimizer =
        SharedOptimizer::new(OptimizerAdaptor::from(MatrixDecayAdamW::new(&config.train)));
    let mut schedule = WarmupCosine::new(&config.train);

    let global_batch = config.train.micro_batch * config.train.grad_accum;
    let mut sampler = Sampler::new(
        splits.train.len(),
        model_config.context,
        global_batch,
        config.train.seed,
        (0, 1),
    )?;
    let mut start_step = 0;
    if let Some(mut loaded) = resumed {
        model = loaded.apply_params(model)?;
        loaded.apply_moments(&model, &optimizer)?;
        schedule.next_step = loaded.state.schedule_step;
        sampler.seek(loaded.state.cursor);
        start_step = loaded.state.step;
    }
    let sampler = Arc::new(Mutex::new(sampler));

    let settings = LoopSettings {
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
    };
    let state = TrainState {
        step: start_step,
        config: config.clone(),
        model: model_config.clone(),
        tokenizer: tokenizer.kind(),
        vocab: tokenizer.vocab_string(),
        cursor: Default::default(),
        rng_seed: config.train.seed,
        schedule_step: start_step,
        optimizer_steps: Default::default(),
    };
    let config_toml = toml::to_string_pretty(&resolved).unwrap_or(config_json);
    let strategy = Arc::new(StepLoop {
        settings,
        optimizer: optimizer.clone(),
        sampler: sampler.clone(),
        sink: Mutex::new(MetricsSink::open(&run_dir, &config_toml, start_step)?),
        state,
        checkpoint_root: checkpoints,
        error: Mutex::new(None),
        losses: Mutex::new(Vec::new()),
    });

    let train_tokens = Arc::new(splits.train);
    let val_tokens = Arc::new(if splits.val.is_empty() {
        train_tokens.to_vec()
    } else {
        splits.val
    });
    let context = model_config.context;
    let micro = config.train.micro_batch;
    let train_loader = TrainLoader::<B>::new(
        train_tokens,
        sampler,
        micro,
        context,
        config.train.max_steps as usize,
        device.clone(),
    );
    let eval_loader = EvalLoader::<B::InnerBackend>::new(
        val_tokens,
        micro,
        context,
        config.train.eval_batches,
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
    if config.run.peak_flops.is_some() {
        training = training.metric_train_numeric(StepScalar::<Mfu>::default());
    }
    if !std::io::stdout().is_terminal() {
        training = training.renderer(LogRenderer::new(
            config.run.log_every as usize,
            config.run.peak_flops.is_some(),
        ));
    }
    println!(
        "training {} parameters ({} layers, {} heads, d_model {}, context {}) on {} train / {} val \
         tokens, steps {start_step}..{}",
        model_config.parameter_count(),
        model_config.n_layer,
        model_config.n_head,
        model_config.d_model,
        model_config.context,
        n_train,
        n_val,
        config.train.max_steps
    );
    let learner = Learner::new(model, optimizer, schedule);
    training.launch(learner);

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
    let probe = burn::tensor::Tensor::<B, 1>::zeros([1], device);
    probe.inner().device()
}

/// The run's configuration as saved: the file's sections plus the resolved model sizes.
#[derive(Debug, serde::Serialize)]
struct ResolvedConfig<'a> {
    #[serde(flatten)]
    run: &'a RunConfig,
    #[serde(rename = "resolved_model")]
    model: &'a GptConfig,
}
