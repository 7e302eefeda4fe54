//! The run history: a Delta table, on local disk or in an object store, with one row per
//! event of a run attempt (its start as RUNNING, its lease renewals, then its end),
//! appended, never rewritten. Starting an attempt claims its tick with a Delta app
//! transaction in the same commit, so of two schedulers racing for one tick exactly one
//! commit succeeds.
//!
//! A RUNNING row holds a lease (`lease_until`) that the process running the attempt renews;
//! any scheduler may end an attempt whose lease ran out ([`holder`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use chrono::{DateTime, Utc};
use deltalake::DeltaTable;
use deltalake::kernel::Transaction;
use deltalake::kernel::transaction::CommitProperties;
use deltalake::operations::write::SchemaMode;
use deltalake::protocol::SaveMode;
use serde::Serialize;

use crate::catalog::{self, TableDef};
use crate::delta;
use crate::error::{Error, Result};

/// Attempt numbers take the low bits of a claim's txn version.
const ATTEMPT_BITS: u32 = 4;

/// The state of an attempt, as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RunState {
    Running,
    Succeeded,
    Failed,
    TimedOut,
    Canceled,
    Skipped,
}

impl RunState {
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Running => "RUNNING",
            RunState::Succeeded => "SUCCEEDED",
            RunState::Failed => "FAILED",
            RunState::TimedOut => "TIMED_OUT",
            RunState::Canceled => "CANCELED",
            RunState::Skipped => "SKIPPED",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        [
            RunState::Running,
            RunState::Succeeded,
            RunState::Failed,
            RunState::TimedOut,
            RunState::Canceled,
            RunState::Skipped,
        ]
        .into_iter()
        .find(|s| s.as_str() == text)
    }
}

/// One row of the run history.
#[derive(Debug, Clone, Serialize)]
pub struct RunRecord {
    /// Shared by a tick's attempts.
    pub run_id: String,
    pub job: String,
    /// `cron`, `every`, `table_updated` or `manual` (retries keep their run's).
    pub trigger: String,
    /// The tick's time: the cron or interval time, or the newest data change that fired it.
    pub scheduled_for: DateTime<Utc>,
    /// The tick's epoch (ms), the number its claim is made with.
    pub tick: i64,
    pub attempt: i32,
    pub state: RunState,
    /// Why a run was skipped, or what kind of failure it was (`interrupted`, `exit 1`).
    pub reason: Option<String>,
    pub started_at: Option<DateTime<Utc>>,
    pub ended_at: Option<DateTime<Utc>>,
    pub error: Option<String>,
    /// A failed attempt that will be retried: when (a restarted scheduler keeps to it).
    pub retry_at: Option<DateTime<Utc>>,
    /// The stage reports (JSON array) of a finished attempt.
    pub reports: Option<serde_json::Value>,
    /// Each Delta table's version when the attempt started (JSON object).
    pub input_versions: Option<serde_json::Value>,
    /// `host:pid` of the process that ran it.
    pub host: String,
    pub recorded_at: DateTime<Utc>,
    /// A RUNNING row: until when its process holds the attempt, unless it renews the lease.
    /// `None` in rows of older lakeml versions and in end rows.
    pub lease_until: Option<DateTime<Utc>>,
}

impl RunRecord {
    /// The same attempt in a new state, recorded now.
    pub(crate) fn ended(&self, state: RunState, reason: Option<String>) -> Self {
        let now = Utc::now();
        Self {
            state,
            reason,
            ended_at: Some(now),
            recorded_at: now,
            retry_at: None,
            lease_until: None,
            ..self.clone()
        }
    }

    /// The same RUNNING attempt with its lease renewed for `lease` from now.
    pub(crate) fn renewed(&self, lease: std::time::Duration) -> Self {
        let now = Utc::now();
        Self {
            recorded_at: now,
            lease_until: Some(now + lease),
            ..self.clone()
        }
    }
}

/// This process, as history rows name it: `host:pid`. `LAKEML_HOST` overrides the host
/// name, for containers that share one and for tests.
pub(crate) fn this_host() -> String {
    let host = std::env::var("LAKEML_HOST")
        .ok()
        .filter(|h| !h.trim().is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .ok()
        })
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into());
    format!("{}:{}", host.trim(), std::process::id())
}

/// True when `host` (as [`this_host`] wrote it) is a process on this machine that is still
/// alive; false when it is dead or on another machine (`None`: cannot tell).
pub(crate) fn host_alive(host: &str) -> Option<bool> {
    let (name, pid) = host.rsplit_once(':')?;
    let me = this_host();
    let (my_name, _) = me.rsplit_once(':')?;
    if name != my_name {
        return None;
    }
    let pid: u32 = pid.parse().ok()?;
    Some(std::path::Path::new(&format!("/proc/{pid}")).exists())
}

/// Who holds an attempt whose latest row is RUNNING, as this process sees it at some time.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Holder {
    /// This process, a live one of this machine, or one whose lease has not run out.
    Alive,
    /// A process of this machine that is gone.
    Gone,
    /// Another process, whose lease ran out at this time.
    Expired(DateTime<Utc>),
    /// A process of another machine, in a row without a lease (an older lakeml wrote it).
    Unknown,
}

/// Who holds the RUNNING attempt `r` at `now`. A lease that ran out ends the claim of a
/// live process too (it may hang, or its pid may be another's now): that process finds its
/// attempt ended when it next renews, and stops its run.
pub(crate) fn holder(r: &RunRecord, now: DateTime<Utc>) -> Holder {
    if r.host == this_host() {
        return Holder::Alive;
    }
    match (r.lease_until, host_alive(&r.host)) {
        (_, Some(false)) => Holder::Gone,
        (Some(until), _) if until < now => Holder::Expired(until),
        (Some(_), _) | (None, Some(true)) => Holder::Alive,
        (None, None) => Holder::Unknown,
    }
}

/// The txn app id that claims a job's ticks of one trigger kind.
pub(crate) fn app_id(pipeline: &str, job: &str, trigger: &str) -> String {
    format!("lakeml-jobs/{pipeline}/{job}/{trigger}")
}

/// The txn version that claims attempt `attempt` of tick `tick_ms`: increasing in both, so
/// a later tick or a retry always claims above an earlier one.
pub(crate) fn claim_version(tick_ms: i64, attempt: i32) -> i64 {
    (tick_ms << ATTEMPT_BITS) | i64::from(attempt & ((1 << ATTEMPT_BITS) - 1))
}

/// The tick (ms) of a claim's txn version.
pub(crate) fn claimed_tick(version: i64) -> i64 {
    version >> ATTEMPT_BITS
}

fn schema() -> SchemaRef {
    let ts = || DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()));
    Arc::new(Schema::new(vec![
        Field::new("run_id", DataType::Utf8, false),
        Field::new("job", DataType::Utf8, false),
        Field::new("trigger", DataType::Utf8, false),
        Field::new("scheduled_for", ts(), false),
        Field::new("tick", DataType::Int64, false),
        Field::new("attempt", DataType::Int32, false),
        Field::new("state", DataType::Utf8, false),
        Field::new("reason", DataType::Utf8, true),
        Field::new("started_at", ts(), true),
        Field::new("ended_at", ts(), true),
        Field::new("error", DataType::Utf8, true),
        Field::new("retry_at", ts(), true),
        Field::new("reports", DataType::Utf8, true),
        Field::new("input_versions", DataType::Utf8, true),
        Field::new("host", DataType::Utf8, false),
        Field::new("recorded_at", ts(), false),
        Field::new("lease_until", ts(), true),
    ]))
}

fn to_batch(records: &[RunRecord]) -> Result<RecordBatch> {
    let text = |f: &dyn Fn(&RunRecord) -> Option<String>| -> ArrayRef {
        Arc::new(records.iter().map(f).collect::<StringArray>())
    };
    let time = |f: &dyn Fn(&RunRecord) -> Option<DateTime<Utc>>| -> ArrayRef {
        Arc::new(
            records
                .iter()
                .map(|r| f(r).map(|t| t.timestamp_micros()))
                .collect::<TimestampMicrosecondArray>()
                .with_timezone("UTC"),
        )
    };
    let json = |v: &Option<serde_json::Value>| v.as_ref().map(ToString::to_string);
    let columns: Vec<ArrayRef> = vec![
        text(&|r| Some(r.run_id.clone())),
        text(&|r| Some(r.job.clone())),
        text(&|r| Some(r.trigger.clone())),
        time(&|r| Some(r.scheduled_for)),
        Arc::new(records.iter().map(|r| r.tick).collect::<Int64Array>()),
        Arc::new(records.iter().map(|r| r.attempt).collect::<Int32Array>()),
        text(&|r| Some(r.state.as_str().to_string())),
        text(&|r| r.reason.clone()),
        time(&|r| r.started_at),
        time(&|r| r.ended_at),
        text(&|r| r.error.clone()),
        time(&|r| r.retry_at),
        text(&|r| json(&r.reports)),
        text(&|r| json(&r.input_versions)),
        text(&|r| Some(r.host.clone())),
        time(&|r| Some(r.recorded_at)),
        time(&|r| r.lease_until),
    ];
    RecordBatch::try_new(schema(), columns)
        .map_err(|e| Error::Internal(format!("building a run-history row: {e}")))
}

fn from_batch(batch: &RecordBatch, out: &mut Vec<RunRecord>) -> Result<()> {
    let bad = |c: &str| Error::Data(format!("the run history's column `{c}` has the wrong type"));
    // The SQL engine reads strings as views; back to the types the rows were written with.
    // A nullable column that an older lakeml's history lacks (`lease_until`) reads as null.
    let mut columns = Vec::new();
    for field in schema().fields() {
        let column = match batch.column_by_name(field.name()) {
            Some(column) => {
                arrow::compute::cast(column, field.data_type()).map_err(|_| bad(field.name()))?
            }
            None if field.is_nullable() => {
                arrow::array::new_null_array(field.data_type(), batch.num_rows())
            }
            None => return Err(bad(field.name())),
        };
        columns.push(column);
    }
    let batch = &RecordBatch::try_new(schema(), columns).map_err(|_| bad("*"))?;
    let text = |c: &str| {
        batch
            .column_by_name(c)
            .and_then(|a| a.as_any().downcast_ref::<StringArray>())
            .ok_or_else(|| bad(c))
    };
    let time = |c: &str| {
        batch
            .column_by_name(c)
            .and_then(|a| a.as_any().downcast_ref::<TimestampMicrosecondArray>())
            .ok_or_else(|| bad(c))
    };
    let (run_id, job, trigger, state, reason) = (
        text("run_id")?,
        text("job")?,
        text("trigger")?,
        text("state")?,
        text("reason")?,
    );
    let (error, reports, inputs, host) = (
        text("error")?,
        text("reports")?,
        text("input_versions")?,
        text("host")?,
    );
    let (scheduled, started, ended, retry_at, recorded, lease) = (
        time("scheduled_for")?,
        time("started_at")?,
        time("ended_at")?,
        time("retry_at")?,
        time("recorded_at")?,
        time("lease_until")?,
    );
    let tick = batch
        .column_by_name("tick")
        .and_then(|a| a.as_any().downcast_ref::<Int64Array>())
        .ok_or_else(|| bad("tick"))?;
    let attempt = batch
        .column_by_name("attempt")
        .and_then(|a| a.as_any().downcast_ref::<Int32Array>())
        .ok_or_else(|| bad("attempt"))?;
    let opt_text = |a: &StringArray, i: usize| (!a.is_null(i)).then(|| a.value(i).to_string());
    let opt_time = |a: &TimestampMicrosecondArray, i: usize| {
        (!a.is_null(i))
            .then(|| DateTime::from_timestamp_micros(a.value(i)))
            .flatten()
    };
    let opt_json = |a: &StringArray, i: usize| {
        (!a.is_null(i))
            .then(|| serde_json::from_str(a.value(i)).ok())
            .flatten()
    };
    for i in 0..batch.num_rows() {
        let Some(state_value) = RunState::parse(state.value(i)) else {
            continue; // a state a newer lakeml wrote
        };
        out.push(RunRecord {
            run_id: run_id.value(i).to_string(),
            job: job.value(i).to_string(),
            trigger: trigger.value(i).to_string(),
            scheduled_for: opt_time(scheduled, i).unwrap_or_default(),
            tick: tick.value(i),
            attempt: attempt.value(i),
            state: state_value,
            reason: opt_text(reason, i),
            started_at: opt_time(started, i),
            ended_at: opt_time(ended, i),
            error: opt_text(error, i),
            retry_at: opt_time(retry_at, i),
            reports: opt_json(reports, i),
            input_versions: opt_json(inputs, i),
            host: host.value(i).to_string(),
            recorded_at: opt_time(recorded, i).unwrap_or_default(),
            lease_until: opt_time(lease, i),
        });
    }
    Ok(())
}

/// Whether a start was recorded, or another process had claimed the tick first.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Claim {
    Won,
    Taken,
}

/// The run-history table of one pipeline.
#[derive(Debug, Clone)]
pub(crate) struct History {
    pub def: TableDef,
    pub pipeline: String,
}

impl History {
    /// Opens the table, creating it (empty) when missing.
    pub(crate) async fn open(&self) -> Result<DeltaTable> {
        if self.def.delta_exists().await? {
            return self.def.open_delta(None).await;
        }
        if let Some(dir) = self.def.location.local() {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        }
        let fresh = self
            .def
            .delta_builder()?
            .build()
            .map_err(|e| Error::delta(format!("table `{}`", self.def.name), e))?;
        let created = fresh
            .write(vec![RecordBatch::new_empty(schema())])
            .with_save_mode(SaveMode::ErrorIfExists)
            .with_table_name(self.def.name.clone())
            .with_commit_properties(CommitProperties::default().with_max_retries(0))
            .await;
        match created {
            Ok(table) => Ok(table),
            // Another scheduler created it a moment ago.
            Err(_) if self.def.delta_exists().await? => self.def.open_delta(None).await,
            Err(e) => Err(Error::delta(
                format!("creating the run history `{}`", self.def.location),
                e,
            )),
        }
    }

    /// Appends rows in one commit. A history written by an older lakeml gets the columns
    /// added since (schema merge), in the first commit that writes them.
    pub(crate) async fn append(&self, records: &[RunRecord]) -> Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let table = self.open().await?;
        table
            .write(vec![to_batch(records)?])
            .with_save_mode(SaveMode::Append)
            .with_schema_mode(SchemaMode::Merge)
            .await
            .map_err(|e| Error::delta(format!("recording runs in `{}`", self.def.name), e))?;
        Ok(())
    }

    /// Records an attempt's start and claims its tick in one commit: [`Claim::Taken`] when
    /// some process already claimed this tick and attempt (or a later one).
    pub(crate) async fn claim(&self, start: &RunRecord) -> Result<Claim> {
        let app = app_id(&self.pipeline, &start.job, &start.trigger);
        let version = claim_version(start.tick, start.attempt);
        for _ in 0..3 {
            let table = self.open().await?;
            if delta::txn_version(&table, &app)
                .await?
                .is_some_and(|v| v >= version)
            {
                return Ok(Claim::Taken);
            }
            let properties = CommitProperties::default()
                .with_application_transaction(Transaction::new(&app, version));
            let committed = table
                .write(vec![to_batch(std::slice::from_ref(start))?])
                .with_save_mode(SaveMode::Append)
                .with_schema_mode(SchemaMode::Merge)
                .with_commit_properties(properties)
                .await;
            match committed {
                Ok(_) => return Ok(Claim::Won),
                // A concurrent commit with the same app id: look again at who holds it.
                Err(e) if delta::is_conflict(&e) => continue,
                Err(e) => {
                    return Err(Error::delta(
                        format!("claiming a run in `{}`", self.def.name),
                        e,
                    ));
                }
            }
        }
        Ok(Claim::Taken)
    }

    /// The newest tick (ms) claimed for a job's trigger kind in `table` (the history as
    /// [`History::open`] returned it), by any process.
    pub(crate) async fn last_tick(
        &self,
        table: &DeltaTable,
        job: &str,
        trigger: &str,
    ) -> Result<Option<i64>> {
        Ok(
            delta::txn_version(table, &app_id(&self.pipeline, job, trigger))
                .await?
                .map(claimed_tick),
        )
    }

    /// Every row, oldest first.
    pub(crate) async fn read(&self) -> Result<Vec<RunRecord>> {
        self.read_where("TRUE").await
    }

    /// The rows that hold `filter` (SQL), oldest first.
    async fn read_where(&self, filter: &str) -> Result<Vec<RunRecord>> {
        if !self.def.delta_exists().await? {
            return Ok(Vec::new());
        }
        let ctx = catalog::session();
        self.def.register(&ctx).await?;
        let sql = format!(
            "SELECT * FROM \"{}\" WHERE {filter} ORDER BY recorded_at, attempt",
            self.def.name
        );
        let engine = |e| Error::engine("reading the run history", e);
        let batches = ctx
            .sql(&sql)
            .await
            .map_err(engine)?
            .collect()
            .await
            .map_err(engine)?;
        let mut out = Vec::new();
        for batch in &batches {
            from_batch(batch, &mut out)?;
        }
        Ok(out)
    }

    /// Each attempt once, in its latest state, newest first.
    pub(crate) async fn attempts(&self) -> Result<Vec<RunRecord>> {
        Ok(latest_per_attempt(self.read().await?))
    }

    /// One attempt in its latest state (its rows only are read: file statistics prune the
    /// rest).
    pub(crate) async fn attempt(&self, run_id: &str, attempt: i32) -> Result<Option<RunRecord>> {
        let filter = format!(
            "run_id = '{}' AND attempt = {attempt}",
            run_id.replace('\'', "''")
        );
        Ok(latest_per_attempt(self.read_where(&filter).await?)
            .into_iter()
            .next())
    }
}

/// Rows reduced to each attempt's latest, newest first.
pub(crate) fn latest_per_attempt(rows: Vec<RunRecord>) -> Vec<RunRecord> {
    let mut latest: BTreeMap<(String, i32), RunRecord> = BTreeMap::new();
    for row in rows {
        let key = (row.run_id.clone(), row.attempt);
        match latest.get(&key) {
            // A final state wins over RUNNING whatever the clocks say.
            Some(prev) if prev.state != RunState::Running && row.state == RunState::Running => {}
            Some(prev) if prev.recorded_at > row.recorded_at && prev.state != RunState::Running => {
            }
            _ => {
                latest.insert(key, row);
            }
        }
    }
    let mut out: Vec<RunRecord> = latest.into_values().collect();
    out.sort_by(|a, b| {
        (b.started_at.or(Some(b.recorded_at)), b.attempt)
            .cmp(&(a.started_at.or(Some(a.recorded_at)), a.attempt))
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeDelta;

    fn record(run: &str, attempt: i32, state: RunState, at: i64) -> RunRecord {
        let t = DateTime::from_timestamp(at, 0).unwrap_or_default();
        RunRecord {
            run_id: run.into(),
            job: "j".into(),
            trigger: "cron".into(),
            scheduled_for: t,
            tick: at * 1000,
            attempt,
            state,
            reason: None,
            started_at: Some(t),
            ended_at: None,
            error: None,
            retry_at: None,
            reports: Some(serde_json::json!([{"stage": "s"}])),
            input_versions: None,
            host: "h:1".into(),
            recorded_at: t,
            lease_until: None,
        }
    }

    #[test]
    fn rows_round_trip_through_arrow() {
        let rows = vec![
            record("a", 1, RunState::Running, 100),
            record("a", 1, RunState::Failed, 160).ended(RunState::Failed, Some("exit 1".into())),
        ];
        let mut back = Vec::new();
        from_batch(&to_batch(&rows).expect("batch"), &mut back).expect("rows");
        assert_eq!(back.len(), 2);
        assert_eq!(back[1].state, RunState::Failed);
        assert_eq!(back[1].reason.as_deref(), Some("exit 1"));
        assert_eq!(back[0].reports, rows[0].reports);
        assert_eq!(back[0].scheduled_for, rows[0].scheduled_for);
        assert_eq!(back[0].lease_until, None);
    }

    #[test]
    fn each_attempt_shows_its_final_state_newest_first() {
        let rows = vec![
            record("a", 1, RunState::Running, 100),
            record("a", 1, RunState::Failed, 110),
            record("a", 2, RunState::Running, 140),
            record("a", 2, RunState::Succeeded, 150),
            record("b", 1, RunState::Running, 200),
        ];
        let latest = latest_per_attempt(rows);
        let states: Vec<(&str, i32, RunState)> = latest
            .iter()
            .map(|r| (r.run_id.as_str(), r.attempt, r.state))
            .collect();
        assert_eq!(
            states,
            vec![
                ("b", 1, RunState::Running),
                ("a", 2, RunState::Succeeded),
                ("a", 1, RunState::Failed),
            ]
        );
    }

    #[test]
    fn a_lease_that_ran_out_frees_the_attempt_and_rows_without_one_keep_the_pid_check() {
        let now = Utc::now();
        let me = this_host();
        let (name, _) = me.rsplit_once(':').unwrap_or_default();
        let running = |host: &str, lease: Option<i64>| RunRecord {
            host: host.into(),
            lease_until: lease.map(|s| now + TimeDelta::seconds(s)),
            ..record("a", 1, RunState::Running, 100)
        };
        // This process's own attempts are never taken from it.
        assert_eq!(holder(&running(&me, Some(-5)), now), Holder::Alive);
        // A dead process of this machine: at once, lease or not.
        let dead = format!("{name}:999999999");
        assert_eq!(holder(&running(&dead, Some(60)), now), Holder::Gone);
        assert_eq!(holder(&running(&dead, None), now), Holder::Gone);
        // Another machine: its lease decides; without one, nobody can tell.
        let expired = running("elsewhere:7", Some(-5));
        assert_eq!(
            holder(&expired, now),
            Holder::Expired(now - TimeDelta::seconds(5))
        );
        assert_eq!(holder(&running("elsewhere:7", Some(5)), now), Holder::Alive);
        assert_eq!(holder(&running("elsewhere:7", None), now), Holder::Unknown);
        // A renewal moves the lease and the row's time; the end row holds no lease.
        let renewed = expired.renewed(std::time::Duration::from_secs(30));
        assert!(renewed.lease_until > Some(now) && renewed.recorded_at >= now);
        assert_eq!(holder(&renewed, Utc::now()), Holder::Alive);
        assert_eq!(renewed.ended(RunState::Failed, None).lease_until, None);
    }

    #[tokio::test]
    async fn a_history_written_before_leases_is_read_and_gets_the_column_on_append() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("runs");
        std::fs::create_dir_all(&path).expect("mkdir");
        let def = TableDef {
            name: "runs".into(),
            kind: catalog::TableKind::Delta { at: None },
            location: crate::storage::Location::Local(path),
        };
        // The old schema: every column but `lease_until`.
        let old = to_batch(&[record("a", 1, RunState::Running, 100)]).expect("batch");
        let old = old
            .project(&(0..old.num_columns() - 1).collect::<Vec<_>>())
            .expect("project");
        def.delta_builder()
            .expect("builder")
            .build()
            .expect("table")
            .write(vec![old])
            .await
            .expect("old history");
        let history = History {
            def,
            pipeline: "p".into(),
        };
        let rows = history.read().await.expect("read old");
        assert_eq!((rows.len(), rows[0].lease_until), (1, None));
        let mut leased = record("b", 1, RunState::Running, 200);
        leased.lease_until = DateTime::from_timestamp(260, 0);
        history.append(&[leased.clone()]).await.expect("append");
        let rows = history.read().await.expect("read merged");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].lease_until, leased.lease_until);
        let one = history.attempt("b", 1).await.expect("attempt");
        assert_eq!(one.map(|r| r.run_id), Some("b".into()));
    }

    #[test]
    fn claims_order_by_tick_then_attempt() {
        let t = 1_790_000_000_000;
        assert!(claim_version(t, 2) > claim_version(t, 1));
        assert!(claim_version(t + 1, 1) > claim_version(t, 10));
        assert_eq!(claimed_tick(claim_version(t, 7)), t);
    }
}
