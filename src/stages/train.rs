//! The stage around the training thread: read the tokenized table, fingerprint inputs and
//! settings (an unchanged run is skipped), hand everything to the trainer, report.

use std::path::Path;

use datafusion::common::Column;
use datafusion::prelude::Expr;
use serde_json::{Value, json};

use super::Run;
use crate::delta;
use crate::error::{Error, Result};
use crate::fingerprint;
use crate::plan::TrainStage;
use crate::report::StageReport;
use crate::storage::Mirror;
use crate::train::{self, ID, Job, Limits, RunDir};

/// What identifies the base model in the fingerprint: for a copy of a model in an object
/// store, its URL and its files' sizes and ETags there, the same on every machine (so a run
/// killed on one resumes on another); for a local directory, each file's size and
/// modification time.
fn model_identity(dir: &Path) -> Value {
    if let Some(remote) = crate::storage::remote_identity(dir) {
        return remote;
    }
    let mut files = serde_json::Map::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if let Ok(meta) = entry.metadata()
                && meta.is_file()
            {
                let mtime = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_nanos().to_string());
                files.insert(name, json!([meta.len(), mtime]));
            }
        }
    }
    Value::Object(files)
}

/// Class names recorded by the tokenize stage that wrote one of `tables`, if any.
async fn recorded_labels(run: &Run<'_>, tables: &[String]) -> Result<Option<Vec<String>>> {
    for name in tables {
        let Some(def) = run.pipeline.tables.get(name) else {
            continue;
        };
        let Some(table) = delta::open_target(def).await.ok().flatten() else {
            continue;
        };
        let names = delta::last_commit(&table)
            .await?
            .and_then(|c| c.tag)
            .and_then(|tag| tag.pointer("/extra/labels").cloned())
            .and_then(|v| serde_json::from_value::<Vec<String>>(v).ok());
        if names.is_some() {
            return Ok(names);
        }
    }
    Ok(None)
}

pub(super) async fn run(run: &Run<'_>, stage: &TrainStage) -> Result<StageReport> {
    let context = || format!("stage `{}` ({})", stage.name, stage.query.origin);
    let engine = |e| Error::engine(context(), e);
    let id = crate::plan::train_id_column(stage, &run.pipeline.tables).await?;
    let column = |name: &str| Expr::Column(Column::from_name(name));
    // Rows in the id's order (ties by label and tokens), whatever order the table's files
    // hold them in: the seeded shuffle then gives the same batches on every run.
    let df = run
        .ctx
        .sql(&stage.query.sql)
        .await
        .map_err(engine)?
        .select(vec![
            column(&id).alias(ID),
            column("input_ids"),
            column("label"),
            column(&stage.split),
        ])
        .map_err(engine)?
        .sort(vec![
            column(ID).sort(true, true),
            column("label").sort(true, true),
            column("input_ids").sort(true, true),
        ])
        .map_err(engine)?;

    let inputs = fingerprint::plan_inputs(df.logical_plan(), &run.identities)?;
    let names = match &stage.labels {
        Some(names) => Some(names.clone()),
        None => recorded_labels(run, &inputs.keys().cloned().collect::<Vec<_>>()).await?,
    };
    let mut identity = json!({
        "kind": "train",
        "sql": stage.query.sql,
        "inputs": inputs,
        "split": stage.split,
        "id": id,
        "labels": names,
        "model": model_identity(&stage.model),
        "device": stage.device_name(),
        "settings": stage.settings,
    });
    // Checkpoints are named by this, which leaves out the number of ranks: a run resumes
    // with the same or another N. The finished run's own fingerprint counts them.
    let fingerprint = fingerprint::digest(&identity);
    let checkpoint_identity = identity.clone();
    let group = run.group.clone();
    let world = group.as_ref().map_or(1, |g| g.world);
    let writes = group.as_ref().is_none_or(|g| g.rank == 0);
    let run_fingerprint = match world {
        1 => fingerprint.clone(),
        n => fingerprint::digest(&json!({ "train": fingerprint, "world": n })),
    };
    if let Some(g) = &group {
        // Threads may differ between machines; everything else must match rank 0's. The
        // model is compared by its config.json, not by file modification times.
        if let Some(settings) = identity.get_mut("settings").and_then(|v| v.as_object_mut()) {
            settings.remove("threads");
        }
        identity["model"] =
            json!(std::fs::read_to_string(stage.model.join("config.json")).unwrap_or_default());
        let plan = fingerprint::digest(&identity);
        g.agree(
            &plan,
            &format!(
                "train stage `{}` (its settings, model or input table versions)",
                stage.name
            ),
        )?;
    }
    let output = RunDir {
        path: stage.output.clone(),
        mirror: stage
            .output_remote
            .as_ref()
            .map(Mirror::new)
            .transpose()
            .map_err(|e| Error::Model(format!("stage `{}`: {e}", stage.name)))?,
    };
    let mut report = StageReport {
        stage: stage.name.clone(),
        kind: "train".into(),
        table: model_location(&output),
        ..Default::default()
    };
    let summary_path = stage.output.join("run.json");
    let mut done = None;
    if writes && !run.options.force {
        done = finished_run(&output)?
            .filter(|d| d.fingerprint.as_deref() == Some(run_fingerprint.as_str()));
    }
    if let Some(g) = &group {
        // Rank 0 alone reads the run directory; the others follow its decision.
        let skip = g.broadcast_bytes(&[u8::from(done.is_some())], "whether the run is done")?;
        if !writes && skip.first() == Some(&1) {
            return Ok(StageReport {
                cached: true,
                ..report
            });
        }
    }
    if let Some(done) = done {
        // A later stage of this run may read the model: have it here too.
        if let Some(mirror) = &output.mirror {
            mirror
                .pull("model")
                .map_err(|e| Error::Model(format!("stage `{}`: {e}", stage.name)))?;
        }
        return Ok(StageReport {
            cached: true,
            ..done
        });
    }
    if run.options.force && writes {
        // A forced run starts over instead of resuming.
        train::clear_checkpoints(&output)?;
    }

    let batches = df.collect().await.map_err(engine)?;
    let dataset = train::dataset(
        &batches,
        &stage.split,
        names,
        &Limits {
            vocab_size: stage.config.arch.vocab_size(),
            max_positions: stage.config.arch.max_positions(),
        },
    )?;
    report.rows_in = dataset.train.len() as u64;
    report.tokens = dataset.train.tokens() as u64;
    let job = Job {
        model_dir: stage.model.clone(),
        config: stage.config.clone(),
        output,
        // With NCCL, each rank trains on its own GPU (its LOCAL_RANK among the visible ones).
        device: group
            .as_ref()
            .and_then(|g| g.device)
            .unwrap_or(stage.device),
        mlflow: stage.mlflow.clone(),
        settings: stage.settings.clone(),
        data: dataset,
        fingerprint,
        identity: checkpoint_identity,
        progress: run.options.progress,
        group,
    };

    let outcome = crate::model::thread::spawn("train", OOM_HINT, move || train::train(job))?
        .await
        .map_err(|_| Error::Internal("the training thread vanished".into()))?
        .map_err(|e| {
            Error::Model(format!(
                "stage `{}` failed: {e}; {} keeps its previous model (if any), and a rerun \
                 resumes from the last checkpoint",
                stage.name,
                stage.output_remote.as_ref().map_or_else(
                    || stage.output.display().to_string(),
                    |r| r.url().to_string()
                )
            ))
        })?;

    report.rows_out = outcome.metrics.get("steps").copied().unwrap_or_default() as u64;
    report.metrics = outcome.metrics;
    report.resumed_from = outcome.resumed_from;
    report.stopped_early = outcome.stopped_early;
    report.mlflow_run_id = outcome.mlflow_run_id;
    report.table = match &stage.output_remote {
        Some(_) => report.table,
        None => outcome.model_dir.display().to_string(),
    };
    report.fingerprint = Some(run_fingerprint);
    if !writes {
        return Ok(report);
    }
    let text = serde_json::to_string_pretty(&report)
        .map_err(|e| Error::Internal(format!("run.json: {e}")))?;
    std::fs::write(&summary_path, text)
        .map_err(|e| Error::io(format!("writing {}", summary_path.display()), e))?;
    if let Some(remote) = &stage.output_remote {
        Mirror::new(remote)
            .and_then(|m| m.push_file("run.json"))
            .map_err(|e| {
                Error::Model(format!("stage `{}`: uploading run.json: {e}", stage.name))
            })?;
    }
    Ok(report)
}

/// Where the trained model is: a local path, or its URL in the store.
fn model_location(output: &RunDir) -> String {
    match &output.mirror {
        Some(mirror) => mirror.url_of("model"),
        None => output.path.join("model").display().to_string(),
    }
}

/// The report of the run that last completed in `output`, if its model is there whole: a
/// local `model.safetensors`, or a model stamped complete in the store.
fn finished_run(output: &RunDir) -> Result<Option<StageReport>> {
    let text = match &output.mirror {
        None => {
            if !output
                .path
                .join("model")
                .join("model.safetensors")
                .is_file()
            {
                return Ok(None);
            }
            std::fs::read(output.path.join("run.json")).ok()
        }
        Some(mirror) => {
            let failed = |e: String| Error::Model(format!("reading the run directory: {e}"));
            let stamp = mirror
                .read(&format!("model/{}", crate::storage::STAMP))
                .map_err(failed)?
                .and_then(|b| serde_json::from_slice::<crate::storage::Stamp>(&b).ok());
            if !stamp.is_some_and(|s| s.is_complete()) {
                return Ok(None);
            }
            mirror.read("run.json").map_err(failed)?
        }
    };
    Ok(text.and_then(|t| serde_json::from_slice(&t).ok()))
}

/// What to lower when training runs out of memory.
const OOM_HINT: &str = "lower `batch_size` (and raise `grad_accum` to keep the effective batch), \
                        lower `eval_batch_size`, or tokenize with a smaller `max_length`";
