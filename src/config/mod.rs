//! The pipeline file as written: YAML into serde structs, unknown keys rejected.
//!
//! This is step one of two; [`crate::plan`] turns these structs into a validated plan
//! before any work starts.

mod interpolate;

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// A whole pipeline file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PipelineFile {
    /// Names the pipeline in reports and in the commit metadata of the tables it writes.
    pub name: String,
    /// Tables registered in the pipeline's SQL session, by name.
    #[serde(default)]
    pub tables: BTreeMap<String, TableSpec>,
    /// Stages, run in order.
    pub stages: Vec<StageSpec>,
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
}

/// A stage by kind, once checked that exactly one kind is given.
pub(crate) enum StageKind {
    Write(WriteSpec),
    Tokenize(TokenizeSpec),
}

impl StageSpec {
    pub(crate) fn kind(self) -> Result<StageKind, String> {
        match (self.write, self.tokenize) {
            (Some(w), None) => Ok(StageKind::Write(w)),
            (None, Some(t)) => Ok(StageKind::Tokenize(t)),
            _ => {
                Err("a stage is a map with exactly one key, its kind: `write` or `tokenize`".into())
            }
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
