//! The predictions table (ARCHITECTURE.md): `id`, `label`, `label_id`, `score`, `probabilities`,
//! optionally `logits`, `model_version`, `run_id`, `predicted_at`, then the `keep` columns;
//! and the embeddings table: `id`, `embedding` (`list<float32>` of `dims` values: Delta has no
//! fixed-size array type, so this is what every reader sees; or `list<int8>` followed by
//! `embedding_scale float32` when quantized), `model_version`, `run_id`, `embedded_at`, then
//! the `keep` columns.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, Float32Array, Int8Array, Int64Array, ListArray, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use arrow::buffer::{NullBuffer, OffsetBuffer};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};

use crate::error::{Error, Result};
use crate::tokenize::RowPolicy;

/// What every row of one run shares.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    /// Class names by label id.
    pub labels: Vec<String>,
    /// sha256 of the model's config.json and weights.
    pub model_version: String,
    pub run_id: String,
    /// When the run started, in microseconds since the Unix epoch (UTC).
    pub predicted_at: i64,
    pub logits: bool,
}

/// `list<float32>` with non-null items, as the predictions table stores probabilities.
pub(crate) fn float_list() -> DataType {
    DataType::List(Arc::new(Field::new_list_field(DataType::Float32, false)))
}

/// `rows` vectors of `width` values each (row-major) as a `list<float32>` column.
pub(crate) fn float_rows(values: Vec<f32>, width: usize, nulls: Option<NullBuffer>) -> ListArray {
    let rows = values.len().checked_div(width).unwrap_or(0);
    ListArray::new(
        Arc::new(Field::new_list_field(DataType::Float32, false)),
        OffsetBuffer::from_lengths(std::iter::repeat_n(width, rows)),
        Arc::new(Float32Array::from(values)),
        nulls,
    )
}

/// The columns every output table ends with: `model_version`, `run_id`, the run's start as
/// `at`, then the `keep` columns as the tokenized schema has them.
fn tail_fields(tokenized: &Schema, policy: &RowPolicy, at: &str) -> Vec<Field> {
    let mut fields = vec![
        Field::new("model_version", DataType::Utf8, false),
        Field::new("run_id", DataType::Utf8, false),
        Field::new(
            at,
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            false,
        ),
    ];
    fields.extend(
        policy
            .keep
            .iter()
            .filter_map(|name| tokenized.field_with_name(name).ok().cloned()),
    );
    fields
}

/// The values of [`tail_fields`] for a window of `rows` rows.
fn tail_columns(tokenized: &RecordBatch, policy: &RowPolicy, meta: &Meta) -> Result<Vec<ArrayRef>> {
    let rows = tokenized.num_rows();
    let repeat = |s: &str| -> ArrayRef { Arc::new(StringArray::from(vec![s; rows])) };
    let mut columns = vec![
        repeat(&meta.model_version),
        repeat(&meta.run_id),
        Arc::new(
            TimestampMicrosecondArray::from(vec![meta.predicted_at; rows]).with_timezone("UTC"),
        ) as ArrayRef,
    ];
    for name in &policy.keep {
        columns.push(column(tokenized, name)?);
    }
    Ok(columns)
}

fn column(tokenized: &RecordBatch, name: &str) -> Result<ArrayRef> {
    tokenized
        .column_by_name(name)
        .cloned()
        .ok_or_else(|| Error::Internal(format!("column `{name}` missing from a window")))
}

/// The predictions schema for a tokenized schema (`id`, `input_ids`, `length`, keep...).
pub(crate) fn output_schema(tokenized: &Schema, policy: &RowPolicy, logits: bool) -> SchemaRef {
    let mut fields = vec![
        tokenized.field(0).clone(),
        Field::new("label", DataType::Utf8, false),
        Field::new("label_id", DataType::Int64, false),
        Field::new("score", DataType::Float32, false),
        Field::new("probabilities", float_list(), false),
    ];
    if logits {
        fields.push(Field::new("logits", float_list(), false));
    }
    fields.extend(tail_fields(tokenized, policy, "predicted_at"));
    Arc::new(Schema::new(fields))
}

/// Class probabilities of rows of logits, with each row's most likely class and its
/// probability.
pub(crate) struct Softmax {
    /// `[rows, classes]`, row-major.
    pub probabilities: Vec<f32>,
    pub label_ids: Vec<i64>,
    pub scores: Vec<f32>,
}

/// Softmax (in f64) over each row of `classes` logits.
pub(crate) fn softmax(logits: &[f32], classes: usize) -> Softmax {
    let rows = logits.len() / classes.max(1);
    let mut out = Softmax {
        probabilities: Vec::with_capacity(logits.len()),
        label_ids: Vec::with_capacity(rows),
        scores: Vec::with_capacity(rows),
    };
    for row in logits.chunks_exact(classes.max(1)) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f64> = row.iter().map(|&l| f64::from(l - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        let (mut best, mut best_p) = (0usize, f32::NEG_INFINITY);
        for (i, e) in exps.iter().enumerate() {
            let p = (e / sum) as f32;
            if p > best_p {
                (best, best_p) = (i, p);
            }
            out.probabilities.push(p);
        }
        out.label_ids.push(best as i64);
        out.scores.push(best_p);
    }
    out
}

/// The predictions of one tokenized window from its logits (`[rows, classes]`, row-major).
pub(crate) fn predictions_batch(
    tokenized: &RecordBatch,
    logits: &[f32],
    meta: &Meta,
    policy: &RowPolicy,
    schema: &SchemaRef,
) -> Result<RecordBatch> {
    let rows = tokenized.num_rows();
    let classes = meta.labels.len();
    if logits.len() != rows * classes {
        return Err(Error::Internal(format!(
            "{} logits for {rows} rows of {classes} classes",
            logits.len()
        )));
    }
    let Softmax {
        probabilities,
        label_ids,
        scores,
    } = softmax(logits, classes);
    let mut columns: Vec<ArrayRef> = vec![
        column(tokenized, &policy.id)?,
        Arc::new(StringArray::from_iter_values(
            label_ids.iter().map(|&i| meta.labels[i as usize].as_str()),
        )),
        Arc::new(Int64Array::from(label_ids)),
        Arc::new(Float32Array::from(scores)),
        Arc::new(float_rows(probabilities, classes, None)),
    ];
    if meta.logits {
        columns.push(Arc::new(float_rows(logits.to_vec(), classes, None)));
    }
    columns.extend(tail_columns(tokenized, policy, meta)?);
    RecordBatch::try_new(schema.clone(), columns)
        .map_err(|e| Error::Internal(format!("building a predictions batch: {e}")))
}

/// The embeddings schema for a tokenized schema (`id`, `input_ids`, `length`, keep...);
/// `quantized`: int8 vectors and their scale.
pub(crate) fn embeddings_schema(
    tokenized: &Schema,
    policy: &RowPolicy,
    quantized: bool,
) -> SchemaRef {
    let mut fields = vec![tokenized.field(0).clone()];
    if quantized {
        let int8 = DataType::List(Arc::new(Field::new_list_field(DataType::Int8, false)));
        fields.push(Field::new("embedding", int8, false));
        fields.push(Field::new("embedding_scale", DataType::Float32, false));
    } else {
        fields.push(Field::new("embedding", float_list(), false));
    }
    fields.extend(tail_fields(tokenized, policy, "embedded_at"));
    Arc::new(Schema::new(fields))
}

/// Symmetric int8 quantization of each `width`-value row: the values over the row's scale
/// (its largest |value| / 127), rounded; returns the int8 rows and the scales. A zero row
/// has scale 0.
fn quantize_rows(values: &[f32], width: usize) -> (Vec<i8>, Vec<f32>) {
    let mut out = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(values.len() / width.max(1));
    for row in values.chunks(width.max(1)) {
        let top = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = top / 127.0;
        let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        // In range by construction: |x| * 127 / top <= 127.
        out.extend(
            row.iter()
                .map(|x| (x * inverse).round().clamp(-127.0, 127.0) as i8),
        );
        scales.push(scale);
    }
    (out, scales)
}

/// The embeddings of one tokenized window from its vectors (`[rows, dims]`, row-major),
/// int8 with a scale per row if `quantized`.
pub(crate) fn embeddings_batch(
    tokenized: &RecordBatch,
    vectors: &[f32],
    dims: usize,
    quantized: bool,
    meta: &Meta,
    policy: &RowPolicy,
    schema: &SchemaRef,
) -> Result<RecordBatch> {
    let rows = tokenized.num_rows();
    if vectors.len() != rows * dims {
        return Err(Error::Internal(format!(
            "{} values for {rows} vectors of {dims}",
            vectors.len()
        )));
    }
    let mut columns: Vec<ArrayRef> = vec![column(tokenized, &policy.id)?];
    if quantized {
        let (values, scales) = quantize_rows(vectors, dims);
        columns.push(Arc::new(ListArray::new(
            Arc::new(Field::new_list_field(DataType::Int8, false)),
            OffsetBuffer::from_lengths(std::iter::repeat_n(dims, rows)),
            Arc::new(Int8Array::from(values)),
            None,
        )));
        columns.push(Arc::new(Float32Array::from(scales)));
    } else {
        columns.push(Arc::new(float_rows(vectors.to_vec(), dims, None)));
    }
    columns.extend(tail_columns(tokenized, policy, meta)?);
    RecordBatch::try_new(schema.clone(), columns)
        .map_err(|e| Error::Internal(format!("building an embeddings batch: {e}")))
}

#[cfg(test)]
mod tests {
    use super::quantize_rows;

    #[test]
    fn int8_rows_put_each_rows_largest_value_at_127_and_round_trip_within_half_a_step() {
        let rows = [
            0.5f32, -0.25, 0.125, 0.0, // a row with its top at +0.5
            0.0, 0.0, 0.0, 0.0, // a zero row
            -2.0, 1.0, 0.01, 0.5, // a row with its top at -2
        ];
        let (q, scales) = quantize_rows(&rows, 4);
        assert_eq!(q, [127, -64, 32, 0, 0, 0, 0, 0, -127, 64, 1, 32]);
        assert_eq!(scales, [0.5 / 127.0, 0.0, 2.0 / 127.0]);
        for (row, (values, scale)) in rows.chunks(4).zip(q.chunks(4).zip(&scales)) {
            for (x, v) in row.iter().zip(values) {
                assert!((x - f32::from(*v) * scale).abs() <= scale / 2.0 + 1e-7);
            }
        }
    }
}
