//! The `predict` and `embed` stages: a model over a table's rows, written as a predictions
//! (or embeddings) table in one commit that carries a Delta app transaction (`txn`) for the
//! job, so a rerun over the same source version adds nothing and two runs of one job cannot
//! both commit. Both run the one engine; only its head and the output columns differ.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use arrow::array::{AsArray, RecordBatch};
use datafusion::common::JoinType;
use datafusion::error::DataFusionError;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::prelude::{SessionContext, ident};
use deltalake::DeltaTable;
use deltalake::kernel::Transaction;
use futures::StreamExt;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::Run;
use crate::config::{PredictMode, WriteMode};
use crate::delta;
use crate::error::{Error, Result};
use crate::fingerprint;
use crate::model::{ModelConfig, weight_files};
use crate::plan::PredictStage;
use crate::plan::model_labels;
use crate::predict::{
    Engine, Head, Meta, embeddings_batch, embeddings_schema, output_schema, predictions_batch,
};
use crate::report::StageReport;
use crate::tokenize::{self, Counters, Encoder, EncoderSettings};

/// How far back a job's last commit is looked for (its labels must match the model's).
const HISTORY_DEPTH: usize = 100;

/// sha256 of the files that make the model: config.json and the weights.
fn model_version(dir: &Path) -> Result<String> {
    let mut hasher = Sha256::new();
    let mut files = vec![dir.join("config.json")];
    files.extend(weight_files(dir)?);
    let mut buf = vec![0u8; 1 << 20];
    for file in files {
        let io = |e| Error::io(format!("reading {}", file.display()), e);
        let mut f = std::fs::File::open(&file).map_err(io)?;
        loop {
            let n = f.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
    }
    Ok(hex::encode(hasher.finalize()))
}

/// The sum of the Delta versions of the tables a query reads: it grows whenever any of
/// them gets a new version. `None` when one of them is not a Delta table.
fn source_version(inputs: &std::collections::BTreeMap<String, String>) -> Option<i64> {
    // A Delta table's identity is `delta:<url>@<version>` (catalog.rs).
    inputs
        .values()
        .map(|v| {
            v.strip_prefix("delta:")
                .and_then(|rest| rest.rsplit_once('@'))
                .and_then(|(_, version)| version.parse::<i64>().ok())
        })
        .sum()
}

pub(super) async fn run(run: &Run<'_>, stage: &PredictStage) -> Result<StageReport> {
    let def = &run.pipeline.tables[&stage.to];
    let context = || format!("stage `{}` ({})", stage.name, stage.query.origin);
    let engine_err = |e| Error::engine(context(), e);
    let model_err = |e: String| Error::Model(format!("stage `{}`: {e}", stage.name));
    let s = &stage.settings;
    let mut state = run.ctx.state();
    *state.config_mut() = state.config().clone().with_batch_size(s.batch_rows);
    let ctx = SessionContext::new_with_state(state);

    // The model is read now: an earlier train stage of this run may have just written it.
    let config = ModelConfig::load(&stage.model).map_err(|e| model_err(e.to_string()))?;
    let labels = match stage.embed {
        Some(_) => Vec::new(),
        None => model_labels(&stage.model, &config, stage.labels.as_deref()).map_err(model_err)?,
    };
    let encoder = Arc::new(Encoder::from_path(
        &stage.model,
        EncoderSettings {
            max_length: s.max_length,
            truncate: true,
            truncation: s.truncation,
            add_special_tokens: true,
        },
    )?);
    let model_version = model_version(&stage.model)?;

    let policy = &stage.policy;
    let df = ctx
        .sql(&stage.query.sql)
        .await
        .map_err(engine_err)?
        .select_columns(&policy.columns())
        .map_err(engine_err)?;
    let inputs = fingerprint::plan_inputs(df.logical_plan(), &run.identities)?;
    let source_version = source_version(&inputs);
    let job = stage
        .job
        .clone()
        .unwrap_or_else(|| format!("lakeml/{}/{}", run.pipeline.name, stage.name));
    let fingerprint = fingerprint::digest(&json!({
        "kind": stage.kind(),
        "embed": stage.embed,
        "sql": stage.query.sql,
        "inputs": inputs,
        "model_version": model_version,
        "tokenizer_sha256": encoder.sha256(),
        "encoder": encoder.settings(),
        "policy": policy,
        "labels": labels,
        "mode": stage.mode,
        "job": job,
        "precision": s.precision,
        "logits": s.logits,
    }));
    let mut report = StageReport {
        stage: stage.name.clone(),
        kind: stage.kind().into(),
        table: stage.to.clone(),
        pooling: stage.embed.as_ref().map(|e| {
            format!(
                "{}; {} dims{}{}",
                e.pooling.source,
                e.dims,
                if e.normalize { ", normalized" } else { "" },
                if e.quantize.is_some() {
                    ", stored as int8 with a scale per row"
                } else {
                    ""
                }
            )
        }),
        precision: Some(s.precision.name().to_string()),
        ..Default::default()
    };

    let target = delta::open_target(def).await?;
    let done = match &target {
        Some(table) => delta::txn_version(table, &job).await?,
        None => None,
    };
    // The job's last commit to the table, if any: its labels and fingerprint.
    let last = match &target {
        Some(table) => delta::find_commit(table, HISTORY_DEPTH, "job", &job).await?,
        None => None,
    };
    let covered = matches!((done, source_version), (Some(d), Some(v)) if d >= v);
    let unchanged = last
        .as_ref()
        .and_then(|tag| tag.get("fingerprint"))
        .and_then(serde_json::Value::as_str)
        == Some(fingerprint.as_str());
    if covered && unchanged && !run.options.force {
        // This job already committed these predictions for this version of its source.
        return Ok(StageReport {
            cached: true,
            version: target.as_ref().and_then(DeltaTable::version),
            ..report
        });
    }

    let mut df = df;
    let incremental = match (stage.mode, &target) {
        (PredictMode::Incremental, Some(table)) => Some(table),
        _ => None,
    };
    if let Some(table) = incremental {
        if let Some(before) = last.as_ref().and_then(|tag| tag.pointer("/extra/labels"))
            && stage.embed.is_none()
            && *before != json!(labels)
        {
            return Err(Error::Data(format!(
                "stage `{}`: table `{}` holds this job's predictions with labels {before}, but \
                 the model `{}` has labels {}; use `mode: overwrite`, or another table",
                stage.name,
                stage.to,
                stage.model.display(),
                json!(labels)
            )));
        }
        // Only ids the table does not hold yet, read at exactly the version this commit
        // builds on: a concurrent run of the job then conflicts on the txn.
        let provider = table.table_provider().await.map_err(engine_err)?;
        let have = ctx
            .read_table(provider)
            .map_err(engine_err)?
            .select(vec![ident(&policy.id).alias("__lakeml_have")])
            .map_err(engine_err)?;
        df = have
            .join(
                df,
                JoinType::RightAnti,
                &["__lakeml_have"],
                &[policy.id.as_str()],
                None,
            )
            .map_err(engine_err)?;
    }
    let mut stream = df.execute_stream().await.map_err(engine_err)?;
    let schema = stream.schema();
    // The first rows to predict, read before the model loads; when an incremental run
    // finds none, the table already holds every id and nothing is written.
    let mut first = None;
    while let Some(batch) = stream.next().await {
        let batch = batch.map_err(engine_err)?;
        if batch.num_rows() > 0 {
            first = Some(batch);
            break;
        }
    }
    if first.is_none()
        && let Some(table) = incremental
    {
        return Ok(StageReport {
            cached: true,
            version: table.version(),
            ..report
        });
    }
    let stream = futures::stream::iter(first.map(Ok)).chain(stream);

    let engine = Arc::new(
        Engine::start(
            &stage.model,
            &config,
            match &stage.embed {
                Some(e) => Head::Embed {
                    pooling: Arc::new(e.pooling.clone()),
                    dims: e.dims,
                    normalize: e.normalize,
                },
                None => Head::Classify {
                    classes: labels.len(),
                },
            },
            stage.device,
            &stage.settings,
        )
        .await
        .map_err(|e| model_err(e.to_string()))?,
    );
    let run_id = uuid::Uuid::new_v4().to_string();
    let meta = Arc::new(Meta {
        labels: labels.clone(),
        model_version: model_version.clone(),
        run_id: run_id.clone(),
        predicted_at: chrono::Utc::now().timestamp_micros(),
        logits: s.logits,
    });
    let tokenized_schema = tokenize::output_schema(&schema, policy)?;
    let schema = match &stage.embed {
        Some(e) => embeddings_schema(&tokenized_schema, policy, e.quantize.is_some()),
        None => output_schema(&tokenized_schema, policy, s.logits),
    };
    let dims = stage.embed.as_ref().map(|e| (e.dims, e.quantize.is_some()));
    let counters = Arc::new(Counters::default());
    let bar = run.progress(&stage.name);
    let in_flight = if stage.device.is_cuda() {
        2
    } else {
        s.replicas + 1
    };
    let predicted = {
        let (schema, counters, progress, bar) = (
            schema.clone(),
            counters.clone(),
            counters.clone(),
            bar.clone(),
        );
        let policy = Arc::new(policy.clone());
        let external = |e: Error| DataFusionError::External(Box::new(e));
        stream
            .map(move |batch| {
                let (tokenized_schema, schema, counters, policy, encoder, engine, meta) = (
                    tokenized_schema.clone(),
                    schema.clone(),
                    counters.clone(),
                    policy.clone(),
                    encoder.clone(),
                    engine.clone(),
                    meta.clone(),
                );
                async move {
                    let batch = batch?;
                    let tokenized = {
                        let policy = policy.clone();
                        tokio::task::spawn_blocking(move || {
                            tokenize::tokenize_batch(
                                &batch,
                                &encoder,
                                &policy,
                                None,
                                &tokenized_schema,
                                &counters,
                            )
                        })
                        .await
                        .map_err(|e| DataFusionError::External(Box::new(e)))?
                        .map_err(external)?
                    };
                    if tokenized.num_rows() == 0 {
                        return Ok(RecordBatch::new_empty(schema));
                    }
                    let ids = tokenized.column(1).as_list::<i32>().clone();
                    let output = engine.run(ids).await.map_err(external)?;
                    if let Some((dims, quantized)) = dims {
                        embeddings_batch(
                            &tokenized, &output, dims, quantized, &meta, &policy, &schema,
                        )
                    } else {
                        predictions_batch(&tokenized, &output, &meta, &policy, &schema)
                    }
                    .map_err(external)
                }
            })
            .buffered(in_flight)
            .inspect(move |result| {
                if result.is_ok() {
                    bar.set_message(format!(
                        "{} rows {}",
                        progress.rows_out.load(Ordering::Relaxed),
                        if dims.is_some() {
                            "embedded"
                        } else {
                            "predicted"
                        }
                    ));
                }
            })
    };
    let txn_version = source_version.unwrap_or_else(|| done.unwrap_or(0) + 1);
    let extra = json!({
        "job": job,
        "labels": labels,
        "embed": stage.embed,
        "model": stage.model.display().to_string(),
        "model_version": model_version,
        "run_id": run_id,
        "mode": stage.mode,
        "source_version": source_version,
    });
    let mode = match stage.mode {
        PredictMode::Incremental => WriteMode::Append,
        PredictMode::Overwrite => WriteMode::Overwrite,
    };
    let written = super::commit(
        &ctx,
        def,
        target,
        Box::pin(RecordBatchStreamAdapter::new(schema, predicted)),
        mode,
        run.tag(&stage.name, fingerprint, extra),
        Some(Transaction::new(&job, txn_version)),
    )
    .await;
    bar.finish_and_clear();
    let table = written?;
    report.version = table.version();
    counters.fill(&mut report);
    Ok(report)
}
