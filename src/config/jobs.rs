//! `jobs:` and `scheduler:` as written: what runs when (`pipeline schedule`), and where the
//! run history goes. [`crate::jobs`] checks them.

use serde::Deserialize;

/// One scheduled job: some of the file's stages, their triggers, and what to do on failure.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct JobSpec {
    /// Stage names, run in file order; default: every stage.
    pub stages: Option<Vec<String>>,
    /// Triggers; a job without any runs only through `pipeline trigger`.
    #[serde(default)]
    pub on: OnSpec,
    #[serde(default)]
    pub retries: RetrySpec,
    /// A run (one attempt) past this is canceled and recorded TIMED_OUT.
    pub timeout: Option<String>,
    #[serde(default)]
    pub overlap: Overlap,
    /// Time triggers: what runs of the ticks missed while no scheduler ran.
    #[serde(default)]
    pub catchup: Catchup,
    /// `catchup: all`: the most ticks run (the newest ones); default 10.
    pub max_catchup: Option<u32>,
    /// A command run with the failed run's JSON on stdin, once retries are spent.
    pub on_failure: Option<HookSpec>,
}

/// A job's triggers: any combination of a cron, an interval and watched tables.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct OnSpec {
    /// 5-field POSIX cron (minute hour day-of-month month day-of-week).
    pub cron: Option<String>,
    /// IANA time zone of `cron` (default UTC).
    pub timezone: Option<String>,
    /// A fixed interval (`10m`), aligned to the Unix epoch so every scheduler agrees.
    pub every: Option<String>,
    /// Tables whose new data fires the job.
    pub table_updated: Option<Vec<String>>,
    /// `any` (default): one updated table fires; `all`: each must have new data.
    #[serde(default)]
    pub wait_for: WaitFor,
    /// At most one table-triggered run per this interval.
    pub min_interval: Option<String>,
    /// Wait until the watched tables have had no new data for this long.
    pub quiet_for: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum WaitFor {
    #[default]
    Any,
    All,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RetrySpec {
    /// Retries after the first attempt (0..=10).
    #[serde(default)]
    pub max: u32,
    /// The first retry's delay; each later one doubles, up to `max_backoff`, with jitter.
    #[serde(default = "default_backoff")]
    pub backoff: String,
    #[serde(default = "default_max_backoff")]
    pub max_backoff: String,
}

impl Default for RetrySpec {
    fn default() -> Self {
        Self {
            max: 0,
            backoff: default_backoff(),
            max_backoff: default_max_backoff(),
        }
    }
}

fn default_backoff() -> String {
    "30s".into()
}

fn default_max_backoff() -> String {
    "10m".into()
}

/// What a trigger does while the job's previous run is still going.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Overlap {
    /// Record the firing as SKIPPED.
    #[default]
    Skip,
    /// Keep the newest firing and run it when the current run ends.
    QueueOne,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Catchup {
    /// Ticks missed while down are skipped.
    None,
    /// The newest missed tick runs once.
    #[default]
    Latest,
    /// Missed ticks run in order, at most `max_catchup` (the newest).
    All,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HookSpec {
    /// Program and arguments (no shell).
    pub command: Vec<String>,
}

/// `scheduler:`: settings of `pipeline schedule` itself.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SchedulerSpec {
    /// The run-history Delta table (a name from `tables`); default `lakeml_runs`, next to
    /// the pipeline's first Delta table.
    pub history: Option<String>,
    /// How often watched tables are checked (default 10s).
    pub poll: Option<String>,
    /// On SIGTERM, how long a running stage may go on before it is canceled (default 60s).
    pub grace: Option<String>,
    /// How long a running attempt's claim lasts unless its scheduler renews it (every
    /// third of it); another scheduler recovers an attempt whose lease ran out (default 60s).
    pub lease: Option<String>,
}

/// `optimize`: compacts a Delta table's small files (a `dataChange=false` commit).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct OptimizeSpec {
    pub name: Option<String>,
    pub table: String,
    /// Files are compacted up to this size in MiB (default 64).
    pub target_file_mb: Option<u64>,
    /// Z-order the rows by these columns instead of plain compaction.
    #[serde(default)]
    pub zorder: Vec<String>,
}

/// `vacuum`: deletes files that no version within the retention references.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct VacuumSpec {
    pub name: Option<String>,
    pub table: String,
    /// Default 7d; less only with `allow_short_retention: true`.
    pub retention: Option<String>,
    #[serde(default)]
    pub allow_short_retention: bool,
}
