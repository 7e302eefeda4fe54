//! What each stage kind takes (`write`, `tokenize`, `train`, `predict`), with its defaults
//! and the enums of its settings, as written in the file.

use serde::Deserialize;

/// Where a stage's rows come from: exactly one of these.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Source {
    /// All rows of a registered table.
    pub from: Option<String>,
    /// An inline SQL query over the registered tables.
    pub sql: Option<String>,
    /// A SQL file (relative to the pipeline file).
    pub sql_file: Option<String>,
}

/// `write`: a query's result into a Delta table, in one atomic commit.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct WriteSpec {
    pub name: Option<String>,
    #[serde(flatten)]
    pub source: Source,
    /// The Delta table to write (a name from `tables`).
    pub to: String,
    #[serde(default)]
    pub mode: WriteMode,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum WriteMode {
    /// Create the table; fail if it exists.
    Create,
    /// Append rows; the schema must match the table's.
    Append,
    /// Replace the table's rows (a new version; old versions stay readable).
    #[default]
    Overwrite,
}

/// `tokenize`: a text column (or a pair) into token ids.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TokenizeSpec {
    pub name: Option<String>,
    #[serde(flatten)]
    pub source: Source,
    /// A `tokenizer.json`, or a model directory that holds one.
    pub tokenizer: String,
    /// The Delta table to write (a name from `tables`).
    pub to: String,
    #[serde(default = "default_id")]
    pub id: String,
    #[serde(default = "default_text")]
    pub text: String,
    /// Second text of a pair (sentence-pair tasks), if any.
    pub text_pair: Option<String>,
    /// Label column (ints or strings); absent for inference data.
    pub label: Option<String>,
    /// Fixed label order for string labels; default: the sorted distinct labels of the data.
    pub labels: Option<Vec<String>>,
    /// Columns carried through unchanged (e.g. a split column).
    #[serde(default)]
    pub keep: Vec<String>,
    /// Most tokens per row, special tokens included (overrides tokenizer.json).
    #[serde(default = "default_max_length")]
    pub max_length: usize,
    #[serde(default)]
    pub truncation: Truncation,
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
    #[serde(default)]
    pub on_overlong: OnOverlong,
    #[serde(default)]
    pub on_null: OnBad,
    #[serde(default)]
    pub on_empty: OnEmpty,
    #[serde(default)]
    pub on_invalid_utf8: OnInvalidUtf8,
    /// Rows per batch read from the source and written to the table.
    #[serde(default = "default_batch_rows")]
    pub batch_rows: usize,
}

/// `train`: fine-tune a model on a tokenized table; writes an HF model directory.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TrainSpec {
    pub name: Option<String>,
    #[serde(flatten)]
    pub source: Source,
    /// The HF model directory to start from (config.json, safetensors, tokenizer.json).
    pub model: String,
    /// The run directory: `model/` (the result), `checkpoints/`, `metrics.jsonl`,
    /// `tensorboard/`.
    pub output: String,
    /// The id column (any type tokenize accepts); rows are put in its order before the
    /// seeded shuffle. Default: the id column the tokenize stage recorded, else `id`.
    pub id: Option<String>,
    /// Column naming each row's split (`train`, `validation`, `test`).
    #[serde(default = "default_split")]
    pub split: String,
    /// Class names by label id; default: those the tokenize stage recorded, else the ids.
    pub labels: Option<Vec<String>>,
    /// `auto` (CUDA when present), `cpu`, `cuda` or `cuda:N`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Default: fp32 on CPU, bf16 on CUDA.
    pub precision: Option<Precision>,
    #[serde(default = "default_seed")]
    pub seed: u64,
    #[serde(default = "default_epochs")]
    pub epochs: u64,
    /// Stop after this many optimizer steps (overrides `epochs`).
    pub max_steps: Option<u64>,
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    /// Rows per batch when evaluating and testing.
    pub eval_batch_size: Option<usize>,
    /// Micro-batches whose gradients add up to one optimizer step.
    #[serde(default = "default_one")]
    pub grad_accum: usize,
    #[serde(default = "default_lr")]
    pub lr: f64,
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default = "default_beta1")]
    pub adam_beta1: f64,
    #[serde(default = "default_beta2")]
    pub adam_beta2: f64,
    #[serde(default = "default_adam_eps")]
    pub adam_eps: f64,
    #[serde(default)]
    pub schedule: Schedule,
    pub warmup_steps: Option<u64>,
    pub warmup_ratio: Option<f64>,
    /// Clip the global gradient norm to this; `0` turns clipping off.
    #[serde(default = "default_one_f")]
    pub max_grad_norm: f64,
    /// Batch rows of similar length together (less padding).
    #[serde(default = "yes")]
    pub group_by_length: bool,
    /// Batches prepared ahead on the loader thread.
    #[serde(default = "default_prefetch")]
    pub prefetch: usize,
    /// Set by the launcher now (`pipeline run --nproc`, torchrun); refused with a hint.
    pub rank: Option<serde_yaml_ng::Value>,
    pub world: Option<serde_yaml_ng::Value>,
    /// Data parallelism across processes: the collectives' backend and timeout.
    #[serde(default)]
    pub distributed: DistributedSpec,
    /// Evaluate on the validation split: `epoch`, a number of steps, or `none`.
    #[serde(default = "default_every")]
    pub eval_every: Every,
    /// Save a checkpoint: `epoch`, a number of steps, or `none`.
    #[serde(default = "default_every")]
    pub checkpoint_every: Every,
    /// Checkpoints kept besides the best one.
    #[serde(default = "default_keep")]
    pub keep_checkpoints: usize,
    /// The validation metric that picks the best model (`loss`, `accuracy`, `f1_macro`, ...).
    #[serde(default = "default_best_metric")]
    pub best_metric: String,
    /// Save the best model (by `best_metric`) or the final one.
    #[serde(default)]
    pub save: SaveWhich,
    pub early_stopping: Option<EarlyStoppingSpec>,
    /// Log training loss and throughput every this many steps.
    #[serde(default = "default_log_every")]
    pub log_every: u64,
    /// Intra-op threads for libtorch (default: all cores).
    pub threads: Option<usize>,
    #[serde(default)]
    pub tracking: TrackingSpec,
}

/// `predict`: a model over a table's text; the predictions go into a Delta table, exactly
/// once per source version. `embed` takes the same keys (less `labels`, `logits` and
/// `text_pair`, plus `normalize`, `dims` and `quantize`) and writes sentence vectors instead.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PredictSpec {
    pub name: Option<String>,
    #[serde(flatten)]
    pub source: Source,
    /// A trained HF model directory (config.json with id2label, safetensors, tokenizer.json).
    pub model: String,
    /// The predictions Delta table (a name from `tables`).
    pub to: String,
    #[serde(default = "default_id")]
    pub id: String,
    #[serde(default = "default_text")]
    pub text: String,
    pub text_pair: Option<String>,
    /// Columns carried through unchanged (e.g. the true label, for evaluation).
    #[serde(default)]
    pub keep: Vec<String>,
    #[serde(default)]
    pub mode: PredictMode,
    /// The job's key in the table's Delta app transactions (default `lakeml/<pipeline>/<stage>`).
    pub job: Option<String>,
    /// The class names the model must have (checked against its `id2label`).
    pub labels: Option<Vec<String>>,
    /// Most tokens per row; longer rows are cut (default: the model's positions, at most 512).
    pub max_length: Option<usize>,
    #[serde(default)]
    pub truncation: Truncation,
    /// Padded tokens per forward pass (rows sorted by length fill it).
    pub batch_tokens: Option<usize>,
    /// `auto` (CUDA when present), `cpu`, `cuda` or `cuda:N`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Default: fp32 on CPU, bf16 on CUDA.
    pub precision: Option<Precision>,
    /// Intra-op threads for libtorch, over all replicas (default: all cores).
    pub threads: Option<usize>,
    /// Copies of the model run side by side on CPU, each on `threads / replicas` threads.
    pub replicas: Option<usize>,
    /// Also write the raw logits (`logits list<float32>`).
    #[serde(default)]
    pub logits: bool,
    #[serde(default)]
    pub on_null: OnBad,
    #[serde(default)]
    pub on_empty: OnEmpty,
    /// Rows read, tokenized and sorted by length together.
    #[serde(default = "default_batch_rows")]
    pub batch_rows: usize,
    /// `embed`: L2-normalize the vectors (default: whether the model's sentence-transformers
    /// modules end with `Normalize`).
    pub normalize: Option<bool>,
    /// `embed`: keep the first `dims` values of each vector (Matryoshka), then normalize.
    pub dims: Option<usize>,
    /// `embed`: store the vectors quantized (`int8`: one scale per row), a quarter of the
    /// bytes of float32.
    pub quantize: Option<Quantize>,
}

/// How an embed stage stores its vectors.
#[derive(Debug, Clone, Copy, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Quantize {
    /// `embedding list<int8>` and `embedding_scale float32`: each value is about
    /// `embedding[i] * embedding_scale`, with the row's largest |value| at 127.
    Int8,
}

/// How a predict stage treats rows already in its table.
#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum PredictMode {
    /// Append predictions for the ids the table does not hold yet.
    #[default]
    Incremental,
    /// Replace the table with predictions for every row.
    Overwrite,
}

#[derive(Debug, Clone, Copy, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Precision {
    Fp32,
    /// On CPU, inference runs bf16 only where the CPU has bf16 dot products (else fp32).
    Bf16,
    /// Inference only, on CPU: int8 products in the encoder (see `model::Linear`).
    Int8,
}

impl Precision {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
        }
    }
}

/// `train.distributed`: how the ranks of a data-parallel run talk (the launcher says how
/// many there are).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DistributedSpec {
    #[serde(default)]
    pub backend: Backend,
    /// How long a rendezvous or a collective may wait for the other ranks (`30s`, `10m`).
    #[serde(default = "default_dist_timeout")]
    pub timeout: String,
}

impl Default for DistributedSpec {
    fn default() -> Self {
        Self {
            backend: Backend::default(),
            timeout: default_dist_timeout(),
        }
    }
}

fn default_dist_timeout() -> String {
    "10m".into()
}

/// The collectives' library: gloo on CPU, NCCL on CUDA; `auto` picks by device.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Backend {
    #[default]
    Auto,
    Gloo,
    Nccl,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Schedule {
    #[default]
    Linear,
    Cosine,
    Constant,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SaveWhich {
    #[default]
    Best,
    Final,
}

/// `epoch`, `none`, or a number of optimizer steps.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub(crate) enum Every {
    Steps(u64),
    Word(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EarlyStoppingSpec {
    /// A validation metric: `loss`, `accuracy`, `precision_macro`, `f1_weighted`, ...
    pub metric: String,
    /// Evaluations without improvement before training stops.
    #[serde(default = "default_patience")]
    pub patience: u32,
    /// Smallest change that counts as an improvement.
    #[serde(default)]
    pub min_delta: f64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TrackingSpec {
    pub mlflow: Option<MlflowSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MlflowSpec {
    /// The tracking server, e.g. `http://127.0.0.1:5000`.
    pub uri: String,
    #[serde(default = "default_experiment")]
    pub experiment: String,
    pub run_name: Option<String>,
}

fn default_split() -> String {
    "split".into()
}
pub(super) fn default_device() -> String {
    "auto".into()
}
fn default_seed() -> u64 {
    42
}
fn default_epochs() -> u64 {
    3
}
fn default_batch_size() -> usize {
    32
}
fn default_one() -> usize {
    1
}
fn default_one_f() -> f64 {
    1.0
}
fn default_lr() -> f64 {
    5e-5
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_adam_eps() -> f64 {
    1e-8
}
fn default_prefetch() -> usize {
    4
}
fn default_every() -> Every {
    Every::Word("epoch".into())
}
fn default_keep() -> usize {
    2
}
fn default_best_metric() -> String {
    "loss".into()
}
fn default_patience() -> u32 {
    3
}
fn default_log_every() -> u64 {
    10
}
fn default_experiment() -> String {
    "lakeml".into()
}

fn default_id() -> String {
    "id".into()
}
fn default_text() -> String {
    "text".into()
}
fn default_max_length() -> usize {
    512
}
fn default_batch_rows() -> usize {
    8192
}
fn yes() -> bool {
    true
}

/// Which side of a pair loses tokens first (HF's `TruncationStrategy`).
#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Truncation {
    #[default]
    LongestFirst,
    OnlyFirst,
    OnlySecond,
}

/// A row longer than `max_length` tokens.
#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnOverlong {
    /// Keep the first `max_length` tokens (counted in the report).
    #[default]
    Truncate,
    /// Drop the row (counted in the report).
    Skip,
    /// Stop with an error naming the row id.
    Error,
}

/// A null text.
#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnBad {
    #[default]
    Error,
    Skip,
}

/// An empty or whitespace-only text (no tokens but the special ones).
#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnEmpty {
    /// Encode it as HF does (`[CLS] [SEP]`), counted in the report.
    #[default]
    Keep,
    Skip,
    Error,
}

/// Bytes that are not UTF-8 in a binary text column.
#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnInvalidUtf8 {
    #[default]
    Error,
    Skip,
    /// Replace each bad sequence with U+FFFD (counted in the report).
    Replace,
}
