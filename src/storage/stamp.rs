//! The stamp of a model directory in an object store: written `writing` before a training
//! run's model is uploaded ([`super::Mirror`]) and `complete` after, so a reader
//! ([`super::model_dir`]) never takes a half-written model.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The stamp of a model directory written by a training run: `writing`, then `complete`
/// with the size of every file. Readers of the directory check it.
pub(crate) const STAMP: &str = "_lakeml_model.json";

/// What [`STAMP`] holds.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Stamp {
    /// `writing` or `complete`.
    pub state: String,
    /// Every file of the directory and its size, when complete.
    #[serde(default)]
    pub files: BTreeMap<String, u64>,
    /// The process that wrote it (`host:pid`), and when.
    pub by: String,
    pub at: String,
}

impl Stamp {
    pub(super) fn new(state: &str, files: BTreeMap<String, u64>) -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        Self {
            state: state.into(),
            files,
            by: format!("{host}:{}", std::process::id()),
            at: chrono::Utc::now().to_rfc3339(),
        }
    }

    pub(crate) fn is_complete(&self) -> bool {
        self.state == "complete"
    }
}
