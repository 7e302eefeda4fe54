//! The pipeline file as written: YAML into serde structs, unknown keys rejected.
//!
//! This is step one of two; [`crate::plan`] turns these structs into a validated plan
//! before any work starts.

mod interpolate;
mod serve;

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};
pub(crate) use serve::{AuthSpec, ServeSpec, parse_duration};

/// A whole pipeline file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PipelineFile {
    /// Names the pipeline in reports and in the commit metadata of the tables it writes.
    pub name: String,
    /// Tables registered in the pipeline's SQL session, by name.
    #[serde(default)]
    pub tables: BTreeMap<String, TableSpec>,
    /// Stages, run in order (a file may hold only tables and `serve`).
    #[serde(default)]
    pub stages: Vec<StageSpec>,
    /// `pipeline serve`: the tables and models over Flight SQL.
    pub serve: Option<ServeSpec>,
}

/// One table: exactly one of `delta`, `parquet`, `csv`, `json` gives its kind and path.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TableSpec {
    pub delta: Option<String>,
    pub parquet: Option<String>,
    pub csv: Option<String>,
    pub json: Option<String>,
    /// Delta time travel: read this table version.
    pub version: Option<i64>,
    /// Delta time travel: read the version current at this RFC 3339 timestamp.
    pub timestamp: Option<String>,
    /// CSV: whether the first line is a header (default true).
    pub has_header: Option<bool>,
    /// CSV: the field delimiter (default `,`).
    pub delimiter: Option<char>,
    /// CSV: quoted values may hold line breaks (default true; false lets DataFusion split
    /// one large file across cores, but misreads such values).
    pub newlines_in_values: Option<bool>,
    /// CSV / JSON: compression of the file; default from the file extension.
    pub compression: Option<Compression>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Compression {
    None,
    Gzip,
    Bzip2,
    Xz,
    Zstd,
}

/// A stage: a map with one key, its kind (`- write: {...}`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StageSpec {
    pub write: Option<WriteSpec>,
    pub tokenize: Option<TokenizeSpec>,
    pub train: Option<Box<TrainSpec>>,
    pub predict: Option<Box<PredictSpec>>,
}

/// A stage by kind, once checked that exactly one kind is given.
pub(crate) enum StageKind {
    Write(WriteSpec),
    Tokenize(TokenizeSpec),
    Train(Box<TrainSpec>),
    Predict(Box<PredictSpec>),
}

impl StageSpec {
    pub(crate) fn kind(self) -> Result<StageKind, String> {
        match (self.write, self.tokenize, self.train, self.predict) {
            (Some(w), None, None, None) => Ok(StageKind::Write(w)),
            (None, Some(t), None, None) => Ok(StageKind::Tokenize(t)),
            (None, None, Some(t), None) => Ok(StageKind::Train(t)),
            (None, None, None, Some(p)) => Ok(StageKind::Predict(p)),
            _ => Err(
                "a stage is a map with exactly one key, its kind: `write`, `tokenize`, \
                 `train` or `predict`"
                    .into(),
            ),
        }
    }
}

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
    /// Data-parallel sharding: this process reads every `world`-th batch from `rank`.
    #[serde(default)]
    pub rank: usize,
    #[serde(default = "default_one")]
    pub world: usize,
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
/// once per source version.
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
    Bf16,
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

impl PipelineFile {
    /// Reads and parses a pipeline file; every error names the file (and line where known).
    pub(crate) fn load(path: &Path) -> Result<Self> {
        let raw = std::fs::read_to_string(path).map_err(|e| {
            Error::config(
                path,
                format!("cannot read the pipeline file: {e}; check the path"),
            )
        })?;
        let text = interpolate::env_vars(&raw).map_err(|m| Error::config(path, m))?;
        serde_yaml_ng::from_str(&text).map_err(|e| {
            let at = e
                .location()
                .map(|l| format!("line {}, column {}: ", l.line(), l.column()))
                .unwrap_or_default();
            Error::config(path, format!("{at}{}", describe_yaml_error(&e)))
        })
    }
}

/// Every key a pipeline file may hold, for "did you mean" on a misspelled one.
const KNOWN_KEYS: &[&str] = &[
    "name",
    "tables",
    "stages",
    "delta",
    "parquet",
    "csv",
    "json",
    "version",
    "timestamp",
    "has_header",
    "delimiter",
    "newlines_in_values",
    "compression",
    "write",
    "tokenize",
    "from",
    "sql",
    "sql_file",
    "to",
    "mode",
    "tokenizer",
    "id",
    "text",
    "text_pair",
    "label",
    "labels",
    "keep",
    "max_length",
    "truncation",
    "add_special_tokens",
    "on_overlong",
    "on_null",
    "on_empty",
    "on_invalid_utf8",
    "batch_rows",
    "train",
    "model",
    "output",
    "split",
    "device",
    "precision",
    "seed",
    "epochs",
    "max_steps",
    "batch_size",
    "eval_batch_size",
    "grad_accum",
    "lr",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "schedule",
    "warmup_steps",
    "warmup_ratio",
    "max_grad_norm",
    "group_by_length",
    "prefetch",
    "rank",
    "world",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "best_metric",
    "save",
    "early_stopping",
    "metric",
    "patience",
    "min_delta",
    "log_every",
    "threads",
    "tracking",
    "mlflow",
    "uri",
    "experiment",
    "run_name",
    "predict",
    "job",
    "batch_tokens",
    "replicas",
    "logits",
    "serve",
    "listen",
    "models",
    "path",
    "default",
    "auth",
    "users_file",
    "tokens",
    "token_ttl",
    "tls",
    "cert",
    "key",
    "limits",
    "max_concurrent_queries",
    "query_timeout",
    "shutdown_grace",
];

/// The known word within edit distance 2 of `word`, if any.
fn closest<'a>(word: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edit_distance(word, k), *k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// serde's wording, plus what to do for the mistakes people make most.
fn describe_yaml_error(e: &serde_yaml_ng::Error) -> String {
    let msg = e.to_string();
    // serde_yaml_ng appends " at line X column Y" itself; we already said where.
    let msg = match msg.find(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg,
    };
    if let Some(field) = msg
        .strip_prefix("unknown field `")
        .or_else(|| msg.split(": unknown field `").nth(1))
        .and_then(|rest| rest.split('`').next())
    {
        match closest(field, KNOWN_KEYS) {
            Some(known) => format!("{msg}; did you mean `{known}`?"),
            None => format!("{msg}; remove it or fix its spelling"),
        }
    } else if msg.contains("unknown variant") {
        format!("{msg}; use one of the values listed")
    } else if msg.contains("missing field") {
        format!("{msg}; add it")
    } else {
        msg
    }
}

#[cfg(test)]
mod tests {
    use super::{KNOWN_KEYS, closest};

    #[test]
    fn misspelled_keys_get_a_suggestion_and_others_do_not() {
        assert_eq!(closest("max_lenght", KNOWN_KEYS), Some("max_length"));
        assert_eq!(closest("tokenise", KNOWN_KEYS), Some("tokenize"));
        assert_eq!(closest("frobnicate", KNOWN_KEYS), None);
    }
}
