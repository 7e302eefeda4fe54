//! Batch inference: a trained model over a table's text, written as a predictions table
//! (ARCHITECTURE.md) in one Delta commit per run.
//!
//! Rows are read and tokenized in windows of `batch_rows`, sorted by length inside each
//! window and cut into forward passes of at most `batch_tokens` padded tokens, so padding
//! stays small and memory stays bounded whatever the table's size. Tokenizing the next
//! window overlaps the model working on this one; on CPU, `replicas` copies of the model
//! can run side by side.

mod engine;
mod output;
mod pooling;
mod stream;

use serde::Serialize;

pub(crate) use engine::{Engine, Head};
pub(crate) use output::{Meta, embeddings_schema, float_list, float_rows, output_schema, softmax};
pub(crate) use pooling::Pooling;
pub(crate) use stream::{Predictor, Rows};

use crate::config::Precision;

/// Every setting that changes the output or its speed.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PredictSettings {
    pub precision: Precision,
    pub max_length: usize,
    pub truncation: crate::config::Truncation,
    pub batch_tokens: usize,
    pub threads: usize,
    pub replicas: usize,
    pub logits: bool,
    pub batch_rows: usize,
}
