//! The pipeline file as written: YAML into serde structs, unknown keys rejected.
//!
//! This is step one of two; [`crate::plan`] turns these structs into a validated plan
//! before any work starts.

mod interpolate;
mod jobs;
mod serve;
mod stages;
mod suggest;

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};
pub(crate) use jobs::{
    Catchup, JobSpec, OptimizeSpec, Overlap, SchedulerSpec, VacuumSpec, WaitFor,
};
pub(crate) use serve::{AuthSpec, ServeSpec, parse_duration};
use stages::default_device;
pub(crate) use stages::{
    Backend, DistributedSpec, Every, OnBad, OnEmpty, OnInvalidUtf8, OnOverlong, Precision,
    PredictMode, PredictSpec, Quantize, SaveWhich, Schedule, Source, TokenizeSpec, TrainSpec,
    Truncation, WriteMode, WriteSpec,
};
pub(crate) use suggest::closest;
use suggest::describe_yaml_error;

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
    /// `pipeline schedule`: jobs (stages with triggers), by name.
    #[serde(default)]
    pub jobs: BTreeMap<String, JobSpec>,
    /// `pipeline schedule`: the run history table, poll interval and shutdown grace.
    pub scheduler: Option<SchedulerSpec>,
    /// Defaults for every object-store URL in the file, by provider.
    #[serde(default)]
    pub storage: StorageSpec,
}

/// `storage:`: options for every URL of a provider, in delta-rs's key names.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StorageSpec {
    #[serde(default)]
    pub s3: OptionMap,
    #[serde(default)]
    pub azure: OptionMap,
    #[serde(default)]
    pub gcs: OptionMap,
}

/// Storage options as written: keys to scalar values (`allow_http: true` reads as "true").
pub(crate) type OptionMap = BTreeMap<String, OptionValue>;

/// One storage option's value. It may be a secret, so `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct OptionValue(pub String);

impl std::fmt::Debug for OptionValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

impl<'de> Deserialize<'de> for OptionValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        match serde_yaml_ng::Value::deserialize(d)? {
            serde_yaml_ng::Value::String(s) => Ok(Self(s)),
            serde_yaml_ng::Value::Bool(b) => Ok(Self(b.to_string())),
            serde_yaml_ng::Value::Number(n) => Ok(Self(n.to_string())),
            _ => Err(serde::de::Error::custom(
                "a storage option's value is a string, a number or true/false",
            )),
        }
    }
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
    /// Object-store options for this table (over the file's `storage:` defaults).
    #[serde(default)]
    pub storage_options: OptionMap,
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
    pub embed: Option<Box<PredictSpec>>,
    pub optimize: Option<OptimizeSpec>,
    pub vacuum: Option<VacuumSpec>,
}

/// A stage by kind, once checked that exactly one kind is given.
pub(crate) enum StageKind {
    Write(WriteSpec),
    Tokenize(TokenizeSpec),
    Train(Box<TrainSpec>),
    Predict(Box<PredictSpec>),
    Embed(Box<PredictSpec>),
    Optimize(OptimizeSpec),
    Vacuum(VacuumSpec),
}

impl StageSpec {
    pub(crate) fn kind(self) -> Result<StageKind, String> {
        let kinds = [
            self.write.map(StageKind::Write),
            self.tokenize.map(StageKind::Tokenize),
            self.train.map(StageKind::Train),
            self.predict.map(StageKind::Predict),
            self.embed.map(StageKind::Embed),
            self.optimize.map(StageKind::Optimize),
            self.vacuum.map(StageKind::Vacuum),
        ];
        let mut given = kinds.into_iter().flatten();
        match (given.next(), given.next()) {
            (Some(kind), None) => Ok(kind),
            _ => Err(
                "a stage is a map with exactly one key, its kind: `write`, `tokenize`, \
                 `train`, `predict`, `embed`, `optimize` or `vacuum`"
                    .into(),
            ),
        }
    }
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
