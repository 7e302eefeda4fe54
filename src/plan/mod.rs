//! Step two of reading a pipeline file: resolve paths, check every table, query, column and
//! type against the real tables, and produce a plan, all before any stage runs.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod checks;
mod jobs;
mod predict;
mod stages;
mod tables;
mod train;

use arrow::datatypes::Schema;
use datafusion::prelude::SessionContext;

use crate::catalog::{self, TableDef, TableKind};
use crate::config::{PipelineFile, PredictMode, Source, WriteMode};
use crate::error::{Error, Result};
pub(crate) use crate::storage::resolve;
use crate::storage::{Defaults, Provider, StorageOptions};
use crate::tokenize::{self, Encoder, RowPolicy};
pub(crate) use checks::is_string;
use checks::{check_row_columns, check_tokenize_columns, plan_schema, schema_diff};
pub(crate) use jobs::{Job, Retries, SchedulerSettings, Timing, human, plan_jobs, plan_scheduler};
pub(crate) use predict::{Inference, PredictStage, inference_settings, model_labels};
use tables::table_def;
pub(crate) use train::{TrainStage, id_column as train_id_column};

/// A validated pipeline, ready to run.
#[derive(Debug)]
pub struct Pipeline {
    pub(crate) file: PathBuf,
    pub(crate) name: String,
    pub(crate) tables: BTreeMap<String, TableDef>,
    pub(crate) stages: Vec<Stage>,
    /// The directory paths in the file are relative to.
    pub(crate) base: PathBuf,
    /// The `serve:` section as written; `pipeline serve` validates it.
    pub(crate) serve: Option<crate::config::ServeSpec>,
    /// `jobs:`, checked against the stages and tables.
    pub(crate) jobs: Vec<Job>,
    /// `scheduler:` (with the run history table); present when the file has jobs.
    pub(crate) scheduler: Option<SchedulerSettings>,
    /// `storage:`: defaults for object-store URLs (models of `serve:` use them too).
    pub(crate) storage: Defaults,
}

#[derive(Debug)]
pub(crate) enum Stage {
    Write(WriteStage),
    Tokenize(TokenizeStage),
    Train(Box<TrainStage>),
    Predict(Box<PredictStage>),
    Optimize(OptimizeStage),
    Vacuum(VacuumStage),
}

/// `optimize`: compacts a Delta table's small files.
#[derive(Debug)]
pub(crate) struct OptimizeStage {
    pub name: String,
    pub field: String,
    pub table: String,
    pub target_file_bytes: u64,
    pub zorder: Vec<String>,
}

/// `vacuum`: deletes files no version within the retention needs.
#[derive(Debug)]
pub(crate) struct VacuumStage {
    pub name: String,
    pub field: String,
    pub table: String,
    pub retention: std::time::Duration,
    /// False only with `allow_short_retention` (and a retention under 7 days).
    pub enforce_retention: bool,
}

/// Vacuum keeps at least this much history unless told otherwise (Delta's own default).
const MIN_RETENTION: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// SQL a stage reads, and where it came from (for error messages).
#[derive(Debug, Clone)]
pub(crate) struct Query {
    pub sql: String,
    pub origin: String,
}

#[derive(Debug)]
pub(crate) struct WriteStage {
    pub name: String,
    pub field: String,
    pub query: Query,
    pub to: String,
    pub mode: WriteMode,
}

#[derive(Debug)]
pub(crate) struct TokenizeStage {
    pub name: String,
    pub field: String,
    pub query: Query,
    pub to: String,
    pub tokenizer: PathBuf,
    /// Loaded once, when the file is read: validation and the run share it.
    pub encoder: Arc<Encoder>,
    pub policy: RowPolicy,
    pub labels: Option<Vec<String>>,
    pub batch_rows: usize,
}

impl Stage {
    pub(crate) fn name(&self) -> &str {
        match self {
            Stage::Write(s) => &s.name,
            Stage::Tokenize(s) => &s.name,
            Stage::Train(s) => &s.name,
            Stage::Predict(s) => &s.name,
            Stage::Optimize(s) => &s.name,
            Stage::Vacuum(s) => &s.name,
        }
    }

    /// The table the stage writes (a train stage writes a model directory instead).
    pub(crate) fn to(&self) -> Option<&str> {
        match self {
            Stage::Write(s) => Some(&s.to),
            Stage::Tokenize(s) => Some(&s.to),
            Stage::Train(_) | Stage::Optimize(_) | Stage::Vacuum(_) => None,
            Stage::Predict(s) => Some(&s.to),
        }
    }

    /// The table an `optimize` or `vacuum` stage maintains in place.
    pub(crate) fn maintains(&self) -> Option<&str> {
        match self {
            Stage::Optimize(s) => Some(&s.table),
            Stage::Vacuum(s) => Some(&s.table),
            _ => None,
        }
    }
}

impl Pipeline {
    /// Reads a pipeline file and checks everything that needs no table: keys, kinds, files,
    /// names. [`Pipeline::validate`] then checks queries and columns against the tables.
    pub fn load(file: impl AsRef<Path>) -> Result<Self> {
        let file = file.as_ref().to_path_buf();
        let spec = PipelineFile::load(&file)?;
        let base = std::fs::canonicalize(&file)
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .unwrap_or_else(|| PathBuf::from("."));
        let err = |m: String| Error::config(&file, m);

        let storage = storage_defaults(spec.storage);
        storage.check().map_err(err)?;

        let mut tables = BTreeMap::new();
        for (name, t) in spec.tables {
            let def = table_def(&base, &name, t, &storage)
                .map_err(|m| err(format!("tables.{name}: {m}")))?;
            tables.insert(name, def);
        }

        let stages = stages::plan_stages(&base, spec.stages, &tables, &storage).map_err(err)?;
        if stages.is_empty() && spec.serve.is_none() && spec.jobs.is_empty() {
            return Err(err(
                "`stages` is empty; add at least one stage (or a `serve` section)".into(),
            ));
        }
        let scheduler = plan_scheduler(spec.scheduler, &base, &mut tables, !spec.jobs.is_empty())
            .map_err(err)?;
        let history = scheduler.as_ref().map(|s| s.history.name.as_str());
        check_tables_exist(&tables, &stages, history).map_err(err)?;
        let jobs = plan_jobs(spec.jobs, &stages, &tables).map_err(err)?;
        Ok(Self {
            file,
            name: spec.name,
            tables,
            stages,
            base,
            serve: spec.serve,
            jobs,
            scheduler,
            storage,
        })
    }

    /// The pipeline's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers every table that exists in `ctx`; returns what each one reads now (for
    /// fingerprints). Tables that a stage will create are left out.
    ///
    /// Object stores are asked first, once per table: a missing bucket, refused credentials
    /// or an unreachable endpoint is a configuration error before any work.
    pub(crate) async fn register_tables(
        &self,
        ctx: &SessionContext,
    ) -> Result<HashMap<String, String>> {
        let err = |m: String| Error::config(&self.file, m);
        for def in self.tables.values() {
            if let Some(remote) = def.location.remote() {
                remote
                    .probe()
                    .await
                    .map_err(|m| err(format!("tables.{}: {m}", def.name)))?;
            }
        }
        let mut identities = HashMap::new();
        for def in self.tables.values() {
            if def.is_delta() && !def.delta_exists().await? {
                let written = self
                    .stages
                    .iter()
                    .any(|s| s.to() == Some(def.name.as_str()));
                let history = self
                    .scheduler
                    .as_ref()
                    .is_some_and(|s| s.history.name == def.name);
                if written || history {
                    continue; // a stage, or the scheduler, creates it
                }
                return Err(err(missing_table(def)));
            }
            let identity = def
                .register(ctx)
                .await
                .map_err(|e| Error::config(&self.file, format!("tables.{}: {e}", def.name)))?;
            identities.insert(def.name.clone(), identity);
        }
        Ok(identities)
    }

    /// Plans each stage's query in `ctx` (which holds the existing tables) and checks it;
    /// each stage's output is then registered as an empty table with the schema it will
    /// have, so later stages are checked against it.
    pub(crate) async fn check_stages(&self, ctx: &SessionContext) -> Result<()> {
        let err = |m: String| Error::config(&self.file, m);
        for stage in &self.stages {
            match stage {
                Stage::Write(w) => {
                    let schema = plan_schema(ctx, &w.query, &self.tables)
                        .await
                        .map_err(err)?;
                    self.check_write_target(w, &schema).await.map_err(err)?;
                    catalog::register_planned(ctx, &w.to, schema)?;
                }
                Stage::Tokenize(t) => {
                    let schema = plan_schema(ctx, &t.query, &self.tables)
                        .await
                        .map_err(err)?;
                    check_tokenize_columns(t, &schema).map_err(err)?;
                    let out = tokenize::output_schema(&schema, &t.policy)?;
                    catalog::register_planned(ctx, &t.to, out)?;
                }
                Stage::Train(t) => {
                    let schema = plan_schema(ctx, &t.query, &self.tables)
                        .await
                        .map_err(err)?;
                    let id = train::id_column(t, &self.tables).await?;
                    train::check_train_columns(t, &id, &schema).map_err(err)?;
                }
                Stage::Predict(p) => {
                    let schema = plan_schema(ctx, &p.query, &self.tables)
                        .await
                        .map_err(err)?;
                    let mut reserved = vec!["input_ids", "length"];
                    reserved.extend(match p.embed {
                        Some(_) => predict::EMBED_COLUMNS,
                        None => predict::PREDICT_COLUMNS,
                    });
                    check_row_columns(&p.field, &p.policy, false, &reserved, &schema)
                        .map_err(err)?;
                    let tokenized = tokenize::output_schema(&schema, &p.policy)?;
                    let out = match &p.embed {
                        Some(e) => crate::predict::embeddings_schema(
                            &tokenized,
                            &p.policy,
                            e.quantize.is_some(),
                        ),
                        None => {
                            crate::predict::output_schema(&tokenized, &p.policy, p.settings.logits)
                        }
                    };
                    self.check_predict_target(p, &out).await.map_err(err)?;
                    catalog::register_planned(ctx, &p.to, out)?;
                }
                Stage::Optimize(o) => {
                    if !o.zorder.is_empty() {
                        let schema = plan_schema(
                            ctx,
                            &Query {
                                sql: format!("SELECT * FROM \"{}\"", o.table.replace('"', "\"\"")),
                                origin: o.field.clone(),
                            },
                            &self.tables,
                        )
                        .await
                        .map_err(err)?;
                        if let Some(c) =
                            o.zorder.iter().find(|c| schema.field_with_name(c).is_err())
                        {
                            return Err(err(format!(
                                "{}.zorder: table `{}` has no column `{c}`",
                                o.field, o.table
                            )));
                        }
                    }
                }
                Stage::Vacuum(_) => {}
            }
        }
        Ok(())
    }

    async fn check_write_target(&self, w: &WriteStage, schema: &Schema) -> Result<(), String> {
        let def = &self.tables[&w.to];
        if !def.delta_exists().await.map_err(|e| e.to_string())? {
            return Ok(()); // every mode creates a table that does not exist yet
        }
        match w.mode {
            WriteMode::Create => Err(format!(
                "{}: table `{}` already exists at {}; use `mode: overwrite` or `mode: append`",
                w.field, w.to, def.location
            )),
            WriteMode::Overwrite => Ok(()),
            WriteMode::Append => appendable(def, schema).await?.map_err(|d| {
                format!(
                    "{}: the query's columns do not match table `{}` for append: {d}; \
                         change the query, or use `mode: overwrite`",
                    w.field, w.to
                )
            }),
        }
    }
}

impl Pipeline {
    /// An incremental predict stage appends to its table: the columns must match.
    async fn check_predict_target(&self, p: &PredictStage, schema: &Schema) -> Result<(), String> {
        let def = &self.tables[&p.to];
        if p.mode == PredictMode::Overwrite
            || !def.delta_exists().await.map_err(|e| e.to_string())?
        {
            return Ok(());
        }
        appendable(def, schema).await?.map_err(|d| {
            format!(
                "{}: table `{}` does not hold {} of this shape, so new ones cannot be \
                 appended: {d}; write to another table, or use `mode: overwrite`",
                p.field,
                p.to,
                if p.embed.is_some() {
                    "embeddings"
                } else {
                    "predictions"
                }
            )
        })
    }
}

/// Whether rows of `schema` can be appended to the existing Delta table `def`: the outer
/// error is reading the table, the inner one how the columns differ.
async fn appendable(def: &TableDef, schema: &Schema) -> Result<Result<(), String>, String> {
    let table = def.open_delta(None).await.map_err(|e| e.to_string())?;
    let existing = table
        .snapshot()
        .map_err(|e| e.to_string())?
        .snapshot()
        .arrow_schema();
    Ok(schema_diff(&existing, schema))
}

pub(super) fn query(base: &Path, s: &Source, field: &str) -> Result<Query, String> {
    match (&s.from, &s.sql, &s.sql_file) {
        (Some(table), None, None) => Ok(Query {
            sql: format!("SELECT * FROM \"{}\"", table.replace('"', "\"\"")),
            origin: format!("{field}.from"),
        }),
        (None, Some(sql), None) => Ok(Query {
            sql: sql.clone(),
            origin: format!("{field}.sql"),
        }),
        (None, None, Some(file)) => {
            let path = crate::storage::local_path(base, file)
                .map_err(|m| format!("{field}.sql_file: {m}"))?;
            let sql = std::fs::read_to_string(&path)
                .map_err(|e| format!("{field}.sql_file: cannot read `{}`: {e}", path.display()))?;
            Ok(Query {
                sql,
                origin: format!("{field}.sql_file ({file})"),
            })
        }
        _ => Err(format!(
            "{field}: give exactly one of `from` (a table), `sql` or `sql_file`"
        )),
    }
}

/// `storage:` as defaults for each provider's URLs.
fn storage_defaults(spec: crate::config::StorageSpec) -> Defaults {
    let options =
        |m: crate::config::OptionMap| StorageOptions::new(m.into_iter().map(|(k, v)| (k, v.0)));
    Defaults::new([
        (Provider::S3, options(spec.s3)),
        (Provider::Azure, options(spec.azure)),
        (Provider::Gcs, options(spec.gcs)),
    ])
}

/// Every declared local Delta table exists, or a stage (or the scheduler, whose run history
/// is `history`) writes it.
fn check_tables_exist(
    tables: &BTreeMap<String, TableDef>,
    stages: &[Stage],
    history: Option<&str>,
) -> std::result::Result<(), String> {
    for def in tables.values() {
        // The scheduler creates its run history on its first run.
        let written = stages.iter().any(|s| s.to() == Some(def.name.as_str()))
            || history == Some(def.name.as_str());
        let missing = def
            .location
            .local()
            .is_some_and(|p| !catalog::has_delta_log(p));
        if def.is_delta() && !written && missing {
            return Err(missing_table(def));
        }
    }
    Ok(())
}

/// A declared Delta table that is not there and that no stage writes.
fn missing_table(def: &TableDef) -> String {
    format!(
        "tables.{}: no Delta table at `{}` (no _delta_log) and no stage writes it; fix the \
         path, or add a stage that writes it",
        def.name, def.location
    )
}

/// The table of an `optimize` or `vacuum` stage: a declared, unpinned Delta table.
fn maintained_table(
    tables: &BTreeMap<String, TableDef>,
    name: &str,
    field: &str,
) -> Result<(), String> {
    match tables.get(name) {
        None => Err(format!(
            "{field}.table: table `{name}` is not declared under `tables` (declared: {})",
            tables.keys().cloned().collect::<Vec<_>>().join(", ")
        )),
        Some(TableDef {
            kind: TableKind::Delta { at: None },
            ..
        }) => Ok(()),
        Some(_) => Err(format!(
            "{field}.table: table `{name}` must be a Delta table that is not pinned to a version"
        )),
    }
}

fn output_table(
    tables: &BTreeMap<String, TableDef>,
    name: &str,
    field: &str,
) -> Result<(), String> {
    let known = || tables.keys().cloned().collect::<Vec<_>>().join(", ");
    match tables.get(name) {
        None => Err(format!(
            "{field}.to: table `{name}` is not declared under `tables` (declared: {}); add it \
             as `{name}: {{ delta: <path> }}`",
            known()
        )),
        Some(def) if !def.is_delta() => Err(format!(
            "{field}.to: table `{name}` is not a Delta table; stages write Delta tables only"
        )),
        Some(TableDef {
            kind: TableKind::Delta { at: Some(_) },
            ..
        }) => Err(format!(
            "{field}.to: table `{name}` is pinned to an old version (time travel); a stage \
             cannot write it"
        )),
        Some(_) => Ok(()),
    }
}
