//! The `write` stage: a query's rows into a Delta table, in one atomic commit.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::StreamExt;
use serde_json::json;

use super::Run;
use crate::config::WriteMode;
use crate::delta;
use crate::error::{Error, Result};
use crate::fingerprint;
use crate::plan::WriteStage;
use crate::report::StageReport;

pub(super) async fn run(run: &Run<'_>, stage: &WriteStage) -> Result<StageReport> {
    let def = &run.pipeline.tables[&stage.to];
    let context = || format!("stage `{}` ({})", stage.name, stage.query.origin);
    let df = run
        .ctx
        .sql(&stage.query.sql)
        .await
        .map_err(|e| Error::engine(context(), e))?;
    let inputs = fingerprint::plan_inputs(df.logical_plan(), &run.identities)?;
    let fingerprint = fingerprint::digest(&json!({
        "kind": "write",
        "sql": stage.query.sql,
        "inputs": inputs,
        "mode": stage.mode,
    }));
    let report = StageReport {
        stage: stage.name.clone(),
        kind: "write".into(),
        table: stage.to.clone(),
        ..Default::default()
    };
    // An append always appends; create and overwrite skip when nothing changed.
    let target = delta::open_target(def).await?;
    if stage.mode != WriteMode::Append
        && let Some(cached) =
            super::up_to_date(run, target.as_ref(), &fingerprint, report.clone()).await?
    {
        return Ok(cached);
    }
    let mut report = report;

    let bar = run.progress(&stage.name);
    let rows = Arc::new(AtomicU64::new(0));
    let stream = df
        .execute_stream()
        .await
        .map_err(|e| Error::engine(context(), e))?;
    let schema = stream.schema();
    let counted = {
        let rows = rows.clone();
        let bar = bar.clone();
        stream.inspect(move |batch| {
            if let Ok(batch) = batch {
                let n = rows.fetch_add(batch.num_rows() as u64, Ordering::Relaxed);
                bar.set_message(format!("{} rows", n + batch.num_rows() as u64));
            }
        })
    };
    let table = super::commit(
        &run.ctx,
        def,
        target,
        Box::pin(RecordBatchStreamAdapter::new(schema, counted)),
        stage.mode,
        run.tag(&stage.name, fingerprint, json!({})),
        None,
    )
    .await?;
    bar.finish_and_clear();
    report.version = table.version();
    report.rows_in = rows.load(Ordering::Relaxed);
    report.rows_out = report.rows_in;
    Ok(report)
}
