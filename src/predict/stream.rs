//! The row stream of the predict and embed stages: each batch of source rows tokenized, run
//! through the [`Engine`] and turned into output rows (class predictions, or sentence
//! vectors), several batches in flight so that tokenizing the next one overlaps the model
//! working on this one.

use std::sync::Arc;

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::{Schema, SchemaRef};
use datafusion::error::DataFusionError;
use futures::{Stream, StreamExt};

use super::Engine;
use super::output::{Meta, embeddings_batch, embeddings_schema, output_schema, predictions_batch};
use crate::error::{Error, Result};
use crate::tokenize::{self, Counters, Encoder, RowPolicy};

/// What a pass writes for each row.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rows {
    /// The predictions table: label, label id, score, probabilities (and logits).
    Predictions,
    /// The embeddings table: `dims` values per row, int8 with a scale if `quantized`.
    Embeddings { dims: usize, quantized: bool },
}

/// A model over a stream of source rows.
pub(crate) struct Predictor {
    encoder: Arc<Encoder>,
    engine: Arc<Engine>,
    policy: Arc<RowPolicy>,
    meta: Arc<Meta>,
    rows: Rows,
    /// The schema of a tokenized batch, and of an output batch.
    tokenized: SchemaRef,
    schema: SchemaRef,
    counters: Arc<Counters>,
}

impl Predictor {
    /// A predictor for batches of `source`'s schema.
    pub(crate) fn new(
        source: &Schema,
        encoder: Arc<Encoder>,
        engine: Engine,
        policy: RowPolicy,
        meta: Meta,
        rows: Rows,
    ) -> Result<Self> {
        let tokenized = tokenize::output_schema(source, &policy)?;
        let schema = match rows {
            Rows::Predictions => output_schema(&tokenized, &policy, meta.logits),
            Rows::Embeddings { quantized, .. } => embeddings_schema(&tokenized, &policy, quantized),
        };
        Ok(Self {
            encoder,
            engine: Arc::new(engine),
            policy: Arc::new(policy),
            meta: Arc::new(meta),
            rows,
            tokenized,
            schema,
            counters: Arc::new(Counters::default()),
        })
    }

    /// The schema of the output batches.
    pub(crate) fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// Rows read, written and skipped so far.
    pub(crate) fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// The output rows of one batch of source rows (rows the row policy skips give none).
    pub(crate) async fn batch(&self, batch: RecordBatch) -> Result<RecordBatch> {
        let tokenized = {
            let (encoder, policy, schema, counters) = (
                self.encoder.clone(),
                self.policy.clone(),
                self.tokenized.clone(),
                self.counters.clone(),
            );
            tokio::task::spawn_blocking(move || {
                tokenize::tokenize_batch(&batch, &encoder, &policy, None, &schema, &counters)
            })
            .await
            .map_err(|e| Error::Internal(format!("the tokenizing task: {e}")))??
        };
        if tokenized.num_rows() == 0 {
            return Ok(RecordBatch::new_empty(self.schema.clone()));
        }
        let ids = tokenized.column(1).as_list::<i32>().clone();
        let output = self.engine.run(ids).await?;
        match self.rows {
            Rows::Predictions => {
                predictions_batch(&tokenized, &output, &self.meta, &self.policy, &self.schema)
            }
            Rows::Embeddings { dims, quantized } => embeddings_batch(
                &tokenized,
                &output,
                dims,
                quantized,
                &self.meta,
                &self.policy,
                &self.schema,
            ),
        }
    }

    /// The output of every batch of `input`, in order, `in_flight` batches at once. Errors
    /// of lakeml's own travel as [`DataFusionError::External`], for the commit to report.
    pub(crate) fn stream<S>(
        self: Arc<Self>,
        input: S,
        in_flight: usize,
    ) -> impl Stream<Item = std::result::Result<RecordBatch, DataFusionError>> + Send + 'static
    where
        S: Stream<Item = std::result::Result<RecordBatch, DataFusionError>> + Send + 'static,
    {
        input
            .map(move |batch| {
                let this = self.clone();
                async move {
                    this.batch(batch?)
                        .await
                        .map_err(|e| DataFusionError::External(Box::new(e)))
                }
            })
            .buffered(in_flight)
    }
}
