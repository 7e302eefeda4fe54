//! Checkpoints in the run directory: `checkpoints/step-NNNNNNNN/` (optimizer state and the
//! loop's position) every N steps or epochs, the last K kept, plus `checkpoints/best/` (the
//! weights with the best validation metric). Each is written to a temporary directory and
//! renamed, so a kill never leaves a half-written checkpoint that looks complete.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::{Error, Result};

/// Where the training loop is, and what it has seen: enough to resume exactly.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct LoopState {
    /// The run's fingerprint: a checkpoint of another configuration is never resumed.
    pub fingerprint: String,
    pub global_step: u64,
    pub epoch: u64,
    /// Micro-batches of `epoch` already consumed.
    pub batches_done: usize,
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
    std::fs::write(tmp.join("state.json"), json).map_err(io(&tmp))?;
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
    run_dir: &Path,
    tensors: &[(&str, Tensor)],
    state: &LoopState,
    keep: usize,
) -> Result<PathBuf> {
    let root = dir(run_dir);
    let path = root.join(format!("step-{:08}", state.global_step));
    write_dir(&path, tensors, state)?;
    let mut steps = list(&root)?;
    while steps.len() > keep.max(1) {
        let old = steps.remove(0);
        std::fs::remove_dir_all(&old).map_err(io(&old))?;
    }
    Ok(path)
}

/// Saves the best weights so far.
pub(crate) fn save_best(run_dir: &Path, weights: Tensor, state: &LoopState) -> Result<()> {
    write_dir(&dir(run_dir).join("best"), &[("weights", weights)], state)
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
                && p.join("state.json").is_file()
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

fn read(path: &Path) -> Result<Restored> {
    let text = std::fs::read_to_string(path.join("state.json")).map_err(io(path))?;
    let state: LoopState = serde_json::from_str(&text).map_err(|e| {
        Error::Model(format!(
            "checkpoint {} has a bad state.json: {e}; delete it to start over",
            path.display()
        ))
    })?;
    let tensors = Tensor::read_safetensors(path.join("state.safetensors")).map_err(|e| {
        Error::Model(format!(
            "checkpoint {} is unreadable: {e}; delete it to start over",
            path.display()
        ))
    })?;
    Ok(Restored { state, tensors })
}

/// The latest step checkpoint of this configuration, if any.
pub(crate) fn latest(run_dir: &Path, fingerprint: &str) -> Result<Option<Restored>> {
    for path in list(&dir(run_dir))?.into_iter().rev() {
        let restored = read(&path)?;
        if restored.state.fingerprint == fingerprint {
            return Ok(Some(restored));
        }
    }
    Ok(None)
}

/// The best weights saved by this configuration, if any.
pub(crate) fn best(run_dir: &Path, fingerprint: &str) -> Result<Option<Tensor>> {
    let path = dir(run_dir).join("best");
    if !path.join("state.json").is_file() {
        return Ok(None);
    }
    let restored = read(&path)?;
    Ok((restored.state.fingerprint == fingerprint)
        .then(|| restored.tensors.into_iter().find(|(n, _)| n == "weights"))
        .flatten()
        .map(|(_, t)| t))
}

/// Removes every checkpoint (a fresh start, or `--force`).
pub(crate) fn clear(run_dir: &Path) -> Result<()> {
    let root = dir(run_dir);
    if root.exists() {
        std::fs::remove_dir_all(&root).map_err(io(&root))?;
    }
    Ok(())
}
