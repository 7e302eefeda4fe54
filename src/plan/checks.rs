//! Checks of a stage's query against what the stage needs: tables, columns and types.

use std::collections::BTreeMap;

use arrow::datatypes::{DataType, Schema, SchemaRef};
use datafusion::prelude::SessionContext;

use super::{Query, TokenizeStage};
use crate::catalog::TableDef;
use crate::tokenize::RowPolicy;

/// Text columns may be any string or binary type (binary is checked for UTF-8 per row).
fn is_text(t: &DataType) -> bool {
    matches!(
        t,
        DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Binary
            | DataType::LargeBinary
            | DataType::BinaryView
    )
}

pub(crate) fn is_string(t: &DataType) -> bool {
    matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

/// Plans `query` (no execution) and returns its output schema.
pub(super) async fn plan_schema(
    ctx: &SessionContext,
    query: &Query,
    tables: &BTreeMap<String, TableDef>,
) -> Result<SchemaRef, String> {
    let df = ctx.sql(&query.sql).await.map_err(|e| {
        let msg = e.strip_backtrace();
        let hint = if msg.contains("table") && msg.contains("not found") {
            let declared = tables.keys().cloned().collect::<Vec<_>>().join(", ");
            format!("; declare the table under `tables` (declared: {declared})")
        } else {
            String::new()
        };
        format!("{}: {msg}{hint}", query.origin)
    })?;
    Ok(df.schema().inner().clone())
}

/// The query's column names, for "not found" messages.
pub(super) fn column_list(schema: &Schema) -> String {
    schema
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn check_tokenize_columns(t: &TokenizeStage, schema: &Schema) -> Result<(), String> {
    check_row_columns(
        &t.field,
        &t.policy,
        t.labels.is_some(),
        &["input_ids", "length", "label"],
        schema,
    )
}

/// The columns a row policy names (id, text, text pair, label, keep) against a query's
/// schema; `reserved` are the names the stage writes itself.
pub(super) fn check_row_columns(
    field: &str,
    p: &RowPolicy,
    has_labels: bool,
    reserved: &[&str],
    schema: &Schema,
) -> Result<(), String> {
    let get =
        |key: &str, name: &str| {
            schema.field_with_name(name).map(|f| f.data_type().clone()).map_err(|_| {
            format!(
                "{field}.{key}: column `{name}` not found in the stage's query (columns: {}); \
                 fix the column name or the query",
                column_list(schema)
            )
        })
        };
    let id = get("id", &p.id)?;
    if !(id.is_integer() || is_string(&id)) {
        return Err(format!(
            "{field}.id: column `{}` has type {id}; ids must be integers or strings",
            p.id
        ));
    }
    for (key, name) in [("text", Some(&p.text)), ("text_pair", p.text_pair.as_ref())] {
        if let Some(name) = name {
            let ty = get(key, name)?;
            if !is_text(&ty) {
                return Err(format!(
                    "{field}.{key}: column `{name}` has type {ty}; text must be a string or \
                     binary column (cast it in the query)"
                ));
            }
        }
    }
    if let Some(label) = &p.label {
        let ty = get("label", label)?;
        if !(ty.is_integer() || is_string(&ty)) {
            return Err(format!(
                "{field}.label: column `{label}` has type {ty}; labels must be integers or strings"
            ));
        }
        if has_labels && !is_string(&ty) {
            return Err(format!(
                "{field}.labels: column `{label}` holds integers, which are used as class ids \
                 as they are; remove `labels`"
            ));
        }
    }
    for name in &p.keep {
        get("keep", name)?;
        if reserved.contains(&name.as_str()) || *name == p.id {
            return Err(format!(
                "{field}.keep: `{name}` is a column the stage writes itself; rename it in the \
                 query"
            ));
        }
    }
    Ok(())
}

/// Columns by name and type, ignoring nullability and metadata.
pub(super) fn schema_diff(table: &Schema, query: &Schema) -> Result<(), String> {
    let describe = |s: &Schema| {
        s.fields()
            .iter()
            .map(|f| format!("{} {}", f.name(), f.data_type()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let same = table.fields().len() == query.fields().len()
        && table.fields().iter().all(|f| {
            query.field_with_name(f.name()).is_ok_and(|q| {
                // Delta names list items `element`; Arrow's default is `item`.
                q.data_type().equals_datatype(f.data_type())
                    || (is_string(q.data_type()) && is_string(f.data_type()))
            })
        });
    if same {
        Ok(())
    } else {
        Err(format!(
            "table has ({}), query gives ({})",
            describe(table),
            describe(query)
        ))
    }
}
