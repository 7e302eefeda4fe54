//! Runs a validated pipeline: one SQL session, stages in order, a report per stage.

mod maintain;
mod predict;
mod tokenize;
mod train;
mod write;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use datafusion::error::DataFusionError;
use datafusion::physical_plan::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::prelude::SessionContext;
use deltalake::DeltaTable;
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};

use crate::catalog::{self, TableDef};
use crate::config::WriteMode;
use crate::delta::{self, CommitTag};
use crate::error::{Error, Result};
use crate::plan::{Pipeline, Stage};
use crate::report::StageReport;

/// How to run a pipeline.
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct RunOptions {
    pub(crate) force: bool,
    pub(crate) progress: bool,
    /// Run only these stages (by name); `None`: all.
    pub(crate) only: Option<Vec<String>>,
}

impl RunOptions {
    pub fn new() -> Self {
        Self::default()
    }
    /// Rerun stages even when their output is up to date.
    pub fn with_force(mut self, force: bool) -> Self {
        self.force = force;
        self
    }
    /// Run only the stages named here, in file order (others are validated, not run).
    pub fn with_stages(mut self, names: Vec<String>) -> Self {
        self.only = (!names.is_empty()).then_some(names);
        self
    }
    /// Show progress bars on stderr (hidden anyway when stderr is not a terminal).
    pub fn with_progress(mut self, progress: bool) -> Self {
        self.progress = progress;
        self
    }
}

/// State shared by the stages of one run.
pub(crate) struct Run<'a> {
    pub pipeline: &'a Pipeline,
    pub ctx: SessionContext,
    /// What each registered table reads now, for fingerprints.
    pub identities: HashMap<String, String>,
    pub options: &'a RunOptions,
    /// The process group of a data-parallel run (torchrun's environment), joined when the
    /// run starts; `None` runs alone.
    pub group: Option<Arc<crate::train::Group>>,
}

impl Run<'_> {
    pub(crate) fn progress(&self, stage: &str) -> ProgressBar {
        if !self.options.progress {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {prefix:.bold} {msg} [{elapsed}]")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_prefix(stage.to_string());
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        bar
    }

    /// What lakeml records in the commit a stage makes.
    fn tag(&self, stage: &str, fingerprint: String, extra: serde_json::Value) -> CommitTag {
        CommitTag {
            pipeline: self.pipeline.name.clone(),
            stage: stage.to_string(),
            fingerprint,
            extra,
        }
    }

    /// (Re-)registers table `name` so later stages read what a stage just wrote.
    async fn refresh(&mut self, name: &str) -> Result<()> {
        let def = &self.pipeline.tables[name];
        let identity = def.register(&self.ctx).await?;
        self.identities.insert(name.to_string(), identity);
        Ok(())
    }
}

/// A report of a stage that did nothing because its table is up to date: lakeml's last
/// commit to it has this fingerprint (and `--force` was not given).
async fn up_to_date(
    run: &Run<'_>,
    target: Option<&DeltaTable>,
    fingerprint: &str,
    report: StageReport,
) -> Result<Option<StageReport>> {
    let Some(table) = target.filter(|_| !run.options.force) else {
        return Ok(None);
    };
    Ok(delta::last_commit(table)
        .await?
        .filter(|last| last.matches(fingerprint))
        .map(|last| StageReport {
            cached: true,
            version: Some(last.version),
            rows_out: last.rows_added.unwrap_or_default(),
            ..report
        }))
}

/// Commits a stage's output stream to its table; on failure, says that nothing changed.
async fn commit(
    ctx: &SessionContext,
    def: &TableDef,
    target: Option<DeltaTable>,
    stream: SendableRecordBatchStream,
    mode: WriteMode,
    tag: CommitTag,
    txn: Option<deltalake::kernel::Transaction>,
) -> Result<DeltaTable> {
    // A stage's own error inside its stream (a bad row) reaches us flattened into a string by
    // delta-rs, so the first one is kept as it passes, to report in the stage's own words.
    let first_error: Arc<Mutex<Option<String>>> = Arc::default();
    let schema = stream.schema();
    let watched = {
        let first_error = first_error.clone();
        stream.inspect(move |result| {
            if let Err(DataFusionError::External(e)) = result
                && let Some(ours) = e.downcast_ref::<Error>()
                && let Ok(mut slot) = first_error.lock()
            {
                slot.get_or_insert_with(|| ours.to_string());
            }
        })
    };
    let watched = Box::pin(RecordBatchStreamAdapter::new(schema, watched));
    delta::write_stream(ctx, def, target, watched, mode, &tag, txn)
        .await
        .map_err(|e| {
            if let Error::Delta { source, .. } = &e
                && delta::is_conflict(source)
            {
                return Error::Data(format!(
                    "stage `{}`: another run committed to table `{}` while this one was \
                     writing; this run's output was not committed, and the table holds the \
                     other run's commit intact; rerun to add what is still missing",
                    tag.stage, def.name
                ));
            }
            let ours = first_error.lock().ok().and_then(|mut slot| slot.take());
            let cause = ours.unwrap_or_else(|| match &e {
                Error::Delta { source, .. } => source.to_string(),
                other => other.to_string(),
            });
            Error::Data(format!(
                "stage `{}` failed: {cause}; table `{}` is unchanged",
                tag.stage, def.name
            ))
        })
}

impl Pipeline {
    /// With torchrun's environment set, joins the data-parallel process group before any
    /// stage runs, so that a bad launch (a rank missing, a port in use) fails before
    /// anything is written, and refuses ranks that run another pipeline file or other
    /// options. `None` for a run alone, or a file without a train stage.
    async fn join_group(&self, options: &RunOptions) -> Result<Option<Arc<crate::train::Group>>> {
        let Some(launch) = crate::train::Launch::from_env()? else {
            return Ok(None);
        };
        let Some((timeout, nccl)) = self
            .stages
            .iter()
            .filter(|s| {
                options
                    .only
                    .as_ref()
                    .is_none_or(|o| o.iter().any(|n| n == s.name()))
            })
            .find_map(|s| match s {
                Stage::Train(t) => Some((t.distributed.timeout, t.distributed.nccl)),
                _ => None,
            })
        else {
            return Err(Error::Launch(format!(
                "{}: WORLD_SIZE={} asks for data-parallel training, but no train stage runs; \
                 run the other stages in one process",
                self.file.display(),
                launch.world
            )));
        };
        let group =
            tokio::task::spawn_blocking(move || crate::train::Group::join(&launch, timeout, nccl))
                .await
                .map_err(|_| Error::Internal("the rendezvous thread vanished".into()))??;
        let text = std::fs::read(&self.file)
            .map_err(|e| Error::io(format!("reading {}", self.file.display()), e))?;
        let plan = crate::fingerprint::digest(&serde_json::json!({
            "file": String::from_utf8_lossy(&text),
            "only": options.only,
            "force": options.force,
        }));
        group.agree(&plan, "pipeline file and `pipeline run` options")?;
        Ok(Some(Arc::new(group)))
    }

    /// Validates, then runs every stage in order. Each stage that writes a table makes one
    /// commit; a stage whose inputs and settings are unchanged since its last commit is
    /// skipped unless `force` is set.
    pub async fn run(&self, options: &RunOptions) -> Result<Vec<StageReport>> {
        if self.stages.is_empty() {
            return Err(Error::config(
                &self.file,
                "`stages` is empty, so there is nothing to run; add a stage, or serve the \
                 file's tables with `pipeline serve`",
            ));
        }
        if let Some(only) = &options.only
            && let Some(unknown) = only
                .iter()
                .find(|n| !self.stages.iter().any(|s| s.name() == n.as_str()))
        {
            let names: Vec<&str> = self.stages.iter().map(Stage::name).collect();
            return Err(Error::config(
                &self.file,
                format!(
                    "--stage {unknown}: no stage has that name (stages: {})",
                    names.join(", ")
                ),
            ));
        }
        // Tables are registered once; validation then runs in the same session.
        let ctx = catalog::session();
        let identities = self.register_tables(&ctx).await?;
        self.check_stages(&ctx).await?;
        let group = self.join_group(options).await?;
        let mut run = Run {
            pipeline: self,
            ctx,
            identities,
            options,
            group,
        };
        // Validation left empty planned tables under the stages' output names: put the real
        // ones back (or nothing, for tables a stage will create).
        let outputs: BTreeSet<&str> = self.stages.iter().filter_map(Stage::to).collect();
        for name in outputs {
            if self.tables[name].delta_exists().await? {
                run.refresh(name).await?;
            } else {
                run.ctx
                    .deregister_table(name)
                    .map_err(|e| Error::engine(format!("table `{name}`"), e))?;
            }
        }
        let mut reports = Vec::new();
        let selected = self.stages.iter().filter(|s| {
            options
                .only
                .as_ref()
                .is_none_or(|only| only.iter().any(|n| n == s.name()))
        });
        for stage in selected {
            if let Some(g) = run.group.clone() {
                // Rank 0 runs every stage; the others join it for training alone, once it
                // has written what the train stage reads.
                let key = format!("stage/{}", stage.name());
                match (stage, g.rank) {
                    (Stage::Train(_), 0) => g.signal(&key)?,
                    (Stage::Train(_), _) => {
                        g.wait(&key, "rank 0's stages before this one").await?;
                        for name in self.stages.iter().filter_map(Stage::to) {
                            if self.tables[name].delta_exists().await? {
                                run.refresh(name).await?;
                            }
                        }
                    }
                    (_, 0) => {}
                    (_, _) => continue,
                }
            }
            let started = Instant::now();
            let mut report = match stage {
                Stage::Write(w) => write::run(&run, w).await?,
                Stage::Tokenize(t) => tokenize::run(&run, t).await?,
                Stage::Train(t) => train::run(&run, t).await?,
                Stage::Predict(p) => predict::run(&run, p).await?,
                Stage::Optimize(o) => maintain::optimize(&run, o).await?,
                Stage::Vacuum(v) => maintain::vacuum(&run, v).await?,
            };
            report.seconds = started.elapsed().as_secs_f64();
            if let Some(table) = stage.to().or(stage.maintains()) {
                run.refresh(table).await?;
            }
            reports.push(report);
        }
        Ok(reports)
    }
}
