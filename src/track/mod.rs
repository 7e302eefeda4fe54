//! Training metrics: one call from the training loop writes them to `metrics.jsonl`, to a
//! TensorBoard event file and, when configured, to an MLflow run.
//!
//! Local files are written through on every call, so a killed run keeps all it logged. MLflow
//! requests run on their own thread (`sender`), so the loop never waits on the network for
//! metrics. Params, artifacts and finish do wait for the server: call the tracker from a plain
//! thread (the trainer's), or from `spawn_blocking` in async code.

mod jsonl;
mod mlflow;
mod sender;
mod tensorboard;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use jsonl::MetricsFile;
use mlflow::Metric;
use sender::MlflowThread;
use tensorboard::EventWriter;

/// Where and under which experiment to record a run in MLflow.
#[derive(Debug, Clone)]
pub(crate) struct MlflowSettings {
    /// The tracking server, e.g. `http://127.0.0.1:5000`.
    pub uri: String,
    /// Experiment name; created on first use.
    pub experiment: String,
    /// Run name shown in the MLflow UI; MLflow makes one up when `None`.
    pub run_name: Option<String>,
}

/// Records one training run. Call [`Tracker::finish`] at the end; a tracker dropped without
/// it marks its MLflow run FAILED, since the trainer only skips `finish` when it bailed out.
pub(crate) struct Tracker {
    /// `None` on a data-parallel rank other than 0, which records nothing.
    metrics: Option<MetricsFile>,
    events: Option<EventWriter>,
    mlflow: Option<MlflowThread>,
    finished: bool,
}

impl Tracker {
    /// Creates `run_dir` if needed; appends to `run_dir/metrics.jsonl`; writes TensorBoard
    /// events to `run_dir/tensorboard/events.out.tfevents.<unix_secs>.<hostname>.lakeml`.
    /// With `mlflow`, creates (or gets) the experiment and starts a run or, with
    /// `resume_run_id`, reopens that run (status RUNNING, in the experiment it belongs to) so
    /// a resumed training continues it. `resume_run_id` is ignored without `mlflow`.
    pub(crate) fn open(
        run_dir: &Path,
        mlflow: Option<MlflowSettings>,
        resume_run_id: Option<&str>,
    ) -> Result<Tracker> {
        std::fs::create_dir_all(run_dir)
            .map_err(|e| Error::io(format!("creating run directory {}", run_dir.display()), e))?;
        let metrics = MetricsFile::open(&run_dir.join("metrics.jsonl"))?;
        let events = EventWriter::create(&run_dir.join("tensorboard"), unix_secs())?;
        let mlflow = match mlflow {
            Some(settings) => Some(MlflowThread::start(settings, resume_run_id)?),
            None => None,
        };
        Ok(Tracker {
            metrics: Some(metrics),
            events: Some(events),
            mlflow,
            finished: false,
        })
    }

    /// A tracker that records nothing: data-parallel ranks other than 0 train the same
    /// model, and rank 0 alone writes the run's logs.
    pub(crate) fn silent() -> Tracker {
        Tracker {
            metrics: None,
            events: None,
            mlflow: None,
            finished: false,
        }
    }

    /// The MLflow run's id, to store in checkpoints so a resumed training can reopen it.
    pub(crate) fn mlflow_run_id(&self) -> Option<&str> {
        self.mlflow.as_ref().map(MlflowThread::run_id)
    }

    /// Records the run's settings (hyperparameters, model, data). MLflow gets values cut to
    /// its 6000-character limit; metrics.jsonl keeps them whole. MLflow refuses a new value
    /// for a key the run already has, so a resumed run must log the same values.
    pub(crate) fn params(&mut self, params: &[(String, String)]) -> Result<()> {
        if let Some(file) = &mut self.metrics {
            file.params(params)?;
        }
        match &mut self.mlflow {
            Some(m) => m.params(params.to_vec()),
            None => Ok(()),
        }
    }

    /// Records `values` (named like `train/loss`, `eval/accuracy`) at `step`: one line in
    /// metrics.jsonl, one TensorBoard scalar per value, and MLflow metrics queued for the next
    /// batch. An error from an earlier MLflow batch is returned here, after the local files
    /// have been written.
    pub(crate) fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let time = unix_secs();
        if let Some(file) = &mut self.metrics {
            file.scalars(step, time, values)?;
        }
        if let Some(events) = &mut self.events {
            events.scalars(time, step, values)?;
        }
        if let Some(m) = &mut self.mlflow {
            let timestamp_ms = (time * 1000.0) as i64;
            let batch = values
                .iter()
                .map(|(key, value)| Metric {
                    key: (*key).to_string(),
                    value: *value,
                    timestamp_ms,
                    step,
                })
                .collect();
            m.metrics(batch)?;
        }
        Ok(())
    }

    /// Sends queued MLflow metrics now (local files are always up to date).
    pub(crate) fn flush(&mut self) -> Result<()> {
        match &mut self.mlflow {
            Some(m) => m.flush(),
            None => Ok(()),
        }
    }

    /// Uploads every file under `dir`, recursively, to the MLflow run's artifacts under
    /// `artifact_path` (`""` for the root), through the tracking server's artifact proxy.
    /// Without MLflow there is nowhere to upload to and this does nothing.
    pub(crate) fn artifacts(&mut self, dir: &Path, artifact_path: &str) -> Result<()> {
        let Some(m) = &mut self.mlflow else {
            return Ok(());
        };
        let prefix = artifact_segments(artifact_path)?;
        let mut files = Vec::new();
        collect_files(dir, dir, &mut Vec::new(), &mut files)?;
        let files = files
            .into_iter()
            .map(|(path, rel)| (path, prefix.iter().cloned().chain(rel).collect()))
            .collect();
        m.artifacts(files)
    }

    /// Sends everything queued and ends the MLflow run as FINISHED (`ok`) or FAILED, with its
    /// end time. Calling it again does nothing.
    pub(crate) fn finish(&mut self, ok: bool) -> Result<()> {
        if std::mem::replace(&mut self.finished, true) {
            return Ok(());
        }
        match &mut self.mlflow {
            Some(m) => m.finish(ok),
            None => Ok(()),
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        // Best effort: the error has nowhere to go, and the trainer's own error matters more.
        let _ = self.finish(false);
    }
}

fn unix_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `artifact_path` as path segments; `..` is refused since the server would refuse it later,
/// after earlier files were uploaded.
fn artifact_segments(artifact_path: &str) -> Result<Vec<String>> {
    let segments: Vec<String> = artifact_path
        .split('/')
        .filter(|s| !s.is_empty() && *s != ".")
        .map(str::to_string)
        .collect();
    if segments.iter().any(|s| s == "..") {
        return Err(Error::Internal(format!(
            "artifact path `{artifact_path}` must stay inside the run's artifacts (no `..`)"
        )));
    }
    Ok(segments)
}

/// Every file under `dir`, sorted by path, with its path relative to `root` as segments.
fn collect_files(
    root: &Path,
    dir: &Path,
    rel: &mut Vec<String>,
    out: &mut Vec<(PathBuf, Vec<String>)>,
) -> Result<()> {
    // Symlinks are followed (a model directory from the HF cache links to its blobs), so a
    // link back up the tree would recurse forever without a limit.
    const MAX_DEPTH: usize = 64;
    if rel.len() > MAX_DEPTH {
        return Err(Error::Data(format!(
            "artifact directory {} nests deeper than {MAX_DEPTH} levels at {}: is there a \
             symlink loop?",
            root.display(),
            dir.display()
        )));
    }
    let read = |e| Error::io(format!("reading artifact directory {}", dir.display()), e);
    let mut entries = std::fs::read_dir(dir)
        .map_err(read)?
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(read)?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let name = entry.file_name().into_string().map_err(|name| {
            Error::Data(format!(
                "artifact file name {name:?} in {} is not UTF-8; MLflow artifact paths are \
                 text, rename the file",
                dir.display()
            ))
        })?;
        let meta = std::fs::metadata(&path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        rel.push(name);
        if meta.is_dir() {
            collect_files(root, &path, rel, out)?;
        } else if meta.is_file() {
            out.push((path, rel.clone()));
        }
        rel.pop();
    }
    Ok(())
}
