//! `optimize` and `vacuum`: keep a Delta table that scheduled appends grow in small files
//! fast to read, and its storage bounded.

use std::collections::BTreeMap;
use std::num::NonZeroU64;

use deltalake::operations::optimize::OptimizeType;
use deltalake::operations::vacuum::VacuumMode;

use super::Run;
use crate::error::{Error, Result};
use crate::plan::{OptimizeStage, VacuumStage};
use crate::report::StageReport;

fn report(kind: &str, stage: &str, table: &str, version: Option<u64>) -> StageReport {
    StageReport {
        stage: stage.to_string(),
        kind: kind.to_string(),
        table: table.to_string(),
        version,
        ..StageReport::default()
    }
}

/// Compacts small files (or Z-orders the rows) in one `dataChange=false` commit: readers
/// see the same rows, and `table_updated` triggers ignore it.
pub(super) async fn optimize(run: &Run<'_>, s: &OptimizeStage) -> Result<StageReport> {
    let def = &run.pipeline.tables[&s.table];
    let table = def.open_delta(None).await?;
    let mut builder = table
        .optimize()
        .with_target_size(NonZeroU64::new(s.target_file_bytes).unwrap_or(NonZeroU64::MIN));
    if !s.zorder.is_empty() {
        builder = builder.with_type(OptimizeType::ZOrder(s.zorder.clone()));
    }
    let (table, metrics) = builder.await.map_err(|e| {
        Error::delta(
            format!(
                "stage `{}`: optimizing table `{}` (unchanged)",
                s.name, s.table
            ),
            e,
        )
    })?;
    let mut out = report("optimize", &s.name, &s.table, table.version());
    out.rows_by_outcome = BTreeMap::from([
        ("files_added".into(), metrics.num_files_added),
        ("files_removed".into(), metrics.num_files_removed),
    ]);
    Ok(out)
}

/// Deletes the files that neither the current version nor any version within the retention
/// references (a `full` vacuum: files of failed writes too, once older than the retention).
pub(super) async fn vacuum(run: &Run<'_>, s: &VacuumStage) -> Result<StageReport> {
    let def = &run.pipeline.tables[&s.table];
    let table = def.open_delta(None).await?;
    let retention = chrono::Duration::from_std(s.retention).map_err(|_| {
        Error::config(
            &run.pipeline.file,
            format!("{}.retention: too long", s.field),
        )
    })?;
    let (table, metrics) = table
        .vacuum()
        .with_retention_period(retention)
        .with_enforce_retention_duration(s.enforce_retention)
        .with_mode(VacuumMode::Full)
        .await
        .map_err(|e| {
            Error::delta(
                format!("stage `{}`: vacuuming table `{}`", s.name, s.table),
                e,
            )
        })?;
    let mut out = report("vacuum", &s.name, &s.table, table.version());
    out.rows_by_outcome =
        BTreeMap::from([("files_deleted".into(), metrics.files_deleted.len() as u64)]);
    Ok(out)
}
