//! Spark scale-out (python/, the `lakeml_spark` package) with PySpark 4.3 in `local[2]` and
//! `pipeline serve` workers on 127.0.0.1: pipelines/spark_predict.py gives the predict stage's
//! predictions, one row per id, in one commit, and a rerun adds nothing; a worker killed with
//! SIGKILL mid-job costs nothing but a retry; a driver killed mid-write leaves the table as it
//! was and the rerun completes it; fail_on_error=false gives bad rows NULL predictions and an
//! error of their own; the data source reads a Flight SQL query in several endpoints and Delta
//! tables after an overwrite (never their removed files).
//!
//! The predictions are compared with the predict stage's over all 12,808 reviews; the
//! failure tests use a few hundred (the same code paths, a shorter CI).
//!
//! The package is imported from the checkout: the driver has python/src first on PYTHONPATH,
//! and the cached venv that the Python workers run holds a `.pth` file naming the python/src
//! of the checkout that last ran `ensure_venv` (scripts/env.sh), which is this one when the
//! tests run through scripts/test.sh.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{
    INGEST, Scratch, env_path, ingest, ingest_yaml, make_model_with, minilm, pipeline_bin,
    pipeline_command, python, repo,
};
use crate::serving::{
    LABELS, PREDICT, PREDICT_YAML, Server, TOKEN, assert_same_predictions, delta_id_label_score,
    predictions,
};

/// The serve-only pipeline of the workers.
const SERVE: &str = "serve.yaml";
/// The reviews of the corpus (fresh or rotten).
const ALL_REVIEWS: usize = 12_808;
/// Longest a Spark script may run here before it is killed and the test fails.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(900);

/// The workers' file: `reviews` and more `tables` (entries indented by two spaces), the model
/// `sentiment` on one intra-op thread (two workers and Spark share the cores), the token.
fn serve_yaml(tables: &str) -> String {
    format!(
        r#"name: s
tables:
  reviews: {{ delta: lake/reviews }}
{tables}serve:
  listen: 127.0.0.1:0
  models:
    sentiment: {{ path: model, threads: 1 }}
  auth:
    tokens: ["${{LAKEML_TOKEN}}"]
  limits: {{ max_concurrent_queries: 64, query_timeout: 10m }}
  shutdown_grace: 10s
"#
    )
}

/// A scratch directory with the classifier (`model/`), `rows` reviews and the pipeline files.
pub fn setup(rows: usize) -> Scratch {
    let s = Scratch::new();
    make_model_with(&s, "model", &LABELS.join(","), 0);
    s.write(INGEST, &ingest_yaml());
    s.write(PREDICT, PREDICT_YAML);
    ingest(&s, rows);
    s
}

pub fn path(s: &Scratch, relative: &str) -> String {
    s.path()
        .join(relative)
        .to_str()
        .expect("utf-8 path")
        .to_string()
}

/// A Delta table as tests/py/read_delta.py reads it: version, num_rows, schema, rows.
fn read_delta(s: &Scratch, table: &str) -> Value {
    python("read_delta.py", &[&path(s, table)])
}

/// Committed versions of a Delta table, from its log directory.
fn log_versions(s: &Scratch, table: &str) -> usize {
    std::fs::read_dir(s.path().join(table).join("_delta_log"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    let name = e.file_name().to_string_lossy().to_string();
                    name.ends_with(".json") && name.len() == 25
                })
                .count()
        })
        .unwrap_or(0)
}

/// The data files (`*.parquet`) in a table's directory, committed or not.
fn parquet_files(s: &Scratch, table: &str) -> HashSet<String> {
    std::fs::read_dir(s.path().join(table))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.ends_with(".parquet"))
                .collect()
        })
        .unwrap_or_default()
}

/// The app transaction a commit carries: (appId, version).
fn commit_txn(s: &Scratch, table: &str, version: u64) -> Option<(String, u64)> {
    let log = s
        .path()
        .join(table)
        .join("_delta_log")
        .join(format!("{version:020}.json"));
    let text = std::fs::read_to_string(&log).unwrap_or_else(|e| panic!("{log:?}: {e}"));
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find_map(|a| {
            let t = a.get("txn")?;
            Some((t["appId"].as_str()?.to_string(), t["version"].as_u64()?))
        })
}

/// A Python process of a Spark job (its own process group: the driver, its JVM and the
/// JVM's Python workers), stdout and stderr in files.
pub struct Job {
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Job {
    /// Starts `LAKEML_PYTHON SCRIPT ARGS` in the scratch directory.
    fn spawn(s: &Scratch, script: &Path, args: &[&str], tag: &str) -> Self {
        Self::spawn_with(s, script, args, tag, &[])
    }

    /// The same with more environment variables (inherited by Spark's Python workers).
    pub fn spawn_with(
        s: &Scratch,
        script: &Path,
        args: &[&str],
        tag: &str,
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Self {
        let (stdout, stderr) = (
            s.path().join(format!("{tag}.out")),
            s.path().join(format!("{tag}.err")),
        );
        let inherited = std::env::var_os("PYTHONPATH")
            .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .unwrap_or_default();
        let pythonpath =
            std::env::join_paths(std::iter::once(repo().join("python/src")).chain(inherited))
                .expect("PYTHONPATH");
        let child = Command::new(env_path("LAKEML_PYTHON"))
            .arg(script)
            .args(args)
            .env("PYTHONPATH", pythonpath)
            .env("LAKEML_TOKEN", TOKEN)
            .envs(env.iter().copied())
            .current_dir(s.path())
            .stdin(Stdio::null())
            .stdout(File::create(&stdout).expect("stdout file"))
            .stderr(File::create(&stderr).expect("stderr file"))
            .process_group(0)
            .spawn()
            .expect("spawn python");
        Self {
            child,
            stdout,
            stderr,
        }
    }

    fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// SIGKILL to the whole process group.
    fn kill_group(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
    }

    /// Waits (at most SCRIPT_TIMEOUT); returns the last stdout line as JSON and stderr.
    pub fn finish(mut self, what: &str) -> (Value, String) {
        let deadline = Instant::now() + SCRIPT_TIMEOUT;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() > deadline {
                self.kill_group();
                panic!(
                    "{what} still running after {SCRIPT_TIMEOUT:?}, killed:\n{}",
                    self.stderr_text()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let stdout = std::fs::read_to_string(&self.stdout).unwrap_or_default();
        let stderr = self.stderr_text();
        assert!(
            status.success(),
            "{what} failed ({status}):\n{stdout}\n{stderr}"
        );
        let last = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .unwrap_or_default();
        let value: Value = serde_json::from_str(last)
            .unwrap_or_else(|e| panic!("{what} printed no JSON ({e}):\n{stdout}\n{stderr}"));
        (value, stderr)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill_group();
        }
    }
}

fn spark_predict_py() -> PathBuf {
    repo().join("pipelines/spark_predict.py")
}

/// pipelines/spark_predict.py over `reviews` into `scored`, through `workers`.
fn spark_predict_args(s: &Scratch, workers: &[&Server], partitions: &str) -> Vec<String> {
    let mut args = vec![
        "--source".to_string(),
        path(s, "lake/reviews"),
        "--target".to_string(),
        path(s, "lake/scored"),
        "--partitions".to_string(),
        partitions.to_string(),
        "--json".to_string(),
    ];
    for w in workers {
        args.push("--endpoint".to_string());
        args.push(w.uri.clone());
    }
    args
}

fn spark_predict(s: &Scratch, workers: &[&Server], partitions: &str, tag: &str) -> Value {
    let args = spark_predict_args(s, workers, partitions);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Job::spawn(s, &spark_predict_py(), &args, tag)
        .finish("pipelines/spark_predict.py")
        .0
}

pub fn test_script(name: &str) -> PathBuf {
    repo().join("tests/py").join(name)
}

#[test]
fn spark_predict_equals_the_predict_stage_and_a_rerun_adds_nothing() {
    let s = setup(ALL_REVIEWS);
    s.run_ok(&[PREDICT]);
    let want = predictions(&s);
    assert_eq!(want.len(), ALL_REVIEWS);
    s.write(SERVE, &serve_yaml(""));
    let (a, b) = (Server::start(&s, SERVE), Server::start(&s, SERVE));

    let first = spark_predict(&s, &[&a, &b], "4", "first");
    assert_eq!(first["committed"], true, "{first}");
    assert_eq!(first["rows"], ALL_REVIEWS, "{first}");
    assert_eq!(first["target_version"], 0, "{first}");
    assert_eq!(first["partitions"], 4, "{first}");
    let table = read_delta(&s, "lake/scored");
    assert_same_predictions("spark_predict.py", &delta_id_label_score(&table), &want);
    assert_eq!(table["version"], 0);
    for (name, ty) in [
        ("id", "int64"),
        ("label", "string"),
        ("label_id", "int64"),
        ("score", "float"),
        ("run_id", "string"),
        ("predicted_at", "timestamp[us, tz=UTC]"),
    ] {
        assert_eq!(
            table["schema"][name], ty,
            "column {name}: {}",
            table["schema"]
        );
    }
    assert!(
        table["schema"]["probabilities"]
            .as_str()
            .is_some_and(|t| t.starts_with("list<") && t.contains("float")),
        "{}",
        table["schema"]
    );
    assert_eq!(
        commit_txn(&s, "lake/scored", 0),
        Some(("lakeml/spark_predict".to_string(), 0)),
        "the commit's app transaction: the job and the source's version"
    );

    // lakeml reads the table Spark wrote (the stage is there for `pipeline sql` to accept
    // the file; it does not run).
    s.write(
        "scored.yaml",
        "name: q\ntables:\n  scored: { delta: lake/scored }\n  copy: { delta: lake/copy }\n\
         stages:\n  - write:\n      from: scored\n      to: copy\n",
    );
    let out = s.pipeline(&[
        "sql",
        "scored.yaml",
        "SELECT count(*) AS n, count(DISTINCT id) AS ids, min(id) AS lo, max(id) AS hi FROM scored",
    ]);
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let numbers: Vec<&str> = printed
        .split(|c: char| !c.is_ascii_digit())
        .filter(|t| !t.is_empty())
        .collect();
    assert_eq!(
        numbers,
        ["12808", "12808", "1", "12808"],
        "pipeline sql printed:\n{printed}"
    );

    // Same source version: the txn says it is done; nothing is predicted or committed.
    let again = spark_predict(&s, &[&a, &b], "4", "again");
    assert_eq!(again["committed"], false, "{again}");
    assert_eq!(again["rows"], 0, "{again}");
    assert_eq!(log_versions(&s, "lake/scored"), 1, "a rerun made a version");
    assert_same_predictions(
        "after the rerun",
        &delta_id_label_score(&read_delta(&s, "lake/scored")),
        &want,
    );
    a.stop();
    b.stop();
}

/// Reviews the job that kills the executors' own worker predicts.
const KILL_ROWS: usize = 3_000;

#[test]
fn without_endpoints_each_executor_runs_one_worker_that_survives_a_kill_and_stops_with_spark() {
    // One Spark session: a job whose worker is killed mid-exchange, predict() over every
    // review, embed() (a second model, so a second worker), a Flight SQL query through the
    // data source on a local worker for a pipeline file, a missing model, a worker's idle
    // timeout (a third), and spark.stop().
    let s = setup(ALL_REVIEWS);
    s.run_ok(&[PREDICT]);
    let want = predictions(&s);
    s.write(SERVE, &serve_yaml(""));
    let tmp = s.path().join("tmp");
    std::fs::create_dir_all(&tmp).expect("mkdir tmp");
    let (got, stderr) = Job::spawn_with(
        &s,
        &test_script("spark_local_worker.py"),
        &[
            &path(&s, "model"),
            &path(&s, "lake/reviews"),
            &KILL_ROWS.to_string(),
            minilm().to_str().expect("utf-8 path"),
            &path(&s, SERVE),
            TOKEN,
        ],
        "local",
        &[
            ("TMPDIR", tmp.as_os_str()),
            ("LAKEML_PIPELINE", pipeline_bin().as_os_str()),
        ],
    )
    .finish("spark_local_worker.py");
    let first: Vec<(u64, String, f64)> = got["first"]
        .as_array()
        .unwrap_or_else(|| panic!("no predictions: {got}"))
        .iter()
        .map(|r| {
            (
                r[0].as_u64().expect("id"),
                r[1].as_str().expect("label").to_string(),
                r[2].as_f64().expect("score"),
            )
        })
        .collect();
    assert_same_predictions("predict() on the executors' worker", &first, &want);
    // The rest, for messages: every prediction would drown them.
    let mut got = got;
    got["first"] = Value::from(first.len());
    assert_eq!(
        got["workers"], 1,
        "local[2] is one executor: one worker for both task slots"
    );

    let killed = &got["killed"];
    assert_eq!(
        killed["killed_pids"].as_array().map(Vec::len),
        Some(1),
        "{got}"
    );
    assert_eq!(killed["rows"], KILL_ROWS, "{got}");
    assert_eq!(killed["ids"], KILL_ROWS, "every id once: {got}");
    assert_eq!(killed["max_id"], KILL_ROWS, "{got}");
    assert_eq!(
        killed["differ"], 0,
        "labels changed after the restart: {got}"
    );
    assert_eq!(killed["workers"], 1, "{got}");
    assert_eq!(killed["supervisor_saw_exit"], true, "{got}");
    assert!(
        stderr.contains("restarting it and sending the partition"),
        "no task restarted the killed worker:\n{stderr}"
    );

    let embedded = &got["embedded"];
    assert_eq!(embedded["rows"], 40, "{got}");
    assert_eq!(embedded["sizes"], serde_json::json!([384]), "{got}");
    assert_eq!(embedded["workers"], 2, "a worker per model: {got}");

    let queried = &got["queried"];
    assert_eq!(queried["rows"], 500, "{got}");
    assert_eq!(queried["ids"], 500, "{got}");
    assert_eq!(
        queried["differ"], 0,
        "predict() in SQL on the local worker: {got}"
    );
    assert_eq!(
        queried["workers"], 1,
        "planning and reading share the executor's worker in local[2]: {got}"
    );

    let missing = got["missing_model"].as_str().unwrap_or_default();
    assert!(
        missing.contains("could not start")
            && missing.contains("no-such-model")
            && missing.contains("is not a directory"),
        "a missing model directory must fail the task with the worker's message: {got}"
    );
    let idle = &got["idle"];
    assert_eq!(idle["before"], 3, "{got}");
    assert_eq!(
        idle["after"], 2,
        "a worker unused for idle_timeout=2 s must stop: {got}"
    );
    assert_eq!(got["before_stop"], 3, "{got}");
    assert_eq!(
        got["after_stop"], 0,
        "the worker outlived spark.stop(): {got}"
    );
}

#[test]
fn a_worker_killed_mid_job_costs_a_retry_and_every_id_lands_once() {
    let s = setup(600);
    s.run_ok(&[PREDICT]);
    let want = predictions(&s);
    s.write(SERVE, &serve_yaml(""));
    let (mut victim, other) = (Server::start(&s, SERVE), Server::start(&s, SERVE));
    let (got, stderr) = Job::spawn(
        &s,
        &test_script("spark_failover.py"),
        &[
            &path(&s, "lake/reviews"),
            &path(&s, "lake/scored"),
            &victim.pid(),
            "8",
            &victim.uri,
            &other.uri,
        ],
        "failover",
    )
    .finish("spark_failover.py");
    assert_eq!(got["partitions"], 8, "{got}");
    assert_eq!(
        got["killed"], true,
        "the worker was not killed while the job ran: {got}"
    );
    let at_kill = &got["at_kill"];
    assert!(
        at_kill["done"].as_u64().expect("done") < at_kill["total"].as_u64().expect("total"),
        "{got}"
    );
    let status = victim.wait_exit(Duration::ZERO);
    assert!(
        status.is_some_and(|s| !s.success()),
        "the victim still runs: {status:?}"
    );
    assert!(
        stderr.contains("retrying the partition"),
        "no partition was retried on the other worker:\n{stderr}"
    );
    assert_eq!(got["result"]["committed"], true, "{got}");
    assert_eq!(got["result"]["rows"], 600, "{got}");
    let table = read_delta(&s, "lake/scored");
    assert_eq!(table["version"], 0);
    assert_same_predictions("with a worker killed", &delta_id_label_score(&table), &want);
    other.stop();
}

#[test]
fn a_driver_killed_mid_write_leaves_the_table_and_the_rerun_completes_it() {
    // Version 0 of the target: the first 100 reviews.
    let s = setup(100);
    s.write(SERVE, &serve_yaml(""));
    let (a, b) = (Server::start(&s, SERVE), Server::start(&s, SERVE));
    let first = spark_predict(&s, &[&a, &b], "2", "first");
    assert_eq!(first["committed"], true, "{first}");
    assert_eq!(first["rows"], 100, "{first}");

    // 500 new reviews (source version 1); the predict stage's rows for all 600, to compare.
    ingest(&s, 600);
    s.run_ok(&[PREDICT]);
    let want = predictions(&s);
    assert_eq!(want.len(), 600);

    // Kill the whole driver (Python, its JVM, its Python workers) once the first data file
    // of the new version is in the table directory, i.e. while the executors write.
    let before = parquet_files(&s, "lake/scored");
    let args = spark_predict_args(&s, &[&a, &b], "12");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut killed = Job::spawn(&s, &spark_predict_py(), &args, "killed");
    let deadline = Instant::now() + SCRIPT_TIMEOUT;
    loop {
        if parquet_files(&s, "lake/scored").len() > before.len() {
            break;
        }
        if let Some(status) = killed.child.try_wait().expect("try_wait") {
            panic!(
                "spark_predict.py ended ({status}) before writing a file:\n{}",
                killed.stderr_text()
            );
        }
        assert!(
            Instant::now() < deadline,
            "no file written in {SCRIPT_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    killed.kill_group();
    std::thread::sleep(Duration::from_secs(2)); // let orphaned Python workers wind down
    assert_eq!(
        log_versions(&s, "lake/scored"),
        1,
        "the killed run committed (it had not finished writing when it was killed?)"
    );
    let table = read_delta(&s, "lake/scored");
    assert_eq!(table["version"], 0, "a killed run changed the table");
    assert_eq!(table["num_rows"], 100);
    assert!(
        parquet_files(&s, "lake/scored").len() > before.len(),
        "the killed run wrote no file: it was not killed mid-write"
    );

    // The rerun predicts the 500 new ids and commits them once; the one after adds nothing.
    let rerun = spark_predict(&s, &[&a, &b], "4", "rerun");
    assert_eq!(rerun["committed"], true, "{rerun}");
    assert_eq!(rerun["rows"], 500, "{rerun}");
    assert_eq!(rerun["target_version"], 1, "{rerun}");
    let table = read_delta(&s, "lake/scored");
    assert_same_predictions("after the rerun", &delta_id_label_score(&table), &want);
    assert_eq!(
        commit_txn(&s, "lake/scored", 1),
        Some(("lakeml/spark_predict".to_string(), 1))
    );
    let again = spark_predict(&s, &[&a, &b], "4", "again");
    assert_eq!(again["committed"], false, "{again}");
    assert_eq!(log_versions(&s, "lake/scored"), 2, "a rerun made a version");
    assert_eq!(read_delta(&s, "lake/scored")["num_rows"], 600);
    a.stop();
    b.stop();
}

/// A row of spark_bad_rows.py: id, label, error.
type BadRow = (u64, Option<String>, Option<String>);

fn bad_rows(got: &Value, case: &str) -> Vec<BadRow> {
    got[case]["rows"]
        .as_array()
        .unwrap_or_else(|| panic!("{case}: {}", got[case]))
        .iter()
        .map(|r| {
            (
                r[0].as_u64().expect("id"),
                r[1].as_str().map(str::to_string),
                r[3].as_str().map(str::to_string),
            )
        })
        .collect()
}

fn predicted(row: &BadRow) -> bool {
    row.1.as_deref().is_some_and(|l| LABELS.contains(&l)) && row.2.is_none()
}

fn refused(row: &BadRow, words: &str) -> bool {
    row.1.is_none() && row.2.as_deref().is_some_and(|e| e.contains(words))
}

#[test]
fn fail_on_error_false_gives_a_bad_row_null_predictions_and_its_own_error() {
    let s = setup(10);
    s.write(SERVE, &serve_yaml(""));
    let worker = Server::start(&s, SERVE);
    let (got, _) = Job::spawn(
        &s,
        &test_script("spark_bad_rows.py"),
        &[&worker.uri],
        "bad_rows",
    )
    .finish("spark_bad_rows.py");

    // Binary text: good UTF-8, NULL, not UTF-8, good UTF-8.
    let rows = bad_rows(&got, "binary_lenient");
    assert_eq!(
        got["binary_lenient"]["columns"],
        serde_json::json!([
            "id",
            "text",
            "label",
            "label_id",
            "score",
            "probabilities",
            "error"
        ])
    );
    assert_eq!(rows.len(), 4, "{rows:?}");
    assert!(predicted(&rows[0]) && predicted(&rows[3]), "{rows:?}");
    assert!(refused(&rows[1], "NULL"), "{rows:?}");
    assert!(refused(&rows[2], "UTF-8"), "{rows:?}");

    let rows = bad_rows(&got, "string_lenient");
    assert!(predicted(&rows[0]) && predicted(&rows[2]), "{rows:?}");
    assert!(refused(&rows[1], "NULL"), "{rows:?}");
    // fail_on_error=true: a NULL text is a NULL prediction, as in SQL, not a failure.
    let rows = bad_rows(&got, "string_strict");
    assert_eq!(
        got["string_strict"]["columns"],
        serde_json::json!(["id", "text", "label", "label_id", "score", "probabilities"])
    );
    assert!(
        rows[0].1.is_some() && rows[1].1.is_none() && rows[2].1.is_some(),
        "{rows:?}"
    );

    // A text column that is not a string: every non-NULL row says so, the NULL one is NULL.
    let rows = bad_rows(&got, "int_lenient");
    assert!(
        refused(&rows[0], "not a string") && refused(&rows[1], "not a string"),
        "{rows:?}"
    );
    assert!(refused(&rows[2], "NULL"), "{rows:?}");

    // fail_on_error=true: the job fails with the worker's refusal.
    for case in ["binary_strict", "int_strict"] {
        let error = got[case]["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{case}: {got}"));
        assert!(
            error.contains("not a string") && error.contains("fail_on_error=False"),
            "{case}: {error}"
        );
    }

    // A refused request is split down to its rows; each gets the worker's message.
    let split = &got["split"];
    let errors = split["errors"].as_array().expect("errors");
    assert_eq!(errors.len(), 5, "{split}");
    assert!(
        errors.iter().all(|e| e
            .as_str()
            .is_some_and(|e| e.contains("refused by the worker") && e.contains("not a string"))),
        "{split}"
    );
    assert!(
        split["labels"]
            .as_array()
            .expect("labels")
            .iter()
            .all(Value::is_null)
    );
    worker.stop();
}

const MULTI_YAML: &str = "name: m\ntables:\n  reviews: { delta: lake/reviews }\n  \
    multi: { delta: lake/multi }\nstages:\n  - write:\n      to: multi\n      mode: append\n      \
    sql: SELECT id, text FROM reviews WHERE id % 3 = ${PART}\n";

#[test]
fn the_data_source_reads_a_split_query_and_tables_after_an_overwrite() {
    // `reviews`: 150 rows (the predict stage's over them, to compare labels with), then
    // overwritten by all of them (lakeml's write stage): version 1, whose one active file
    // replaced version 0's; ids 1..=150 are the same reviews in both.
    let s = setup(150);
    s.run_ok(&[PREDICT]);
    let want = predictions(&s);
    ingest(&s, ALL_REVIEWS);
    // `multi`: the same reviews in three Delta files (three appends). The server spreads a
    // scan of more than a batch (8192 rows) over one partition per core and offers each as
    // a Flight endpoint.
    s.write("multi.yaml", MULTI_YAML);
    for part in 0..3 {
        let out = pipeline_command()
            .args(["run", "-q", "multi.yaml"])
            .env("PART", part.to_string())
            .current_dir(s.path())
            .output()
            .expect("run multi.yaml");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    s.write(SERVE, &serve_yaml("  multi: { delta: lake/multi }\n"));
    let worker = Server::start(&s, SERVE);
    let (got, _) = Job::spawn(
        &s,
        &test_script("spark_datasource.py"),
        &[&worker.uri, &path(&s, "lake/reviews"), &path(&s, "")],
        "datasource",
    )
    .finish("spark_datasource.py");

    let ids = |v: &Value| -> Vec<u64> {
        v["ids"]
            .as_array()
            .unwrap_or_else(|| panic!("ids in {v}"))
            .iter()
            .map(|i| i.as_u64().expect("id"))
            .collect()
    };
    // The scan is spread over one partition per core: the server offers each as a Flight
    // endpoint, and each endpoint is a Spark partition.
    let query = &got["query"];
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let endpoints = query["flight_endpoints"].as_u64().expect("endpoints");
    assert!(
        endpoints >= cores.min(3) as u64,
        "{cores} cores, {endpoints} endpoints"
    );
    assert_eq!(query["spark_partitions"], endpoints);
    assert_eq!(query["rows"], ALL_REVIEWS);
    assert_eq!(ids(query), (1..=ALL_REVIEWS as u64).collect::<Vec<u64>>());
    assert_eq!(query["columns"], serde_json::json!(["id", "text"]));

    let labelled = &got["predicted"];
    assert_eq!(
        labelled["spark_partitions"], labelled["flight_endpoints"],
        "{labelled}"
    );
    let labels: BTreeMap<u64, String> = labelled["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            (
                r[0].as_u64().expect("id"),
                r[1].as_str().expect("label").to_string(),
            )
        })
        .collect();
    assert_eq!(labels.len(), 150);
    for (id, label) in &labels {
        assert_eq!(label, &want[id].0, "sentiment(text) of id {id}");
    }

    // lakeml's overwritten table: only version 1's file is read; version 0 still reads.
    let reviews = &got["reviews"];
    assert_eq!(reviews["version"], 1, "{reviews}");
    let on_disk = reviews["all_parquet_files"]
        .as_u64()
        .expect("all_parquet_files");
    assert!(
        on_disk > reviews["active_files"].as_u64().expect("active_files"),
        "the removed file is gone from disk, nothing to tell apart: {reviews}"
    );
    assert_eq!(
        ids(&reviews["latest"]),
        (1..=ALL_REVIEWS as u64).collect::<Vec<u64>>()
    );
    assert_eq!(
        reviews["latest"]["rows"], ALL_REVIEWS,
        "read removed files? {}",
        reviews["active_files"]
    );
    assert_eq!(ids(&reviews["v0"]), (1..=150).collect::<Vec<u64>>());

    // write_delta's table: 200 rows in 4 files, overwritten by 30 rows in 2.
    let written = &got["written"];
    assert_eq!(written["version"], 1, "{written}");
    assert_eq!(written["active_files"], 2, "{written}");
    assert_eq!(written["all_parquet_files"], 6, "{written}");
    assert_eq!(ids(&written["latest"]), (1001..=1030).collect::<Vec<u64>>());
    assert_eq!(ids(&written["v0"]), (1..=200).collect::<Vec<u64>>());
    // Row ranges of 7 over two files of 15 rows: 3 partitions each, every row once.
    let split = &written["rows_split"];
    assert_eq!(split["spark_partitions"], 6, "{split}");
    assert_eq!(split["rows"], 30, "{split}");
    assert_eq!(split["distinct_ids"], 30, "{split}");
    worker.stop();
}
