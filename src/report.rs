//! What a stage did: rows, tokens, time, throughput, and every row it skipped or changed.

use std::collections::BTreeMap;
use std::fmt;

/// The report of one stage run.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct StageReport {
    pub stage: String,
    pub kind: String,
    /// The table the stage wrote.
    pub table: String,
    /// The table's version after the stage.
    pub version: Option<u64>,
    /// True when the output was up to date and the stage did no work.
    pub cached: bool,
    pub rows_in: u64,
    pub rows_out: u64,
    pub tokens: u64,
    pub seconds: f64,
    /// Rows skipped or changed, by reason (e.g. `truncated`, `skipped_null`).
    pub rows_by_outcome: BTreeMap<String, u64>,
    /// Training: throughput, final and test metrics (`test_accuracy`, `samples_per_second`, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, f64>,
    /// Training: the step a killed run was resumed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<u64>,
    /// Training: stopped by early stopping.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopped_early: bool,
    /// Training: the MLflow run that holds the params, metrics and model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlflow_run_id: Option<String>,
    /// Training: the fingerprint of inputs and settings (a matching rerun is skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// Embedding: how the vectors were pooled, and where that came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooling: Option<String>,
    /// Predict and embed: the precision the model ran at (after a CPU fallback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<String>,
}

impl StageReport {
    pub fn rows_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.rows_in as f64 / self.seconds
        } else {
            0.0
        }
    }
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl StageReport {
    /// A train stage's summary: where the model went, throughput, and the test metrics.
    fn fmt_train(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = |k: &str| self.metrics.get(k).copied().unwrap_or(f64::NAN);
        if self.cached {
            write!(
                f,
                "train {} -> {}: up to date, skipped",
                self.stage, self.table
            )?;
        } else {
            write!(
                f,
                "train {} -> {}: {} steps on {} rows in {:.1} s ({:.1} samples/s, {} tokens/s, \
                 padding {:.1}%)",
                self.stage,
                self.table,
                m("steps"),
                thousands(self.rows_in),
                self.seconds,
                m("samples_per_second"),
                thousands(m("tokens_per_second") as u64),
                100.0 * m("padding_ratio"),
            )?;
            if let Some(step) = self.resumed_from {
                write!(f, "; resumed from step {step}")?;
            }
            if self.stopped_early {
                write!(f, "; stopped early")?;
            }
        }
        if self.metrics.contains_key("test_accuracy") {
            write!(
                f,
                "\n  test: accuracy {:.4}, f1_macro {:.4}, precision_macro {:.4}, recall_macro \
                 {:.4}, loss {:.4}",
                m("test_accuracy"),
                m("test_f1_macro"),
                m("test_precision_macro"),
                m("test_recall_macro"),
                m("test_loss")
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for StageReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.kind == "train" {
            return self.fmt_train(f);
        }
        let version = self.version.map(|v| format!(" v{v}")).unwrap_or_default();
        if self.cached {
            let rows = match self.rows_out {
                0 => String::new(),
                n => format!(" ({} rows)", thousands(n)),
            };
            return write!(
                f,
                "{} {} -> {}{version}: up to date{rows}, skipped",
                self.kind, self.stage, self.table
            );
        }
        write!(
            f,
            "{} {} -> {}{version}: {} rows in, {} rows out",
            self.kind,
            self.stage,
            self.table,
            thousands(self.rows_in),
            thousands(self.rows_out)
        )?;
        if self.tokens > 0 {
            write!(f, ", {} tokens", thousands(self.tokens))?;
        }
        write!(
            f,
            " in {:.2} s ({} rows/s)",
            self.seconds,
            thousands(self.rows_per_second() as u64)
        )?;
        let notes: Vec<String> = self
            .rows_by_outcome
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| format!("{} {}", k.replace('_', " "), thousands(*n)))
            .collect();
        if !notes.is_empty() {
            write!(f, "; {}", notes.join(", "))?;
        }
        if let Some(pooling) = &self.pooling {
            write!(f, "\n  pooling: {pooling}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn groups_digits_by_three() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1234567), "1,234,567");
    }
}
