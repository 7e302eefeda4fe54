//! `table_updated`: when each watched table last got new data.
//!
//! A Delta table, on local disk or in an object store, is followed through its log: a poll
//! asks for the next commit file only (one GET in an object store, never a listing; a
//! missing file means nothing new) and reads only the commits it has not seen. A commit
//! changes data when one of its `add`, `remove` or `cdc` actions says `dataChange: true`; a
//! compaction (`optimize`, `dataChange: false`) does not. Local Parquet directories and
//! CSV/JSON files change when a file appears, disappears, or changes size or modification
//! time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use futures::TryStreamExt;
use object_store::{ObjectStore, ObjectStoreExt};
use serde_json::Value;

use crate::catalog::{self, TableDef};
use crate::error::{Error, Result};
use crate::storage::{Location, Remote};

/// How far back the first look at a Delta log searches for its newest data change.
const FIRST_LOOK_COMMITS: u64 = 1000;

/// One watched table.
pub(crate) struct TableWatch {
    pub def: TableDef,
    state: State,
    /// When the table last got new data (ms since the epoch); `None`: never seen any.
    last_change_ms: Option<i64>,
}

enum State {
    /// `version`: the newest commit read; `None` before the table exists.
    Delta {
        log: DeltaLog,
        version: Option<u64>,
    },
    Files {
        seen: BTreeMap<PathBuf, (u64, i64)>,
    },
}

/// Where a Delta table's log is.
enum DeltaLog {
    Local(PathBuf),
    Remote {
        remote: Remote,
        store: Arc<dyn ObjectStore>,
        /// The `_delta_log` prefix in the bucket.
        dir: object_store::path::Path,
    },
}

fn log_file(table: &Path, version: u64) -> PathBuf {
    table.join("_delta_log").join(format!("{version:020}.json"))
}

fn mtime_ms(meta: &std::fs::Metadata) -> i64 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The commit number a `_delta_log` entry's name holds, if it is a commit file.
fn commit_number(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(".json")?;
    (stem.len() == 20).then(|| stem.parse().ok()).flatten()
}

/// The newest commit number of a Delta table, local or in an object store; `None` when it
/// does not exist or cannot be read.
pub(crate) async fn delta_version(def: &TableDef) -> Option<u64> {
    DeltaLog::of(def).ok()?.latest_version().await.ok()?
}

/// The newest commit number in a local Delta log (one directory listing), if any.
fn latest_version(table: &Path) -> Option<u64> {
    std::fs::read_dir(table.join("_delta_log"))
        .ok()?
        .flatten()
        .filter_map(|e| commit_number(e.file_name().to_str()?))
        .max()
}

/// Whether a commit's actions changed data, and when it was made (ms): its `commitInfo`
/// timestamp, else `fallback_ms` (the file's modification time).
fn parse_commit(text: &str, fallback_ms: i64) -> (bool, i64) {
    let mut changed = false;
    let mut at = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(action) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        for kind in ["add", "remove", "cdc"] {
            if let Some(a) = action.get(kind) {
                // `cdc` files are data; `add`/`remove` say whether they are.
                changed |=
                    kind == "cdc" || a.get("dataChange").and_then(Value::as_bool).unwrap_or(true);
            }
        }
        if let Some(ts) = action
            .pointer("/commitInfo/timestamp")
            .and_then(Value::as_i64)
        {
            at = Some(ts);
        }
    }
    (changed, at.unwrap_or(fallback_ms))
}

impl DeltaLog {
    fn of(def: &TableDef) -> Result<Self> {
        match &def.location {
            Location::Local(path) => Ok(Self::Local(path.clone())),
            Location::Remote(r) => {
                let fail = |m: String| Error::Data(format!("table `{}`: {m}", def.name));
                Ok(Self::Remote {
                    store: r.store().map_err(fail)?,
                    dir: r.key().map_err(fail)?.join("_delta_log"),
                    remote: r.clone(),
                })
            }
        }
    }

    /// The newest commit number: one listing (in an object store, of the entries after the
    /// last checkpoint, which `_last_checkpoint` names).
    async fn latest_version(&self) -> Result<Option<u64>, String> {
        let (remote, store, dir) = match self {
            Self::Local(path) => return Ok(latest_version(path)),
            Self::Remote { remote, store, dir } => (remote, store, dir),
        };
        let explain = |e: object_store::Error| crate::storage::explain(remote, &e);
        let checkpoint = match store.get(&dir.clone().join("_last_checkpoint")).await {
            Ok(got) => {
                let bytes = got.bytes().await.map_err(explain)?;
                serde_json::from_slice::<Value>(&bytes)
                    .ok()
                    .and_then(|v| v.get("version")?.as_u64())
            }
            Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => return Err(explain(e)),
        };
        let listing = match checkpoint {
            Some(v) => store.list_with_offset(Some(dir), &dir.clone().join(format!("{v:020}"))),
            None => store.list(Some(dir)),
        };
        let entries: Vec<object_store::ObjectMeta> =
            listing.try_collect().await.map_err(explain)?;
        let listed = entries
            .iter()
            .filter_map(|m| commit_number(m.location.filename()?))
            .max();
        Ok(listed.max(checkpoint))
    }

    /// Whether commit `version` changed data, and when it was made (ms); `None` when the
    /// commit file is not there (one GET in an object store).
    async fn read_commit(&self, version: u64) -> Result<Option<(bool, i64)>, String> {
        match self {
            Self::Local(table) => {
                let path = log_file(table, version);
                let Ok(text) = std::fs::read_to_string(&path) else {
                    return Ok(None);
                };
                let mtime = std::fs::metadata(&path).map_or(0, |m| mtime_ms(&m));
                Ok(Some(parse_commit(&text, mtime)))
            }
            Self::Remote { remote, store, dir } => {
                let explain = |e: object_store::Error| crate::storage::explain(remote, &e);
                match store
                    .get(&dir.clone().join(format!("{version:020}.json")))
                    .await
                {
                    Ok(got) => {
                        let mtime = got.meta.last_modified.timestamp_millis();
                        let bytes = got.bytes().await.map_err(explain)?;
                        Ok(Some(parse_commit(&String::from_utf8_lossy(&bytes), mtime)))
                    }
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(explain(e)),
                }
            }
        }
    }
}

fn file_state(path: &Path) -> BTreeMap<PathBuf, (u64, i64)> {
    catalog::files_of(path)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|f| {
            let meta = std::fs::metadata(&f).ok()?;
            Some((f, (meta.len(), mtime_ms(&meta))))
        })
        .collect()
}

impl TableWatch {
    /// Looks at the table once: its newest data change so far (one listing of a Delta log,
    /// then its newest commits until one changed data).
    pub(crate) async fn new(def: TableDef) -> Result<Self> {
        if !def.is_delta() {
            // The plan watches file tables on local disk only.
            let seen = file_state(def.local_dir());
            let last_change_ms = seen.values().map(|(_, m)| *m).max();
            return Ok(Self {
                def,
                state: State::Files { seen },
                last_change_ms,
            });
        }
        let log = DeltaLog::of(&def)?;
        let fail = |m: String| Error::Data(format!("table `{}`: watching its log: {m}", def.name));
        let version = log.latest_version().await.map_err(fail)?;
        let mut last_change_ms = None;
        if let Some(newest) = version {
            let oldest = newest.saturating_sub(FIRST_LOOK_COMMITS);
            for v in (oldest..=newest).rev() {
                match log.read_commit(v).await.map_err(fail)? {
                    Some((true, at)) => {
                        last_change_ms = Some(at);
                        break;
                    }
                    Some((false, _)) => {}
                    None => break, // cleaned up behind a checkpoint
                }
            }
        }
        Ok(Self {
            def,
            state: State::Delta { log, version },
            last_change_ms,
        })
    }

    /// Reads what is new since the last poll: for a Delta table, the commits after the one
    /// read last (from the first, before the table exists), until one is not there.
    pub(crate) async fn poll(&mut self) -> Result<(), String> {
        match &mut self.state {
            State::Delta { log, version } => {
                let mut next = version.map_or(0, |v| v + 1);
                while let Some((changed, at)) = log.read_commit(next).await? {
                    if changed {
                        self.last_change_ms = self.last_change_ms.max(Some(at));
                    }
                    *version = Some(next);
                    next += 1;
                }
            }
            State::Files { seen } => {
                let now = file_state(self.def.local_dir());
                if now != *seen {
                    let newest_changed = now
                        .iter()
                        .filter(|(f, sig)| seen.get(*f) != Some(sig))
                        .map(|(_, (_, m))| *m)
                        .max();
                    // A deleted file counts as a change now.
                    let at =
                        newest_changed.unwrap_or_else(|| chrono::Utc::now().timestamp_millis());
                    self.last_change_ms = self.last_change_ms.max(Some(at));
                    *seen = now;
                }
            }
        }
        Ok(())
    }

    pub(crate) fn last_change_ms(&self) -> Option<i64> {
        self.last_change_ms
    }

    /// The Delta version seen last (`None` for file tables or a table not created yet).
    pub(crate) fn version(&self) -> Option<u64> {
        match self.state {
            State::Delta { version, .. } => version,
            State::Files { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::TableKind;

    fn commit(dir: &Path, version: u64, actions: &[Value]) {
        std::fs::create_dir_all(dir.join("_delta_log")).expect("mkdir");
        let text: Vec<String> = actions.iter().map(Value::to_string).collect();
        std::fs::write(log_file(dir, version), text.join("\n")).expect("write");
    }

    fn add(data_change: bool) -> Value {
        serde_json::json!({"add": {"path": "p.parquet", "dataChange": data_change}})
    }

    fn info(ts: i64) -> Value {
        serde_json::json!({"commitInfo": {"timestamp": ts}})
    }

    #[tokio::test]
    async fn data_commits_count_and_compactions_do_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = dir.path().join("t");
        commit(&t, 0, &[info(1_000), add(true)]);
        let def = TableDef {
            name: "t".into(),
            kind: TableKind::Delta { at: None },
            location: crate::storage::Location::Local(t.clone()),
        };
        let mut w = TableWatch::new(def).await.expect("watch");
        assert_eq!((w.version(), w.last_change_ms()), (Some(0), Some(1_000)));
        // An optimize: removes and adds with dataChange=false.
        commit(
            &t,
            1,
            &[
                info(2_000),
                serde_json::json!({"remove": {"path": "p.parquet", "dataChange": false}}),
                add(false),
            ],
        );
        w.poll().await.expect("poll");
        assert_eq!((w.version(), w.last_change_ms()), (Some(1), Some(1_000)));
        // Two appends land between polls: both are read, the newest counts.
        commit(&t, 2, &[info(3_000), add(true)]);
        commit(&t, 3, &[info(4_000), add(true)]);
        w.poll().await.expect("poll");
        assert_eq!((w.version(), w.last_change_ms()), (Some(3), Some(4_000)));
        // A fresh look behind a compaction finds the last data change.
        commit(&t, 4, &[info(5_000), add(false)]);
        let fresh = TableWatch::new(w.def.clone()).await.expect("watch");
        assert_eq!(fresh.last_change_ms(), Some(4_000));
    }

    #[tokio::test]
    async fn file_tables_change_with_new_or_rewritten_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path().join("pq");
        std::fs::create_dir_all(&d).expect("mkdir");
        std::fs::write(d.join("a.parquet"), b"x").expect("write");
        let def = TableDef {
            name: "pq".into(),
            kind: TableKind::Parquet,
            location: crate::storage::Location::Local(d.clone()),
        };
        let mut w = TableWatch::new(def).await.expect("watch");
        let first = w.last_change_ms();
        assert!(first.is_some());
        w.poll().await.expect("poll");
        assert_eq!(w.last_change_ms(), first, "nothing new");
        std::fs::write(d.join("b.parquet"), b"yy").expect("write");
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(d.join("b.parquet"))
            .and_then(|f| f.set_modified(later))
            .expect("touch");
        w.poll().await.expect("poll");
        assert!(w.last_change_ms() > first);
    }
}
