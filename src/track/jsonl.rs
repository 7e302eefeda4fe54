//! `metrics.jsonl`: one JSON object per line, the run's own record that needs no server.
//!
//! Lines are `{"params":{..}}` or `{"step":s,"time":unix_secs,"<name>":value,..}`; a value
//! that is not finite (a diverged loss) is written as `null`, since JSON has no NaN and a null
//! still loads as NaN in pandas.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

pub(super) struct MetricsFile {
    file: File,
    path: PathBuf,
}

impl MetricsFile {
    /// Opens `path` for appending, so a resumed run continues the same file.
    pub(super) fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
        })
    }

    pub(super) fn params(&mut self, params: &[(String, String)]) -> Result<()> {
        let map: serde_json::Map<String, Value> = params
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        let line = serde_json::json!({ "params": map }).to_string();
        self.write_line(line)
    }

    pub(super) fn scalars(&mut self, step: u64, time: f64, values: &[(&str, f64)]) -> Result<()> {
        // Written by hand so that `step` and `time` come first and names keep the caller's
        // order (serde_json's map would sort them).
        let mut line = format!("{{\"step\":{step},\"time\":{}", number(time));
        for (name, value) in values {
            line.push(',');
            line.push_str(&Value::String((*name).to_string()).to_string());
            line.push(':');
            line.push_str(&number(*value));
        }
        line.push('}');
        self.write_line(line)
    }

    fn write_line(&mut self, mut line: String) -> Result<()> {
        line.push('\n');
        // One write per line: with O_APPEND a line is never interleaved or split by a crash
        // between two writes.
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|e| Error::io(format!("writing {}", self.path.display()), e))
    }
}

fn number(v: f64) -> String {
    serde_json::Number::from_f64(v).map_or_else(|| "null".to_string(), |n| n.to_string())
}
