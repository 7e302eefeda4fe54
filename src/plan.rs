//! Step two of reading a pipeline file: resolve paths, check every table, query, column and
//! type against the real tables, and produce a plan, all before any stage runs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow::datatypes::{DataType, Schema, SchemaRef};
use datafusion::prelude::SessionContext;

use crate::catalog::{self, TableDef, TableKind, TimeTravel};
use crate::config::{PipelineFile, Source, StageKind, TableSpec, WriteMode};
use crate::error::{Error, Result};
use crate::tokenize::{self, Encoder, EncoderSettings, RowPolicy};

/// A validated pipeline, ready to run.
#[derive(Debug)]
pub struct Pipeline {
    pub(crate) file: PathBuf,
    pub(crate) name: String,
    pub(crate) tables: BTreeMap<String, TableDef>,
    pub(crate) stages: Vec<Stage>,
}

#[derive(Debug)]
pub(crate) enum Stage {
    Write(WriteStage),
    Tokenize(TokenizeStage),
}

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
    pub encoder: EncoderSettings,
    pub policy: RowPolicy,
    pub labels: Option<Vec<String>>,
    pub batch_rows: usize,
}

impl Stage {
    pub(crate) fn name(&self) -> &str {
        match self {
            Stage::Write(s) => &s.name,
            Stage::Tokenize(s) => &s.name,
        }
    }
}

/// Text columns may be any string or binary type (binary is checked for UTF-8 per row).
fn is_text(t: &DataType) -> bool {
    matches!(
        t,
        DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Binary
            | DataType::LargeBinary
            | DataType::BinaryView
    )
}

fn is_string(t: &DataType) -> bool {
    matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

/// `~/x` and paths relative to the pipeline file's directory.
fn resolve(base: &Path, path: &str) -> PathBuf {
    let expanded = match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(path),
    };
    let joined = if expanded.is_absolute() {
        expanded
    } else {
        base.join(expanded)
    };
    // Lexical clean-up of `.` and `..` so messages and table URLs read naturally.
    let mut out = PathBuf::new();
    for part in joined.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
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

        let mut tables = BTreeMap::new();
        for (name, t) in spec.tables {
            let def = table_def(&base, &name, t).map_err(|m| err(format!("tables.{name}: {m}")))?;
            tables.insert(name, def);
        }

        let mut stages: Vec<Stage> = Vec::new();
        let mut names = std::collections::HashSet::new();
        for (i, s) in spec.stages.into_iter().enumerate() {
            let kind = s.kind().map_err(|m| err(format!("stages[{i}]: {m}")))?;
            let stage = match kind {
                StageKind::Write(w) => {
                    let field = format!("stages[{i}].write");
                    let name = w.name.unwrap_or_else(|| format!("write-{}", w.to));
                    let query = query(&base, &w.source, &field).map_err(err)?;
                    output_table(&tables, &w.to, &field).map_err(err)?;
                    Stage::Write(WriteStage {
                        name,
                        field,
                        query,
                        to: w.to,
                        mode: w.mode,
                    })
                }
                StageKind::Tokenize(t) => {
                    let field = format!("stages[{i}].tokenize");
                    let name = t.name.unwrap_or_else(|| format!("tokenize-{}", t.to));
                    let query = query(&base, &t.source, &field).map_err(err)?;
                    output_table(&tables, &t.to, &field).map_err(err)?;
                    if t.max_length < 2 || t.max_length > 1 << 16 {
                        return Err(err(format!(
                            "{field}.max_length: {} is out of range; use 2..=65536",
                            t.max_length
                        )));
                    }
                    if t.batch_rows == 0 || t.batch_rows > 1 << 20 {
                        return Err(err(format!(
                            "{field}.batch_rows: {} is out of range; use 1..=1048576",
                            t.batch_rows
                        )));
                    }
                    if t.labels.is_some() && t.label.is_none() {
                        return Err(err(format!(
                            "{field}.labels: set `label` (the label column) too"
                        )));
                    }
                    let tokenizer = resolve(&base, &t.tokenizer);
                    let json = if tokenizer.is_dir() {
                        tokenizer.join("tokenizer.json")
                    } else {
                        tokenizer.clone()
                    };
                    if !json.is_file() {
                        return Err(err(format!(
                            "{field}.tokenizer: `{}` not found; give a tokenizer.json or a model \
                             directory that holds one",
                            json.display()
                        )));
                    }
                    Stage::Tokenize(TokenizeStage {
                        name,
                        field,
                        query,
                        to: t.to,
                        tokenizer,
                        encoder: EncoderSettings {
                            max_length: t.max_length,
                            truncate: t.on_overlong == crate::config::OnOverlong::Truncate,
                            truncation: t.truncation,
                            add_special_tokens: t.add_special_tokens,
                        },
                        policy: RowPolicy {
                            id: t.id,
                            text: t.text,
                            text_pair: t.text_pair,
                            label: t.label,
                            keep: t.keep,
                            on_overlong: t.on_overlong,
                            on_null: t.on_null,
                            on_empty: t.on_empty,
                            on_invalid_utf8: t.on_invalid_utf8,
                        },
                        labels: t.labels,
                        batch_rows: t.batch_rows,
                    })
                }
            };
            if !names.insert(stage.name().to_string()) {
                return Err(err(format!(
                    "stages[{i}]: stage name `{}` is used twice; give each stage its own `name`",
                    stage.name()
                )));
            }
            stages.push(stage);
        }
        if stages.is_empty() {
            return Err(err("`stages` is empty; add at least one stage".into()));
        }
        for def in tables.values() {
            let written = stages.iter().any(|s| match s {
                Stage::Write(w) => w.to == def.name,
                Stage::Tokenize(t) => t.to == def.name,
            });
            if def.is_delta() && !written && !catalog::delta_exists(&def.path) {
                return Err(err(format!(
                    "tables.{}: no Delta table at `{}` (no _delta_log) and no stage writes it; \
                     fix the path, or add a stage that writes it",
                    def.name,
                    def.path.display()
                )));
            }
        }
        Ok(Self {
            file,
            name: spec.name,
            tables,
            stages,
        })
    }

    /// The pipeline's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Checks every stage's query, columns and types against the tables as they are, and
    /// against what earlier stages will write, without running anything.
    pub async fn validate(&self) -> Result<()> {
        let ctx = catalog::session();
        let err = |m: String| Error::config(&self.file, m);
        for def in self.tables.values() {
            if def.is_delta() && !catalog::delta_exists(&def.path) {
                // Written by a stage (checked in load); registered when planned below.
                continue;
            }
            def.register(&ctx)
                .await
                .map_err(|e| err(format!("tables.{}: {e}", def.name)))?;
        }
        for stage in &self.stages {
            match stage {
                Stage::Write(w) => {
                    let schema = plan_schema(&ctx, &w.query, &self.tables)
                        .await
                        .map_err(err)?;
                    self.check_write_target(w, &schema).await.map_err(err)?;
                    catalog::register_planned(&ctx, &w.to, schema)?;
                }
                Stage::Tokenize(t) => {
                    let schema = plan_schema(&ctx, &t.query, &self.tables)
                        .await
                        .map_err(err)?;
                    check_tokenize_columns(t, &schema).map_err(err)?;
                    Encoder::from_path(&t.tokenizer, t.encoder)
                        .map_err(|e| err(format!("{}.tokenizer: {e}", t.field)))?;
                    let out = tokenize::output_schema(&schema, &t.policy)?;
                    catalog::register_planned(&ctx, &t.to, out)?;
                }
            }
        }
        Ok(())
    }

    async fn check_write_target(&self, w: &WriteStage, schema: &Schema) -> Result<(), String> {
        let def = &self.tables[&w.to];
        if !catalog::delta_exists(&def.path) {
            return Ok(()); // every mode creates a table that does not exist yet
        }
        match w.mode {
            WriteMode::Create => Err(format!(
                "{}: table `{}` already exists at {}; use `mode: overwrite` or `mode: append`",
                w.field,
                w.to,
                def.path.display()
            )),
            WriteMode::Overwrite => Ok(()),
            WriteMode::Append => {
                let table = def.open_delta(None).await.map_err(|e| e.to_string())?;
                let existing = table
                    .snapshot()
                    .map_err(|e| e.to_string())?
                    .snapshot()
                    .arrow_schema();
                schema_diff(&existing, schema).map_err(|d| {
                    format!(
                        "{}: the query's columns do not match table `{}` for append: {d}; \
                         change the query, or use `mode: overwrite`",
                        w.field, w.to
                    )
                })
            }
        }
    }
}

fn table_def(base: &Path, name: &str, t: TableSpec) -> Result<TableDef, String> {
    let kinds: Vec<(&str, &String)> = [
        ("delta", t.delta.as_ref()),
        ("parquet", t.parquet.as_ref()),
        ("csv", t.csv.as_ref()),
        ("json", t.json.as_ref()),
    ]
    .into_iter()
    .filter_map(|(k, v)| v.map(|v| (k, v)))
    .collect();
    let [(kind, path)] = kinds[..] else {
        return Err(
            "give exactly one of `delta`, `parquet`, `csv`, `json` with the table's path".into(),
        );
    };
    let path = resolve(base, path);
    if kind != "delta" && (t.version.is_some() || t.timestamp.is_some()) {
        return Err("`version` and `timestamp` (time travel) apply to `delta` tables only".into());
    }
    if kind != "csv"
        && (t.has_header.is_some() || t.delimiter.is_some() || t.newlines_in_values.is_some())
    {
        return Err(
            "`has_header`, `delimiter` and `newlines_in_values` apply to `csv` tables only".into(),
        );
    }
    if matches!(kind, "delta" | "parquet") && t.compression.is_some() {
        return Err("`compression` applies to `csv` and `json` tables only".into());
    }
    if kind != "delta"
        && catalog::files_of(&path)
            .map_err(|e| e.to_string())?
            .is_empty()
    {
        return Err(format!(
            "no {kind} file at `{}`; check the path",
            path.display()
        ));
    }
    let compression = t
        .compression
        .unwrap_or_else(|| catalog::compression_from_extension(&path));
    let kind = match kind {
        "delta" => {
            let at = match (t.version, t.timestamp) {
                (Some(_), Some(_)) => return Err("give `version` or `timestamp`, not both".into()),
                (Some(v), None) if v < 0 => {
                    return Err(format!("`version: {v}` must be 0 or more"));
                }
                (Some(v), None) => Some(TimeTravel::Version(v.unsigned_abs())),
                (None, Some(ts)) => {
                    chrono::DateTime::parse_from_rfc3339(&ts).map_err(|e| {
                        format!("`timestamp: {ts}` is not RFC 3339 (2026-01-31T12:00:00Z): {e}")
                    })?;
                    Some(TimeTravel::Timestamp(ts))
                }
                (None, None) => None,
            };
            if at.is_some() && !catalog::delta_exists(&path) {
                return Err(format!(
                    "time travel needs an existing Delta table, and `{}` has no _delta_log",
                    path.display()
                ));
            }
            TableKind::Delta { at }
        }
        "parquet" => TableKind::Parquet,
        "csv" => {
            let delimiter = t.delimiter.unwrap_or(',');
            if !delimiter.is_ascii() {
                return Err(format!(
                    "`delimiter: {delimiter}` must be one ASCII character"
                ));
            }
            TableKind::Csv {
                has_header: t.has_header.unwrap_or(true),
                delimiter: delimiter as u8,
                newlines_in_values: t.newlines_in_values.unwrap_or(true),
                compression,
            }
        }
        _ => TableKind::Json { compression },
    };
    Ok(TableDef {
        name: name.to_string(),
        kind,
        path,
    })
}

fn query(base: &Path, s: &Source, field: &str) -> Result<Query, String> {
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
            let path = resolve(base, file);
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

/// Plans `query` (no execution) and returns its output schema.
async fn plan_schema(
    ctx: &SessionContext,
    query: &Query,
    tables: &BTreeMap<String, TableDef>,
) -> Result<SchemaRef, String> {
    let df = ctx.sql(&query.sql).await.map_err(|e| {
        let msg = e.strip_backtrace();
        let hint = if msg.contains("table") && msg.contains("not found") {
            let declared = tables.keys().cloned().collect::<Vec<_>>().join(", ");
            format!("; declare the table under `tables` (declared: {declared})")
        } else {
            String::new()
        };
        format!("{}: {msg}{hint}", query.origin)
    })?;
    Ok(df.schema().inner().clone())
}

fn check_tokenize_columns(t: &TokenizeStage, schema: &Schema) -> Result<(), String> {
    let columns = || {
        schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let get =
        |key: &str, name: &str| {
            schema.field_with_name(name).map(|f| f.data_type().clone()).map_err(|_| {
            format!(
                "{}.{key}: column `{name}` not found in the stage's query (columns: {}); fix \
                 the column name or the query",
                t.field,
                columns()
            )
        })
        };
    let p = &t.policy;
    let id = get("id", &p.id)?;
    if !(id.is_integer() || is_string(&id)) {
        return Err(format!(
            "{}.id: column `{}` has type {id}; ids must be integers or strings",
            t.field, p.id
        ));
    }
    for (key, name) in [("text", Some(&p.text)), ("text_pair", p.text_pair.as_ref())] {
        if let Some(name) = name {
            let ty = get(key, name)?;
            if !is_text(&ty) {
                return Err(format!(
                    "{}.{key}: column `{name}` has type {ty}; text must be a string or binary \
                     column (cast it in the query)",
                    t.field
                ));
            }
        }
    }
    if let Some(label) = &p.label {
        let ty = get("label", label)?;
        if !(ty.is_integer() || is_string(&ty)) {
            return Err(format!(
                "{}.label: column `{label}` has type {ty}; labels must be integers or strings",
                t.field
            ));
        }
        if t.labels.is_some() && !is_string(&ty) {
            return Err(format!(
                "{}.labels: column `{label}` holds integers, which are used as class ids as \
                 they are; remove `labels`",
                t.field
            ));
        }
    }
    let reserved = ["input_ids", "length", "label"];
    for name in &p.keep {
        get("keep", name)?;
        if reserved.contains(&name.as_str()) || *name == p.id {
            return Err(format!(
                "{}.keep: `{name}` is a column the stage writes itself; rename it in the query",
                t.field
            ));
        }
    }
    Ok(())
}

/// Columns by name and type, ignoring nullability and metadata.
fn schema_diff(table: &Schema, query: &Schema) -> Result<(), String> {
    let describe = |s: &Schema| {
        s.fields()
            .iter()
            .map(|f| format!("{} {}", f.name(), f.data_type()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let same = table.fields().len() == query.fields().len()
        && table.fields().iter().all(|f| {
            query.field_with_name(f.name()).is_ok_and(|q| {
                q.data_type() == f.data_type()
                    || (is_string(q.data_type()) && is_string(f.data_type()))
            })
        });
    if same {
        Ok(())
    } else {
        Err(format!(
            "table has ({}), query gives ({})",
            describe(table),
            describe(query)
        ))
    }
}
