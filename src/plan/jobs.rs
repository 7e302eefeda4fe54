//! `jobs:` and `scheduler:` checked: each job's stages, triggers (cron patterns parsed with
//! their time zone), retries and timeouts; the run-history table. `pipeline schedule`
//! (`crate::jobs`) runs them.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use chrono_tz::Tz;

use super::Stage;
use crate::catalog::{TableDef, TableKind};
use crate::config::{Catchup, JobSpec, Overlap, SchedulerSpec, WaitFor, parse_duration};

/// Retries per run at most (attempt numbers take 4 bits of a tick's claim).
pub(crate) const MAX_RETRIES: u32 = 10;

/// The shortest `scheduler.lease`.
const MIN_LEASE: Duration = Duration::from_secs(3);

/// The run history's table name when the file declares none.
pub(crate) const DEFAULT_HISTORY: &str = "lakeml_runs";

/// A checked job.
#[derive(Debug)]
pub(crate) struct Job {
    pub name: String,
    /// Stage names, in file order.
    pub stages: Vec<String>,
    pub timings: Vec<Timing>,
    pub watch: Option<Watch>,
    pub retries: Retries,
    pub timeout: Option<Duration>,
    pub overlap: Overlap,
    pub catchup: Catchup,
    pub max_catchup: usize,
    pub on_failure: Option<Vec<String>>,
}

/// `table_updated`: the tables watched and how their new data fires the job.
#[derive(Debug)]
pub(crate) struct Watch {
    pub tables: Vec<TableDef>,
    pub wait_for: WaitFor,
    pub min_interval: Duration,
    pub quiet_for: Duration,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Retries {
    pub max: u32,
    pub backoff: Duration,
    pub max_backoff: Duration,
}

/// `scheduler:` resolved.
#[derive(Debug)]
pub(crate) struct SchedulerSettings {
    pub history: TableDef,
    pub poll: Duration,
    pub grace: Duration,
    /// How long a RUNNING attempt stays claimed unless its scheduler renews the lease.
    pub lease: Duration,
}

fn duration(field: &str, text: &str) -> Result<Duration, String> {
    if text.trim_start().starts_with('-') {
        return Err(format!(
            "{field}: `{text}` is negative; give a positive duration such as `30s` or `5m`"
        ));
    }
    parse_duration(text).map_err(|m| format!("{field}: {m}"))
}

/// Checks `jobs:` against the file's stages and tables.
pub(crate) fn plan_jobs(
    specs: BTreeMap<String, JobSpec>,
    stages: &[Stage],
    tables: &BTreeMap<String, TableDef>,
) -> Result<Vec<Job>, String> {
    let mut jobs = Vec::new();
    for (name, spec) in specs {
        let field = format!("jobs.{name}");
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-".contains(c))
        {
            return Err(format!(
                "{field}: name jobs with letters, digits, `_` and `-` only"
            ));
        }
        let stage_names: Vec<String> = match spec.stages {
            None => stages.iter().map(|s| s.name().to_string()).collect(),
            Some(wanted) => {
                if wanted.is_empty() {
                    return Err(format!("{field}.stages: is empty; list at least one stage"));
                }
                for w in &wanted {
                    if !stages.iter().any(|s| s.name() == w) {
                        let known: Vec<&str> = stages.iter().map(Stage::name).collect();
                        return Err(format!(
                            "{field}.stages: no stage is named `{w}` (stages: {}); a stage's \
                             name is its `name`, or `<kind>-<table>` (e.g. `predict-preds`)",
                            known.join(", ")
                        ));
                    }
                }
                // File order, whatever the order listed.
                stages
                    .iter()
                    .map(|s| s.name().to_string())
                    .filter(|n| wanted.contains(n))
                    .collect()
            }
        };
        if stage_names.is_empty() {
            return Err(format!(
                "{field}: the file has no stages for this job to run"
            ));
        }
        let on = spec.on;
        let mut timings = Vec::new();
        let tz = match &on.timezone {
            Some(tz) => {
                if on.cron.is_none() {
                    return Err(format!("{field}.on.timezone: applies to `cron`; add one"));
                }
                tz.parse::<chrono_tz::Tz>().map_err(|_| {
                    format!(
                        "{field}.on.timezone: `{tz}` is not an IANA time zone; write e.g. \
                         `Europe/Berlin` or `UTC`"
                    )
                })?
            }
            None => chrono_tz::UTC,
        };
        if let Some(cron) = &on.cron {
            timings.push(Timing::cron(cron, tz).map_err(|m| format!("{field}.on.cron: {m}"))?);
        }
        if let Some(every) = &on.every {
            let d = duration(&format!("{field}.on.every"), every)?;
            if d < Duration::from_secs(1) {
                return Err(format!("{field}.on.every: `{every}` is under a second"));
            }
            timings.push(Timing::Every(d));
        }
        let watch = match &on.table_updated {
            None => {
                for (key, given) in [
                    ("min_interval", on.min_interval.is_some()),
                    ("quiet_for", on.quiet_for.is_some()),
                    ("wait_for", on.wait_for != WaitFor::Any),
                ] {
                    if given {
                        return Err(format!(
                            "{field}.on.{key}: applies to `table_updated`; add one"
                        ));
                    }
                }
                None
            }
            Some(names) => {
                if names.is_empty() {
                    return Err(format!(
                        "{field}.on.table_updated: is empty; list the tables to watch"
                    ));
                }
                let mut watched = Vec::new();
                for t in names {
                    let def = tables.get(t).ok_or_else(|| {
                        format!(
                            "{field}.on.table_updated: table `{t}` is not declared under \
                             `tables` (declared: {})",
                            tables.keys().cloned().collect::<Vec<_>>().join(", ")
                        )
                    })?;
                    if matches!(def.kind, TableKind::Delta { at: Some(_) }) {
                        return Err(format!(
                            "{field}.on.table_updated: table `{t}` is pinned to one version, \
                             so it never changes; watch an unpinned table"
                        ));
                    }
                    if def.location.remote().is_some() && !def.is_delta() {
                        return Err(format!(
                            "{field}.on.table_updated: table `{t}` is a file table in an \
                             object store, and the scheduler watches object-store tables only \
                             when they are Delta tables (it reads their log); make it a Delta \
                             table, or trigger the job with `cron` or `every`"
                        ));
                    }
                    watched.push(def.clone());
                }
                let opt = |key: &str, v: &Option<String>| match v {
                    Some(text) => duration(&format!("{field}.on.{key}"), text),
                    None => Ok(Duration::ZERO),
                };
                Some(Watch {
                    tables: watched,
                    wait_for: on.wait_for,
                    min_interval: opt("min_interval", &on.min_interval)?,
                    quiet_for: opt("quiet_for", &on.quiet_for)?,
                })
            }
        };
        let retries = Retries {
            max: spec.retries.max,
            backoff: duration(&format!("{field}.retries.backoff"), &spec.retries.backoff)?,
            max_backoff: duration(
                &format!("{field}.retries.max_backoff"),
                &spec.retries.max_backoff,
            )?,
        };
        if retries.max > MAX_RETRIES {
            return Err(format!(
                "{field}.retries.max: {} is more than {}; fix what fails instead",
                retries.max, MAX_RETRIES
            ));
        }
        let timeout = spec
            .timeout
            .as_deref()
            .map(|t| duration(&format!("{field}.timeout"), t))
            .transpose()?;
        if timeout == Some(Duration::ZERO) {
            return Err(format!("{field}.timeout: must be more than 0"));
        }
        if spec.max_catchup.is_some() && spec.catchup != Catchup::All {
            return Err(format!(
                "{field}.max_catchup: applies to `catchup: all` only"
            ));
        }
        let max_catchup = spec.max_catchup.unwrap_or(10) as usize;
        if max_catchup == 0 {
            return Err(format!("{field}.max_catchup: must be 1 or more"));
        }
        let on_failure = match spec.on_failure {
            Some(hook) if hook.command.is_empty() => {
                return Err(format!(
                    "{field}.on_failure.command: is empty; give the program and its arguments"
                ));
            }
            Some(hook) => Some(hook.command),
            None => None,
        };
        jobs.push(Job {
            name,
            stages: stage_names,
            timings,
            watch,
            retries,
            timeout,
            overlap: spec.overlap,
            catchup: spec.catchup,
            max_catchup,
            on_failure,
        });
    }
    Ok(jobs)
}

/// `scheduler:` resolved; the default history table is added to `tables` so `pipeline sql`
/// and `pipeline serve` can read it.
pub(crate) fn plan_scheduler(
    spec: Option<SchedulerSpec>,
    base: &Path,
    tables: &mut BTreeMap<String, TableDef>,
    has_jobs: bool,
) -> Result<Option<SchedulerSettings>, String> {
    if !has_jobs {
        return match spec {
            Some(_) => Err("scheduler: the file has no `jobs`; add some, or remove it".into()),
            None => Ok(None),
        };
    }
    let spec = spec.unwrap_or_default();
    let history = match &spec.history {
        Some(name) => {
            let def = tables.get(name).ok_or_else(|| {
                format!("scheduler.history: table `{name}` is not declared under `tables`")
            })?;
            if !matches!(def.kind, TableKind::Delta { at: None }) {
                return Err(format!(
                    "scheduler.history: table `{name}` must be an unpinned Delta table"
                ));
            }
            def.clone()
        }
        None => {
            if let Some(def) = tables.get(DEFAULT_HISTORY) {
                return Err(format!(
                    "tables.{}: the name is taken by the run history; set \
                     `scheduler.history: {}` to keep the history there, or rename it",
                    def.name, def.name
                ));
            }
            let dir = tables
                .values()
                .find(|t| t.is_delta())
                .and_then(|t| t.location.local()?.parent().map(Path::to_path_buf))
                .unwrap_or_else(|| base.join("lake"));
            let def = TableDef {
                name: DEFAULT_HISTORY.into(),
                kind: TableKind::Delta { at: None },
                location: crate::storage::Location::Local(dir.join(DEFAULT_HISTORY)),
            };
            tables.insert(DEFAULT_HISTORY.into(), def.clone());
            def
        }
    };
    let poll = match &spec.poll {
        Some(p) => duration("scheduler.poll", p)?,
        None => Duration::from_secs(10),
    };
    if poll < Duration::from_millis(100) {
        return Err("scheduler.poll: under 100ms would only burn CPU".into());
    }
    let grace = match &spec.grace {
        Some(g) => duration("scheduler.grace", g)?,
        None => Duration::from_secs(60),
    };
    let lease = match &spec.lease {
        Some(l) => duration("scheduler.lease", l)?,
        None => Duration::from_secs(60),
    };
    if lease < MIN_LEASE {
        return Err(format!(
            "scheduler.lease: `{}` is under {}; a running attempt's lease is renewed with a \
             commit to the run history every third of it, so give at least that (default 60s)",
            spec.lease.as_deref().unwrap_or_default(),
            human(MIN_LEASE)
        ));
    }
    Ok(Some(SchedulerSettings {
        history,
        poll,
        grace,
        lease,
    }))
}

/// A time trigger.
#[derive(Debug, Clone)]
pub(crate) enum Timing {
    Cron {
        cron: Box<croner::Cron>,
        tz: Tz,
        /// As written, for messages.
        text: String,
    },
    /// Ticks at whole multiples of the interval since the Unix epoch (UTC).
    Every(Duration),
}

impl Timing {
    /// Parses a 5-field POSIX cron in an IANA time zone.
    pub(crate) fn cron(text: &str, tz: Tz) -> Result<Self, String> {
        let fields = text.split_whitespace().count();
        if fields != 5 {
            return Err(format!(
                "`{text}` has {fields} fields; write 5: minute hour day-of-month month \
                 day-of-week, e.g. `0 3 * * SUN`"
            ));
        }
        let cron = croner::parser::CronParser::builder()
            .seconds(croner::parser::Seconds::Disallowed)
            .build()
            .parse(text)
            .map_err(|e| format!("`{text}` is not a valid cron pattern: {e}"))?;
        let timing = Self::Cron {
            cron: Box::new(cron),
            tz,
            text: text.to_string(),
        };
        // A pattern that parses but never matches (`0 0 30 2 *`) is refused here, not at
        // run time.
        timing
            .next_after(DateTime::<Utc>::UNIX_EPOCH + TimeDelta::days(365 * 56))
            .ok_or_else(|| format!("`{text}` never matches a date; check the day and month"))?;
        Ok(timing)
    }

    /// The first tick strictly after `t`.
    pub(crate) fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self {
            Timing::Cron { cron, tz, .. } => cron
                .find_next_occurrence(&t.with_timezone(tz), false)
                .ok()
                .map(|local| local.with_timezone(&Utc)),
            Timing::Every(interval) => {
                let step = i64::try_from(interval.as_millis()).ok()?.max(1);
                let ms = t.timestamp_millis();
                let next = (ms.div_euclid(step) + 1).checked_mul(step)?;
                DateTime::from_timestamp_millis(next)
            }
        }
    }

    /// The next `n` ticks after `t`.
    pub(crate) fn upcoming(&self, t: DateTime<Utc>, n: usize) -> Vec<DateTime<Utc>> {
        let mut out = Vec::with_capacity(n);
        let mut at = t;
        while out.len() < n {
            match self.next_after(at) {
                Some(next) => {
                    out.push(next);
                    at = next;
                }
                None => break,
            }
        }
        out
    }

    /// A short name for logs and the history table.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Timing::Cron { .. } => "cron",
            Timing::Every(_) => "every",
        }
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            Timing::Cron { text, tz, .. } => format!("cron `{text}` ({tz})"),
            Timing::Every(d) => format!("every {}", human(*d)),
        }
    }
}

/// `90s` as `1m30s`, for logs.
pub(crate) fn human(d: Duration) -> String {
    let s = d.as_secs();
    if d.subsec_millis() != 0 || s == 0 {
        return format!("{}ms", d.as_millis());
    }
    let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
    let mut out = String::new();
    if h > 0 {
        out += &format!("{h}h");
    }
    if m > 0 {
        out += &format!("{m}m");
    }
    if s > 0 {
        out += &format!("{s}s");
    }
    out
}
