//! One attempt of a job: its stages in a child `pipeline run`, which a timeout, a shutdown
//! or a lost lease can stop (SIGTERM, then SIGKILL). A stage commits its table in one Delta
//! commit or not at all, so a stopped attempt leaves the stage it was in at its last version.
//! While the child runs, its attempt's lease in the run history is renewed.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::watch;

use super::history::{Claim, History, RunRecord, RunState, this_host};
use super::timing;
use sha2::{Digest, Sha256};

use crate::catalog::TableDef;
use crate::error::{Error, Result};
use crate::plan::Pipeline;
use crate::plan::{Job, Retries};
use crate::storage::Location;

/// How long a stopped child gets between SIGTERM and SIGKILL.
const KILL_AFTER: Duration = Duration::from_secs(10);

/// stderr kept from a failed attempt for the history's `error`.
const ERROR_TAIL_BYTES: usize = 4000;

/// What an attempt needs, owned, so it can run on its own task.
#[derive(Debug, Clone)]
pub(crate) struct JobRun {
    pub file: PathBuf,
    pub job: String,
    pub stages: Vec<String>,
    pub timeout: Option<Duration>,
    pub retries: Retries,
    pub on_failure: Option<Vec<String>>,
    pub history: History,
    /// The pipeline's Delta tables, whose versions each attempt records.
    pub tables: Vec<TableDef>,
    /// How long the attempt's claim lasts; renewed every third of it.
    pub lease: Duration,
}

impl JobRun {
    pub(crate) fn new(pipeline: &Pipeline, job: &Job, history: History, lease: Duration) -> Self {
        let tables = pipeline
            .tables
            .values()
            .filter(|t| t.is_delta() && t.name != history.def.name)
            .cloned()
            .collect();
        Self {
            file: pipeline.file.clone(),
            job: job.name.clone(),
            stages: job.stages.clone(),
            timeout: job.timeout,
            retries: job.retries,
            on_failure: job.on_failure.clone(),
            history,
            tables,
            lease,
        }
    }

    /// The RUNNING row that starts (and claims) an attempt, with each Delta table's
    /// version (in an object store: a GET of `_last_checkpoint` and one listing after it).
    pub(crate) async fn start_record(&self, firing: &Firing) -> RunRecord {
        let found = futures::future::join_all(self.tables.iter().map(super::watch::delta_version));
        let versions: serde_json::Map<String, Value> = self
            .tables
            .iter()
            .zip(found.await)
            .map(|(t, v)| (t.name.clone(), v.map_or(Value::Null, Value::from)))
            .collect();
        let now = Utc::now();
        RunRecord {
            run_id: firing.run_id.clone(),
            job: self.job.clone(),
            trigger: firing.trigger.clone(),
            scheduled_for: firing.scheduled_for,
            tick: firing.tick,
            attempt: firing.attempt,
            state: RunState::Running,
            reason: None,
            started_at: Some(now),
            ended_at: None,
            error: None,
            retry_at: None,
            reports: None,
            input_versions: Some(Value::Object(versions)),
            host: this_host(),
            recorded_at: now,
            lease_until: Some(now + self.lease),
        }
    }
}

/// A tick to run (or an attempt of one).
#[derive(Debug, Clone)]
pub(crate) struct Firing {
    pub run_id: String,
    pub trigger: String,
    pub scheduled_for: DateTime<Utc>,
    pub tick: i64,
    pub attempt: i32,
}

impl Firing {
    pub(crate) fn new(trigger: &str, scheduled_for: DateTime<Utc>) -> Self {
        Self {
            run_id: uuid::Uuid::new_v4().to_string(),
            trigger: trigger.to_string(),
            scheduled_for,
            tick: scheduled_for.timestamp_millis(),
            attempt: 1,
        }
    }

    pub(crate) fn retry(&self) -> Self {
        Self {
            attempt: self.attempt + 1,
            ..self.clone()
        }
    }
}

/// How an attempt ended.
struct Ended {
    state: RunState,
    reason: Option<String>,
    error: Option<String>,
    reports: Option<Value>,
    /// The pipeline file itself is bad (exit 2): retrying cannot help.
    usage: bool,
    /// Another process recorded the attempt's end (its lease ran out): nothing to record.
    ended_elsewhere: bool,
}

/// Runs one attempt whose start is already recorded; records its end (with the time of its
/// retry, if its policy has one left) and returns that row. A `true` on `cancel` stops it.
pub(crate) async fn attempt(
    run: &JobRun,
    start: RunRecord,
    mut cancel: watch::Receiver<bool>,
) -> RunRecord {
    let ended = execute(run, &start, &mut cancel).await;
    let mut end = start.ended(ended.state, ended.reason);
    end.error = ended.error;
    end.reports = ended.reports;
    if ended.ended_elsewhere {
        return end;
    }
    let retryable = matches!(end.state, RunState::Failed | RunState::TimedOut) && !ended.usage;
    if retryable && end.attempt <= run.retries.max as i32 {
        let jitter = (uuid::Uuid::new_v4().as_u128() % 1_000_000) as f64 / 1e6;
        let delay = timing::backoff(
            run.retries.backoff,
            run.retries.max_backoff,
            end.attempt.unsigned_abs(),
            jitter,
        );
        end.retry_at = Some(Utc::now() + delay);
    }
    if let Err(e) = run.history.append(std::slice::from_ref(&end)).await {
        eprintln!(
            "{} job={} run={} attempt={} event=history-error error={e:?}",
            Utc::now().to_rfc3339(),
            run.job,
            end.run_id,
            end.attempt
        );
    }
    end
}

async fn execute(run: &JobRun, start: &RunRecord, cancel: &mut watch::Receiver<bool>) -> Ended {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return failed(format!("cannot find the pipeline binary: {e}"), false),
    };
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("run").arg(&run.file).args(["--json", "--quiet"]);
    for stage in &run.stages {
        cmd.args(["--stage", stage]);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // A scheduler killed with SIGKILL takes its run with it (Linux): no orphan goes on
    // writing while a restarted scheduler retries the interrupted attempt.
    #[cfg(target_os = "linux")]
    // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => return failed(format!("cannot start `pipeline run`: {e}"), false),
    };
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let out_reader = tokio::spawn(async move {
        let mut text = String::new();
        if let Some(mut out) = stdout {
            let _ = out.read_to_string(&mut text).await;
        }
        text
    });
    let prefix = format!("[{} {} #{}]", run.job, short(&start.run_id), start.attempt);
    let err_reader = tokio::spawn(async move {
        let mut tail = String::new();
        if let Some(err) = stderr {
            let mut lines = BufReader::new(err).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("{prefix} {line}");
                tail.push_str(&line);
                tail.push('\n');
                if tail.len() > 2 * ERROR_TAIL_BYTES {
                    let cut = tail.len() - ERROR_TAIL_BYTES;
                    let cut = (cut..tail.len())
                        .find(|i| tail.is_char_boundary(*i))
                        .unwrap_or(0);
                    tail.drain(..cut);
                }
            }
        }
        tail
    });
    let deadline = async {
        match run.timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    let stopped = tokio::select! {
        status = child.wait() => Ok(status),
        () = deadline => Err(Stop::TimedOut),
        _ = cancel.wait_for(|c| *c) => Err(Stop::Canceled),
        other = keep_lease(run, start) => Err(Stop::LostLease(Box::new(other))),
    };
    let status = match stopped {
        Ok(status) => status,
        Err(stop) => {
            terminate(&mut child).await;
            let tail = err_reader.await.unwrap_or_default();
            let (state, reason) = match &stop {
                Stop::TimedOut => (
                    RunState::TimedOut,
                    format!(
                        "timed out after {}",
                        timing::human(run.timeout.unwrap_or_default())
                    ),
                ),
                Stop::Canceled => (RunState::Canceled, "canceled: the scheduler stopped".into()),
                Stop::LostLease(other) => (
                    RunState::Canceled,
                    format!(
                        "canceled: its lease was lost; {} recorded it {}",
                        other.host,
                        other.state.as_str()
                    ),
                ),
            };
            return Ended {
                state,
                reason: Some(reason),
                error: error_of(&tail),
                reports: None,
                usage: false,
                ended_elsewhere: matches!(stop, Stop::LostLease(_)),
            };
        }
    };
    let stdout = out_reader.await.unwrap_or_default();
    let tail = err_reader.await.unwrap_or_default();
    let reports: Vec<Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    match status {
        Ok(s) if s.success() => Ended {
            state: RunState::Succeeded,
            reason: None,
            error: None,
            reports: Some(Value::Array(reports)),
            usage: false,
            ended_elsewhere: false,
        },
        Ok(s) => {
            let reason = match s.code() {
                Some(2) => "the pipeline file is invalid (exit 2)".to_string(),
                Some(code) => format!("exit {code}"),
                None => "killed by a signal".into(),
            };
            Ended {
                state: RunState::Failed,
                reason: Some(reason),
                error: error_of(&tail),
                reports: (!reports.is_empty()).then_some(Value::Array(reports)),
                usage: s.code() == Some(2),
                ended_elsewhere: false,
            }
        }
        Err(e) => failed(format!("waiting for `pipeline run`: {e}"), false),
    }
}

fn failed(error: String, usage: bool) -> Ended {
    Ended {
        state: RunState::Failed,
        reason: Some("could not run".into()),
        error: Some(error),
        reports: None,
        usage,
        ended_elsewhere: false,
    }
}

/// Why a running child was stopped.
enum Stop {
    TimedOut,
    Canceled,
    /// Another process recorded the attempt's end: this row.
    LostLease(Box<RunRecord>),
}

/// Renews the attempt's lease every third of it, for as long as it is polled; returns the
/// row another process ended the attempt with, once one has (this process lost the lease,
/// and a scheduler that recovered the attempt may be running its retry).
async fn keep_lease(run: &JobRun, start: &RunRecord) -> RunRecord {
    let mut every = tokio::time::interval(run.lease / 3);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await; // the first tick is now, when the start row holds a fresh lease
    loop {
        every.tick().await;
        let error = |e: Error| {
            log(
                &run.job,
                "history-error",
                &format!(
                    "run={} attempt={} reason=\"renewing the lease\" error={:?}",
                    short(&start.run_id),
                    start.attempt,
                    e.to_string()
                ),
            );
        };
        match run.history.attempt(&start.run_id, start.attempt).await {
            Ok(Some(latest)) if latest.state != RunState::Running => {
                log(
                    &run.job,
                    "lease-lost",
                    &format!(
                        "run={} attempt={} by={} state={} reason=\"stopping the run\"",
                        short(&start.run_id),
                        start.attempt,
                        latest.host,
                        latest.state.as_str()
                    ),
                );
                return latest;
            }
            Ok(_) => {}
            Err(e) => error(e),
        }
        let renewal = start.renewed(run.lease);
        if let Err(e) = run.history.append(std::slice::from_ref(&renewal)).await {
            error(e);
        }
    }
}

/// The child's error message: its stderr from the first `error:` line on, else the tail.
fn error_of(tail: &str) -> Option<String> {
    let text = tail.find("error:").map_or(tail, |i| &tail[i..]).trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// SIGTERM, then SIGKILL if the child is still there after [`KILL_AFTER`].
async fn terminate(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: kill(2) on our own child's pid, which `child` has not reaped yet.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        if tokio::time::timeout(KILL_AFTER, child.wait()).await.is_ok() {
            return;
        }
    }
    let _ = child.kill().await;
}

fn short(run_id: &str) -> &str {
    run_id.get(..8).unwrap_or(run_id)
}

/// A log line of the scheduler: time, job, event, then `key=value` details.
pub(crate) fn log(job: &str, event: &str, details: &str) {
    let now = Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    if details.is_empty() {
        eprintln!("{now} job={job} event={event}");
    } else {
        eprintln!("{now} job={job} event={event} {details}");
    }
}

/// Describes a finished attempt for the log.
pub(crate) fn describe(end: &RunRecord) -> String {
    let mut out = format!(
        "run={} attempt={} trigger={} state={}",
        short(&end.run_id),
        end.attempt,
        end.trigger,
        end.state.as_str()
    );
    if let Some(reason) = &end.reason {
        out += &format!(" reason={reason:?}");
    }
    if let (Some(s), Some(e)) = (end.started_at, end.ended_at) {
        out += &format!(" seconds={:.1}", (e - s).as_seconds_f64());
    }
    if let Some(at) = end.retry_at {
        out += &format!(" retry_at={}", at.to_rfc3339());
    }
    out
}

/// Runs the `on_failure` command with the run's row as JSON on stdin. Its own failure is
/// logged, never raised.
pub(crate) async fn on_failure(command: &[String], end: &RunRecord) {
    let Some((program, args)) = command.split_first() else {
        return;
    };
    let json = serde_json::to_string(end).unwrap_or_default();
    let result = async {
        let mut child = tokio::process::Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start `{program}`: {e}"))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(json.as_bytes())
                .await
                .map_err(|e| format!("writing its stdin: {e}"))?;
        }
        match tokio::time::timeout(Duration::from_secs(60), child.wait()).await {
            Ok(Ok(s)) if s.success() => Ok(()),
            Ok(Ok(s)) => Err(format!("it exited with {s}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("it ran over 60 s and was killed".into()),
        }
    }
    .await;
    match result {
        Ok(()) => log(
            &end.job,
            "on-failure",
            &format!("run={} ok", short(&end.run_id)),
        ),
        Err(e) => log(
            &end.job,
            "on-failure-failed",
            &format!("run={} error={e:?}", short(&end.run_id)),
        ),
    }
}

/// What `pipeline trigger` did.
#[derive(Debug, serde::Serialize)]
pub struct TriggerOutcome {
    /// The attempt's final row, as recorded in the run history.
    pub run: RunRecord,
}

impl TriggerOutcome {
    pub fn succeeded(&self) -> bool {
        self.run.state == RunState::Succeeded
    }
}

impl Pipeline {
    /// `pipeline trigger`: one run of `job` now, recorded as `manual`, in the foreground.
    /// Retries are left to the caller (an orchestrator's task has its own); `on_failure`
    /// runs when it fails. SIGINT or SIGTERM cancels it.
    pub async fn trigger(&self, job: &str) -> Result<TriggerOutcome> {
        let job = self.job(job)?;
        let settings = self.scheduler_settings()?;
        let history = History {
            def: settings.history.clone(),
            pipeline: self.name.clone(),
        };
        let run = JobRun::new(self, job, history.clone(), settings.lease);
        let firing = Firing::new("manual", Utc::now());
        let start = run.start_record(&firing).await;
        if history.claim(&start).await? == Claim::Taken {
            return Err(Error::Data(format!(
                "job `{}`: another process claimed this manual run's tick; try again",
                job.name
            )));
        }
        log(
            &job.name,
            "fired",
            &format!("run={} trigger=manual", short(&start.run_id)),
        );
        let (stop, cancel) = watch::channel(false);
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = stop.send(true);
        });
        let mut run = run;
        run.retries.max = 0;
        let end = attempt(&run, start, cancel).await;
        log(&job.name, "finished", &describe(&end));
        if end.state != RunState::Succeeded
            && let Some(command) = &run.on_failure
        {
            on_failure(command, &end).await;
        }
        Ok(TriggerOutcome { run: end })
    }
}

/// SIGINT or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

/// The file a job's scheduler locks: next to a local run history; for one in an object
/// store, in the cache (`$LAKEML_CACHE/locks`), named by a hash of the history's URL.
pub(crate) fn lock_path(history: &TableDef) -> PathBuf {
    match &history.location {
        Location::Local(path) => {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "lakeml_runs".into());
            path.with_file_name(format!(".{name}.scheduler.lock"))
        }
        Location::Remote(r) => {
            let hash = Sha256::digest(r.url().as_str().trim_end_matches('/').as_bytes());
            crate::storage::cache_root()
                .join("locks")
                .join(format!("{}.scheduler.lock", hex::encode(&hash[..8])))
        }
    }
}
