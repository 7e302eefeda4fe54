//! The tokenized table in memory, split by the split column, with labels mapped to class ids.

use std::collections::BTreeSet;

use arrow::array::{Array, AsArray};
use arrow::datatypes::{DataType, Int32Type, Int64Type};
use arrow::record_batch::RecordBatch;
use arrow::util::display::{ArrayFormatter, FormatOptions};

use crate::error::{Error, Result};

/// The name the stage's id column is read under.
pub(crate) const ID: &str = "id";

/// Rows of one split: token ids packed end to end.
#[derive(Debug, Default)]
pub(crate) struct Split {
    pub tokens: Vec<i32>,
    /// `offsets[i]..offsets[i + 1]` are row `i`'s tokens.
    pub offsets: Vec<usize>,
    pub labels: Vec<i64>,
}

impl Split {
    fn new() -> Self {
        Self {
            offsets: vec![0],
            ..Self::default()
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.labels.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    pub(crate) fn row(&self, i: usize) -> &[i32] {
        &self.tokens[self.offsets[i]..self.offsets[i + 1]]
    }

    pub(crate) fn length(&self, i: usize) -> usize {
        self.offsets[i + 1] - self.offsets[i]
    }

    pub(crate) fn tokens(&self) -> usize {
        self.tokens.len()
    }
}

/// The three splits and the class names.
#[derive(Debug)]
pub(crate) struct Dataset {
    pub train: Split,
    pub validation: Split,
    pub test: Split,
    /// Class names by id.
    pub labels: Vec<String>,
}

/// What the model accepts, checked row by row.
pub(crate) struct Limits {
    pub vocab_size: i64,
    pub max_positions: i64,
}

/// Builds the dataset from the stage's query result ([`ID`], `input_ids`, `label`, split
/// column), in the rows' order. `names` are class names by id when known (`labels:` or the tokenize stage's
/// record); otherwise the distinct label values, sorted, become the classes.
pub(crate) fn dataset(
    batches: &[RecordBatch],
    split_column: &str,
    names: Option<Vec<String>>,
    limits: &Limits,
) -> Result<Dataset> {
    let mut raw_labels = Vec::new();
    let (mut train, mut validation, mut test) = (Split::new(), Split::new(), Split::new());
    for batch in batches {
        let col = |name: &str| {
            batch.column_by_name(name).ok_or_else(|| {
                Error::Internal(format!("column `{name}` vanished after validation"))
            })
        };
        let ids = ArrayFormatter::try_new(col(ID)?.as_ref(), &FormatOptions::default())
            .map_err(|e| Error::Internal(format!("formatting ids: {e}")))?;
        let input_ids = col("input_ids")?.as_list::<i32>().clone();
        let labels = arrow::compute::cast(col("label")?, &DataType::Int64)
            .map_err(|e| Error::Data(format!("column `label`: {e}")))?;
        let labels = labels.as_primitive::<Int64Type>();
        let splits = arrow::compute::cast(col(split_column)?, &DataType::Utf8)
            .map_err(|e| Error::Data(format!("column `{split_column}`: {e}")))?;
        let splits = splits.as_string::<i32>();
        for row in 0..batch.num_rows() {
            let id = ids.value(row);
            if labels.is_null(row) {
                return Err(Error::Data(format!(
                    "row id {id}: `label` is null; every training row needs a label (filter \
                     unlabeled rows out in the stage's `sql`)"
                )));
            }
            let target = match splits.is_valid(row).then(|| splits.value(row)) {
                Some("train") => &mut train,
                Some("validation") => &mut validation,
                Some("test") => &mut test,
                _ => continue,
            };
            let tokens = input_ids.value(row);
            let tokens = tokens.as_primitive::<Int32Type>();
            if tokens.len() as i64 > limits.max_positions {
                return Err(Error::Data(format!(
                    "row id {id} has {} tokens but the model takes at most {}; tokenize with \
                     `max_length: {}` or less",
                    tokens.len(),
                    limits.max_positions,
                    limits.max_positions
                )));
            }
            if let Some(bad) = tokens
                .values()
                .iter()
                .find(|t| **t < 0 || i64::from(**t) >= limits.vocab_size)
            {
                return Err(Error::Data(format!(
                    "row id {id}: token id {bad} is outside the model's vocabulary (vocab_size \
                     {}); the table was tokenized with a tokenizer that does not match the \
                     model: tokenize with the model's own tokenizer.json",
                    limits.vocab_size
                )));
            }
            target.tokens.extend_from_slice(tokens.values());
            target.offsets.push(target.tokens.len());
            target.labels.push(labels.value(row));
            raw_labels.push(labels.value(row));
        }
    }
    if train.is_empty() {
        return Err(Error::Data(format!(
            "no training rows: no row has `{split_column}` = 'train'"
        )));
    }
    let seen: BTreeSet<i64> = raw_labels.iter().copied().collect();
    let labels = match names {
        Some(names) => {
            if let Some(bad) = seen.iter().find(|l| **l < 0 || **l >= names.len() as i64) {
                return Err(Error::Data(format!(
                    "label id {bad} has no class name (classes: {}); fix `labels:`",
                    names.join(", ")
                )));
            }
            names
        }
        None => {
            // Label values that are not 0..n-1 are mapped onto it, in sorted order.
            let values: Vec<i64> = seen.iter().copied().collect();
            if values.iter().enumerate().any(|(i, v)| i as i64 != *v) {
                for split in [&mut train, &mut validation, &mut test] {
                    for l in &mut split.labels {
                        *l = values.binary_search(l).unwrap_or_default() as i64;
                    }
                }
            }
            values.iter().map(i64::to_string).collect()
        }
    };
    if seen.len() < 2 {
        return Err(Error::Data(format!(
            "the data has only one class ({}); a classifier needs at least two",
            seen.iter()
                .map(|l| labels
                    .get(*l as usize)
                    .cloned()
                    .unwrap_or_else(|| l.to_string()))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(Dataset {
        train,
        validation,
        test,
        labels,
    })
}
