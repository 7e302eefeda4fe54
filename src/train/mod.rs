//! The training engine: fine-tunes a model on an in-memory dataset and writes the result as
//! an HF model directory, with metrics, TensorBoard events, checkpoints and (optionally)
//! MLflow. The `train` stage around it (reading the table, skipping an unchanged run) is
//! `stages::train`; its validated settings are `plan::TrainStage`.
//!
//! The run directory (`output:`) holds `model/` (the result), `checkpoints/`,
//! `metrics.jsonl`, `tensorboard/` and `run.json` (the fingerprint and final metrics; a rerun
//! with the same inputs and settings is skipped, and a killed run resumes from its latest
//! checkpoint).

mod checkpoint;
mod data;
mod dist;
mod loader;
mod metrics;
mod optim;
mod trainer;

use serde::Serialize;

pub(crate) use checkpoint::{RunDir, clear as clear_checkpoints};
pub(crate) use data::{ID, Limits, dataset};
pub(crate) use dist::{Group, Launch};
pub(crate) use trainer::{Job, train};

use crate::config::{Precision, SaveWhich, Schedule};

/// Every setting that changes the result (all go into the fingerprint and MLflow params).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TrainSettings {
    pub precision: Precision,
    pub seed: u64,
    pub epochs: u64,
    pub max_steps: Option<u64>,
    pub batch_size: usize,
    pub eval_batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_eps: f64,
    pub schedule: Schedule,
    pub warmup_steps: Option<u64>,
    pub warmup_ratio: Option<f64>,
    pub max_grad_norm: f64,
    pub group_by_length: bool,
    pub prefetch: usize,
    pub eval_every: Every,
    pub checkpoint_every: Every,
    pub keep_checkpoints: usize,
    pub best_metric: String,
    pub save: SaveWhich,
    pub early_stopping: Option<EarlyStopping>,
    pub log_every: u64,
    pub threads: usize,
}

/// When something happens during training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) enum Every {
    Never,
    Epoch,
    Steps(u64),
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct EarlyStopping {
    pub metric: String,
    pub patience: u32,
    pub min_delta: f64,
}

pub(crate) use metrics::NAMES as METRIC_NAMES;
