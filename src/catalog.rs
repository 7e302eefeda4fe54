//! Registers a pipeline's tables in one DataFusion session and says what each one is.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::datasource::MemTable;
use datafusion::datasource::file_format::file_compression_type::FileCompressionType;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{
    CsvReadOptions, JsonReadOptions, ParquetReadOptions, SessionConfig, SessionContext,
};
use deltalake::DeltaTable;
use deltalake::delta_datafusion::planner::DeltaPlanner;
use url::Url;

use crate::config::Compression;
use crate::error::{Error, Result};

/// A table as resolved from the pipeline file.
#[derive(Debug, Clone)]
pub(crate) struct TableDef {
    pub name: String,
    pub kind: TableKind,
    /// Absolute path (a file, a directory or a glob for file tables).
    pub path: PathBuf,
}

#[derive(Debug, Clone)]
pub(crate) enum TableKind {
    Delta {
        at: Option<TimeTravel>,
    },
    Parquet,
    Csv {
        has_header: bool,
        delimiter: u8,
        newlines_in_values: bool,
        compression: Compression,
    },
    Json {
        compression: Compression,
    },
}

#[derive(Debug, Clone)]
pub(crate) enum TimeTravel {
    Version(u64),
    Timestamp(String),
}

impl TableDef {
    pub(crate) fn is_delta(&self) -> bool {
        matches!(self.kind, TableKind::Delta { .. })
    }

    /// The table's URL for deltalake (local paths only for now).
    pub(crate) fn url(&self) -> Result<Url> {
        Url::from_directory_path(&self.path).map_err(|()| {
            Error::Data(format!(
                "table `{}`: `{}` is not an absolute local path",
                self.name,
                self.path.display()
            ))
        })
    }

    /// Registers the table in `ctx` and returns what identifies the data it reads now
    /// (a Delta version, or the files' sizes and modification times), for fingerprints.
    pub(crate) async fn register(&self, ctx: &SessionContext) -> Result<String> {
        let path = self.path.to_string_lossy().into_owned();
        let engine = |e| Error::engine(format!("table `{}` ({path})", self.name), e);
        match &self.kind {
            TableKind::Delta { at } => {
                let table = self.open_delta(at.as_ref()).await?;
                let version = table.version().map_or("none".into(), |v| v.to_string());
                let provider = table.table_provider().await.map_err(engine)?;
                table
                    .update_datafusion_session(&ctx.state())
                    .map_err(|e| Error::delta(format!("table `{}`", self.name), e))?;
                ctx.deregister_table(self.name.as_str()).map_err(engine)?;
                ctx.register_table(self.name.as_str(), provider)
                    .map_err(engine)?;
                Ok(format!("delta:{}@{version}", self.url()?))
            }
            TableKind::Parquet => {
                let opts = ParquetReadOptions::default().file_extension(extension_of(&self.path));
                ctx.register_parquet(self.name.as_str(), &path, opts)
                    .await
                    .map_err(engine)?;
                file_identity(&self.path)
            }
            TableKind::Csv {
                has_header,
                delimiter,
                newlines_in_values,
                compression,
            } => {
                let schema = infer_csv_schema(&self.path, *has_header, *delimiter, *compression)
                    .map_err(|m| Error::Data(format!("table `{}` ({path}): {m}", self.name)))?;
                let opts = CsvReadOptions::new()
                    .schema(&schema)
                    .has_header(*has_header)
                    .delimiter(*delimiter)
                    .newlines_in_values(*newlines_in_values)
                    .file_extension(extension_of(&self.path))
                    .file_compression_type(compression_type(*compression));
                ctx.register_csv(self.name.as_str(), &path, opts)
                    .await
                    .map_err(engine)?;
                file_identity(&self.path)
            }
            TableKind::Json { compression } => {
                let opts = JsonReadOptions::default()
                    .file_extension(extension_of(&self.path))
                    .file_compression_type(compression_type(*compression));
                ctx.register_json(self.name.as_str(), &path, opts)
                    .await
                    .map_err(engine)?;
                file_identity(&self.path)
            }
        }
    }

    /// Opens the Delta table at its pinned version (or the latest).
    pub(crate) async fn open_delta(&self, at: Option<&TimeTravel>) -> Result<DeltaTable> {
        let url = self.url()?;
        let ctx = |what: &str| format!("table `{}`: cannot open {what} of {}", self.name, url);
        match at {
            None => deltalake::open_table(url.clone())
                .await
                .map_err(|e| Error::delta(ctx("the Delta table"), e)),
            Some(TimeTravel::Version(v)) => deltalake::open_table_with_version(url.clone(), *v)
                .await
                .map_err(|e| Error::delta(ctx(&format!("version {v}")), e)),
            Some(TimeTravel::Timestamp(ts)) => deltalake::open_table_with_ds(url.clone(), ts)
                .await
                .map_err(|e| Error::delta(ctx(&format!("the version at {ts}")), e)),
        }
    }
}

/// A SQL session that can also plan delta-rs writes (its `DeltaPlanner` handles the write
/// plan's custom nodes). Identifiers keep DataFusion's usual rules (unquoted lower-cased).
pub(crate) fn session() -> SessionContext {
    let config = SessionConfig::new().with_information_schema(true);
    let state = SessionStateBuilder::new()
        .with_default_features()
        .with_config(config)
        .with_query_planner(DeltaPlanner::new())
        .build();
    SessionContext::new_with_state(state)
}

/// Registers an empty table with `schema` under `name`: how validation sees a table that an
/// earlier stage will write but that does not exist yet.
pub(crate) fn register_planned(
    ctx: &SessionContext,
    name: &str,
    schema: arrow::datatypes::SchemaRef,
) -> Result<()> {
    let table = MemTable::try_new(schema, vec![vec![]])
        .map_err(|e| Error::engine(format!("table `{name}`"), e))?;
    ctx.deregister_table(name)
        .map_err(|e| Error::engine(format!("table `{name}`"), e))?;
    ctx.register_table(name, Arc::new(table))
        .map_err(|e| Error::engine(format!("table `{name}`"), e))?;
    Ok(())
}

/// True when `path` holds a Delta table (a `_delta_log` directory).
pub(crate) fn delta_exists(path: &Path) -> bool {
    path.join("_delta_log").is_dir()
}

/// The listing extension DataFusion filters on: the file's own suffix for a single file
/// (so `x.csv.bz2` or `x.txt` are read), the kind's usual one for directories and globs.
fn extension_of(path: &Path) -> &str {
    if path.is_file() {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        match name.find('.') {
            Some(i) => &name[i..],
            None => "",
        }
    } else {
        ""
    }
}

/// Rows read to infer a CSV file's column types.
const CSV_INFER_ROWS: usize = 1000;

/// Infers a CSV table's schema from its first file, read as one stream.
///
/// DataFusion's own inference parses the byte stream chunk by chunk, so a quoted value with a
/// line break that straddles two chunks fails (as in the Rotten Tomatoes corpus).
fn infer_csv_schema(
    path: &Path,
    has_header: bool,
    delimiter: u8,
    compression: Compression,
) -> Result<arrow::datatypes::Schema, String> {
    let files = files_of(path).map_err(|e| e.to_string())?;
    let first = files.first().ok_or("no CSV file found")?;
    let file = std::fs::File::open(first).map_err(|e| format!("{}: {e}", first.display()))?;
    let reader = compression_type(compression)
        .convert_read(std::io::BufReader::new(file))
        .map_err(|e| format!("{}: {e}", first.display()))?;
    arrow::csv::reader::Format::default()
        .with_header(has_header)
        .with_delimiter(delimiter)
        .infer_schema(reader, Some(CSV_INFER_ROWS))
        .map(|(schema, _)| schema)
        .map_err(|e| {
            let hint = if e.to_string().contains("UTF-8") {
                "; fix the file's encoding, or store it as Parquet with a binary text column \
                 and choose an `on_invalid_utf8` policy"
            } else {
                ""
            };
            format!(
                "{}: cannot infer the CSV columns: {e}{hint}",
                first.display()
            )
        })
}

fn compression_type(c: Compression) -> FileCompressionType {
    match c {
        Compression::None => FileCompressionType::UNCOMPRESSED,
        Compression::Gzip => FileCompressionType::GZIP,
        Compression::Bzip2 => FileCompressionType::BZIP2,
        Compression::Xz => FileCompressionType::XZ,
        Compression::Zstd => FileCompressionType::ZSTD,
    }
}

/// Compression from a file name's last extension.
pub(crate) fn compression_from_extension(path: &Path) -> Compression {
    match path.extension().and_then(|e| e.to_str()) {
        Some("gz") => Compression::Gzip,
        Some("bz2") => Compression::Bzip2,
        Some("xz") => Compression::Xz,
        Some("zst") => Compression::Zstd,
        _ => Compression::None,
    }
}

/// The files a file table reads, sorted: the path itself, every file under a directory, or
/// the matches of a glob.
pub(crate) fn files_of(path: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let text = path.to_string_lossy();
    if text.contains(['*', '?', '[']) {
        let matches =
            glob::glob(&text).map_err(|e| Error::Data(format!("bad glob `{text}`: {e}")))?;
        files.extend(matches.filter_map(|m| m.ok()).filter(|p| p.is_file()));
    } else if path.is_dir() {
        walk(path, &mut files).map_err(|e| Error::io(format!("listing {text}"), e))?;
    } else if path.is_file() {
        files.push(path.to_path_buf());
    }
    files.sort();
    Ok(files)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(['.', '_']));
        if hidden {
            continue;
        } else if path.is_dir() {
            walk(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// Identity of a file table's data: each file's path, size and modification time.
fn file_identity(path: &Path) -> Result<String> {
    let mut id = String::from("files:");
    for file in files_of(path)? {
        let meta = std::fs::metadata(&file)
            .map_err(|e| Error::io(format!("reading {}", file.display()), e))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        id.push_str(&format!("{}:{}:{mtime};", file.display(), meta.len()));
    }
    Ok(id)
}
