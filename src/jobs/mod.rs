//! Scheduled jobs (`jobs:` in the pipeline file): `pipeline schedule`, `jobs`, `runs` and
//! `trigger`.
//!
//! A job is some of the file's stages plus triggers (cron, interval, new data in tables).
//! Each run executes those stages as `pipeline run` would, in a child process the scheduler
//! can time out or cancel; every attempt is recorded in a Delta run-history table, and each
//! tick is claimed there with a Delta app transaction before it runs, so two schedulers
//! never both run it.

mod history;
mod runner;
mod scheduler;
mod timing;
mod watch;

use crate::config::WaitFor;
use crate::plan::{Job, Pipeline, SchedulerSettings, Timing};

pub use history::{RunRecord, RunState};
pub use runner::TriggerOutcome;

impl Pipeline {
    pub(crate) fn job(&self, name: &str) -> crate::Result<&Job> {
        self.jobs.iter().find(|j| j.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.jobs.iter().map(|j| j.name.as_str()).collect();
            crate::Error::config(
                &self.file,
                if known.is_empty() {
                    format!("no job `{name}`: the file has no `jobs` section")
                } else {
                    format!("no job `{name}`; jobs: {}", known.join(", "))
                },
            )
        })
    }

    pub(crate) fn scheduler_settings(&self) -> crate::Result<&SchedulerSettings> {
        self.scheduler.as_ref().ok_or_else(|| {
            crate::Error::config(
                &self.file,
                "the file has no `jobs` section; add one (see the README's \"Scheduled jobs\")",
            )
        })
    }
}

/// One job as `pipeline jobs` shows it.
#[derive(Debug, serde::Serialize)]
pub struct JobOverview {
    pub name: String,
    pub stages: Vec<String>,
    pub triggers: Vec<String>,
    /// The next fire times of its cron and interval triggers (the soonest 5).
    pub next: Vec<chrono::DateTime<chrono::Utc>>,
    /// Watched tables: Delta version and newest data change seen now.
    pub watched: Vec<WatchedTable>,
    /// Its newest attempt in the run history.
    pub last_run: Option<RunRecord>,
}

#[derive(Debug, serde::Serialize)]
pub struct WatchedTable {
    pub table: String,
    pub version: Option<u64>,
    pub last_change: Option<chrono::DateTime<chrono::Utc>>,
}

impl std::fmt::Display for JobOverview {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "job {}: stages {}", self.name, self.stages.join(", "))?;
        if self.triggers.is_empty() {
            writeln!(f, "  triggers: none (runs with `pipeline trigger` only)")?;
        } else {
            writeln!(f, "  triggers: {}", self.triggers.join("; "))?;
        }
        for t in &self.watched {
            writeln!(
                f,
                "  watches {}: version {}, newest data {}",
                t.table,
                t.version.map_or("none".into(), |v| v.to_string()),
                t.last_change.map_or("none".into(), |t| t.to_rfc3339())
            )?;
        }
        if !self.next.is_empty() {
            let next: Vec<String> = self.next.iter().map(|t| t.to_rfc3339()).collect();
            writeln!(f, "  next: {}", next.join(", "))?;
        }
        match &self.last_run {
            Some(r) => write!(
                f,
                "  last run: {} attempt {} ({}) {}{}",
                r.started_at.unwrap_or(r.recorded_at).to_rfc3339(),
                r.attempt,
                r.trigger,
                r.state.as_str(),
                r.reason
                    .as_ref()
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default()
            ),
            None => write!(f, "  last run: never"),
        }
    }
}

/// `pipeline runs` as a text table.
pub fn format_runs(runs: &[RunRecord]) -> String {
    let mut out = format!(
        "{:<10} {:<20} {:<13} {:<25} {:>3} {:<10} {:>8}  {}\n",
        "run", "job", "trigger", "started", "try", "state", "seconds", "reason"
    );
    for r in runs {
        let seconds = match (r.started_at, r.ended_at) {
            (Some(s), Some(e)) => format!("{:.1}", (e - s).as_seconds_f64()),
            _ => "-".into(),
        };
        let started = r
            .started_at
            .unwrap_or(r.recorded_at)
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        out += &format!(
            "{:<10} {:<20} {:<13} {:<25} {:>3} {:<10} {:>8}  {}\n",
            r.run_id.get(..8).unwrap_or(&r.run_id),
            r.job,
            r.trigger,
            started,
            r.attempt,
            r.state.as_str(),
            seconds,
            r.reason.as_deref().unwrap_or("")
        );
    }
    out
}

impl Pipeline {
    fn history(&self) -> crate::Result<history::History> {
        Ok(history::History {
            def: self.scheduler_settings()?.history.clone(),
            pipeline: self.name.clone(),
        })
    }

    /// `pipeline jobs`: each job, its triggers, next fire times and last run.
    pub async fn jobs_overview(&self) -> crate::Result<Vec<JobOverview>> {
        let attempts = self.history()?.attempts().await?;
        let now = chrono::Utc::now();
        let mut out = Vec::new();
        for job in &self.jobs {
            let mut next: Vec<_> = job
                .timings
                .iter()
                .flat_map(|t| t.upcoming(now, 5))
                .collect();
            next.sort();
            next.dedup();
            next.truncate(5);
            let mut triggers: Vec<String> = job.timings.iter().map(Timing::describe).collect();
            let mut watched = Vec::new();
            if let Some(w) = &job.watch {
                let names: Vec<&str> = w.tables.iter().map(|t| t.name.as_str()).collect();
                triggers.push(format!(
                    "table_updated [{}] ({}, min_interval {}, quiet_for {})",
                    names.join(", "),
                    if w.wait_for == WaitFor::All {
                        "all"
                    } else {
                        "any"
                    },
                    timing::human(w.min_interval),
                    timing::human(w.quiet_for)
                ));
                for def in &w.tables {
                    let seen = watch::TableWatch::new(def.clone()).await?;
                    watched.push(WatchedTable {
                        table: def.name.clone(),
                        version: seen.version(),
                        last_change: seen
                            .last_change_ms()
                            .and_then(chrono::DateTime::from_timestamp_millis),
                    });
                }
            }
            out.push(JobOverview {
                name: job.name.clone(),
                stages: job.stages.clone(),
                triggers,
                next,
                watched,
                last_run: attempts.iter().find(|r| r.job == job.name).cloned(),
            });
        }
        Ok(out)
    }

    /// `pipeline runs`: attempts in their latest state, newest first.
    pub async fn runs(&self, job: Option<&str>, limit: usize) -> crate::Result<Vec<RunRecord>> {
        if let Some(name) = job {
            self.job(name)?;
        }
        let mut runs = self.history()?.attempts().await?;
        runs.retain(|r| job.is_none_or(|j| r.job == j));
        runs.truncate(limit);
        Ok(runs)
    }
}
