//! The `predict` and `embed` stages: a model over a table's rows, written as a predictions
//! (or embeddings) table in one commit that carries a Delta app transaction (`txn`) for the
//! job, so a rerun over the same source version adds nothing and two runs of one job cannot
//! both commit. Both run the one engine; only its head and the output columns differ.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use arrow::array::RecordBatch;
use datafusion::common::JoinType;
use datafusion::error::DataFusionError;
use datafusion::physical_plan::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::prelude::{DataFrame, SessionContext, ident};
use deltalake::DeltaTable;
use deltalake::kernel::Transaction;
use futures::StreamExt;
use indicatif::ProgressBar;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::Run;
use crate::catalog::TableDef;
use crate::config::{PredictMode, WriteMode};
use crate::delta;
use crate::error::{Error, Result};
use crate::fingerprint;
use crate::model::{ModelConfig, weight_files};
use crate::plan::PredictStage;
use crate::plan::model_labels;
use crate::predict::{Engine, Head, Meta, Predictor, Rows};
use crate::report::StageReport;
use crate::tokenize::{Counters, Encoder, EncoderSettings};

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

/// What a predict or embed stage reads before it decides to run: the session, the model,
/// the rows its query selects, and what identifies this run's output.
struct Prepared {
    ctx: SessionContext,
    config: ModelConfig,
    /// The model's class names; empty for an embed stage.
    labels: Vec<String>,
    encoder: Arc<Encoder>,
    model_version: String,
    /// The query, with the row policy's columns.
    df: DataFrame,
    source_version: Option<i64>,
    /// Key of the job in the table's Delta app transactions.
    job: String,
    fingerprint: String,
}

fn context(stage: &PredictStage) -> String {
    format!("stage `{}` ({})", stage.name, stage.query.origin)
}

fn model_error(stage: &PredictStage, e: impl std::fmt::Display) -> Error {
    Error::Model(format!("stage `{}`: {e}", stage.name))
}

/// Reads the model (an earlier train stage of this run may have just written it) and plans
/// the query in a session that reads `batch_rows` rows at a time.
async fn prepare(run: &Run<'_>, stage: &PredictStage) -> Result<Prepared> {
    let s = &stage.settings;
    let mut state = run.ctx.state();
    *state.config_mut() = state.config().clone().with_batch_size(s.batch_rows);
    let ctx = SessionContext::new_with_state(state);
    let config = ModelConfig::load(&stage.model).map_err(|e| model_error(stage, e))?;
    let labels = match stage.embed {
        Some(_) => Vec::new(),
        None => model_labels(&stage.model, &config, stage.labels.as_deref())
            .map_err(|e| model_error(stage, e))?,
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
    let engine_err = |e| Error::engine(context(stage), e);
    let df = ctx
        .sql(&stage.query.sql)
        .await
        .map_err(engine_err)?
        .select_columns(&stage.policy.columns())
        .map_err(engine_err)?;
    let inputs = fingerprint::plan_inputs(df.logical_plan(), &run.identities)?;
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
        "policy": stage.policy,
        "labels": labels,
        "mode": stage.mode,
        "job": job,
        "precision": s.precision,
        "logits": s.logits,
    }));
    Ok(Prepared {
        ctx,
        config,
        labels,
        encoder,
        model_version,
        df,
        source_version: source_version(&inputs),
        job,
        fingerprint,
    })
}

/// The stage's report before it runs.
fn report(stage: &PredictStage) -> StageReport {
    StageReport {
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
        precision: Some(stage.settings.precision.name().to_string()),
        ..Default::default()
    }
}

/// The output table as the job last left it.
struct Target {
    table: Option<DeltaTable>,
    /// The source version the job's last app transaction covered.
    done: Option<i64>,
    /// The job's last commit to the table: its labels and fingerprint.
    last: Option<Value>,
}

impl Target {
    async fn open(def: &TableDef, job: &str) -> Result<Self> {
        let table = delta::open_target(def).await?;
        let (done, last) = match &table {
            Some(t) => (
                delta::txn_version(t, job).await?,
                delta::find_commit(t, HISTORY_DEPTH, "job", job).await?,
            ),
            None => (None, None),
        };
        Ok(Self { table, done, last })
    }

    /// Whether the job already committed these predictions for this version of its source.
    fn covers(&self, p: &Prepared) -> bool {
        let covered = matches!((self.done, p.source_version), (Some(d), Some(v)) if d >= v);
        let unchanged = self
            .last
            .as_ref()
            .and_then(|tag| tag.get("fingerprint"))
            .and_then(Value::as_str)
            == Some(p.fingerprint.as_str());
        covered && unchanged
    }

    /// The report of a stage that had nothing to write.
    fn cached(&self, report: StageReport) -> StageReport {
        StageReport {
            cached: true,
            version: self.table.as_ref().and_then(DeltaTable::version),
            ..report
        }
    }
}

pub(super) async fn run(run: &Run<'_>, stage: &PredictStage) -> Result<StageReport> {
    let def = &run.pipeline.tables[&stage.to];
    let p = prepare(run, stage).await?;
    let mut report = report(stage);
    let target = Target::open(def, &p.job).await?;
    if target.covers(&p) && !run.options.force {
        return Ok(target.cached(report));
    }
    let Some(rows) = rows_to_predict(stage, &p, &target).await? else {
        // An incremental run whose table already holds every id: nothing to write.
        return Ok(target.cached(report));
    };
    let run_id = uuid::Uuid::new_v4().to_string();
    let predictor = Arc::new(predictor(stage, &p, &rows, &run_id).await?);
    let counters = predictor.counters();
    let bar = run.progress(&stage.name);
    let in_flight = if stage.device.is_cuda() {
        2
    } else {
        stage.settings.replicas + 1
    };
    let schema = predictor.schema();
    let predicted = predictor.stream(rows, in_flight).inspect(progress(
        bar.clone(),
        counters.clone(),
        stage.embed.is_some(),
    ));
    let written = commit(
        run,
        stage,
        def,
        &p,
        target,
        Box::pin(RecordBatchStreamAdapter::new(schema, predicted)),
        &run_id,
    )
    .await;
    bar.finish_and_clear();
    report.version = written?.version();
    counters.fill(&mut report);
    Ok(report)
}

/// The rows to run the model on, or `None` when an incremental run finds every id already
/// in its table. An incremental run reads only ids the table does not hold yet, at exactly
/// the version its commit builds on, so a concurrent run of the job conflicts on the txn.
async fn rows_to_predict(
    stage: &PredictStage,
    p: &Prepared,
    target: &Target,
) -> Result<Option<SendableRecordBatchStream>> {
    let engine_err = |e| Error::engine(context(stage), e);
    let incremental = match (stage.mode, &target.table) {
        (PredictMode::Incremental, Some(table)) => Some(table),
        _ => None,
    };
    let mut df = p.df.clone();
    if let Some(table) = incremental {
        if let Some(before) = target
            .last
            .as_ref()
            .and_then(|tag| tag.pointer("/extra/labels"))
            && stage.embed.is_none()
            && *before != json!(p.labels)
        {
            return Err(Error::Data(format!(
                "stage `{}`: table `{}` holds this job's predictions with labels {before}, but \
                 the model `{}` has labels {}; use `mode: overwrite`, or another table",
                stage.name,
                stage.to,
                crate::storage::model_name(&stage.model),
                json!(p.labels)
            )));
        }
        let provider = table.table_provider().await.map_err(engine_err)?;
        let have = p
            .ctx
            .read_table(provider)
            .map_err(engine_err)?
            .select(vec![ident(&stage.policy.id).alias("__lakeml_have")])
            .map_err(engine_err)?;
        df = have
            .join(
                df,
                JoinType::RightAnti,
                &["__lakeml_have"],
                &[stage.policy.id.as_str()],
                None,
            )
            .map_err(engine_err)?;
    }
    let mut stream = df.execute_stream().await.map_err(engine_err)?;
    let schema = stream.schema();
    // The first rows are read before the model loads.
    let mut first: Option<RecordBatch> = None;
    while let Some(batch) = stream.next().await {
        let batch = batch.map_err(engine_err)?;
        if batch.num_rows() > 0 {
            first = Some(batch);
            break;
        }
    }
    if first.is_none() && incremental.is_some() {
        return Ok(None);
    }
    let rows = futures::stream::iter(first.map(Ok)).chain(stream);
    Ok(Some(Box::pin(RecordBatchStreamAdapter::new(schema, rows))))
}

/// Loads the model with the stage's head and readies it for `rows`.
async fn predictor(
    stage: &PredictStage,
    p: &Prepared,
    rows: &SendableRecordBatchStream,
    run_id: &str,
) -> Result<Predictor> {
    let (head, output) = match &stage.embed {
        Some(e) => (
            Head::Embed {
                pooling: Arc::new(e.pooling.clone()),
                dims: e.dims,
                normalize: e.normalize,
            },
            Rows::Embeddings {
                dims: e.dims,
                quantized: e.quantize.is_some(),
            },
        ),
        None => (
            Head::Classify {
                classes: p.labels.len(),
            },
            Rows::Predictions,
        ),
    };
    let engine = Engine::start(&stage.model, &p.config, head, stage.device, &stage.settings)
        .await
        .map_err(|e| model_error(stage, e))?;
    let meta = Meta {
        labels: p.labels.clone(),
        model_version: p.model_version.clone(),
        run_id: run_id.to_string(),
        predicted_at: chrono::Utc::now().timestamp_micros(),
        logits: stage.settings.logits,
    };
    Predictor::new(
        &rows.schema(),
        p.encoder.clone(),
        engine,
        stage.policy.clone(),
        meta,
        output,
    )
}

/// Shows the rows done so far on the stage's progress bar.
fn progress(
    bar: ProgressBar,
    counters: Arc<Counters>,
    embed: bool,
) -> impl FnMut(&std::result::Result<RecordBatch, DataFusionError>) {
    let verb = if embed { "embedded" } else { "predicted" };
    move |result| {
        if result.is_ok() {
            bar.set_message(format!(
                "{} rows {verb}",
                counters.rows_out.load(Ordering::Relaxed)
            ));
        }
    }
}

/// Commits the predicted rows in one commit with the job's app transaction: appended to
/// the table (incremental) or replacing it.
async fn commit(
    run: &Run<'_>,
    stage: &PredictStage,
    def: &TableDef,
    p: &Prepared,
    target: Target,
    rows: SendableRecordBatchStream,
    run_id: &str,
) -> Result<DeltaTable> {
    let txn_version = p
        .source_version
        .unwrap_or_else(|| target.done.unwrap_or(0) + 1);
    let extra = json!({
        "job": p.job,
        "labels": p.labels,
        "embed": stage.embed,
        "model": crate::storage::model_name(&stage.model),
        "model_version": p.model_version,
        "run_id": run_id,
        "mode": stage.mode,
        "source_version": p.source_version,
    });
    let mode = match stage.mode {
        PredictMode::Incremental => WriteMode::Append,
        PredictMode::Overwrite => WriteMode::Overwrite,
    };
    super::commit(
        &p.ctx,
        def,
        target.table,
        rows,
        mode,
        run.tag(&stage.name, p.fingerprint.clone(), extra),
        Some(Transaction::new(&p.job, txn_version)),
    )
    .await
}
