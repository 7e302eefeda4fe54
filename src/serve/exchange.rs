//! Flight DoExchange: a client (Spark's `mapInArrow`, say) streams record batches in and
//! gets the same rows back, in order, with prediction columns appended.
//!
//! The first message's descriptor is a JSON command:
//! `{"model": "sentiment", "text": "text", "text_pair": null, "columns": ["label", ...]}`
//! (`model` defaults to the default model, `text` to `text`, `columns` to the four
//! prediction columns `label`, `label_id`, `score`, `probabilities`, or for a model without
//! a classification head to `embedding`, the sentence vector, which any model can append).

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{ArrayRef, Float32Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow_flight::FlightData;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::error::FlightError;
use futures::{Stream, StreamExt, TryStreamExt};
use serde::Deserialize;
use tonic::{Status, Streaming};

use super::scorer::Scorer;
use crate::predict::{float_list, float_rows};

/// Input batches scored at once while earlier ones are sent back.
const IN_FLIGHT: usize = 2;

const COLUMNS: [&str; 5] = ["label", "label_id", "score", "probabilities", "embedding"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Command {
    model: Option<String>,
    #[serde(default = "default_text")]
    text: String,
    text_pair: Option<String>,
    columns: Option<Vec<String>>,
}

fn default_text() -> String {
    "text".into()
}

fn invalid(message: String) -> FlightError {
    FlightError::Tonic(Box::new(Status::invalid_argument(message)))
}

/// The scored batches of one DoExchange call, with the model named by its descriptor. The
/// Flight service holds the concurrency slot, bounds the stream by the query timeout and
/// encodes it.
pub(super) async fn exchange(
    scorers: &BTreeMap<String, Arc<Scorer>>,
    mut input: Streaming<FlightData>,
) -> Result<impl Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static, Status> {
    let first = input.message().await?.ok_or_else(|| {
        Status::invalid_argument("DoExchange: the stream is empty; send a descriptor first")
    })?;
    let descriptor = first.flight_descriptor.clone().ok_or_else(|| {
        Status::invalid_argument(
            "DoExchange: the first message has no descriptor; use \
             FlightDescriptor.for_command(b'{\"model\": \"...\", \"text\": \"text\"}')",
        )
    })?;
    let command: Command = serde_json::from_slice(&descriptor.cmd).map_err(|e| {
        Status::invalid_argument(format!(
            "DoExchange: malformed descriptor command ({e}); send JSON such as \
             {{\"model\": \"sentiment\", \"text\": \"text\"}}"
        ))
    })?;
    let name = command.model.as_deref().unwrap_or("predict");
    let scorer = scorers.get(name).cloned().ok_or_else(|| {
        let served: Vec<&str> = scorers
            .keys()
            .map(String::as_str)
            .filter(|n| *n != "predict")
            .collect();
        Status::invalid_argument(if name == "predict" {
            format!(
                "DoExchange: no default model; name one with \"model\" (served: {})",
                served.join(", ")
            )
        } else {
            format!(
                "DoExchange: unknown model `{name}`; served: {}",
                served.join(", ")
            )
        })
    })?;
    let columns = command.columns.clone().unwrap_or_else(|| {
        let defaults = if scorer.labels.is_empty() {
            &COLUMNS[4..]
        } else {
            &COLUMNS[..4]
        };
        defaults.iter().map(|c| c.to_string()).collect()
    });
    if let Some(bad) = columns.iter().find(|c| !COLUMNS.contains(&c.as_str())) {
        return Err(Status::invalid_argument(format!(
            "DoExchange: unknown output column `{bad}`; choose from {}",
            COLUMNS.join(", ")
        )));
    }
    let command = Arc::new(Command {
        columns: Some(columns),
        ..command
    });
    // Messages without an IPC header (the descriptor alone, as pyarrow sends it first, or
    // app metadata) carry no rows.
    let stream = futures::stream::once(async move { Ok(first) })
        .chain(input)
        .try_filter(|m| futures::future::ready(!m.data_header.is_empty()))
        .map_err(|s| FlightError::Tonic(Box::new(s)));
    Ok(FlightRecordBatchStream::new_from_flight_data(stream)
        .map(move |batch| {
            let (scorer, command) = (scorer.clone(), command.clone());
            async move { score(&scorer, &command, batch?).await }
        })
        .buffered(IN_FLIGHT))
}

/// `batch` with the command's prediction columns appended.
async fn score(
    scorer: &Scorer,
    command: &Command,
    batch: RecordBatch,
) -> Result<RecordBatch, FlightError> {
    let text_column = |name: &str| -> Result<ArrayRef, FlightError> {
        let schema = batch.schema();
        let (i, field) = schema.column_with_name(name).ok_or_else(|| {
            let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            invalid(format!(
                "DoExchange: the input has no column `{name}` (columns: {}); name the text \
                 column with \"text\" in the descriptor",
                names.join(", ")
            ))
        })?;
        match field.data_type() {
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
                Ok(batch.column(i).clone())
            }
            other => Err(invalid(format!(
                "DoExchange: column `{name}` is {other}, not a string; cast it to a string \
                 before sending"
            ))),
        }
    };
    let texts = text_column(&command.text)?;
    let pairs = command.text_pair.as_deref().map(text_column).transpose()?;
    let columns = command.columns.iter().flatten();
    let failed = |e: crate::error::Error| match e {
        crate::error::Error::Model(m) if scorer.labels.is_empty() => {
            invalid(format!("DoExchange: {m}"))
        }
        e => FlightError::Tonic(Box::new(Status::internal(e.to_string()))),
    };
    let scores = if columns.clone().any(|c| c != "embedding") {
        Some(scorer.score(&texts, pairs.as_ref()).await.map_err(failed)?)
    } else {
        None
    };
    let vectors = if columns.clone().any(|c| c == "embedding") {
        if pairs.is_some() {
            return Err(invalid(
                "DoExchange: `embedding` takes one text; drop \"text_pair\"".into(),
            ));
        }
        Some(scorer.embed(&texts).await.map_err(failed)?)
    } else {
        None
    };
    let rows = batch.num_rows();
    let (ids, best) = scores.as_ref().map(|s| s.best()).unwrap_or_default();
    let nulls = scores.as_ref().and_then(|s| s.nulls.clone());
    let valid = |r: usize| nulls.as_ref().is_none_or(|n| n.is_valid(r));
    let mut fields: Vec<Arc<Field>> = batch.schema().fields().iter().cloned().collect();
    let mut arrays: Vec<ArrayRef> = batch.columns().to_vec();
    for name in command.columns.iter().flatten() {
        if batch.schema().column_with_name(name).is_some() {
            return Err(invalid(format!(
                "DoExchange: the input already has a column `{name}`; rename it, or choose the \
                 output with \"columns\""
            )));
        }
        let (data_type, array): (DataType, ArrayRef) = match name.as_str() {
            "label" => (
                DataType::Utf8,
                Arc::new(StringArray::from_iter((0..rows).map(|r| {
                    valid(r).then(|| scorer.labels[ids[r] as usize].as_str())
                }))),
            ),
            "label_id" => (
                DataType::Int64,
                Arc::new(Int64Array::new(ids.clone().into(), nulls.clone())),
            ),
            "score" => (
                DataType::Float32,
                Arc::new(Float32Array::new(best.clone().into(), nulls.clone())),
            ),
            "embedding" => {
                let Some(v) = &vectors else {
                    return Err(invalid("DoExchange: no vectors were made".into()));
                };
                (
                    float_list(),
                    Arc::new(float_rows(v.values.clone(), v.dims, v.nulls.clone())),
                )
            }
            _ => {
                let Some(scores) = &scores else {
                    return Err(invalid("DoExchange: no probabilities were made".into()));
                };
                (
                    float_list(),
                    Arc::new(float_rows(
                        scores.probabilities.clone(),
                        scores.classes,
                        nulls.clone(),
                    )),
                )
            }
        };
        fields.push(Arc::new(Field::new(name, data_type, true)));
        arrays.push(array);
    }
    Ok(RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)?)
}
