//! Delta commits made by stages: one atomic commit per stage run, tagged with the stage's
//! fingerprint so an unchanged stage is skipped on the next run.

use std::num::NonZeroU64;
use std::sync::{Arc, Mutex};

use datafusion::catalog::streaming::StreamingTable;
use datafusion::execution::TaskContext;
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_plan::SendableRecordBatchStream;
use datafusion::physical_plan::streaming::PartitionStream;
use datafusion::prelude::SessionContext;
use deltalake::DeltaTable;
use deltalake::kernel::Transaction;
use deltalake::kernel::transaction::CommitProperties;
use deltalake::operations::write::SchemaMode;
use deltalake::protocol::SaveMode;
use futures::StreamExt;
use serde_json::{Value, json};

use crate::catalog::TableDef;
use crate::config::WriteMode;
use crate::error::{Error, Result};

/// Key of lakeml's entry in each commit's `commitInfo`.
const COMMIT_KEY: &str = "lakeml";

/// Data files are cut at this size, so a stage's memory stays bounded whatever the table size.
const TARGET_FILE_BYTES: u64 = 64 << 20;

/// What lakeml records in the commits it makes.
#[derive(Debug, Clone)]
pub(crate) struct CommitTag {
    pub pipeline: String,
    pub stage: String,
    pub fingerprint: String,
    /// Stage-specific facts (e.g. the label names of a tokenized table).
    pub extra: Value,
}

/// The latest commit of a table, as lakeml needs it.
#[derive(Debug)]
pub(crate) struct LastCommit {
    pub version: u64,
    /// lakeml's entry, if lakeml made the commit.
    pub tag: Option<Value>,
    pub rows_added: Option<u64>,
}

/// The latest version of a stage's target table, or `None` when a stage will create it.
pub(crate) async fn open_target(def: &TableDef) -> Result<Option<DeltaTable>> {
    if def.delta_exists().await? {
        Ok(Some(def.open_delta(None).await?))
    } else {
        Ok(None)
    }
}

/// Reads the latest commit of `table`.
pub(crate) async fn last_commit(table: &DeltaTable) -> Result<Option<LastCommit>> {
    let Some(version) = table.version() else {
        return Ok(None);
    };
    let mut history = table.history(Some(1));
    let info = match history.next().await {
        Some(info) => info.map_err(|e| Error::delta("reading the table's history", e))?,
        None => return Ok(None),
    };
    let rows_added = info
        .info
        .get("operationMetrics")
        .and_then(|m| m.get("num_added_rows"))
        .and_then(Value::as_u64);
    Ok(Some(LastCommit {
        version,
        tag: info.info.get(COMMIT_KEY).cloned(),
        rows_added,
    }))
}

impl LastCommit {
    /// True when lakeml made this commit from exactly these inputs and settings.
    pub(crate) fn matches(&self, fingerprint: &str) -> bool {
        self.tag
            .as_ref()
            .and_then(|t| t.get("fingerprint"))
            .and_then(Value::as_str)
            == Some(fingerprint)
    }
}

/// The version the app transaction `app_id` last recorded in `table`, if any.
pub(crate) async fn txn_version(table: &DeltaTable, app_id: &str) -> Result<Option<i64>> {
    table
        .snapshot()
        .map_err(|e| Error::delta("reading the table's state", e))?
        .transaction_version(table.log_store().as_ref(), app_id)
        .await
        .map_err(|e| Error::delta("reading the table's app transactions", e))
}

/// lakeml's entry in the latest of the last `depth` commits whose entry says `key = value`.
pub(crate) async fn find_commit(
    table: &DeltaTable,
    depth: usize,
    key: &str,
    value: &str,
) -> Result<Option<Value>> {
    let mut history = table.history(Some(depth));
    while let Some(info) = history.next().await {
        let info = info.map_err(|e| Error::delta("reading the table's history", e))?;
        if let Some(tag) = info.info.get(COMMIT_KEY)
            && tag
                .pointer(&format!("/extra/{key}"))
                .and_then(Value::as_str)
                == Some(value)
        {
            return Ok(Some(tag.clone()));
        }
    }
    Ok(None)
}

/// True when `e` says another writer committed to the table first, in a way this commit
/// cannot be reconciled with (the same job, the same files, or the table's creation).
pub(crate) fn is_conflict(e: &deltalake::DeltaTableError) -> bool {
    use deltalake::kernel::transaction::TransactionError;
    matches!(
        e,
        deltalake::DeltaTableError::Transaction {
            source: TransactionError::CommitConflict(_)
                | TransactionError::VersionAlreadyExists(_)
                | TransactionError::MaxCommitAttempts(_)
        }
    )
}

/// Writes `stream` to the Delta table `def` (opened as `target`, or created) in one commit.
///
/// Nothing is visible to readers until the commit: a failed or killed run leaves data files
/// that no version references, and the table at its last committed version.
pub(crate) async fn write_stream(
    ctx: &SessionContext,
    def: &TableDef,
    target: Option<DeltaTable>,
    stream: SendableRecordBatchStream,
    mode: WriteMode,
    tag: &CommitTag,
    txn: Option<Transaction>,
) -> Result<DeltaTable> {
    let plan = stream_plan(ctx, stream)?;
    let creating = target.is_none();
    let table = match target {
        Some(table) => table,
        None => {
            if let Some(path) = def.location.local() {
                std::fs::create_dir_all(path)
                    .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
            }
            // Not loaded, even if another writer has created the table since: this commit
            // then conflicts with theirs instead of silently building on rows it never saw.
            def.delta_builder()?
                .build()
                .map_err(|e| Error::delta(format!("table `{}`", def.name), e))?
        }
    };
    let (save, schema_mode) = match mode {
        WriteMode::Create => (SaveMode::ErrorIfExists, None),
        WriteMode::Append => (SaveMode::Append, None),
        // Overwrite replaces the rows and the schema; old versions keep theirs.
        WriteMode::Overwrite => (SaveMode::Overwrite, Some(SchemaMode::Overwrite)),
    };
    let metadata = json!({
        "pipeline": tag.pipeline,
        "stage": tag.stage,
        "fingerprint": tag.fingerprint,
        "extra": tag.extra,
        "lakeml_version": env!("CARGO_PKG_VERSION"),
    });
    let mut properties =
        CommitProperties::default().with_metadata([(COMMIT_KEY.to_string(), metadata)]);
    if let Some(txn) = txn {
        properties = properties.with_application_transaction(txn);
    }
    if creating {
        // delta-rs 1.1 retries a create that lost the race for version 0 on top of the
        // winner's commit without checking it for conflicts (not even the txn), which would
        // silently add rows the winner already has. A create gets one attempt instead.
        properties = properties.with_max_retries(0);
    }
    let mut builder = table
        .write(Vec::new())
        .with_input_plan(plan)
        .with_session_state(Arc::new(ctx.state()))
        .with_save_mode(save)
        .with_table_name(def.name.clone())
        .with_target_file_size(NonZeroU64::new(TARGET_FILE_BYTES))
        .with_commit_properties(properties);
    if let Some(schema_mode) = schema_mode {
        builder = builder.with_schema_mode(schema_mode);
    }
    builder
        .await
        .map_err(|e| Error::delta(format!("writing table `{}`", def.name), e))
}

/// A one-shot stream as a table, so a stage's output stream can be planned and written by
/// DataFusion and delta-rs like any query.
struct OnceStream {
    schema: arrow::datatypes::SchemaRef,
    stream: Mutex<Option<SendableRecordBatchStream>>,
}

impl std::fmt::Debug for OnceStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnceStream")
            .field("schema", &self.schema)
            .finish()
    }
}

impl PartitionStream for OnceStream {
    fn schema(&self) -> &arrow::datatypes::SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let taken = self.stream.lock().map(|mut s| s.take()).ok().flatten();
        taken.unwrap_or_else(|| {
            let err = datafusion::error::DataFusionError::Internal(
                "a stage's output stream was executed twice".into(),
            );
            Box::pin(
                datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(
                    self.schema.clone(),
                    futures::stream::once(async move { Err(err) }),
                ),
            )
        })
    }
}

/// Wraps a record batch stream as a logical plan.
fn stream_plan(ctx: &SessionContext, stream: SendableRecordBatchStream) -> Result<LogicalPlan> {
    let schema = stream.schema();
    let part = Arc::new(OnceStream {
        schema: schema.clone(),
        stream: Mutex::new(Some(stream)),
    });
    let table = StreamingTable::try_new(schema, vec![part])
        .map_err(|e| Error::engine("stage output", e))?;
    let df = ctx
        .read_table(Arc::new(table))
        .map_err(|e| Error::engine("stage output", e))?;
    Ok(df.into_unoptimized_plan())
}
