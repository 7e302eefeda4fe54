//! Scheduled jobs with real processes on real tables: `pipeline schedule` fires on new data
//! (and not on a compaction), retries with back-off, calls `on_failure`, survives `kill -9`
//! without losing or doubling predictions, and two schedulers run each tick once. Cron, DST
//! and catch-up are unit-tested against an injected clock (src/jobs/timing.rs).

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{
    INGEST, Scratch, ingest, ingest_yaml, make_model_with, pipeline_command, python, run_quiet,
};

/// `pipeline schedule FILE` in the background, in a process group of its own with its runs,
/// its stderr (the decision log) in a file.
pub(crate) struct Scheduler {
    child: Child,
    log: PathBuf,
}

impl Scheduler {
    fn start(s: &Scratch, file: &str, log_name: &str) -> Self {
        Self::start_with(s, file, log_name, &[])
    }

    /// [`Scheduler::start`] with `env` set.
    pub(crate) fn start_with(
        s: &Scratch,
        file: &str,
        log_name: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let log = s.path().join(log_name);
        let err = std::fs::File::create(&log).expect("log file");
        let child = pipeline_command()
            .args(["schedule", file])
            .envs(env.iter().copied())
            .current_dir(s.path())
            .stdout(Stdio::null())
            .stderr(err)
            .process_group(0)
            .spawn()
            .expect("start pipeline schedule");
        let me = Self { child, log };
        me.wait_for("event=started", Duration::from_secs(60));
        me
    }

    pub(crate) fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Lines of the log holding every one of `parts`.
    pub(crate) fn lines(&self, parts: &[&str]) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .map(str::to_string)
            .collect()
    }

    /// Waits until a log line holds every `|`-separated part of `pattern`; returns it.
    pub(crate) fn wait_for(&self, pattern: &str, limit: Duration) -> String {
        let parts: Vec<&str> = pattern.split('|').collect();
        let began = Instant::now();
        loop {
            if let Some(line) = self.lines(&parts).into_iter().next() {
                return line;
            }
            assert!(
                began.elapsed() < limit,
                "no `{pattern}` in the scheduler's log after {limit:?}:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// SIGKILL to the scheduler and its runs (its process group).
    pub(crate) fn kill_group(&self) {
        // SAFETY: signalling our own child's process group.
        let done = unsafe { libc::killpg(self.child.id() as i32, libc::SIGKILL) };
        assert_eq!(done, 0, "killpg: {}", std::io::Error::last_os_error());
    }

    /// SIGTERM, then the exit status (within 60 s).
    pub(crate) fn stop(mut self) -> std::process::ExitStatus {
        self.signal("-TERM");
        let began = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "the scheduler did not stop on SIGTERM:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `pipeline runs FILE --json` (optionally one job's), oldest first.
fn runs(s: &Scratch, file: &str, job: Option<&str>) -> Vec<serde_json::Value> {
    let mut args = vec!["runs", file, "--json", "--limit", "1000"];
    if let Some(job) = job {
        args.extend(["--job", job]);
    }
    let out = s.pipeline(&args);
    assert!(
        out.status.success(),
        "pipeline runs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("run json"))
        .collect();
    rows.reverse();
    rows
}

fn time(v: &serde_json::Value) -> chrono::DateTime<chrono::Utc> {
    v.as_str()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&chrono::Utc))
        .unwrap_or_else(|| panic!("not a time: {v}"))
}

fn read_delta(s: &Scratch, table: &str, version: Option<u64>) -> serde_json::Value {
    let path = s.path().join(table);
    let mut args = vec![path.to_str().expect("utf-8 path").to_string()];
    args.extend(version.map(|v| v.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    python("read_delta.py", &args)
}

/// Asserts the predictions hold ids `1..=n`, each once.
fn each_id_once(s: &Scratch, n: u64) {
    let preds = read_delta(s, "lake/preds", None);
    let ids: Vec<u64> = preds["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| r["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(
        ids,
        (1..=n).collect::<Vec<u64>>(),
        "each id once, none missing"
    );
}

/// Appends reviews `skip+1 ..= skip+rows` of the corpus to `reviews` (as [`ingest`] does).
const MORE: &str = "more.yaml";

fn more_yaml() -> String {
    ingest_yaml()
        .replace(
            "      to: reviews\n",
            "      to: reviews\n      mode: append\n",
        )
        .replace("LIMIT ${ROWS}", "LIMIT ${ROWS} OFFSET ${SKIP}")
}

fn append_reviews(s: &Scratch, skip: usize, rows: usize) {
    run_quiet(
        s,
        MORE,
        &[("ROWS", rows.to_string()), ("SKIP", skip.to_string())],
    );
}

/// Scores `reviews` into `preds` on new data; `slow` is the same stage with a tiny timeout.
const SCORE: &str = "score.yaml";
const SCORE_YAML: &str = r#"name: score
tables:
  reviews: { delta: lake/reviews }
  preds: { delta: lake/preds }
scheduler: { poll: 500ms, grace: 20s }
stages:
  - predict: { from: reviews, model: model, to: preds }
  - optimize: { table: reviews }
jobs:
  score:
    stages: [predict-preds]
    on: { table_updated: [reviews], min_interval: 1s, quiet_for: 1s }
    retries: { max: 2, backoff: 1s }
  slow:
    stages: [predict-preds]
    timeout: 300ms
"#;

fn score_setup(rows: usize) -> Scratch {
    let s = Scratch::new();
    make_model_with(&s, "model", "rotten,fresh", 0);
    s.write(INGEST, &ingest_yaml());
    s.write(MORE, &more_yaml());
    s.write(SCORE, SCORE_YAML);
    ingest(&s, rows);
    s
}

#[test]
fn new_reviews_are_scored_once_within_the_trigger_delays_and_a_compaction_fires_nothing() {
    let s = score_setup(40);

    // A run past its timeout is stopped and recorded; its table is not written.
    let out = s.pipeline(&["trigger", SCORE, "slow", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", s.stderr(&out));
    let slow: serde_json::Value = serde_json::from_slice(&out.stdout).expect("trigger json");
    assert_eq!(slow["state"], "TIMED_OUT", "{slow}");
    assert!(
        !s.path().join("lake/preds").exists(),
        "a timed-out run wrote"
    );

    // A manual run, as Airflow's BashOperator would make it.
    let out = s.pipeline(&["trigger", SCORE, "score", "--json"]);
    assert!(out.status.success(), "{}", s.stderr(&out));
    let manual: serde_json::Value = serde_json::from_slice(&out.stdout).expect("trigger json");
    assert_eq!(
        (manual["state"].as_str(), manual["trigger"].as_str()),
        (Some("SUCCEEDED"), Some("manual"))
    );
    assert_eq!(manual["reports"][0]["rows_out"], 40, "{manual}");
    each_id_once(&s, 40);

    let scheduler = Scheduler::start(&s, SCORE, "schedule.log");
    append_reviews(&s, 40, 25);
    let landed = Instant::now();
    scheduler.wait_for(
        "job=score|event=fired|trigger=table_updated",
        Duration::from_secs(60),
    );
    let delay = landed.elapsed();
    // min_interval 1s + quiet_for 1s + poll 0.5s, and slack for a busy machine.
    assert!(
        delay < Duration::from_secs(8),
        "fired {delay:?} after the write"
    );
    scheduler.wait_for(
        "job=score|event=finished|trigger=table_updated|state=SUCCEEDED",
        Duration::from_secs(180),
    );
    each_id_once(&s, 65);

    // A compaction of the watched table is not new data.
    let out = s.pipeline(&["run", "-q", SCORE, "--stage", "optimize-reviews"]);
    assert!(out.status.success(), "{}", s.stderr(&out));
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        scheduler.lines(&["job=score", "event=fired"]).len(),
        1,
        "an optimize fired the job:\n{}",
        scheduler.text()
    );

    let status = scheduler.stop();
    assert!(status.success(), "exit {status}");
    let history = runs(&s, SCORE, None);
    let summary: Vec<(String, String, String)> = history
        .iter()
        .map(|r| {
            (
                r["job"].as_str().unwrap_or_default().to_string(),
                r["trigger"].as_str().unwrap_or_default().to_string(),
                r["state"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let expect = |j: &str, t: &str, st: &str| (j.to_string(), t.to_string(), st.to_string());
    assert_eq!(
        summary,
        vec![
            expect("slow", "manual", "TIMED_OUT"),
            expect("score", "manual", "SUCCEEDED"),
            expect("score", "table_updated", "SUCCEEDED"),
        ]
    );
    let fired = &history[2];
    assert_eq!(fired["reports"][0]["rows_out"], 25, "{fired}");
    assert!(
        fired["input_versions"]["reviews"].as_u64().is_some(),
        "{fired}"
    );

    // The history is a table like the others.
    let out = s.pipeline(&[
        "sql",
        SCORE,
        "SELECT state, count(*) AS n FROM lakeml_runs GROUP BY state ORDER BY state",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("SUCCEEDED"), "{text}");
    let out = s.pipeline(&["jobs", SCORE]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("table_updated [reviews]") && text.contains("SUCCEEDED"),
        "{text}"
    );
}

#[test]
fn a_scheduler_killed_during_a_run_is_recovered_and_the_retry_scores_each_id_once() {
    let s = score_setup(40);
    let first = Scheduler::start(&s, SCORE, "first.log");
    append_reviews(&s, 40, 760);
    first.wait_for("job=score|event=fired", Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        first.lines(&["event=finished"]).is_empty(),
        "the run ended before the kill; make it longer:\n{}",
        first.text()
    );
    first.signal("-KILL");
    drop(first);

    let second = Scheduler::start(&s, SCORE, "second.log");
    second.wait_for("job=score|event=interrupted", Duration::from_secs(10));
    second.wait_for(
        "job=score|event=finished|attempt=2|state=SUCCEEDED",
        Duration::from_secs(240),
    );
    assert!(second.stop().success());

    let history = runs(&s, SCORE, Some("score"));
    assert_eq!(history.len(), 2, "{history:?}");
    assert_eq!(history[0]["run_id"], history[1]["run_id"]);
    assert_eq!(
        (history[0]["attempt"].as_i64(), history[0]["state"].as_str()),
        (Some(1), Some("FAILED"))
    );
    assert!(
        history[0]["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("interrupted")),
        "{}",
        history[0]
    );
    assert_eq!(
        (history[1]["attempt"].as_i64(), history[1]["state"].as_str()),
        (Some(2), Some("SUCCEEDED"))
    );
    each_id_once(&s, 800);
}

/// Two jobs over CSV files: `flaky` fails while its file holds a word, `broken` always.
const FAIL: &str = "fail.yaml";
const FAIL_YAML: &str = r#"name: fail
tables:
  flaky: { csv: flaky.csv }
  broken: { csv: broken.csv }
  out: { delta: lake/out }
  out2: { delta: lake/out2 }
scheduler: { poll: 200ms }
stages:
  - write: { name: load, to: out, sql: "SELECT CAST(x AS INT) AS x FROM flaky" }
  - write: { name: load-broken, to: out2, sql: "SELECT CAST(x AS INT) AS x FROM broken" }
jobs:
  flaky:
    stages: [load]
    on: { table_updated: [flaky] }
    retries: { max: 3, backoff: 2s }
  broken:
    stages: [load-broken]
    on: { table_updated: [broken] }
    retries: { max: 1, backoff: 1s }
    on_failure: { command: [sh, -c, "cat > hook.json"] }
"#;

#[test]
fn failures_retry_with_back_off_then_succeed_or_end_in_the_failure_hook() {
    let s = Scratch::new();
    s.write("flaky.csv", "x\n1\n");
    s.write("broken.csv", "x\n1\n");
    s.write(FAIL, FAIL_YAML);
    let scheduler = Scheduler::start(&s, FAIL, "schedule.log");
    std::thread::sleep(Duration::from_millis(50));
    s.write("flaky.csv", "x\nabc\n");
    s.write("broken.csv", "x\nabc\n");
    scheduler.wait_for(
        "job=flaky|event=finished|attempt=2|state=FAILED",
        Duration::from_secs(60),
    );
    s.write("flaky.csv", "x\n7\n"); // fixed before the third attempt (4 s back-off)
    scheduler.wait_for(
        "job=flaky|event=finished|attempt=3|state=SUCCEEDED",
        Duration::from_secs(60),
    );
    scheduler.wait_for("job=broken|event=on-failure", Duration::from_secs(60));
    assert!(scheduler.stop().success());

    let flaky: Vec<serde_json::Value> = runs(&s, FAIL, Some("flaky"))
        .into_iter()
        .filter(|r| r["state"] != "SKIPPED")
        .collect();
    let states: Vec<(i64, &str)> = flaky
        .iter()
        .map(|r| {
            (
                r["attempt"].as_i64().unwrap_or(0),
                r["state"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(states, vec![(1, "FAILED"), (2, "FAILED"), (3, "SUCCEEDED")]);
    assert!(flaky.iter().all(|r| r["run_id"] == flaky[0]["run_id"]));
    assert!(
        flaky[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("abc")),
        "the error names the bad value: {}",
        flaky[0]
    );
    // Back-off: 2 s, then 4 s, each at least 80% of that (jitter).
    for (i, min) in [(1, 1.6), (2, 3.2)] {
        let gap = time(&flaky[i]["started_at"]) - time(&flaky[i - 1]["ended_at"]);
        assert!(
            gap.as_seconds_f64() >= min,
            "attempt {} started {gap} after attempt {i} ended",
            i + 1
        );
    }
    let out = read_delta(&s, "lake/out", None);
    assert_eq!(out["rows"], serde_json::json!([{"x": 7}]));

    let broken = runs(&s, FAIL, Some("broken"));
    let states: Vec<&str> = broken
        .iter()
        .map(|r| r["state"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(states, vec!["FAILED", "FAILED"]);
    assert!(
        broken[1]["retry_at"].is_null(),
        "retries spent: {}",
        broken[1]
    );
    let hook: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(s.path().join("hook.json")).expect("the hook wrote its stdin"),
    )
    .expect("the hook got JSON");
    assert_eq!(
        (
            hook["job"].as_str(),
            hook["attempt"].as_i64(),
            hook["state"].as_str()
        ),
        (Some("broken"), Some(2), Some("FAILED"))
    );
    assert!(
        !s.path().join("lake/out2/_delta_log").exists(),
        "a failed stage committed"
    );
}

const TICK: &str = "tick.yaml";
const TICK_YAML: &str = r#"name: tick
tables:
  src: { csv: src.csv }
  out: { delta: lake/out }
stages:
  - write: { to: out, from: src }
jobs:
  copy:
    on: { every: 3s }
"#;

#[test]
fn a_second_scheduler_refuses_and_without_the_lock_each_tick_still_runs_once() {
    let s = Scratch::new();
    s.write("src.csv", "x\n1\n");
    s.write(TICK, TICK_YAML);
    let a = Scheduler::start(&s, TICK, "a.log");
    let out = s.pipeline(&["schedule", TICK]);
    assert_eq!(out.status.code(), Some(2), "{}", s.stderr(&out));
    assert!(
        s.stderr(&out).contains("another `pipeline schedule`"),
        "{}",
        s.stderr(&out)
    );
    std::fs::remove_file(s.path().join("lake/.lakeml_runs.scheduler.lock")).expect("lock file");
    let b = Scheduler::start(&s, TICK, "b.log");
    std::thread::sleep(Duration::from_secs(10));
    assert!(a.stop().success());
    assert!(b.stop().success());

    let mut by_tick: BTreeMap<i64, usize> = BTreeMap::new();
    for r in runs(&s, TICK, None) {
        if r["state"] != "SKIPPED" {
            *by_tick
                .entry(r["tick"].as_i64().expect("tick"))
                .or_default() += 1;
        }
    }
    assert!(by_tick.len() >= 2, "too few ticks ran: {by_tick:?}");
    assert!(
        by_tick.values().all(|n| *n == 1),
        "a tick ran twice: {by_tick:?}"
    );
}

#[test]
fn optimize_compacts_and_vacuum_keeps_time_travel_within_the_retention() {
    let s = Scratch::new();
    s.write(
        "v.yaml",
        r#"name: v
tables:
  src: { csv: src.csv }
  t: { delta: lake/t }
stages:
  - write: { name: put, to: t, from: src, mode: append }
  - optimize: { table: t }
  - vacuum: { table: t, retention: 2s, allow_short_retention: true }
"#,
    );
    let put = |x: u32| {
        s.write("src.csv", &format!("x\n{x}\n"));
        s.run_ok(&["v.yaml", "--stage", "put"]);
    };
    for x in 1..=3 {
        put(x); // versions 0, 1, 2: a file each
    }
    let reports = s.run_ok(&["v.yaml", "--stage", "optimize-t"]); // v3: one file
    assert_eq!(reports[0]["rows_by_outcome"]["files_removed"], 3);
    std::thread::sleep(Duration::from_secs(3));
    put(4); // v4
    s.run_ok(&["v.yaml", "--stage", "optimize-t"]); // v5 removes v3's and v4's files
    let reports = s.run_ok(&["v.yaml", "--stage", "vacuum-t"]);
    // Only the three files removed more than 2 s ago go.
    assert_eq!(
        reports[0]["rows_by_outcome"]["files_deleted"], 3,
        "{reports:?}"
    );

    let rows = |v: Option<u64>| read_delta(&s, "lake/t", v)["rows"].clone();
    let all = serde_json::json!([{"x": 1}, {"x": 2}, {"x": 3}, {"x": 4}]);
    assert_eq!(rows(None), all);
    assert_eq!(rows(Some(4)), all, "time travel within the retention");
    assert_eq!(
        rows(Some(3)),
        serde_json::json!([{"x": 1}, {"x": 2}, {"x": 3}])
    );
    let gone = Command::new(crate::common::env_path("LAKEML_PYTHON"))
        .arg(crate::common::repo().join("tests/py/read_delta.py"))
        .args([s.path().join("lake/t").to_str().expect("utf-8"), "1"])
        .output()
        .expect("python");
    assert!(
        !gone.status.success(),
        "version 1's files should be vacuumed"
    );
}

#[test]
fn bad_jobs_are_refused_naming_the_field() {
    let s = Scratch::new();
    s.write("src.csv", "x\n1\n");
    let check = |jobs: &str, field: &str| {
        s.write(
            "j.yaml",
            &format!(
                "name: j\ntables:\n  src: {{ csv: src.csv }}\n  out: {{ delta: lake/out }}\n\
                 stages:\n  - write: {{ to: out, from: src }}\n{jobs}"
            ),
        );
        let out = s.pipeline(&["validate", "j.yaml"]);
        let err = s.stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{jobs}: {err}");
        assert!(err.contains(field), "{jobs}: `{field}` not in: {err}");
    };
    check(
        "jobs:\n  a: { on: { cron: '0 3 * *' } }\n",
        "jobs.a.on.cron: `0 3 * *` has 4 fields",
    );
    check(
        "jobs:\n  a: { on: { cron: '0 25 * * *' } }\n",
        "jobs.a.on.cron",
    );
    check(
        "jobs:\n  a: { on: { cron: '0 3 * * SUN', timezone: Mars/Olympus } }\n",
        "jobs.a.on.timezone: `Mars/Olympus` is not an IANA time zone",
    );
    check(
        "jobs:\n  a: { stages: [nope], on: { every: 5m } }\n",
        "jobs.a.stages: no stage is named `nope`",
    );
    check(
        "jobs:\n  a: { on: { table_updated: [nope] } }\n",
        "jobs.a.on.table_updated: table `nope` is not declared",
    );
    check(
        "jobs:\n  a: { on: { every: -5m } }\n",
        "jobs.a.on.every: `-5m` is negative",
    );
    check(
        "jobs:\n  a: { on: { table_updated: [src], quiet_for: 1x } }\n",
        "jobs.a.on.quiet_for",
    );
    check(
        "jobs:\n  a: { retries: { max: 50 } }\n",
        "jobs.a.retries.max",
    );
    check(
        "jobs:\n  a: { on: { every: 5m }, max_catchup: 3 }\n",
        "jobs.a.max_catchup: applies to `catchup: all`",
    );
    s.write(
        "v.yaml",
        "name: v\ntables:\n  out: { delta: lake/out }\n  src: { csv: src.csv }\nstages:\n  \
         - write: { to: out, from: src }\n  - vacuum: { table: out, retention: 1h }\n",
    );
    let out = s.pipeline(&["validate", "v.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        s.stderr(&out)
            .contains("stages[1].vacuum.retention: `1h` is less than 7 days")
    );
    s.write(
        "w.yaml",
        "name: w\ntables:\n  out: { delta: lake/out }\n  src: { csv: src.csv }\nstages:\n  \
         - write: { to: out, from: src }\n",
    );
    let out = s.pipeline(&["run", "w.yaml", "--stage", "nope"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        s.stderr(&out)
            .contains("--stage nope: no stage has that name")
    );
    let out = s.pipeline(&["trigger", "w.yaml", "x"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(s.stderr(&out).contains("no job `x`"), "{}", s.stderr(&out));
}
