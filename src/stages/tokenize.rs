//! The `tokenize` stage: a text column into the tokenized table (ARCHITECTURE.md), streamed in
//! bounded memory, written in one commit, and reused while its fingerprint matches.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use arrow::array::AsArray;
use arrow::datatypes::DataType;
use datafusion::error::DataFusionError;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::prelude::{SessionContext, ident};
use futures::StreamExt;
use serde_json::json;

use super::Run;
use crate::config::WriteMode;
use crate::delta;
use crate::error::{Error, Result};
use crate::fingerprint;
use crate::plan::{TokenizeStage, is_string};
use crate::report::StageReport;
use crate::tokenize::{self, Counters, LabelMap};

/// Batches tokenized ahead of the writer: reading, tokenizing and writing overlap.
const IN_FLIGHT: usize = 2;

pub(super) async fn run(run: &Run<'_>, stage: &TokenizeStage) -> Result<StageReport> {
    let def = &run.pipeline.tables[&stage.to];
    let context = || format!("stage `{}` ({})", stage.name, stage.query.origin);
    let engine = |e| Error::engine(context(), e);
    // The stage's own batch size, in a session that shares the run's tables.
    let mut state = run.ctx.state();
    *state.config_mut() = state.config().clone().with_batch_size(stage.batch_rows);
    let ctx = SessionContext::new_with_state(state);

    let policy = &stage.policy;
    let df = ctx
        .sql(&stage.query.sql)
        .await
        .map_err(engine)?
        .select_columns(&policy.columns())
        .map_err(engine)?;

    let encoder = stage.encoder.clone();
    let label_names = match &policy.label {
        Some(label)
            if df
                .schema()
                .field_with_unqualified_name(label)
                .is_ok_and(|f| is_string(f.data_type())) =>
        {
            Some(match &stage.labels {
                Some(names) => names.clone(),
                None => distinct_labels(&df, label).await.map_err(engine)?,
            })
        }
        _ => None,
    };
    let inputs = fingerprint::plan_inputs(df.logical_plan(), &run.identities)?;
    let fingerprint = fingerprint::digest(&json!({
        "kind": "tokenize",
        "sql": stage.query.sql,
        "inputs": inputs,
        "tokenizer_sha256": encoder.sha256(),
        "encoder": encoder.settings(),
        "policy": policy,
        "labels": label_names,
    }));
    let report = StageReport {
        stage: stage.name.clone(),
        kind: "tokenize".into(),
        table: stage.to.clone(),
        ..Default::default()
    };
    let target = delta::open_target(def).await?;
    if let Some(cached) =
        super::up_to_date(run, target.as_ref(), &fingerprint, report.clone()).await?
    {
        return Ok(cached);
    }
    let mut report = report;

    let labels = match &label_names {
        Some(names) => Some(LabelMap::Names(
            names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.clone(), i as i64))
                .collect::<HashMap<_, _>>(),
        )),
        None => policy.label.as_ref().map(|_| LabelMap::Ints),
    };
    let stream = df.execute_stream().await.map_err(engine)?;
    let schema = tokenize::output_schema(&stream.schema(), policy)?;
    let counters = Arc::new(Counters::default());
    let bar = run.progress(&stage.name);
    let tokenized = {
        let (schema, counters, bar) = (schema.clone(), counters.clone(), bar.clone());
        let (policy, labels, encoder) = (Arc::new(policy.clone()), Arc::new(labels), encoder);
        let progress = counters.clone();
        stream
            .map(move |batch| {
                let (schema, counters, policy, labels, encoder) = (
                    schema.clone(),
                    counters.clone(),
                    policy.clone(),
                    labels.clone(),
                    encoder.clone(),
                );
                async move {
                    let batch = batch?;
                    tokio::task::spawn_blocking(move || {
                        tokenize::tokenize_batch(
                            &batch,
                            &encoder,
                            &policy,
                            labels.as_ref().as_ref(),
                            &schema,
                            &counters,
                        )
                    })
                    .await
                    .map_err(|e| DataFusionError::External(Box::new(e)))?
                    .map_err(|e| DataFusionError::External(Box::new(e)))
                }
            })
            .buffered(IN_FLIGHT)
            .inspect(move |result| {
                if result.is_ok() {
                    bar.set_message(format!(
                        "{} rows, {} tokens",
                        progress.rows_in.load(Ordering::Relaxed),
                        progress.tokens.load(Ordering::Relaxed)
                    ));
                }
            })
    };
    let extra = json!({
        "id": stage.policy.id,
        "labels": label_names,
        "tokenizer": stage.tokenizer.display().to_string(),
        "max_length": stage.encoder.settings().max_length,
    });
    let written = super::commit(
        &ctx,
        def,
        target,
        Box::pin(RecordBatchStreamAdapter::new(schema, tokenized)),
        WriteMode::Overwrite,
        run.tag(&stage.name, fingerprint, extra),
        None,
    )
    .await;
    bar.finish_and_clear();
    let table = written?;
    report.version = table.version();
    counters.fill(&mut report);
    Ok(report)
}

/// Sorted distinct non-null values of a string label column.
async fn distinct_labels(
    df: &datafusion::dataframe::DataFrame,
    label: &str,
) -> datafusion::error::Result<Vec<String>> {
    let batches = df
        .clone()
        .select(vec![ident(label)])?
        .distinct()?
        .collect()
        .await?;
    let mut names = Vec::new();
    for batch in batches {
        let array = arrow::compute::cast(batch.column(0), &DataType::Utf8)?;
        let strings = array.as_string::<i32>();
        names.extend(strings.iter().flatten().map(str::to_string));
    }
    names.sort();
    Ok(names)
}
