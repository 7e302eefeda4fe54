//! A table entry of the pipeline file into a resolved [`TableDef`].

use std::path::Path;

use crate::catalog::{self, TableDef, TableKind, TimeTravel};
use crate::config::TableSpec;
use crate::storage::{Defaults, Location, StorageOptions};

/// Checks one `tables:` entry: one kind, options that fit it, local files that exist (an
/// object store is asked later, before any work: see `Pipeline::register_tables`).
pub(super) fn table_def(
    base: &Path,
    name: &str,
    t: TableSpec,
    defaults: &Defaults,
) -> Result<TableDef, String> {
    let kinds: Vec<(&str, &String)> = [
        ("delta", t.delta.as_ref()),
        ("parquet", t.parquet.as_ref()),
        ("csv", t.csv.as_ref()),
        ("json", t.json.as_ref()),
    ]
    .into_iter()
    .filter_map(|(k, v)| v.map(|v| (k, v)))
    .collect();
    let [(kind, path)] = kinds[..] else {
        return Err(
            "give exactly one of `delta`, `parquet`, `csv`, `json` with the table's path".into(),
        );
    };
    let options = StorageOptions::new(t.storage_options.into_iter().map(|(k, v)| (k, v.0)));
    let location = Location::parse(base, path, defaults, &options)?;
    if kind != "delta" && (t.version.is_some() || t.timestamp.is_some()) {
        return Err("`version` and `timestamp` (time travel) apply to `delta` tables only".into());
    }
    if kind != "csv"
        && (t.has_header.is_some() || t.delimiter.is_some() || t.newlines_in_values.is_some())
    {
        return Err(
            "`has_header`, `delimiter` and `newlines_in_values` apply to `csv` tables only".into(),
        );
    }
    if matches!(kind, "delta" | "parquet") && t.compression.is_some() {
        return Err("`compression` applies to `csv` and `json` tables only".into());
    }
    if let Some(path) = location.local()
        && kind != "delta"
        && catalog::files_of(path)
            .map_err(|e| e.to_string())?
            .is_empty()
    {
        return Err(format!(
            "no {kind} file at `{}`; check the path",
            path.display()
        ));
    }
    let compression = t
        .compression
        .unwrap_or_else(|| catalog::compression_from_extension(&location.to_string()));
    let kind = match kind {
        "delta" => {
            let at = match (t.version, t.timestamp) {
                (Some(_), Some(_)) => return Err("give `version` or `timestamp`, not both".into()),
                (Some(v), None) if v < 0 => {
                    return Err(format!("`version: {v}` must be 0 or more"));
                }
                (Some(v), None) => Some(TimeTravel::Version(v.unsigned_abs())),
                (None, Some(ts)) => {
                    chrono::DateTime::parse_from_rfc3339(&ts).map_err(|e| {
                        format!("`timestamp: {ts}` is not RFC 3339 (2026-01-31T12:00:00Z): {e}")
                    })?;
                    Some(TimeTravel::Timestamp(ts))
                }
                (None, None) => None,
            };
            if let Some(path) = location.local()
                && at.is_some()
                && !catalog::has_delta_log(path)
            {
                return Err(format!(
                    "time travel needs an existing Delta table, and `{}` has no _delta_log",
                    path.display()
                ));
            }
            TableKind::Delta { at }
        }
        "parquet" => TableKind::Parquet,
        "csv" => {
            let delimiter = t.delimiter.unwrap_or(',');
            if !delimiter.is_ascii() {
                return Err(format!(
                    "`delimiter: {delimiter}` must be one ASCII character"
                ));
            }
            TableKind::Csv {
                has_header: t.has_header.unwrap_or(true),
                delimiter: delimiter as u8,
                newlines_in_values: t.newlines_in_values.unwrap_or(true),
                compression,
            }
        }
        _ => TableKind::Json { compression },
    };
    Ok(TableDef {
        name: name.to_string(),
        kind,
        location,
    })
}
