//! The recipe's configuration: TOML files with `--set section.key=value` overrides, unknown
//! keys rejected, and the fully resolved form saved with every run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use wildfire_backend::device::{DeviceKind, DeviceSpec};
use wildfire_backend::kernels::choice::{FusedOp, FusedOps};
use wildfire_backend::kernels::matmul::MatmulPrecision;
use wildfire_parallel::fsdp::ZeroStage;
use wildfire_parallel::pp::ScheduleKind;
use wildfire_parallel::precision::{DynamicLossScaler, Precision};

use crate::data::{TokenizerKind, tokenizer_json};
use crate::model::{GptConfig, Llama3Scaling, ModelKind, Preset};

/// The config `wildfire train` runs when given none.
pub const DEFAULT_CONFIG: &str = include_str!("../configs/shakespeare-char.toml");
/// Where the default config is, for messages.
pub const DEFAULT_CONFIG_NAME: &str = "recipes/configs/shakespeare-char.toml";

/// A training run, as written in a config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub model: ModelSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub checkpoint: CheckpointSection,
    pub run: RunSection,
    /// Absent in configs that do not parallelize (one rank).
    #[serde(default)]
    pub parallel: ParallelSection,
    /// Absent in fp32 configs.
    #[serde(default)]
    pub precision: PrecisionSection,
}

/// The compute precision and fp16's loss scaling (see `wildfire_parallel::precision`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionSection {
    /// fp32, bf16 or fp16; parameters and optimizer state are fp32 in every case.
    pub compute: Precision,
    /// fp16: the first loss scale, a power of two.
    pub initial_loss_scale: f64,
    /// fp16: clean steps in a row after which the loss scale doubles.
    pub loss_scale_window: u32,
    /// off, bf16 or f16: the type fp32 matmuls round their inputs to (products accumulated in
    /// f32; `wildfire_backend::kernels::matmul`). Only with `compute = "fp32"`.
    pub matmul: MatmulPrecision,
}

impl Default for PrecisionSection {
    fn default() -> Self {
        let scaler = DynamicLossScaler::default();
        Self {
            compute: Precision::Fp32,
            initial_loss_scale: scaler.scale(),
            loss_scale_window: scaler.growth_interval(),
            matmul: MatmulPrecision::Off,
        }
    }
}

impl PrecisionSection {
    /// The loss scaler of an fp16 run (`None` for fp32 and bf16). The settings are checked in
    /// every precision, so a bad value is found before it is first used.
    pub fn scaler(&self) -> anyhow::Result<Option<DynamicLossScaler>> {
        let scaler = DynamicLossScaler::new(self.initial_loss_scale, self.loss_scale_window)
            .with_context(|| {
                format!(
                    "precision.initial_loss_scale = {}, precision.loss_scale_window = {}",
                    self.initial_loss_scale, self.loss_scale_window
                )
            })?;
        Ok(self.compute.scales_loss().then_some(scaler))
    }

    /// The matmul precision policy rounds fp32 inputs; a half-precision run's matmuls already
    /// take half-precision inputs.
    fn check_matmul(&self) -> anyhow::Result<()> {
        if self.matmul != MatmulPrecision::Off && self.compute != Precision::Fp32 {
            bail!(
                "precision.matmul = \"{}\" rounds fp32 matmul inputs, but precision.compute = \
                 \"{}\" already computes in half precision: use one or the other",
                self.matmul,
                self.compute
            );
        }
        Ok(())
    }
}

/// A preset plus explicit overrides; without a preset every size must be given.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub preset: Option<Preset>,
    /// `gpt` or `llama`; the preset's kind, or `gpt` without a preset.
    pub kind: Option<ModelKind>,
    pub n_layer: Option<usize>,
    pub n_head: Option<usize>,
    /// Defaults to `n_head` (no grouping), or a Llama preset's.
    pub n_kv_head: Option<usize>,
    pub d_model: Option<usize>,
    /// Width of one attention head (Llama); defaults to d_model / n_head.
    pub head_dim: Option<usize>,
    /// Defaults to 4·d_model for GPT; a Llama model needs it (or its preset's).
    pub ffn_hidden: Option<usize>,
    pub context: Option<usize>,
    pub dropout: Option<f64>,
    pub bias: Option<bool>,
    /// Biases on the query, key and value projections alone (Llama; Qwen2's); defaults to false.
    pub qkv_bias: Option<bool>,
    /// An RMSNorm of each head of Q and K (Llama; Qwen3's); defaults to false.
    pub qk_norm: Option<bool>,
    pub tie_embeddings: Option<bool>,
    /// Defaults to the tokenizer's vocabulary; may be larger (padding, e.g. 50304 for GPT-2).
    pub vocab_size: Option<usize>,
    /// RoPE's base θ (Llama); defaults to the preset's, or 10,000.
    pub rope_theta: Option<f64>,
    /// Llama 3.1's frequency scaling (a `[model.rope_scaling]` table); the preset's if absent.
    pub rope_scaling: Option<Llama3Scaling>,
    /// The norms' ε; defaults to 1e-5.
    pub norm_eps: Option<f64>,
    /// Mistral's sliding window of attention (Llama), in keys; none by default.
    pub sliding_window: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// A text file, or a directory whose files are read in path order.
    pub path: PathBuf,
    pub tokenizer: TokenizerKind,
    /// The `tokenizer.json` of `tokenizer = "hf"` (a file, or a model directory holding one);
    /// defaults to the one beside the weights of `run.init_from = "hf:DIR"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_file: Option<PathBuf>,
    /// Fraction of the tokens, at the end of the corpus, held out for validation.
    pub val_fraction: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    pub seed: u64,
    pub max_steps: u64,
    /// Sequences per micro-batch on one device.
    pub micro_batch: usize,
    /// Micro-batches accumulated per optimizer step.
    pub grad_accum: usize,
    /// Sequences per optimizer step over every data-parallel rank. Optional: it must equal
    /// `micro_batch × grad_accum × parallel.dp`, which it is when absent.
    pub global_batch: Option<usize>,
    /// Peak learning rate, reached at the end of warmup.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay (step `max_steps`).
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm bound; 0 disables clipping.
    pub grad_clip: f64,
    /// Evaluate the validation loss every this many steps (and at the end); 0 disables.
    pub eval_every: u64,
    /// Validation batches (of `micro_batch` sequences) per evaluation.
    pub eval_batches: usize,
    /// Which activations the backward recomputes instead of keeping them.
    #[serde(default)]
    pub activation_checkpointing: ActivationCheckpointing,
    /// Whether the model's fused ops (each with its fused backward: attention where it has no
    /// dropout, the MLP's bias + GELU, LayerNorm and RMSNorm, the rotary embedding, SwiGLU) and
    /// AdamW's one-pass step all run fused (`true`) or all as decomposed ops (`false`: Megatron-LM's
    /// `--no-masked-softmax-fusion` and `--no-bias-gelu-fusion`, Burn's own modules). Absent:
    /// each op as the device's defaults say, fused only where it was measured to win there
    /// (`wildfire_backend::kernels::choice::FusedOps::device_default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fused_ops: Option<bool>,
    /// Per-op choices on top of `fused_ops`, `[train.fused]` with `attention = false` and the
    /// like (`--set train.fused.attention=false`); names as `FusedOp` writes them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fused: BTreeMap<FusedOp, bool>,
}

impl TrainSection {
    /// Which ops run fused on a device of `kind`: the device's defaults, or all or none as
    /// `fused_ops` says, then `fused`'s per-op choices.
    pub fn fused_ops(&self, kind: DeviceKind) -> FusedOps {
        let all = match self.fused_ops {
            Some(fused) => FusedOps::all(fused),
            None => FusedOps::device_default(kind),
        };
        self.fused
            .iter()
            .fold(all, |ops, (&op, &fused)| ops.with(op, fused))
    }
}

/// Activation checkpointing: which activations of the forward are recomputed in the backward
/// instead of being kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ActivationCheckpointing {
    /// Keep every activation the backward needs.
    #[default]
    None,
    /// Keep each transformer block's input only and recompute the block in the backward, one
    /// block at a time (the pipeline executor's checkpoint segments).
    Full,
    /// Burn's autodiff checkpointing (`BalancedCheckpointing`): keep the outputs of
    /// compute-bound operations (matmuls) and recompute the memory-bound ones (elementwise
    /// operations, softmax, GELU) from them.
    Selective,
}

impl std::fmt::Display for ActivationCheckpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Full => "full",
            Self::Selective => "selective",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Save every this many steps (and at the end); 0 saves only at the end.
    pub every: u64,
    /// Committed checkpoints kept; older ones are deleted. 0 keeps all.
    pub keep_last: usize,
    /// Write checkpoints in the background while training goes on (the step copies what it
    /// saves to host memory; the next save waits for the previous one). The last one is
    /// always written before the run ends.
    #[serde(default, rename = "async")]
    pub in_background: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    /// Run directory: config.json, metrics.jsonl, the event file, checkpoints/.
    pub dir: PathBuf,
    /// Where the ranks compute: `cpu`, `wgpu` or `cuda` (each rank of a launched job on local
    /// device `LOCAL_RANK`), or one device for a single process (`cuda:1`). A resumed run may
    /// continue on another device.
    #[serde(default)]
    pub device: DeviceSpec,
    /// Every this many steps the loop reads the steps' losses and gradient norms back from the
    /// device (the steps themselves read nothing), writes them to the metrics files (every
    /// step is there) and prints a progress line.
    pub log_every: u64,
    /// Profile the kernels of this many steps after the first (0: none; wgpu and cuda only):
    /// each step's table of kernels (CubeCL's profiling logger: name, time, launches, share),
    /// its blocking reads, and the time outside its kernels, printed by rank 0. Profiling times
    /// every kernel of the run (on CUDA by synchronising around each one), so a profiled run is
    /// slower: profile short runs.
    #[serde(default)]
    pub profile: u64,
    /// Peak FLOP/s of one rank's device, for MFU. Absent: a known GPU's dense bf16 peak, or on
    /// cpu and wgpu the f32 matmul rate measured at start (shared by the ranks of one host).
    pub peak_flops: Option<f64>,
    /// Worker threads of the CPU backend; absent uses every core.
    pub threads: Option<usize>,
    /// Start from Hugging Face GPT-2 or Llama weights: `hf:DIR` (a model directory, whose
    /// `config.json` gives the model's sizes), or `hf:FILE` (a `.safetensors` file or a
    /// `model.safetensors.index.json`, the sizes from `[model]`).
    pub init_from: Option<String>,
}

/// How the run is spread over ranks. The pipeline's micro-batches are the step's accumulation
/// micro-batches: `train.grad_accum` of `train.micro_batch` sequences each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelSection {
    /// Data-parallel ranks (replicas, or shards under ZeRO).
    pub dp: usize,
    /// ZeRO stage over the data-parallel ranks: 0 (DDP), 1 (optimizer state sharded), 2 (and
    /// gradients), 3 (and parameters, FSDP).
    pub zero: u8,
    /// Size of the gradient buckets of the data-parallel reduction, in MiB.
    pub bucket_mb: f64,
    /// Keep the ZeRO optimizer's moments and master parameters in host memory and update there.
    pub offload_optimizer: bool,
    /// Tensor-parallel ranks (Megatron-LM's: attention split by heads, the MLP and the
    /// vocabulary by columns; see `model::TP_PLAN`).
    pub tp: usize,
    /// Split the LayerNorm and dropout regions between tensor-parallel layers along the
    /// sequence (sequence parallelism; needs the context to divide by tp).
    pub sequence_parallel: bool,
    /// Pipeline-parallel ranks.
    pub pp: usize,
    /// Model chunks per pipeline rank (more than 1 needs the interleaved schedule).
    pub virtual_stages: usize,
    /// Pipeline schedule: `gpipe`, `1f1b` or `interleaved`.
    pub schedule: String,
    /// Blocks of each stage (`pp × virtual_stages` entries, in stage order); empty spreads the
    /// blocks as evenly as possible.
    pub stage_layers: Vec<usize>,
    /// `local` runs every rank as a thread of this process; `launch` (the default) joins the
    /// job `wildfire launch` (or torchrun, Slurm, MPI) describes, one rank per process.
    pub transport: Transport,
}

/// Where the ranks of a run live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// One process per rank, from the launch environment.
    Launch,
    /// Every rank a thread of this process.
    Local,
}

impl Default for ParallelSection {
    fn default() -> Self {
        Self {
            dp: 1,
            zero: 0,
            bucket_mb: 25.0,
            offload_optimizer: false,
            tp: 1,
            sequence_parallel: false,
            pp: 1,
            virtual_stages: 1,
            schedule: "1f1b".into(),
            stage_layers: Vec::new(),
            transport: Transport::Launch,
        }
    }
}

impl ParallelSection {
    /// The ZeRO stage `zero` names.
    pub fn zero_stage(&self) -> anyhow::Result<ZeroStage> {
        ZeroStage::from_level(self.zero).with_context(|| {
            format!(
                "parallel.zero = {} is not a ZeRO stage (0, 1, 2 or 3)",
                self.zero
            )
        })
    }

    /// The bucket size in bytes.
    pub fn bucket_bytes(&self) -> anyhow::Result<usize> {
        if !(self.bucket_mb > 0.0 && self.bucket_mb.is_finite()) {
            bail!(
                "parallel.bucket_mb = {} must be a positive number of MiB",
                self.bucket_mb
            );
        }
        Ok((self.bucket_mb * (1 << 20) as f64) as usize)
    }

    /// The schedule kind named by `schedule`.
    pub fn schedule_kind(&self) -> anyhow::Result<ScheduleKind> {
        self.schedule
            .parse()
            .with_context(|| format!("parallel.schedule = {:?}", self.schedule))
    }
}

impl RunConfig {
    /// Parses `text` (TOML) after applying `overrides` of the form `section.key=value`. The value
    /// is read as a TOML value (`3`, `1e-3`, `true`, `"x"`), or as a string when it is not one.
    pub fn parse(text: &str, source: &str, overrides: &[String]) -> anyhow::Result<Self> {
        let mut table: toml::Table =
            toml::from_str(text).with_context(|| format!("config {source} is not valid TOML"))?;
        for assignment in overrides {
            apply_override(&mut table, assignment)?;
        }
        let config: RunConfig = table.try_into().map_err(|e: toml::de::Error| {
            anyhow::anyhow!(
                "config {source}: {}",
                e.to_string().trim().replace('\n', " ")
            )
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Reads a config file (or the built-in default when `path` is `None`).
    pub fn load(path: Option<&Path>, overrides: &[String]) -> anyhow::Result<Self> {
        match path {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("config file {} cannot be read", path.display()))?;
                Self::parse(&text, &path.display().to_string(), overrides)
            }
            None => Self::parse(DEFAULT_CONFIG, DEFAULT_CONFIG_NAME, overrides),
        }
    }

    /// Tokens in one optimizer step on one device.
    pub fn tokens_per_step(&self, context: usize) -> usize {
        self.train.micro_batch * self.train.grad_accum * context
    }
}

fn apply_override(table: &mut toml::Table, assignment: &str) -> anyhow::Result<()> {
    let Some((path, raw)) = assignment.split_once('=') else {
        bail!("--set {assignment:?} is not of the form section.key=value");
    };
    let keys: Vec<&str> = path.trim().split('.').collect();
    if keys.len() < 2 || keys.iter().any(|k| k.is_empty()) {
        bail!("--set {assignment:?}: the key {path:?} must be section.key (or section.table.key)");
    }
    let (last, tables) = keys.split_last().expect("two keys or more");
    let mut table = table;
    for (depth, key) in tables.iter().enumerate() {
        let entry = table
            .entry(*key)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let Some(inner) = entry.as_table_mut() else {
            bail!(
                "--set {assignment:?}: {} is not a table",
                keys[..=depth].join(".")
            );
        };
        table = inner;
    }
    table.insert(last.to_string(), parse_value(raw.trim()));
    Ok(())
}

fn parse_value(raw: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

impl RunConfig {
    /// The checks no single field's type expresses; each error names the keys and values.
    fn validate(&self) -> anyhow::Result<()> {
        let train = &self.train;
        for (key, value) in [
            ("max_steps", train.max_steps as usize),
            ("micro_batch", train.micro_batch),
            ("grad_accum", train.grad_accum),
        ] {
            if value == 0 {
                bail!("train.{key} must be at least 1, got 0");
            }
        }
        if !(train.lr > 0.0 && train.lr.is_finite()) {
            bail!("train.lr = {} must be a positive number", train.lr);
        }
        if !(0.0..=train.lr).contains(&train.min_lr) {
            bail!(
                "train.min_lr = {} must be between 0 and train.lr = {}",
                train.min_lr,
                train.lr
            );
        }
        for (key, value) in [("beta1", train.beta1), ("beta2", train.beta2)] {
            if !(0.0..1.0).contains(&value) {
                bail!("train.{key} = {value} is outside [0, 1)");
            }
        }
        for (key, value) in [
            ("eps", train.eps),
            ("weight_decay", train.weight_decay),
            ("grad_clip", train.grad_clip),
        ] {
            if !(value >= 0.0 && value.is_finite()) {
                bail!("train.{key} = {value} must be a finite number ≥ 0");
            }
        }
        if train.eval_every > 0 && train.eval_batches == 0 {
            bail!(
                "train.eval_every = {} needs train.eval_batches ≥ 1, got 0",
                train.eval_every
            );
        }
        if train.eval_every > 0 && self.data.val_fraction == 0.0 {
            bail!(
                "train.eval_every = {} needs held-out data, but data.val_fraction = 0 \
                 (set train.eval_every = 0 to train without evaluation)",
                train.eval_every
            );
        }
        if let (Some(file), false) = (
            &self.data.tokenizer_file,
            self.data.tokenizer == TokenizerKind::Hf,
        ) {
            bail!(
                "data.tokenizer_file = {} is a Hugging Face tokenizer, but data.tokenizer = \"{}\": \
                 set data.tokenizer = \"hf\" to use it",
                file.display(),
                self.data.tokenizer
            );
        }
        if let Some(peak) = self.run.peak_flops.filter(|p| !(*p > 0.0 && p.is_finite())) {
            bail!("run.peak_flops = {peak} must be a positive number of FLOP/s");
        }
        if self.run.threads == Some(0) {
            bail!("run.threads must be at least 1, got 0");
        }
        // The parallel layout is validated in one place, `ParallelDims::pipeline`, before a run
        // touches its directory; only the schedule's name is read here.
        self.parallel.schedule_kind()?;
        if self.parallel.zero_stage()? == ZeroStage::Replicated && self.parallel.offload_optimizer {
            bail!(
                "parallel.offload_optimizer = true offloads ZeRO's sharded optimizer, but \
                 parallel.zero = 0 keeps Burn's replicated one: use --zero 1, 2 or 3"
            );
        }
        self.parallel.bucket_bytes()?;
        self.precision.scaler()?;
        self.precision.check_matmul()?;
        Ok(())
    }
}

impl RunConfig {
    /// The model's sizes: from the `config.json` of a Hugging Face model directory the run starts
    /// from (`run.init_from = "hf:DIR"`), else as [`ModelSection::resolve`] gives them. From a
    /// directory, only `model.context` (a shorter training sequence; Llama only, as GPT-2's
    /// position embedding has the file's rows) and `model.dropout` are taken from the run's
    /// config.
    pub fn model(&self, vocab: usize) -> anyhow::Result<GptConfig> {
        let dropout = self.model.dropout.unwrap_or(0.0);
        let from_hf = match &self.run.init_from {
            Some(source) => crate::hf::model_config(source, dropout)?,
            None => None,
        };
        let Some(hf) = from_hf else {
            return self.model.resolve(vocab);
        };
        if hf.vocab_size < vocab {
            bail!(
                "the Hugging Face model has {} tokens, fewer than the tokenizer's {vocab}",
                hf.vocab_size
            );
        }
        let context = self.model.context.unwrap_or(hf.context);
        if context > hf.context || (hf.kind == ModelKind::Gpt && context != hf.context) {
            bail!(
                "model.context = {context} does not fit the Hugging Face {} model's {} positions",
                hf.kind,
                hf.context
            );
        }
        Ok(GptConfig { context, ..hf })
    }
}

impl RunConfig {
    /// The `tokenizer.json` of a `data.tokenizer = "hf"` run: `data.tokenizer_file`, else the
    /// one in the model directory of `run.init_from = "hf:DIR"`.
    pub fn tokenizer_file(&self) -> anyhow::Result<PathBuf> {
        if let Some(path) = &self.data.tokenizer_file {
            return Ok(tokenizer_json(path));
        }
        let init_dir = (self.run.init_from.as_deref())
            .and_then(|source| crate::hf::source_path(source).ok())
            .filter(|path| path.is_dir());
        match init_dir.map(tokenizer_json) {
            Some(path) if path.exists() => Ok(path),
            _ => bail!(
                "data.tokenizer = \"hf\" needs a tokenizer.json: set data.tokenizer_file (or \
                 --tokenizer hf:PATH), or start from run.init_from = \"hf:DIR\" with a \
                 DIR/tokenizer.json"
            ),
        }
    }
}

impl ModelSection {
    /// The model's sizes: the preset's, overridden by every field given here. `vocab` is the
    /// tokenizer's vocabulary size, used unless `vocab_size` is set (it may only be larger).
    pub fn resolve(&self, vocab: usize) -> anyhow::Result<GptConfig> {
        let base = self.preset.map(|p| p.config(vocab));
        let pick = |given: Option<usize>, preset: Option<usize>, field: &str| {
            given.or(preset).with_context(|| {
                format!("model.{field} is missing (give it, or a model.preset to take it from)")
            })
        };
        let vocab_size = self.vocab_size.unwrap_or(vocab);
        if vocab_size < vocab {
            bail!("model.vocab_size = {vocab_size} is smaller than the tokenizer's {vocab} tokens");
        }
        let kind = match (self.kind, &base) {
            (Some(kind), Some(base)) if kind != base.kind => {
                let preset = self.preset.expect("a base comes from a preset");
                let name = clap::ValueEnum::to_possible_value(&preset).expect("presets are named");
                bail!(
                    "model.kind = \"{kind}\" contradicts model.preset = \"{}\", a {} model",
                    name.get_name(),
                    base.kind
                )
            }
            (kind, base) => kind.or(base.as_ref().map(|b| b.kind)).unwrap_or_default(),
        };
        let llama = kind == ModelKind::Llama;
        let n_head = pick(self.n_head, base.as_ref().map(|b| b.n_head), "n_head")?;
        let d_model = pick(self.d_model, base.as_ref().map(|b| b.d_model), "d_model")?;
        // GPT's derived sizes follow the sizes given; a Llama preset's are its own.
        let llama_base = base.as_ref().filter(|_| llama);
        let ffn_hidden = match llama {
            true => pick(
                self.ffn_hidden,
                llama_base.map(|b| b.ffn_hidden),
                "ffn_hidden",
            )?,
            false => self.ffn_hidden.unwrap_or(4 * d_model),
        };
        let config = GptConfig {
            kind,
            vocab_size,
            n_layer: pick(self.n_layer, base.as_ref().map(|b| b.n_layer), "n_layer")?,
            n_head,
            n_kv_head: self
                .n_kv_head
                .or(llama_base.map(|b| b.n_kv_head))
                .unwrap_or(n_head),
            d_model,
            // A preset's head width holds while its heads and width do.
            head_dim: self.head_dim.map_or_else(
                || {
                    (base.as_ref())
                        .filter(|b| (b.d_model, b.n_head) == (d_model, n_head))
                        .and_then(|b| b.head_dim)
                },
                |h| GptConfig::explicit_head_dim(d_model, n_head, h),
            ),
            ffn_hidden,
            context: pick(self.context, base.as_ref().map(|b| b.context), "context")?,
            dropout: self
                .dropout
                .or(base.as_ref().map(|b| b.dropout))
                .unwrap_or(0.0),
            bias: self.bias.or(base.as_ref().map(|b| b.bias)).unwrap_or(true),
            qkv_bias: (self.qkv_bias)
                .or(base.as_ref().map(|b| b.qkv_bias))
                .unwrap_or(false),
            qk_norm: (self.qk_norm)
                .or(base.as_ref().map(|b| b.qk_norm))
                .unwrap_or(false),
            tie_embeddings: self
                .tie_embeddings
                .or(base.as_ref().map(|b| b.tie_embeddings))
                .unwrap_or(true),
            rope_theta: self
                .rope_theta
                .or(base.as_ref().map(|b| b.rope_theta))
                .unwrap_or(10_000.0),
            rope_scaling: self
                .rope_scaling
                .or(base.as_ref().and_then(|b| b.rope_scaling)),
            norm_eps: self
                .norm_eps
                .or(base.as_ref().map(|b| b.norm_eps))
                .unwrap_or(1e-5),
            sliding_window: (self.sliding_window).or(base.as_ref().and_then(|b| b.sliding_window)),
        };
        config.validate()?;
        Ok(config)
    }
}

/// Keys a resumed run keeps from its checkpoint: they decide the model, the data stream and the
/// RNG, so changing one would break the continuation. The global batch is kept too (the sampler
/// draws by global batches), but how it is made may change: `parallel.dp`, `train.micro_batch`
/// and `train.grad_accum` (see [`RunConfig::keep_global_batch`]). Other keys
/// (`train.max_steps`, `checkpoint.*`, `run.*`, the schedule, the parallel layout) may change on
/// resume. (The model is compared after resolving its preset, by [`check_same_model`].)
const LOCKED_ON_RESUME: [&str; 2] = ["data", "train.seed"];

impl RunConfig {
    /// The config of a resumed run: the one saved in its checkpoint, with this invocation's
    /// `--set` overrides applied on top. Overrides of [`LOCKED_ON_RESUME`] keys are refused,
    /// naming the key and both values, and the global batch stays the checkpoint's.
    pub fn for_resume(saved: &RunConfig, overrides: &[String]) -> anyhow::Result<Self> {
        let text = toml::to_string(saved)?;
        let mut resumed = Self::parse(&text, "saved in the checkpoint", overrides)?;
        let (before, after) = (
            serde_json::to_value(saved)?,
            serde_json::to_value(&resumed)?,
        );
        for locked in LOCKED_ON_RESUME {
            let pointer = format!("/{}", locked.replace('.', "/"));
            let null = Value::Null;
            let was = before.pointer(&pointer).unwrap_or(&null);
            let now = after.pointer(&pointer).unwrap_or(&null);
            if let Some((key, was, now)) = first_difference(locked, was, now) {
                bail!(
                    "cannot resume with {key} changed: it is {was} in the checkpoint but {now} on \
                     the command line (the model, the data order and the RNG depend on it)"
                );
            }
        }
        resumed.keep_global_batch(saved)?;
        Ok(resumed)
    }

    /// Sequences per optimizer step over every data-parallel rank.
    pub fn global_batch(&self) -> usize {
        let train = &self.train;
        (train.global_batch).unwrap_or(train.micro_batch * train.grad_accum * self.parallel.dp)
    }

    /// Keeps `saved`'s global batch `G` under this config's data-parallel degree `dp` and
    /// micro-batch `m`: unless `train.grad_accum` was changed too, it becomes `G / (m · dp)`.
    /// A `G` that `m · dp` does not divide, or a changed `G`, is refused naming the numbers.
    fn keep_global_batch(&mut self, saved: &RunConfig) -> anyhow::Result<()> {
        let global = saved.global_batch();
        let (dp, train) = (self.parallel.dp, &mut self.train);
        if let Some(given) = train.global_batch.filter(|&given| given != global) {
            bail!(
                "cannot resume with train.global_batch changed: it is {global} in the checkpoint \
                 but {given} on the command line (the data order depends on it)"
            );
        }
        let per_micro_step = train.micro_batch * dp;
        if train.grad_accum == saved.train.grad_accum && global.is_multiple_of(per_micro_step) {
            train.grad_accum = global / per_micro_step;
        }
        let product = train.micro_batch * train.grad_accum * dp;
        if product != global {
            bail!(
                "cannot resume with a global batch of {product} sequences (train.micro_batch {} × \
                 train.grad_accum {} × parallel.dp {dp}): the checkpoint's is {global}, and the \
                 data order depends on it; choose a micro-batch and dp whose product divides {global}",
                train.micro_batch,
                train.grad_accum,
            );
        }
        Ok(())
    }
}

/// The first dotted key below `path` where `a` and `b` differ, with both values.
fn first_difference(path: &str, a: &Value, b: &Value) -> Option<(String, Value, Value)> {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => a.keys().chain(b.keys()).find_map(|key| {
            let null = Value::Null;
            let (x, y) = (a.get(key).unwrap_or(&null), b.get(key).unwrap_or(&null));
            first_difference(&format!("{path}.{key}"), x, y)
        }),
        _ if a != b => Some((path.to_string(), a.clone(), b.clone())),
        _ => None,
    }
}

/// The first field where a checkpoint's model and the given one differ, as an error naming the
/// field and both values.
pub fn check_same_model(checkpoint: &GptConfig, given: &GptConfig) -> anyhow::Result<()> {
    let (saved, now) = (
        serde_json::to_value(checkpoint)?,
        serde_json::to_value(given)?,
    );
    if let (Some(saved), Some(now)) = (saved.as_object(), now.as_object()) {
        for (field, saved_value) in saved {
            let given_value = &now[field];
            if saved_value != given_value {
                bail!(
                    "cannot resume: model.{field} is {saved_value} in the checkpoint but \
                     {given_value} in the given config"
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_parses_and_overrides_apply() {
        let config = RunConfig::parse(
            DEFAULT_CONFIG,
            "default",
            &[
                "train.max_steps=7".into(),
                "model.dropout=0.25".into(),
                "run.dir=/tmp/x".into(),
            ],
        )
        .unwrap();
        assert_eq!(config.train.max_steps, 7);
        assert_eq!(config.model.dropout, Some(0.25));
        assert_eq!(config.run.dir, PathBuf::from("/tmp/x"));
    }

    #[test]
    fn unknown_and_missing_keys_are_named() {
        let err = RunConfig::parse(DEFAULT_CONFIG, "default", &["train.max_stepz=7".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_stepz"), "{err}");
        let text = DEFAULT_CONFIG.replace("max_steps", "# max_steps");
        let err = RunConfig::parse(&text, "edited", &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_steps"), "{err}");
        let err = RunConfig::parse(DEFAULT_CONFIG, "default", &["nonsense".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("section.key=value"), "{err}");
    }

    #[test]
    fn resume_keeps_the_saved_config_and_refuses_locked_changes() {
        let saved = RunConfig::parse(DEFAULT_CONFIG, "default", &["train.seed=5".into()]).unwrap();
        let resumed = RunConfig::for_resume(&saved, &["train.max_steps=9".into()]).unwrap();
        assert_eq!((resumed.train.seed, resumed.train.max_steps), (5, 9));
        let err = RunConfig::for_resume(&saved, &["train.seed=6".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train.seed changed: it is 5 in the checkpoint but 6"),
            "{err}"
        );
        let err = RunConfig::for_resume(&saved, &["data.tokenizer=gpt2".into()]).unwrap_err();
        assert!(err.to_string().contains("data.tokenizer changed"), "{err}");
    }

    #[test]
    fn resume_at_another_dp_keeps_the_global_batch() {
        let saved = ["train.micro_batch=2", "train.grad_accum=2", "parallel.dp=2"];
        let saved = RunConfig::parse(DEFAULT_CONFIG, "default", &saved.map(String::from)).unwrap();
        let resume = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            RunConfig::for_resume(&saved, &sets)
        };
        let at = |sets: &[&str]| {
            let train = resume(sets).unwrap().train;
            (train.micro_batch, train.grad_accum)
        };
        assert_eq!(at(&["parallel.dp=4"]), (2, 1));
        assert_eq!(at(&["parallel.dp=1"]), (2, 4));
        assert_eq!(at(&["parallel.dp=4", "train.micro_batch=1"]), (1, 2));
        let err = resume(&["parallel.dp=3"]).unwrap_err().to_string();
        assert!(
            err.contains("global batch of 12 sequences (train.micro_batch 2 × train.grad_accum 2 × parallel.dp 3): the checkpoint's is 8"),
            "{err}"
        );
        let err = resume(&["parallel.dp=4", "train.grad_accum=3"]).unwrap_err();
        assert!(err.to_string().contains("the checkpoint's is 8"), "{err}");
        let err = resume(&["train.global_batch=16"]).unwrap_err().to_string();
        assert!(
            err.contains("train.global_batch changed: it is 8 in the checkpoint but 16"),
            "{err}"
        );
    }

    #[test]
    fn model_mismatch_names_field_and_values() {
        let a = Preset::Tiny.config(65);
        let b = GptConfig {
            n_layer: 6,
            ..a.clone()
        };
        let err = check_same_model(&a, &b).unwrap_err().to_string();
        assert_eq!(
            err,
            "cannot resume: model.n_layer is 4 in the checkpoint but 6 in the given config"
        );
    }

    /// Absent `train.fused_ops` leaves each device its defaults; `true`/`false` sets every op;
    /// `train.fused.<op>` then sets one op, on either; an unknown op is named with the known
    /// ones; the choice survives the saved config.
    #[test]
    fn fused_ops_follow_the_device_then_the_switch_then_each_op() {
        let parse = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            RunConfig::parse(DEFAULT_CONFIG, "default", &sets).unwrap()
        };
        let defaults = parse(&[]);
        for kind in [DeviceKind::Cpu, DeviceKind::Wgpu, DeviceKind::Cuda] {
            assert_eq!(
                defaults.train.fused_ops(kind),
                FusedOps::device_default(kind)
            );
        }
        let cuda = defaults.train.fused_ops(DeviceKind::Cuda);
        assert!(!cuda.is_fused(FusedOp::Attention) && cuda.is_fused(FusedOp::BiasGelu));

        let none = parse(&["train.fused_ops=false"]);
        assert_eq!(none.train.fused_ops(DeviceKind::Cpu), FusedOps::all(false));
        let all = parse(&["train.fused_ops=true"]);
        assert_eq!(all.train.fused_ops(DeviceKind::Cuda), FusedOps::all(true));

        let one = parse(&["train.fused_ops=false", "train.fused.swiglu=true"]);
        let expected = FusedOps::all(false).with(FusedOp::Swiglu, true);
        assert_eq!(one.train.fused_ops(DeviceKind::Cuda), expected);
        let attention = parse(&["train.fused.attention=true", "train.fused.bias_gelu=false"]);
        let expected = FusedOps::device_default(DeviceKind::Cuda)
            .with(FusedOp::Attention, true)
            .with(FusedOp::BiasGelu, false);
        assert_eq!(attention.train.fused_ops(DeviceKind::Cuda), expected);
        let saved = toml::to_string(&attention).unwrap();
        let reread = RunConfig::parse(&saved, "saved", &[]).unwrap();
        assert_eq!(reread.train.fused_ops(DeviceKind::Cuda), expected);

        let err = RunConfig::parse(DEFAULT_CONFIG, "default", &["train.fused.gelu=true".into()])
            .unwrap_err();
        let err = format!("{err:#}");
        assert!(err.contains("gelu") && err.contains("bias_gelu"), "{err}");
        let err = RunConfig::parse(DEFAULT_CONFIG, "default", &["train.seed.x=1".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("train.seed is not a table"), "{err}");
    }
}
