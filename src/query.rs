//! What a loaded pipeline answers besides running and serving: validation of the whole file
//! (`pipeline validate`: the stages, and the `serve:` section), ad-hoc SQL over its tables
//! (`pipeline sql`), and the summary a run ends with: where the model and tables are, and how
//! to query them.

use std::fmt::Write;

use arrow::array::RecordBatch;

use crate::catalog;
use crate::error::{Error, Result};
use crate::plan::Pipeline;
use crate::report::StageReport;

impl Pipeline {
    /// Checks every stage's query, columns and types against the tables as they are, and
    /// against what earlier stages will write, without running anything.
    /// A `serve:` section is checked too (models, users, TLS files), without loading a model.
    pub async fn validate(&self) -> Result<()> {
        let ctx = catalog::session();
        self.register_tables(&ctx).await?;
        self.check_stages(&ctx).await?;
        if self.serve.is_some() {
            crate::serve::check(self)?;
        }
        Ok(())
    }

    /// Runs `sql` over the pipeline's tables as they are now (Delta tables at their latest
    /// version) and returns the result. The `serve.models` the query calls (`embed(text)`,
    /// `predict(text)`, ...) are loaded and run as `pipeline serve` runs them.
    pub async fn sql(&self, sql: &str) -> Result<Vec<RecordBatch>> {
        let ctx = catalog::session();
        self.register_tables(&ctx).await?;
        for f in crate::serve::query_functions(self, sql).await? {
            ctx.register_udf(f);
        }
        let df = crate::serve::plan_query(&ctx, sql).await?;
        df.collect()
            .await
            .map_err(|e| Error::engine("the query", e))
    }

    /// What a run produced, for people: the model, the tables written, and a query to try
    /// (empty when the run wrote nothing worth pointing at).
    pub fn summary(&self, reports: &[StageReport]) -> String {
        let mut out = String::new();
        for r in reports.iter().filter(|r| r.kind == "train") {
            let _ = write!(out, "\n  model: {}", r.table);
            if let Some(acc) = r.metrics.get("test_accuracy") {
                let f1 = r.metrics.get("test_f1_macro").copied().unwrap_or(f64::NAN);
                let _ = write!(out, " (test accuracy {acc:.4}, f1_macro {f1:.4})");
            }
        }
        let written: Vec<&StageReport> = reports
            .iter()
            .filter(|r| self.tables.contains_key(&r.table))
            .collect();
        for r in &written {
            let version = r.version.map(|v| format!(" v{v}")).unwrap_or_default();
            let path = &self.tables[&r.table].location;
            let _ = write!(out, "\n  table {}{version}: {path}", r.table);
        }
        let predictions = written.iter().rev().find(|r| r.kind == "predict");
        let query = match (predictions, written.last()) {
            (Some(p), _) => Some(format!(
                "SELECT label, count(*) AS n, avg(score) AS mean_score FROM {} GROUP BY label",
                p.table
            )),
            (None, Some(last)) => Some(format!("SELECT * FROM {} LIMIT 5", last.table)),
            (None, None) => None,
        };
        if let Some(query) = query {
            let file = self.file.display();
            let _ = write!(out, "\n  query: pipeline sql {file} \"{query}\"");
        }
        if out.is_empty() {
            out
        } else {
            format!("summary:{out}")
        }
    }
}
