//! Fingerprints of a stage's inputs and settings, so an unchanged stage can be skipped.

use std::collections::{BTreeMap, HashMap};

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::logical_expr::LogicalPlan;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Identity (Delta version, or files' sizes and times) of each table `plan` scans.
pub(crate) fn plan_inputs(
    plan: &LogicalPlan,
    identities: &HashMap<String, String>,
) -> Result<BTreeMap<String, String>> {
    let mut names = Vec::new();
    plan.apply_with_subqueries(|node| {
        if let LogicalPlan::TableScan(scan) = node {
            let name = scan.table_name.table();
            // DataFusion names a table function's scan `name()`. Its arguments are constants
            // of the SQL text, which the fingerprint holds already: a literal, not a table.
            if !name.ends_with("()") {
                names.push(name.to_string());
            }
        }
        Ok(TreeNodeRecursion::Continue)
    })
    .map_err(|e| Error::engine("walking a query plan", e))?;
    let mut inputs = BTreeMap::new();
    for name in names {
        let identity = identities
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(&name))
            .map(|(_, v)| v.clone())
            .ok_or_else(|| Error::Internal(format!("table `{name}` has no identity")))?;
        inputs.insert(name, identity);
    }
    Ok(inputs)
}

/// sha256 of a JSON value (serde_json writes object keys in a stable order).
pub(crate) fn digest(value: &Value) -> String {
    hex::encode(Sha256::digest(value.to_string().as_bytes()))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    #[tokio::test]
    async fn a_table_function_with_constant_arguments_fingerprints_like_a_literal() {
        let ctx = crate::catalog::session();
        let df = ctx
            .sql("SELECT value * 2 AS id FROM generate_series(1, 100)")
            .await
            .expect("plan");
        let inputs = super::plan_inputs(df.logical_plan(), &HashMap::new()).expect("inputs");
        assert!(inputs.is_empty(), "{inputs:?}");
    }
}
