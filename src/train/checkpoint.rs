//! Checkpoints in the run directory: `checkpoints/step-NNNNNNNN/` (optimizer state and the
//! loop's position) every N steps or epochs, the last K kept, plus `checkpoints/best/` (the
//! weights with the best validation metric). Each is written to a temporary directory and
//! renamed, so a kill never leaves a half-written checkpoint that looks complete.
//!
//! When `train.output` is an object-store URL, each checkpoint is uploaded as it is saved
//! (its `state.json` last, which marks it whole), pruned there as here, and the newest whole
//! one is fetched before a run starts, so a run killed on one machine resumes on another.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::{Error, Result};
use crate::storage::Mirror;

/// Where a run writes: a local directory, mirrored to an object store when `train.output`
/// is a URL.
#[derive(Debug)]
pub(crate) struct RunDir {
    pub path: PathBuf,
    pub mirror: Option<Mirror>,
}

/// The file that marks a checkpoint directory whole, here and in the store.
const MARKER: &str = "state.json";

/// Files of the run directory a resumed run appends to.
const LOGS: [&str; 2] = ["metrics.jsonl", "tensorboard"];

fn remote(e: String) -> Error {
    Error::Model(format!("checkpoint upload: {e}"))
}

/// Where the training loop is, and what it has seen: enough to resume exactly.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct LoopState {
    /// The run's fingerprint: a checkpoint of another configuration is never resumed.
    pub fingerprint: String,
    pub global_step: u64,
    pub epoch: u64,
    /// Micro-batches of `epoch` already consumed (global batches, with data parallelism).
    pub batches_done: usize,
    /// Ranks that trained it (data parallelism): a run resumes with the same or another.
    #[serde(default = "one")]
    pub world: usize,
    pub samples: u64,
    pub tokens: u64,
    pub slots: u64,
    pub train_seconds: f64,
    /// Best validation value of `best_metric` so far, and its step.
    pub best: Option<(f64, u64)>,
    /// Best value of the early-stopping metric, and evaluations since it improved.
    pub stop_best: Option<f64>,
    pub stale_evals: u32,
    pub mlflow_run_id: Option<String>,
    /// What the fingerprint was made of (inputs, model, settings), so that a run that
    /// cannot resume this checkpoint can say what changed. Absent in older checkpoints.
    #[serde(default)]
    pub identity: Option<serde_json::Value>,
    /// Seconds spent averaging gradients across ranks since this process started (not
    /// saved: a benchmark's figure, not the run's).
    #[serde(skip)]
    pub all_reduce_seconds: f64,
    /// Bytes those all-reduces carried, each rank's share (not saved either).
    #[serde(skip)]
    pub all_reduce_bytes: f64,
}

fn one() -> usize {
    1
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(format!("checkpoint {}", path.display()), e)
}

/// Writes `dir` atomically: files go to `dir.tmp`, which is then renamed.
fn write_dir(dir: &Path, tensors: &[(&str, Tensor)], state: &LoopState) -> Result<()> {
    let tmp = dir.with_extension("tmp");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    Tensor::write_safetensors(tensors, tmp.join("state.safetensors"))
        .map_err(|e| Error::Model(format!("writing checkpoint {}: {e}", tmp.display())))?;
    let json = serde_json::to_string_pretty(state)
        .map_err(|e| Error::Internal(format!("checkpoint state: {e}")))?;
    std::fs::write(tmp.join(MARKER), json).map_err(io(&tmp))?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(io(dir))?;
    }
    std::fs::rename(&tmp, dir).map_err(io(dir))
}

pub(crate) fn dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

/// Saves a resumable checkpoint at `state.global_step` and prunes all but the last `keep`.
pub(crate) fn save(
    run: &RunDir,
    tensors: &[(&str, Tensor)],
    state: &LoopState,
    keep: usize,
) -> Result<PathBuf> {
    let root = dir(&run.path);
    let name = format!("step-{:08}", state.global_step);
    let path = root.join(&name);
    write_dir(&path, tensors, state)?;
    let mut steps = list(&root)?;
    while steps.len() > keep.max(1) {
        let old = steps.remove(0);
        std::fs::remove_dir_all(&old).map_err(io(&old))?;
    }
    if let Some(mirror) = &run.mirror {
        mirror
            .push_dir(&format!("checkpoints/{name}"), Some(MARKER))
            .map_err(remote)?;
        let kept: Vec<String> = steps
            .iter()
            .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
            .collect();
        for old in mirror.whole_dirs("checkpoints", MARKER).map_err(remote)? {
            if old.starts_with("step-") && !kept.contains(&old) {
                mirror
                    .remove_dir(&format!("checkpoints/{old}"), Some(MARKER))
                    .map_err(remote)?;
            }
        }
        push_logs(run)?;
    }
    Ok(path)
}

/// Saves the best weights so far.
pub(crate) fn save_best(run: &RunDir, weights: Tensor, state: &LoopState) -> Result<()> {
    write_dir(&dir(&run.path).join("best"), &[("weights", weights)], state)?;
    if let Some(mirror) = &run.mirror {
        mirror
            .push_dir("checkpoints/best", Some(MARKER))
            .map_err(remote)?;
    }
    Ok(())
}

/// Uploads the metrics log and the TensorBoard events, which a resumed run appends to.
pub(crate) fn push_logs(run: &RunDir) -> Result<()> {
    let Some(mirror) = &run.mirror else {
        return Ok(());
    };
    for name in LOGS {
        let path = run.path.join(name);
        if path.is_dir() {
            mirror.push_dir(name, None).map_err(remote)?;
        } else if path.is_file() {
            mirror.push_file(name).map_err(remote)?;
        }
    }
    Ok(())
}

/// Before a run on a mirrored run directory: makes the local checkpoints the newest whole
/// one in the store (and its best weights), with the logs, whichever machine wrote them.
pub(crate) fn pull(run: &RunDir) -> Result<()> {
    let Some(mirror) = &run.mirror else {
        return Ok(());
    };
    let fetch = |e: String| Error::Model(format!("fetching checkpoints: {e}"));
    let whole = mirror.whole_dirs("checkpoints", MARKER).map_err(fetch)?;
    let newest = whole.iter().rfind(|n| n.starts_with("step-"));
    for local in list(&dir(&run.path))? {
        if local.file_name().and_then(|n| n.to_str()) != newest.map(String::as_str) {
            std::fs::remove_dir_all(&local).map_err(io(&local))?;
        }
    }
    if let Some(name) = newest {
        mirror.pull(&format!("checkpoints/{name}")).map_err(fetch)?;
    }
    let best = dir(&run.path).join("best");
    if whole.iter().any(|n| n == "best") {
        mirror.pull("checkpoints/best").map_err(fetch)?;
    } else if best.exists() {
        std::fs::remove_dir_all(&best).map_err(io(&best))?;
    }
    for name in LOGS {
        mirror.pull(name).map_err(fetch)?;
    }
    Ok(())
}

/// Complete step checkpoints, oldest first.
fn list(root: &Path) -> Result<Vec<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(Vec::new());
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("step-") && !n.ends_with(".tmp"))
                && p.join(MARKER).is_file()
        })
        .collect();
    out.sort();
    Ok(out)
}

/// A checkpoint read back.
pub(crate) struct Restored {
    pub state: LoopState,
    pub tensors: Vec<(String, Tensor)>,
}

fn read_state(path: &Path) -> Result<LoopState> {
    let text = std::fs::read_to_string(path.join(MARKER)).map_err(io(path))?;
    serde_json::from_str(&text).map_err(|e| {
        Error::Model(format!(
            "checkpoint {} has a bad state.json: {e}; delete it to start over",
            path.display()
        ))
    })
}

fn read_tensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    Tensor::read_safetensors(path.join("state.safetensors")).map_err(|e| {
        Error::Model(format!(
            "checkpoint {} is unreadable: {e}; delete it to start over",
            path.display()
        ))
    })
}

/// What a run directory's step checkpoints hold for one configuration.
pub(crate) enum Found {
    /// The latest checkpoint of this configuration, read back.
    Mine(Restored),
    /// None of this configuration: the newest checkpoint's directory name and state (its
    /// tensors are not read).
    Other(String, LoopState),
    /// No step checkpoint at all.
    Nothing,
}

/// The latest step checkpoint of the configuration `fingerprint`, else the newest of
/// another. Only `state.json` files are read until one matches; only its tensors are loaded.
pub(crate) fn find(run: &RunDir, fingerprint: &str) -> Result<Found> {
    let mut newest = None;
    for path in list(&dir(&run.path))?.into_iter().rev() {
        let state = read_state(&path)?;
        if state.fingerprint == fingerprint {
            let tensors = read_tensors(&path)?;
            return Ok(Found::Mine(Restored { state, tensors }));
        }
        if newest.is_none() {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            newest = Some((name, state));
        }
    }
    Ok(newest.map_or(Found::Nothing, |(name, state)| Found::Other(name, state)))
}

/// The best weights saved by this configuration, if any.
pub(crate) fn best(run: &RunDir, fingerprint: &str) -> Result<Option<Tensor>> {
    let path = dir(&run.path).join("best");
    if !path.join(MARKER).is_file() {
        return Ok(None);
    }
    if read_state(&path)?.fingerprint != fingerprint {
        return Ok(None);
    }
    Ok(read_tensors(&path)?
        .into_iter()
        .find(|(n, _)| n == "weights")
        .map(|(_, t)| t))
}

/// Removes every checkpoint (a fresh start, or `--force`), here and in the store.
pub(crate) fn clear(run: &RunDir) -> Result<()> {
    let root = dir(&run.path);
    if root.exists() {
        std::fs::remove_dir_all(&root).map_err(io(&root))?;
    }
    if let Some(mirror) = &run.mirror {
        for whole in mirror.whole_dirs("checkpoints", MARKER).map_err(remote)? {
            mirror
                .remove_dir(&format!("checkpoints/{whole}"), Some(MARKER))
                .map_err(remote)?;
        }
        mirror.remove_dir("checkpoints", None).map_err(remote)?;
    }
    Ok(())
}
