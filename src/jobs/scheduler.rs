//! `pipeline schedule`: the scheduler loop, in the foreground until SIGTERM or SIGINT.
//!
//! Every second it looks for due cron and interval ticks; every `scheduler.poll` it reads
//! what is new in the watched tables; every third of `scheduler.lease` it looks in the run
//! history for attempts whose holder is gone or let its lease run out. A firing is claimed
//! in the run history before its run starts; runs are child processes, so the loop never
//! waits on one.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};
use tokio::sync::{mpsc, watch};

use super::history::{Claim, History, Holder, RunRecord, RunState, holder};
use super::runner::{self, Firing, JobRun, log};
use super::timing;
use super::watch::TableWatch;
use crate::config::{Overlap, WaitFor};
use crate::error::{Error, Result};
use crate::plan::Pipeline;
use crate::plan::{Job, SchedulerSettings, Timing};

/// A finished attempt, back from its task.
struct Finished {
    job: usize,
    firing: Firing,
    end: RunRecord,
}

/// What the loop knows about one job.
struct JobState {
    run: Arc<JobRun>,
    /// Per time trigger: the newest tick handled.
    cursors: Vec<DateTime<Utc>>,
    /// `table_updated`: the newest data change (ms) already fired for.
    watch_cursor: i64,
    /// Indexes into the scheduler's table watches.
    watches: Vec<usize>,
    last_watch_fire: Option<DateTime<Utc>>,
    running: Option<Firing>,
    queued: Option<Firing>,
    retry: Option<(Firing, DateTime<Utc>)>,
}

/// Holds the scheduler's lock file (an OS lock: a killed scheduler releases it).
struct Lock {
    _file: File,
}

fn lock(settings: &SchedulerSettings, pipeline: &Pipeline) -> Result<Lock> {
    let path = runner::lock_path(&settings.history);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    let mut file = File::options()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io(format!("opening the lock file {}", path.display()), e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            return Err(Error::config(
                &pipeline.file,
                format!(
                    "another `pipeline schedule` ({}) already runs these jobs: it holds {}; \
                     stop it first, or give this file its own `scheduler.history`",
                    holder.trim(),
                    path.display()
                ),
            ));
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(Error::io(format!("locking {}", path.display()), e));
        }
    }
    let _ = file.set_len(0);
    let _ = writeln!(
        file,
        "pid {} on {}",
        std::process::id(),
        super::history::this_host()
    );
    Ok(Lock { _file: file })
}

/// Median and maximum of the watch polls, for the stop line.
#[derive(Default)]
struct PollStats {
    micros: Vec<u64>,
}

impl PollStats {
    fn summary(&mut self) -> String {
        if self.micros.is_empty() {
            return "polls=0".into();
        }
        self.micros.sort_unstable();
        format!(
            "polls={} poll_median_us={} poll_max_us={}",
            self.micros.len(),
            self.micros[self.micros.len() / 2],
            self.micros[self.micros.len() - 1]
        )
    }
}

impl Pipeline {
    /// `pipeline schedule`: runs the file's jobs when their triggers fire, until SIGTERM or
    /// SIGINT; then takes no new runs and lets running ones finish within `scheduler.grace`
    /// before canceling them.
    pub async fn schedule(&self) -> Result<()> {
        let settings = self.scheduler_settings()?;
        let _lock = lock(settings, self)?;
        let history = History {
            def: settings.history.clone(),
            pipeline: self.name.clone(),
        };
        let table = history.open().await?;
        let now = Utc::now();
        let attempts = history.attempts().await?;

        // One watch per table, shared by the jobs that watch it.
        let mut watches: Vec<TableWatch> = Vec::new();
        let mut states = Vec::new();
        for job in &self.jobs {
            let mut cursors = Vec::new();
            for t in &job.timings {
                let last = history.last_tick(&table, &job.name, t.kind()).await?;
                cursors.push(
                    last.and_then(DateTime::from_timestamp_millis)
                        .unwrap_or(now),
                );
            }
            let mut indexes = Vec::new();
            if let Some(w) = &job.watch {
                for def in &w.tables {
                    let i = match watches.iter().position(|x| x.def.name == def.name) {
                        Some(i) => i,
                        None => {
                            watches.push(TableWatch::new(def.clone()).await?);
                            watches.len() - 1
                        }
                    };
                    indexes.push(i);
                }
            }
            // A job never run starts from the data as it is now: new data fires it.
            let watch_cursor = match history
                .last_tick(&table, &job.name, "table_updated")
                .await?
            {
                Some(tick) => tick,
                None => indexes
                    .iter()
                    .filter_map(|i| watches[*i].last_change_ms())
                    .max()
                    .unwrap_or(0),
            };
            let last_watch_fire = attempts
                .iter()
                .filter(|r| r.job == job.name && r.trigger == "table_updated")
                .filter_map(|r| r.started_at)
                .max();
            states.push(JobState {
                run: Arc::new(JobRun::new(self, job, history.clone(), settings.lease)),
                cursors,
                watch_cursor,
                watches: indexes,
                last_watch_fire,
                running: None,
                queued: None,
                retry: None,
            });
        }
        recover(&self.jobs, &mut states, &history, &attempts, true).await?;

        for (job, state) in self.jobs.iter().zip(&states) {
            let mut triggers: Vec<String> = job.timings.iter().map(Timing::describe).collect();
            if let Some(w) = &job.watch {
                let names: Vec<&str> = w.tables.iter().map(|t| t.name.as_str()).collect();
                triggers.push(format!(
                    "table_updated {:?} {}",
                    names,
                    match w.wait_for {
                        WaitFor::Any => "any",
                        WaitFor::All => "all",
                    }
                ));
            }
            let next = job
                .timings
                .iter()
                .filter_map(|t| t.next_after(now))
                .min()
                .map(|t| format!(" next={}", t.to_rfc3339()))
                .unwrap_or_default();
            log(
                &job.name,
                "scheduled",
                &format!(
                    "stages={:?} triggers={:?}{next}{}",
                    job.stages,
                    triggers,
                    if state.retry.is_some() {
                        " retry-pending"
                    } else {
                        ""
                    }
                ),
            );
        }
        log(
            "-",
            "started",
            &format!(
                "pid={} host={} history={} poll={} lease={} watched_tables={}",
                std::process::id(),
                super::history::this_host(),
                history.def.location,
                timing::human(settings.poll),
                timing::human(settings.lease),
                watches.len()
            ),
        );

        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Finished>();
        let (cancel_tx, cancel_rx) = watch::channel(false);
        let shutdown = runner::shutdown_signal();
        tokio::pin!(shutdown);
        let step = settings.poll.min(Duration::from_secs(1));
        let mut second = tokio::time::interval(step);
        second.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut last_poll = Instant::now() - settings.poll;
        let mut last_lease_check = Instant::now();
        let mut stats = PollStats::default();
        let on_time = (settings.poll * 2).max(Duration::from_secs(60));
        let mut ctx = Ctx {
            history: &history,
            done: &done_tx,
            cancel: &cancel_rx,
        };

        loop {
            tokio::select! {
                () = &mut shutdown => break,
                Some(f) = done_rx.recv() => {
                    finished(&self.jobs, &mut states, f, &mut ctx).await;
                    continue;
                }
                _ = second.tick() => {}
            }
            let now = Utc::now();
            for (i, job) in self.jobs.iter().enumerate() {
                // Retries whose time has come.
                if let Some((firing, at)) = states[i].retry.clone()
                    && at <= now
                    && states[i].running.is_none()
                {
                    states[i].retry = None;
                    start(i, job, &mut states[i], firing, &mut ctx).await;
                }
                for t in 0..job.timings.len() {
                    let due = timing::due(
                        &job.timings[t],
                        states[i].cursors[t],
                        now,
                        job.catchup,
                        job.max_catchup,
                        on_time,
                    );
                    states[i].cursors[t] = due.cursor;
                    if due.skipped > 0 {
                        log(
                            &job.name,
                            "skipped",
                            &format!(
                                "trigger={} missed_ticks={} reason=\"missed while no scheduler \
                                 ran (catchup: {:?})\"",
                                job.timings[t].kind(),
                                due.skipped,
                                job.catchup
                            ),
                        );
                    }
                    for tick in due.run {
                        let firing = Firing::new(job.timings[t].kind(), tick);
                        fire(i, job, &mut states[i], firing, &mut ctx).await;
                    }
                }
            }
            // Attempts another scheduler left RUNNING: recovered once their lease ran out.
            if last_lease_check.elapsed() >= settings.lease / 3 {
                last_lease_check = Instant::now();
                let recovered = match history.attempts().await {
                    Ok(attempts) => {
                        recover(&self.jobs, &mut states, &history, &attempts, false).await
                    }
                    Err(e) => Err(e),
                };
                if let Err(e) = recovered {
                    log(
                        "-",
                        "history-error",
                        &format!(
                            "reason=\"looking for expired leases\" error={:?}",
                            e.to_string()
                        ),
                    );
                }
            }
            // Half a step of slack, so a 1 s poll is not pushed to every other second.
            if last_poll.elapsed() + step / 2 >= settings.poll && !watches.is_empty() {
                last_poll = Instant::now();
                let began = Instant::now();
                // Each table's poll is one request in an object store; all at once.
                let polled = futures::future::join_all(watches.iter_mut().map(|w| w.poll())).await;
                for (w, result) in watches.iter().zip(polled) {
                    if let Err(e) = result {
                        log(
                            "-",
                            "watch-error",
                            &format!("table={} error={e:?}", w.def.name),
                        );
                    }
                }
                stats
                    .micros
                    .push(u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX));
                for (i, job) in self.jobs.iter().enumerate() {
                    if let Some(firing) = watch_firing(job, &states[i], &watches, now) {
                        states[i].watch_cursor = firing.tick;
                        states[i].last_watch_fire = Some(now);
                        fire(i, job, &mut states[i], firing, &mut ctx).await;
                    }
                }
            }
        }

        // Shutdown: no new runs; running ones get `grace`, then are canceled.
        let running = states.iter().filter(|s| s.running.is_some()).count();
        log(
            "-",
            "stopping",
            &format!("running={running} grace={}", timing::human(settings.grace)),
        );
        let deadline = tokio::time::Instant::now() + settings.grace;
        let mut canceled = false;
        while states.iter().any(|s| s.running.is_some()) {
            tokio::select! {
                Some(f) = done_rx.recv() => {
                    let job = &self.jobs[f.job];
                    log(&job.name, "finished", &runner::describe(&f.end));
                    states[f.job].running = None;
                }
                () = tokio::time::sleep_until(deadline), if !canceled => {
                    log("-", "canceling", "reason=\"grace period over\"");
                    let _ = cancel_tx.send(true);
                    canceled = true;
                }
            }
        }
        log("-", "stopped", &stats.summary());
        Ok(())
    }
}

/// What starting a run needs from the loop.
struct Ctx<'a> {
    history: &'a History,
    done: &'a mpsc::UnboundedSender<Finished>,
    cancel: &'a watch::Receiver<bool>,
}

/// The `table_updated` firing due now, if any.
fn watch_firing(
    job: &Job,
    state: &JobState,
    watches: &[TableWatch],
    now: DateTime<Utc>,
) -> Option<Firing> {
    let w = job.watch.as_ref()?;
    let changes: Vec<Option<i64>> = state
        .watches
        .iter()
        .map(|i| watches[*i].last_change_ms())
        .collect();
    let newest = changes.iter().flatten().copied().max()?;
    let new = match w.wait_for {
        WaitFor::Any => newest > state.watch_cursor,
        WaitFor::All => changes
            .iter()
            .all(|c| c.is_some_and(|c| c > state.watch_cursor)),
    };
    if !new {
        return None;
    }
    let quiet = TimeDelta::from_std(w.quiet_for).unwrap_or(TimeDelta::MAX);
    if now.timestamp_millis() - newest < quiet.num_milliseconds() {
        return None; // still being written
    }
    let min = TimeDelta::from_std(w.min_interval).unwrap_or(TimeDelta::MAX);
    if state.last_watch_fire.is_some_and(|last| now - last < min) {
        return None;
    }
    DateTime::from_timestamp_millis(newest).map(|at| Firing::new("table_updated", at))
}

/// A trigger fired: run it, or queue or skip it when the job is already running.
async fn fire(i: usize, job: &Job, state: &mut JobState, firing: Firing, ctx: &mut Ctx<'_>) {
    if state.running.is_none() && state.retry.is_none() {
        start(i, job, state, firing, ctx).await;
        return;
    }
    match job.overlap {
        Overlap::QueueOne => {
            log(
                &job.name,
                "queued",
                &format!(
                    "trigger={} scheduled_for={} reason=\"the previous run is not done\"",
                    firing.trigger,
                    firing.scheduled_for.to_rfc3339()
                ),
            );
            state.queued = Some(firing);
        }
        Overlap::Skip => {
            let mut skipped = state.run.start_record(&firing).await;
            skipped.state = RunState::Skipped;
            skipped.lease_until = None;
            skipped.reason = Some("the previous run is not done (overlap: skip)".into());
            skipped.started_at = None;
            log(
                &job.name,
                "skipped",
                &format!(
                    "trigger={} scheduled_for={} reason=\"the previous run is not done\"",
                    firing.trigger,
                    firing.scheduled_for.to_rfc3339()
                ),
            );
            if let Err(e) = ctx.history.append(&[skipped]).await {
                log(
                    &job.name,
                    "history-error",
                    &format!("error={:?}", e.to_string()),
                );
            }
        }
    }
}

/// Claims an attempt in the history and starts it on its own task.
async fn start(i: usize, job: &Job, state: &mut JobState, firing: Firing, ctx: &mut Ctx<'_>) {
    let record = state.run.start_record(&firing).await;
    match ctx.history.claim(&record).await {
        Ok(Claim::Won) => {}
        Ok(Claim::Taken) => {
            log(
                &job.name,
                "not-run",
                &format!(
                    "trigger={} scheduled_for={} attempt={} reason=\"another scheduler \
                     claimed this tick\"",
                    firing.trigger,
                    firing.scheduled_for.to_rfc3339(),
                    firing.attempt
                ),
            );
            return;
        }
        Err(e) => {
            log(
                &job.name,
                "not-run",
                &format!("reason=\"cannot record the run\" error={:?}", e.to_string()),
            );
            return;
        }
    }
    log(
        &job.name,
        if firing.attempt > 1 {
            "retrying"
        } else {
            "fired"
        },
        &format!(
            "run={} attempt={} trigger={} scheduled_for={}",
            record.run_id.get(..8).unwrap_or(""),
            firing.attempt,
            firing.trigger,
            firing.scheduled_for.to_rfc3339()
        ),
    );
    state.running = Some(firing.clone());
    let run = state.run.clone();
    let done = ctx.done.clone();
    let cancel = ctx.cancel.clone();
    tokio::spawn(async move {
        let end = runner::attempt(&run, record, cancel).await;
        let _ = done.send(Finished {
            job: i,
            firing,
            end,
        });
    });
}

/// An attempt ended: log it, plan its retry or call `on_failure`, start a queued firing.
async fn finished(jobs: &[Job], states: &mut [JobState], f: Finished, ctx: &mut Ctx<'_>) {
    let job = &jobs[f.job];
    let state = &mut states[f.job];
    state.running = None;
    log(&job.name, "finished", &runner::describe(&f.end));
    if let Some(at) = f.end.retry_at {
        state.retry = Some((f.firing.retry(), at));
    } else if f.end.state != RunState::Succeeded
        && f.end.state != RunState::Canceled
        && let Some(command) = job.on_failure.clone()
    {
        let end = f.end.clone();
        tokio::spawn(async move { runner::on_failure(&command, &end).await });
    }
    if state.retry.is_none()
        && let Some(next) = state.queued.take()
    {
        start(f.job, job, state, next, ctx).await;
    }
}

/// Attempts left RUNNING by a process that is gone, or whose lease ran out, are recorded as
/// interrupted failures and retried when their policy allows (the retry's claim makes it run
/// once, however many schedulers recover the attempt). At start (`starting`), planned
/// retries are picked up too, and attempts left as they are get a log line.
async fn recover(
    jobs: &[Job],
    states: &mut [JobState],
    history: &History,
    attempts: &[RunRecord],
    starting: bool,
) -> Result<()> {
    // The newest attempt of each run decides.
    let mut newest: BTreeMap<&str, &RunRecord> = BTreeMap::new();
    for r in attempts {
        newest
            .entry(r.run_id.as_str())
            .and_modify(|n| {
                if r.attempt > n.attempt {
                    *n = r;
                }
            })
            .or_insert(r);
    }
    let mut rows = Vec::new();
    for r in newest.values() {
        let Some(i) = jobs.iter().position(|j| j.name == r.job) else {
            continue;
        };
        let job = &jobs[i];
        let firing = Firing {
            run_id: r.run_id.clone(),
            trigger: r.trigger.clone(),
            scheduled_for: r.scheduled_for,
            tick: r.tick,
            attempt: r.attempt,
        };
        if r.state != RunState::Running {
            if starting && let Some(at) = r.retry_at {
                states[i].retry = Some((firing.retry(), at));
            }
            continue;
        }
        let reason = match holder(r, Utc::now()) {
            Holder::Gone => format!("interrupted: the process that ran it ({}) is gone", r.host),
            Holder::Expired(at) => format!(
                "interrupted: the lease of {} expired at {}",
                r.host,
                at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
            ),
            Holder::Alive => {
                if starting {
                    log(
                        &job.name,
                        "still-running",
                        &format!("run={} host={}", r.run_id, r.host),
                    );
                }
                continue;
            }
            Holder::Unknown => {
                if starting {
                    log(
                        &job.name,
                        "unknown",
                        &format!(
                            "run={} reason=\"RUNNING on another machine ({}), in a row \
                             without a lease; left as it is\"",
                            r.run_id, r.host
                        ),
                    );
                }
                continue;
            }
        };
        let mut end = r.ended(RunState::Failed, Some(reason));
        if r.attempt <= job.retries.max as i32 && r.trigger != "manual" {
            let at = Utc::now()
                + timing::backoff(
                    job.retries.backoff,
                    job.retries.max_backoff,
                    r.attempt.unsigned_abs(),
                    0.5,
                );
            end.retry_at = Some(at);
            states[i].retry = Some((firing.retry(), at));
        }
        log(&job.name, "interrupted", &runner::describe(&end));
        rows.push(end);
    }
    history.append(&rows).await
}
