//! `table_updated`: when each watched table last got new data.
//!
//! A Delta table is followed through its log: a poll checks whether the next commit file
//! exists and reads only the commits it has not seen. A commit changes data when one of its
//! `add`, `remove` or `cdc` actions says `dataChange: true`; a compaction (`optimize`,
//! `dataChange: false`) does not. Parquet directories and CSV/JSON files change when a file
//! appears, disappears, or changes size or modification time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde_json::Value;

use crate::catalog::{self, TableDef};

/// How far back the first look at a Delta log searches for its newest data change.
const FIRST_LOOK_COMMITS: u64 = 1000;

/// One watched table.
#[derive(Debug)]
pub(crate) struct TableWatch {
    pub def: TableDef,
    state: State,
    /// When the table last got new data (ms since the epoch); `None`: never seen any.
    last_change_ms: Option<i64>,
}

#[derive(Debug)]
enum State {
    Delta { version: Option<u64> },
    Files { seen: BTreeMap<PathBuf, (u64, i64)> },
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

/// The newest commit number in a Delta log (one directory listing), if any.
pub(crate) fn latest_version(table: &Path) -> Option<u64> {
    std::fs::read_dir(table.join("_delta_log"))
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let name = name.to_str()?;
            let stem = name.strip_suffix(".json")?;
            (stem.len() == 20)
                .then(|| stem.parse::<u64>().ok())
                .flatten()
        })
        .max()
}

/// Whether commit `version` changed data, and when it was made (ms); `None` when the
/// commit file is missing or unreadable.
fn read_commit(table: &Path, version: u64) -> Option<(bool, i64)> {
    let path = log_file(table, version);
    let text = std::fs::read_to_string(&path).ok()?;
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
    let at = at.or_else(|| std::fs::metadata(&path).ok().map(|m| mtime_ms(&m)))?;
    Some((changed, at))
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
    /// Looks at the table once: its newest data change so far.
    pub(crate) fn new(def: TableDef) -> Self {
        if def.is_delta() {
            let version = latest_version(def.local_dir());
            let mut last_change_ms = None;
            if let Some(newest) = version {
                let oldest = newest.saturating_sub(FIRST_LOOK_COMMITS);
                for v in (oldest..=newest).rev() {
                    match read_commit(def.local_dir(), v) {
                        Some((true, at)) => {
                            last_change_ms = Some(at);
                            break;
                        }
                        Some((false, _)) => {}
                        None => break, // cleaned up behind a checkpoint
                    }
                }
            }
            Self {
                def,
                state: State::Delta { version },
                last_change_ms,
            }
        } else {
            let seen = file_state(def.local_dir());
            let last_change_ms = seen.values().map(|(_, m)| *m).max();
            Self {
                def,
                state: State::Files { seen },
                last_change_ms,
            }
        }
    }

    /// Reads what is new since the last poll.
    pub(crate) fn poll(&mut self) {
        match &mut self.state {
            State::Delta { version } => {
                if version.is_none() {
                    // Not created yet: one listing until it is.
                    *version = latest_version(self.def.local_dir());
                    if let Some(v) = *version {
                        for past in 0..=v {
                            if let Some((true, at)) = read_commit(self.def.local_dir(), past) {
                                self.last_change_ms = self.last_change_ms.max(Some(at));
                            }
                        }
                    }
                    return;
                }
                while let Some(current) = *version {
                    let next = current + 1;
                    if !log_file(self.def.local_dir(), next).exists() {
                        break;
                    }
                    if let Some((true, at)) = read_commit(self.def.local_dir(), next) {
                        self.last_change_ms = self.last_change_ms.max(Some(at));
                    }
                    *version = Some(next);
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
    }

    pub(crate) fn last_change_ms(&self) -> Option<i64> {
        self.last_change_ms
    }

    /// The Delta version seen last (`None` for file tables or a table not created yet).
    pub(crate) fn version(&self) -> Option<u64> {
        match self.state {
            State::Delta { version } => version,
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

    #[test]
    fn data_commits_count_and_compactions_do_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = dir.path().join("t");
        commit(&t, 0, &[info(1_000), add(true)]);
        let def = TableDef {
            name: "t".into(),
            kind: TableKind::Delta { at: None },
            location: crate::storage::Location::Local(t.clone()),
        };
        let mut w = TableWatch::new(def);
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
        w.poll();
        assert_eq!((w.version(), w.last_change_ms()), (Some(1), Some(1_000)));
        // Two appends land between polls: both are read, the newest counts.
        commit(&t, 2, &[info(3_000), add(true)]);
        commit(&t, 3, &[info(4_000), add(true)]);
        w.poll();
        assert_eq!((w.version(), w.last_change_ms()), (Some(3), Some(4_000)));
        // A fresh look behind a compaction finds the last data change.
        commit(&t, 4, &[info(5_000), add(false)]);
        let fresh = TableWatch::new(w.def.clone());
        assert_eq!(fresh.last_change_ms(), Some(4_000));
    }

    #[test]
    fn file_tables_change_with_new_or_rewritten_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path().join("pq");
        std::fs::create_dir_all(&d).expect("mkdir");
        std::fs::write(d.join("a.parquet"), b"x").expect("write");
        let def = TableDef {
            name: "pq".into(),
            kind: TableKind::Parquet,
            location: crate::storage::Location::Local(d.clone()),
        };
        let mut w = TableWatch::new(def);
        let first = w.last_change_ms();
        assert!(first.is_some());
        w.poll();
        assert_eq!(w.last_change_ms(), first, "nothing new");
        std::fs::write(d.join("b.parquet"), b"yy").expect("write");
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(d.join("b.parquet"))
            .and_then(|f| f.set_modified(later))
            .expect("touch");
        w.poll();
        assert!(w.last_change_ms() > first);
    }
}
