//! One source batch `{id, text[, text_pair][, label], keep..}` into one tokenized batch
//! `{id, input_ids, length[, label], keep..}`, applying the stage's policy for each bad row.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::{
    Array, ArrayRef, AsArray, Int32Array, Int64Array, ListArray, RecordBatch, UInt32Array,
};
use arrow::buffer::{OffsetBuffer, ScalarBuffer};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::util::display::array_value_to_string;

use super::encoder::Encoder;
use crate::config::{OnBad, OnEmpty, OnInvalidUtf8, OnOverlong};
use crate::error::{Error, Result};

/// Column names and policies of a tokenize stage.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct RowPolicy {
    pub id: String,
    pub text: String,
    pub text_pair: Option<String>,
    pub label: Option<String>,
    pub keep: Vec<String>,
    pub on_overlong: OnOverlong,
    pub on_null: OnBad,
    pub on_empty: OnEmpty,
    pub on_invalid_utf8: OnInvalidUtf8,
}

impl RowPolicy {
    /// The source columns a stage reads: id, text, pair, label, then `keep`, each once (a
    /// kept column may also be the text, kept for reference).
    pub(crate) fn columns(&self) -> Vec<&str> {
        let mut columns: Vec<&str> = vec![&self.id, &self.text];
        columns.extend(self.text_pair.as_deref());
        columns.extend(self.label.as_deref());
        columns.extend(self.keep.iter().map(String::as_str));
        let mut seen = std::collections::HashSet::new();
        columns.retain(|c| seen.insert(*c));
        columns
    }
}

/// What happened to rows, summed over the whole stage (shared by the stream's tasks).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub rows_in: AtomicU64,
    pub rows_out: AtomicU64,
    pub tokens: AtomicU64,
    pub truncated: AtomicU64,
    pub skipped_overlong: AtomicU64,
    pub skipped_null: AtomicU64,
    pub skipped_empty: AtomicU64,
    pub skipped_invalid_utf8: AtomicU64,
    pub kept_empty: AtomicU64,
    pub replaced_invalid_utf8: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Rows in and out, tokens, and what happened to rows, into a stage's report.
    pub(crate) fn fill(&self, report: &mut crate::report::StageReport) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        report.rows_in = load(&self.rows_in);
        report.rows_out = load(&self.rows_out);
        report.tokens = load(&self.tokens);
        report.rows_by_outcome = [
            ("truncated", load(&self.truncated)),
            ("skipped_overlong", load(&self.skipped_overlong)),
            ("skipped_null", load(&self.skipped_null)),
            ("skipped_empty", load(&self.skipped_empty)),
            ("skipped_invalid_utf8", load(&self.skipped_invalid_utf8)),
            ("kept_empty", load(&self.kept_empty)),
            ("replaced_invalid_utf8", load(&self.replaced_invalid_utf8)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    }
}

/// Labels as the model sees them: ints as they are, strings by position in `names`.
#[derive(Debug, Clone)]
pub(crate) enum LabelMap {
    Ints,
    Names(HashMap<String, i64>),
}

/// The tokenized table's schema for a source schema.
pub(crate) fn output_schema(source: &Schema, policy: &RowPolicy) -> Result<SchemaRef> {
    let field = |name: &str| {
        source
            .field_with_name(name)
            .map_err(|_| Error::Internal(format!("column `{name}` vanished after validation")))
    };
    let mut fields = vec![
        Field::new(&policy.id, field(&policy.id)?.data_type().clone(), false),
        Field::new(
            "input_ids",
            DataType::List(Arc::new(Field::new_list_field(DataType::Int32, false))),
            false,
        ),
        Field::new("length", DataType::Int32, false),
    ];
    if policy.label.is_some() {
        fields.push(Field::new("label", DataType::Int64, false));
    }
    for name in &policy.keep {
        fields.push(field(name)?.as_ref().clone());
    }
    Ok(Arc::new(Schema::new(fields)))
}

/// A text column of any string or binary type.
enum TextColumn<'a> {
    Utf8(&'a dyn StrAt),
    Binary(&'a dyn BytesAt),
}

trait StrAt {
    fn str_at(&self, i: usize) -> &str;
}
trait BytesAt {
    fn bytes_at(&self, i: usize) -> &[u8];
}
impl<O: arrow::array::OffsetSizeTrait> StrAt for arrow::array::GenericStringArray<O> {
    fn str_at(&self, i: usize) -> &str {
        self.value(i)
    }
}
impl StrAt for arrow::array::StringViewArray {
    fn str_at(&self, i: usize) -> &str {
        self.value(i)
    }
}
impl<O: arrow::array::OffsetSizeTrait> BytesAt for arrow::array::GenericBinaryArray<O> {
    fn bytes_at(&self, i: usize) -> &[u8] {
        self.value(i)
    }
}
impl BytesAt for arrow::array::BinaryViewArray {
    fn bytes_at(&self, i: usize) -> &[u8] {
        self.value(i)
    }
}

impl<'a> TextColumn<'a> {
    fn new(array: &'a ArrayRef) -> Result<Self> {
        Ok(match array.data_type() {
            DataType::Utf8 => TextColumn::Utf8(array.as_string::<i32>()),
            DataType::LargeUtf8 => TextColumn::Utf8(array.as_string::<i64>()),
            DataType::Utf8View => TextColumn::Utf8(array.as_string_view()),
            DataType::Binary => TextColumn::Binary(array.as_binary::<i32>()),
            DataType::LargeBinary => TextColumn::Binary(array.as_binary::<i64>()),
            DataType::BinaryView => TextColumn::Binary(array.as_binary_view()),
            other => {
                return Err(Error::Internal(format!(
                    "text column of type {other} passed validation"
                )));
            }
        })
    }

    fn get(&self, i: usize) -> std::result::Result<&'a str, &'a [u8]> {
        match self {
            TextColumn::Utf8(a) => Ok(a.str_at(i)),
            TextColumn::Binary(a) => {
                let bytes = a.bytes_at(i);
                std::str::from_utf8(bytes).map_err(|_| bytes)
            }
        }
    }
}

/// Tokenizes one batch. Rows dropped by a `skip` policy are counted in `counters`.
pub(crate) fn tokenize_batch(
    batch: &RecordBatch,
    encoder: &Encoder,
    policy: &RowPolicy,
    labels: Option<&LabelMap>,
    schema: &SchemaRef,
    counters: &Counters,
) -> Result<RecordBatch> {
    let column = |name: &str| {
        batch
            .column_by_name(name)
            .ok_or_else(|| Error::Internal(format!("column `{name}` missing from a batch")))
    };
    let ids = column(&policy.id)?;
    let id_of = |row: usize| array_value_to_string(ids, row).unwrap_or_else(|_| "?".into());
    let texts_array = column(&policy.text)?;
    let texts = TextColumn::new(texts_array)?;
    let pair_array = policy.text_pair.as_deref().map(column).transpose()?;
    let pairs = pair_array.map(TextColumn::new).transpose()?;
    let label_array = policy.label.as_deref().map(column).transpose()?;
    Counters::add(&counters.rows_in, batch.num_rows());

    let mut rows: Vec<u32> = Vec::with_capacity(batch.num_rows());
    let mut first: Vec<Cow<str>> = Vec::with_capacity(batch.num_rows());
    let mut second: Vec<Cow<str>> = Vec::new();
    'rows: for row in 0..batch.num_rows() {
        if ids.is_null(row) {
            return Err(Error::Data(format!(
                "column `{}` is null in a row (text: {:?}); every row needs an id",
                policy.id,
                texts.get(row).unwrap_or("<binary>")
            )));
        }
        if let Some(labels) = label_array
            && labels.is_null(row)
        {
            return Err(Error::Data(format!(
                "row id {}: label column `{}` is null; fill it or filter the row out in the \
                 stage's SQL",
                id_of(row),
                policy.label.as_deref().unwrap_or_default()
            )));
        }
        let mut cells = [None, None];
        let sides = [
            Some((&texts, texts_array, &policy.text)),
            pairs
                .as_ref()
                .zip(pair_array)
                .zip(policy.text_pair.as_ref())
                .map(|((p, a), n)| (p, a, n)),
        ];
        for (side, spec) in sides.into_iter().enumerate() {
            let Some((col, array, name)) = spec else {
                continue;
            };
            if array.is_null(row) {
                match policy.on_null {
                    OnBad::Skip => {
                        Counters::add(&counters.skipped_null, 1);
                        continue 'rows;
                    }
                    OnBad::Error => {
                        return Err(Error::Data(format!(
                            "row id {}: text column `{name}` is null; set `on_null: skip` to \
                             drop such rows, or filter them out in the stage's SQL",
                            id_of(row)
                        )));
                    }
                }
            }
            let text: Cow<str> = match col.get(row) {
                Ok(s) => Cow::Borrowed(s),
                Err(bytes) => match policy.on_invalid_utf8 {
                    OnInvalidUtf8::Skip => {
                        Counters::add(&counters.skipped_invalid_utf8, 1);
                        continue 'rows;
                    }
                    OnInvalidUtf8::Replace => {
                        Counters::add(&counters.replaced_invalid_utf8, 1);
                        String::from_utf8_lossy(bytes)
                    }
                    OnInvalidUtf8::Error => {
                        let bad = std::str::from_utf8(bytes)
                            .err()
                            .map_or(0, |e| e.valid_up_to());
                        return Err(Error::Data(format!(
                            "row id {}: column `{name}` is not valid UTF-8 (bad byte at offset \
                             {bad}); set `on_invalid_utf8: skip` or `replace`",
                            id_of(row)
                        )));
                    }
                },
            };
            if text.trim().is_empty() {
                match policy.on_empty {
                    OnEmpty::Keep => Counters::add(&counters.kept_empty, 1),
                    OnEmpty::Skip => {
                        Counters::add(&counters.skipped_empty, 1);
                        continue 'rows;
                    }
                    OnEmpty::Error => {
                        return Err(Error::Data(format!(
                            "row id {}: column `{name}` is empty; set `on_empty: keep` or `skip`",
                            id_of(row)
                        )));
                    }
                }
            }
            cells[side] = Some(text);
        }
        let [a, b] = cells;
        first.push(a.unwrap_or_default());
        if let Some(b) = b {
            second.push(b);
        }
        rows.push(row as u32);
    }

    let first_refs: Vec<&str> = first.iter().map(|s| s.as_ref()).collect();
    let second_refs: Vec<&str> = second.iter().map(|s| s.as_ref()).collect();
    let encoded = encoder.encode(&first_refs, pairs.is_some().then_some(&second_refs[..]))?;

    // Over-long rows: already cut (truncate), dropped (skip) or an error.
    let mut kept: Vec<usize> = Vec::with_capacity(rows.len());
    for (k, &row) in rows.iter().enumerate() {
        if encoded.overlong[k] {
            match policy.on_overlong {
                OnOverlong::Truncate => Counters::add(&counters.truncated, 1),
                OnOverlong::Skip => {
                    Counters::add(&counters.skipped_overlong, 1);
                    continue;
                }
                OnOverlong::Error => {
                    return Err(Error::Data(format!(
                        "row id {}: {} tokens is more than max_length; set `on_overlong: \
                         truncate` or `skip`, or raise max_length",
                        id_of(row as usize),
                        encoded.len(k)
                    )));
                }
            }
        }
        kept.push(k);
    }
    // Usually every row is kept and the encoder's buffers become the column as they are.
    let (values, offsets, rows) = if kept.len() == rows.len() {
        (encoded.values, encoded.offsets, rows)
    } else {
        let mut values = Vec::with_capacity(encoded.values.len());
        let mut offsets = Vec::with_capacity(kept.len() + 1);
        offsets.push(0);
        for &k in &kept {
            let (start, end) = (encoded.offsets[k] as usize, encoded.offsets[k + 1] as usize);
            values.extend_from_slice(&encoded.values[start..end]);
            offsets.push(values.len() as i32);
        }
        (values, offsets, kept.iter().map(|&k| rows[k]).collect())
    };
    let lengths: Vec<i32> = offsets.windows(2).map(|w| w[1] - w[0]).collect();
    let take = UInt32Array::from(rows);
    let take_col = |array: &ArrayRef| {
        arrow::compute::take(array.as_ref(), &take, None)
            .map_err(|e| Error::Internal(format!("take: {e}")))
    };

    let kept_ids = take_col(ids)?;
    let mut columns: Vec<ArrayRef> = vec![kept_ids.clone()];
    let item = Arc::new(Field::new_list_field(DataType::Int32, false));
    let list = ListArray::try_new(
        item,
        OffsetBuffer::new(ScalarBuffer::from(offsets)),
        Arc::new(Int32Array::from(values)),
        None,
    )
    .map_err(|e| Error::Internal(format!("input_ids: {e}")))?;
    Counters::add(&counters.tokens, list.values().len());
    columns.push(Arc::new(list));
    columns.push(Arc::new(Int32Array::from(lengths)));
    if let Some(array) = label_array {
        columns.push(label_ids(&take_col(array)?, labels, &kept_ids, policy)?);
    }
    for name in &policy.keep {
        columns.push(take_col(column(name)?)?);
    }
    Counters::add(&counters.rows_out, take.len());
    RecordBatch::try_new(schema.clone(), columns)
        .map_err(|e| Error::Internal(format!("tokenized batch: {e}")))
}

/// Label values as int64 class ids.
fn label_ids(
    array: &ArrayRef,
    labels: Option<&LabelMap>,
    ids: &ArrayRef,
    policy: &RowPolicy,
) -> Result<ArrayRef> {
    match labels {
        Some(LabelMap::Names(map)) => {
            let strings = arrow::compute::cast(array, &DataType::Utf8)
                .map_err(|e| Error::Internal(format!("label cast: {e}")))?;
            let strings = strings.as_string::<i32>();
            let mut out = Vec::with_capacity(strings.len());
            for row in 0..strings.len() {
                let name = strings.value(row);
                let Some(&id) = map.get(name) else {
                    return Err(Error::Data(format!(
                        "row id {}: label `{name}` in column `{}` is not one of the stage's \
                         `labels`; add it there",
                        array_value_to_string(ids, row).unwrap_or_default(),
                        policy.label.as_deref().unwrap_or_default()
                    )));
                };
                out.push(id);
            }
            Ok(Arc::new(Int64Array::from(out)))
        }
        _ => {
            let cast = arrow::compute::cast(array, &DataType::Int64)
                .map_err(|e| Error::Data(format!("label column: {e}")))?;
            let values = cast.as_primitive::<arrow::datatypes::Int64Type>();
            if let Some(row) = (0..values.len()).find(|&r| values.value(r) < 0) {
                return Err(Error::Data(format!(
                    "row id {}: label {} in column `{}` is negative; integer labels are class \
                     ids 0..n-1",
                    array_value_to_string(ids, row).unwrap_or_default(),
                    values.value(row),
                    policy.label.as_deref().unwrap_or_default()
                )));
            }
            Ok(cast)
        }
    }
}
