//! The plan of the stages that need no model: `write`, `tokenize`, `optimize` and `vacuum`
//! (`train` and `predict` have files of their own). Each checks its keys and files and
//! returns its stage, or a message that names the field at fault.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use super::{
    MIN_RETENTION, OptimizeStage, Stage, TokenizeStage, VacuumStage, WriteStage, maintained_table,
    output_table, predict, query, train,
};
use crate::catalog::TableDef;
use crate::config::{OptimizeSpec, StageKind, StageSpec, TokenizeSpec, VacuumSpec, WriteSpec};
use crate::storage::Defaults;
use crate::tokenize::{Encoder, EncoderSettings, RowPolicy};

/// Every stage of the file, in order, each checked and planned; stage names are unique.
pub(super) fn plan_stages(
    base: &Path,
    specs: Vec<StageSpec>,
    tables: &BTreeMap<String, TableDef>,
    storage: &Defaults,
) -> Result<Vec<Stage>, String> {
    let mut stages: Vec<Stage> = Vec::new();
    let mut names = HashSet::new();
    for (i, s) in specs.into_iter().enumerate() {
        let kind = s.kind().map_err(|m| format!("stages[{i}]: {m}"))?;
        let embed = matches!(kind, StageKind::Embed(_));
        let stage = match kind {
            StageKind::Write(w) => write_stage(base, i, w, tables)?,
            StageKind::Tokenize(t) => tokenize_stage(base, i, t, tables, storage)?,
            StageKind::Train(t) => {
                Stage::Train(Box::new(train::train_stage(base, i, *t, &stages, storage)?))
            }
            StageKind::Predict(p) | StageKind::Embed(p) => {
                let stage = predict::predict_stage(base, i, *p, &stages, storage, embed)?;
                output_table(tables, &stage.to, &stage.field)?;
                Stage::Predict(Box::new(stage))
            }
            StageKind::Optimize(o) => optimize_stage(i, o, tables)?,
            StageKind::Vacuum(v) => vacuum_stage(i, v, tables)?,
        };
        if !names.insert(stage.name().to_string()) {
            return Err(format!(
                "stages[{i}]: stage name `{}` is used twice; give each stage its own `name`",
                stage.name()
            ));
        }
        stages.push(stage);
    }
    Ok(stages)
}

fn write_stage(
    base: &Path,
    i: usize,
    w: WriteSpec,
    tables: &BTreeMap<String, TableDef>,
) -> Result<Stage, String> {
    let field = format!("stages[{i}].write");
    let name = w.name.unwrap_or_else(|| format!("write-{}", w.to));
    let query = query(base, &w.source, &field)?;
    output_table(tables, &w.to, &field)?;
    Ok(Stage::Write(WriteStage {
        name,
        field,
        query,
        to: w.to,
        mode: w.mode,
    }))
}

/// A tokenize stage; its tokenizer is loaded now, once, for validation and the run.
fn tokenize_stage(
    base: &Path,
    i: usize,
    t: TokenizeSpec,
    tables: &BTreeMap<String, TableDef>,
    storage: &Defaults,
) -> Result<Stage, String> {
    let field = format!("stages[{i}].tokenize");
    let name = t.name.unwrap_or_else(|| format!("tokenize-{}", t.to));
    let query = query(base, &t.source, &field)?;
    output_table(tables, &t.to, &field)?;
    if t.max_length < 2 || t.max_length > 1 << 16 {
        return Err(format!(
            "{field}.max_length: {} is out of range; use 2..=65536",
            t.max_length
        ));
    }
    if t.batch_rows == 0 || t.batch_rows > 1 << 20 {
        return Err(format!(
            "{field}.batch_rows: {} is out of range; use 1..=1048576",
            t.batch_rows
        ));
    }
    if let Some(labels) = &t.labels {
        let mut seen = HashSet::new();
        if let Some(dup) = labels.iter().find(|l| !seen.insert(l.as_str())) {
            return Err(format!(
                "{field}.labels: `{dup}` is listed twice; list each class once"
            ));
        }
    }
    if t.labels.is_some() && t.label.is_none() {
        return Err(format!(
            "{field}.labels: set `label` (the label column) too"
        ));
    }
    let tokenizer = crate::storage::model_dir(base, &t.tokenizer, storage)
        .map_err(|m| format!("{field}.tokenizer: {m}"))?;
    let json = if tokenizer.is_dir() {
        tokenizer.join("tokenizer.json")
    } else {
        tokenizer.clone()
    };
    if !json.is_file() {
        return Err(format!(
            "{field}.tokenizer: `{}` not found; give a tokenizer.json or a model \
             directory that holds one",
            json.display()
        ));
    }
    let settings = EncoderSettings {
        max_length: t.max_length,
        truncate: t.on_overlong == crate::config::OnOverlong::Truncate,
        truncation: t.truncation,
        add_special_tokens: t.add_special_tokens,
    };
    let encoder =
        Encoder::from_path(&tokenizer, settings).map_err(|e| format!("{field}.tokenizer: {e}"))?;
    Ok(Stage::Tokenize(TokenizeStage {
        name,
        field,
        query,
        to: t.to,
        tokenizer,
        encoder: Arc::new(encoder),
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
    }))
}

fn optimize_stage(
    i: usize,
    o: OptimizeSpec,
    tables: &BTreeMap<String, TableDef>,
) -> Result<Stage, String> {
    let field = format!("stages[{i}].optimize");
    maintained_table(tables, &o.table, &field)?;
    let mb = o.target_file_mb.unwrap_or(64);
    if mb == 0 || mb > 1 << 20 {
        return Err(format!(
            "{field}.target_file_mb: {mb} is out of range; use 1..=1048576"
        ));
    }
    Ok(Stage::Optimize(OptimizeStage {
        name: o.name.unwrap_or_else(|| format!("optimize-{}", o.table)),
        field,
        table: o.table,
        target_file_bytes: mb << 20,
        zorder: o.zorder,
    }))
}

fn vacuum_stage(
    i: usize,
    v: VacuumSpec,
    tables: &BTreeMap<String, TableDef>,
) -> Result<Stage, String> {
    let field = format!("stages[{i}].vacuum");
    maintained_table(tables, &v.table, &field)?;
    let retention = match &v.retention {
        Some(text) => {
            crate::config::parse_duration(text).map_err(|m| format!("{field}.retention: {m}"))?
        }
        None => MIN_RETENTION,
    };
    if retention < MIN_RETENTION && !v.allow_short_retention {
        return Err(format!(
            "{field}.retention: `{}` is less than 7 days, so readers of older \
             versions and writers still committing could lose files; set \
             `allow_short_retention: true` if no one reads or writes that far \
             back",
            v.retention.as_deref().unwrap_or_default()
        ));
    }
    Ok(Stage::Vacuum(VacuumStage {
        name: v.name.unwrap_or_else(|| format!("vacuum-{}", v.table)),
        field,
        table: v.table,
        retention,
        enforce_retention: retention >= MIN_RETENTION,
    }))
}
