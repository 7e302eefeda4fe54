//! Registers a pipeline's tables in one DataFusion session and says what each one is.
//! Tables live on local disk or in an object store ([`crate::storage`]).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::datasource::file_format::file_compression_type::FileCompressionType;
use datafusion::datasource::{MemTable, source_as_provider};
use datafusion::execution::SessionStateBuilder;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::{
    CsvReadOptions, JsonReadOptions, ParquetReadOptions, SessionConfig, SessionContext,
};
use deltalake::delta_datafusion::planner::DeltaPlanner;
use deltalake::{DeltaTable, DeltaTableBuilder};
use futures::TryStreamExt;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};
use url::Url;

use crate::config::Compression;
use crate::error::{Error, Result};
use crate::storage::{Location, Remote};

/// A table as resolved from the pipeline file.
#[derive(Debug, Clone)]
pub(crate) struct TableDef {
    pub name: String,
    pub kind: TableKind,
    /// Where it lives: an absolute path or an object-store URL (a file, a directory or a
    /// glob for file tables).
    pub location: Location,
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

    /// The table's root URL for deltalake.
    pub(crate) fn url(&self) -> Result<Url> {
        self.location
            .dir_url()
            .map_err(|m| Error::Data(format!("table `{}`: {m}", self.name)))
    }

    /// The local path of a file table that `table_updated:` watches. The plan refuses
    /// object-store file tables there (`plan::jobs`), so this never gives the empty path it
    /// would for one; anything else asks `location.local()`.
    pub(crate) fn local_dir(&self) -> &Path {
        self.location.local().unwrap_or(Path::new(""))
    }

    /// A Delta table handle for this location, with its storage options, not loaded.
    pub(crate) fn delta_builder(&self) -> Result<DeltaTableBuilder> {
        DeltaTableBuilder::from_url(self.url()?)
            .map(|b| b.with_storage_options(self.location.delta_options()))
            .map_err(|e| Error::delta(format!("table `{}`", self.name), e))
    }

    /// True when a Delta table is there (its `_delta_log` holds a commit or checkpoint).
    pub(crate) async fn delta_exists(&self) -> Result<bool> {
        match &self.location {
            Location::Local(path) => Ok(has_delta_log(path)),
            Location::Remote(_) => self
                .delta_builder()?
                .build_storage()
                .map_err(|e| Error::delta(format!("table `{}`", self.name), e))?
                .is_delta_table_location()
                .await
                .map_err(|e| self.storage_error(e)),
        }
    }

    /// A failed object-store request, said for people (which bucket, which credentials).
    fn storage_error(&self, e: deltalake::DeltaTableError) -> Error {
        match (&self.location, &e) {
            (Location::Remote(r), deltalake::DeltaTableError::ObjectStore { source }) => {
                Error::Data(format!(
                    "table `{}`: {}",
                    self.name,
                    crate::storage::explain(r, source)
                ))
            }
            _ => Error::delta(format!("table `{}`", self.name), e),
        }
    }

    /// Registers the table in `ctx` and returns what identifies the data it reads now
    /// (a Delta version, or the files' sizes and modification times), for fingerprints.
    pub(crate) async fn register(&self, ctx: &SessionContext) -> Result<String> {
        let path = self.location.to_string();
        let engine = |e| Error::engine(format!("table `{}` ({path})", self.name), e);
        let fail = |m: String| Error::Data(format!("table `{}`: {m}", self.name));
        // A remote file table's store is built once: registered for DataFusion's scans, and
        // used here to list the objects and read a CSV's first one.
        let (files, store) = match &self.location {
            _ if self.is_delta() => (Vec::new(), None),
            Location::Local(path) => (local_files(path)?, None),
            Location::Remote(r) => {
                let store = r.store().map_err(fail)?;
                ctx.register_object_store(&r.store_url(), store.clone());
                let files = remote_files(r, store.as_ref()).await.map_err(fail)?;
                (files, Some(store))
            }
        };
        if !self.is_delta() && files.is_empty() {
            return Err(fail(format!("no file at `{path}`; check the path")));
        }
        let extension = self.extension(&files);
        // DataFusion lists a local directory or glob itself; in an object store it reads
        // exactly the objects listed here (its URL parser takes no globs), which are also
        // the ones the identity names.
        let remote: Option<Vec<String>> = self
            .location
            .remote()
            .map(|_| files.iter().map(|f| f.name.clone()).collect());
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
                let opts = ParquetReadOptions::default().file_extension(&extension);
                match remote {
                    None => ctx.register_parquet(self.name.as_str(), &path, opts).await,
                    Some(urls) => listing(ctx, &self.name, ctx.read_parquet(urls, opts).await),
                }
                .map_err(engine)?;
                Ok(file_identity(&files))
            }
            TableKind::Csv {
                has_header,
                delimiter,
                newlines_in_values,
                compression,
            } => {
                let first = self.read_start(&files[0], store.as_deref()).await?;
                let schema =
                    infer_csv_schema(&files[0].name, first, *has_header, *delimiter, *compression)
                        .map_err(|m| Error::Data(format!("table `{}` ({path}): {m}", self.name)))?;
                let opts = CsvReadOptions::new()
                    .schema(&schema)
                    .has_header(*has_header)
                    .delimiter(*delimiter)
                    .newlines_in_values(*newlines_in_values)
                    .file_extension(&extension)
                    .file_compression_type(compression_type(*compression));
                match remote {
                    None => ctx.register_csv(self.name.as_str(), &path, opts).await,
                    Some(urls) => listing(ctx, &self.name, ctx.read_csv(urls, opts).await),
                }
                .map_err(engine)?;
                Ok(file_identity(&files))
            }
            TableKind::Json { compression } => {
                let opts = JsonReadOptions::default()
                    .file_extension(&extension)
                    .file_compression_type(compression_type(*compression));
                match remote {
                    None => ctx.register_json(self.name.as_str(), &path, opts).await,
                    Some(urls) => listing(ctx, &self.name, ctx.read_json(urls, opts).await),
                }
                .map_err(engine)?;
                Ok(file_identity(&files))
            }
        }
    }

    /// Opens the Delta table at its pinned version (or the latest).
    pub(crate) async fn open_delta(&self, at: Option<&TimeTravel>) -> Result<DeltaTable> {
        let url = self.url()?;
        let ctx = |what: &str| format!("table `{}`: cannot open {what} of {}", self.name, url);
        let builder = self.delta_builder()?;
        let (builder, what) = match at {
            None => (builder, "the Delta table".to_string()),
            Some(TimeTravel::Version(v)) => (builder.with_version(*v), format!("version {v}")),
            Some(TimeTravel::Timestamp(ts)) => (
                builder
                    .with_datestring(ts)
                    .map_err(|e| Error::delta(ctx(&format!("the version at {ts}")), e))?,
                format!("the version at {ts}"),
            ),
        };
        builder.load().await.map_err(|e| match e {
            deltalake::DeltaTableError::ObjectStore { .. } => self.storage_error(e),
            e => Error::delta(ctx(&what), e),
        })
    }

    /// The listing extension DataFusion filters on: the file's own suffix for a single file
    /// (so `x.csv.bz2` or `x.txt` are read), the kind's usual one for directories and globs.
    fn extension(&self, files: &[FileEntry]) -> String {
        let single = match &self.location {
            Location::Local(path) => path.is_file(),
            Location::Remote(r) => {
                files.len() == 1 && r.key().is_ok_and(|k| files[0].object_key() == Some(&k))
            }
        };
        let name = files.first().map(|f| f.name.as_str()).unwrap_or_default();
        let name = name.rsplit('/').next().unwrap_or_default();
        match (single, name.find('.')) {
            (true, Some(i)) => name[i..].to_string(),
            _ => String::new(),
        }
    }

    /// The start of a file (all of it, up to [`CSV_INFER_BYTES`]), for schema inference.
    async fn read_start(
        &self,
        file: &FileEntry,
        store: Option<&dyn ObjectStore>,
    ) -> Result<Box<dyn Read + Send>> {
        let fail = |m: String| Error::Data(format!("table `{}`: {}: {m}", self.name, file.name));
        match (&self.location, store, &file.object) {
            (Location::Remote(r), Some(store), Some(meta)) => {
                let end = meta.size.min(CSV_INFER_BYTES);
                let bytes = store
                    .get_range(&meta.location, 0..end)
                    .await
                    .map_err(|e| fail(crate::storage::explain(r, &e)))?;
                Ok(Box::new(std::io::Cursor::new(bytes)))
            }
            _ => {
                let f = std::fs::File::open(&file.name).map_err(|e| fail(e.to_string()))?;
                Ok(Box::new(std::io::BufReader::new(f)))
            }
        }
    }
}

/// Registers the listing table that reads a file table's objects under `name`.
///
/// Not as a view of `ctx.read_parquet(urls)`: DataFusion inlines a view's plan into every
/// query, so a stage's plan would scan DataFusion's unnamed `?table?` instead of `name`, and
/// the stage's fingerprint could not name the table it reads (issue 36).
fn listing(
    ctx: &SessionContext,
    name: &str,
    df: datafusion::error::Result<datafusion::prelude::DataFrame>,
) -> datafusion::error::Result<()> {
    let df = df?;
    let provider = match df.logical_plan() {
        LogicalPlan::TableScan(scan) if scan.filters.is_empty() => {
            source_as_provider(&scan.source)?
        }
        other => {
            return Err(datafusion::error::DataFusionError::Internal(format!(
                "reading table `{name}` planned {} instead of a table scan",
                other.display()
            )));
        }
    };
    ctx.deregister_table(name)?;
    ctx.register_table(name, provider).map(|_| ())
}

/// One file of a file table: its name (a path or a URL), size and version (a modification
/// time or an ETag), which together identify the data it holds.
#[derive(Debug, Clone)]
pub(crate) struct FileEntry {
    pub name: String,
    pub size: u64,
    pub version: String,
    /// The object's metadata, in an object store.
    object: Option<ObjectMeta>,
}

impl FileEntry {
    fn object_key(&self) -> Option<&object_store::path::Path> {
        self.object.as_ref().map(|m| &m.location)
    }
}

/// The files of a local file table, sorted: names, sizes and modification times.
fn local_files(path: &Path) -> Result<Vec<FileEntry>> {
    files_of(path)?
        .into_iter()
        .map(|p| {
            let meta = std::fs::metadata(&p)
                .map_err(|e| Error::io(format!("reading {}", p.display()), e))?;
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            Ok(FileEntry {
                name: p.to_string_lossy().into_owned(),
                size: meta.len(),
                version: mtime.to_string(),
                object: None,
            })
        })
        .collect()
}

/// The objects a remote file table reads, sorted: the object itself, every visible object
/// under a prefix, or the matches of a glob.
async fn remote_files(r: &Remote, store: &dyn ObjectStore) -> Result<Vec<FileEntry>, String> {
    let key = r.key()?;
    let explain = |e: object_store::Error| crate::storage::explain(r, &e);
    let text = key.as_ref().to_string();
    let pattern = if text.contains(['*', '?', '[']) {
        Some(glob::Pattern::new(&text).map_err(|e| format!("bad glob `{text}`: {e}"))?)
    } else {
        match store.head(&key).await {
            Ok(meta) if !r.url().path().ends_with('/') => {
                return Ok(vec![entry(r, meta)]);
            }
            Ok(_) | Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => return Err(explain(e)),
        }
    };
    let prefix = r.list_prefix()?;
    let objects: Vec<ObjectMeta> = store
        .list(Some(&prefix))
        .try_collect()
        .await
        .map_err(explain)?;
    let mut files: Vec<FileEntry> = objects
        .into_iter()
        .filter(|m| match &pattern {
            Some(p) => p.matches(m.location.as_ref()),
            None => m
                .location
                .prefix_match(&prefix)
                .is_some_and(|mut parts| !parts.any(|p| p.as_ref().starts_with(['.', '_']))),
        })
        .map(|m| entry(r, m))
        .collect();
    files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(files)
}

fn entry(r: &Remote, meta: ObjectMeta) -> FileEntry {
    let mut url = r.store_url();
    url.set_path(meta.location.as_ref());
    FileEntry {
        name: url.to_string(),
        size: meta.size,
        version: meta
            .e_tag
            .clone()
            .unwrap_or_else(|| meta.last_modified.to_rfc3339()),
        object: Some(meta),
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
    let ctx = SessionContext::new_with_state(state);
    crate::vector::register(&ctx);
    ctx
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

/// True when the local directory `path` holds a Delta table (a `_delta_log` directory).
pub(crate) fn has_delta_log(path: &Path) -> bool {
    path.join("_delta_log").is_dir()
}

/// Rows read to infer a CSV file's column types.
const CSV_INFER_ROWS: usize = 1000;

/// At most this much of a remote CSV file is fetched to infer its column types.
const CSV_INFER_BYTES: u64 = 16 << 20;

/// Infers a CSV table's schema from its first file, read as one stream.
///
/// DataFusion's own inference parses the byte stream chunk by chunk, so a quoted value with a
/// line break that straddles two chunks fails (as in the Rotten Tomatoes corpus).
fn infer_csv_schema(
    first: &str,
    file: Box<dyn Read + Send>,
    has_header: bool,
    delimiter: u8,
    compression: Compression,
) -> Result<arrow::datatypes::Schema, String> {
    let reader = compression_type(compression)
        .convert_read(file)
        .map_err(|e| format!("{first}: {e}"))?;
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
            format!("{first}: cannot infer the CSV columns: {e}{hint}")
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

/// Compression from a file name's (or URL's) last extension.
pub(crate) fn compression_from_extension(name: &str) -> Compression {
    match Path::new(name).extension().and_then(|e| e.to_str()) {
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

/// Identity of a file table's data: each file's name, size and version (a modification time
/// or an ETag).
fn file_identity(files: &[FileEntry]) -> String {
    let mut id = String::from("files:");
    for f in files {
        id.push_str(&format!("{}:{}:{};", f.name, f.size, f.version));
    }
    id
}
