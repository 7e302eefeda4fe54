//! The predict stage end to end on real reviews with a real MiniLM classifier: predictions
//! equal transformers' logits, the table reads back in deltalake and Spark, reruns add
//! nothing, new source rows are added once, kills and concurrent runs lose nothing, and bad
//! input is refused clearly.

use std::collections::HashSet;
use std::process::{Child, Stdio};
use std::time::Duration;

use crate::common::{
    INGEST, Scratch, ingest, ingest_yaml, make_model_with, minilm, pipeline_command, python,
};

/// The predict pipeline over `reviews` (see [`predict_yaml`]).
const PREDICT: &str = "predict.yaml";

/// A predict stage over `reviews` into `preds`, with more settings (six-space indent).
fn predict_yaml(settings: &str) -> String {
    format!(
        "name: p\ntables:\n  reviews: {{ delta: lake/reviews }}\n  preds: {{ delta: lake/preds }}\n\
         stages:\n  - predict:\n      from: reviews\n      model: model\n      to: preds\n\
         {settings}"
    )
}

/// A scratch directory with a MiniLM classifier (`model/`, labels rotten/fresh, head drawn
/// with `seed`), `rows` reviews ingested, and the two pipeline files.
fn setup(rows: usize, settings: &str) -> Scratch {
    let s = Scratch::new();
    make_model(&s, "model", 0);
    s.write(INGEST, &ingest_yaml());
    s.write(PREDICT, &predict_yaml(settings));
    ingest(&s, rows);
    s
}

fn make_model(s: &Scratch, name: &str, seed: u32) {
    make_model_with(s, name, "rotten,fresh", seed);
}

fn read_delta(s: &Scratch, table: &str) -> serde_json::Value {
    python(
        "read_delta.py",
        &[s.path().join(table).to_str().expect("utf-8 path")],
    )
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

/// Asserts that `rows` holds exactly one row per id in `1..=n`.
fn one_row_per_id(table: &serde_json::Value, n: u64) {
    let rows = table["rows"].as_array().expect("rows");
    let ids: Vec<u64> = rows.iter().map(|r| r["id"].as_u64().expect("id")).collect();
    let distinct: HashSet<u64> = ids.iter().copied().collect();
    assert_eq!(
        ids.len(),
        distinct.len(),
        "duplicate ids in the predictions"
    );
    assert_eq!(distinct, (1..=n).collect::<HashSet<u64>>());
}

/// tests/py/check_predictions.py on `lake/preds` (which must keep `text` and `logits`):
/// transformers in fp32 on the same `model/` and rows, cut at `max_length` tokens.
fn check_against_transformers(s: &Scratch, max_length: usize) -> serde_json::Value {
    python(
        "check_predictions.py",
        &[
            s.path().join("lake/preds").to_str().expect("utf-8 path"),
            s.path().join("model").to_str().expect("utf-8 path"),
            &max_length.to_string(),
        ],
    )
}

#[test]
fn predictions_equal_transformers_and_read_back_in_deltalake_and_spark() {
    let s = setup(
        300,
        "      keep: [text, truth]\n      logits: true\n      max_length: 128\n      \
         batch_tokens: 512\n      batch_rows: 100\n",
    );
    let reports = s.run_ok(&[PREDICT]);
    assert_eq!(reports[0]["rows_out"], 300);

    // Tolerance: 1e-4 on logits and probabilities (fp32 on both sides).
    let check = check_against_transformers(&s, 128);
    assert_eq!(check["rows"], 300);
    assert_eq!(check["distinct_ids"], 300);
    assert!(
        check["max_logit_diff"].as_f64().expect("diff") < 1e-4,
        "{check}"
    );
    assert!(
        check["max_prob_diff"].as_f64().expect("diff") < 1e-4,
        "{check}"
    );
    assert_eq!(check["same_label"], 300, "{check}");
    assert_eq!(check["consistent"], 300, "{check}");
    assert_eq!(check["run_ids"], 1);

    let table = read_delta(&s, "lake/preds");
    one_row_per_id(&table, 300);
    assert_eq!(table["version"], 0);
    let schema = &table["schema"];
    for (name, ty) in [
        ("label", "string"),
        ("label_id", "int64"),
        ("score", "float"),
        ("model_version", "string"),
        ("run_id", "string"),
        ("predicted_at", "timestamp[us, tz=UTC]"),
    ] {
        assert_eq!(schema[name], ty, "column {name} in {schema}");
    }
    assert!(
        schema["probabilities"]
            .as_str()
            .is_some_and(|t| t.starts_with("list<") && t.contains("float")),
        "{schema}"
    );
    let tag = &table["history"][0]["lakeml"];
    assert_eq!(tag["extra"]["job"], "lakeml/p/predict-preds");
    assert_eq!(
        tag["extra"]["labels"],
        serde_json::json!(["rotten", "fresh"])
    );

    let spark = python(
        "spark_read_delta.py",
        &[
            s.path().join("lake/preds").to_str().expect("utf-8 path"),
            "id",
        ],
    );
    assert_eq!(spark["rows"], 300, "{spark}");
    assert_eq!(spark["distinct_ids"], 300, "{spark}");
    assert_eq!(spark["schema"]["probabilities"], "array<float>", "{spark}");
    let counts = spark["label_counts"].as_object().expect("label counts");
    let total: u64 = counts.values().filter_map(serde_json::Value::as_u64).sum();
    assert_eq!(total, 300);
}

#[test]
fn reruns_add_nothing_and_new_source_rows_are_predicted_once() {
    let s = setup(120, "      batch_rows: 50\n");
    let first = s.run_ok(&[PREDICT]);
    assert_eq!(first[0]["rows_out"], 120);
    assert_eq!(first[0]["version"], 0);

    // Same source version: the job's txn says it is covered; nothing is read or written.
    let again = s.run_ok(&[PREDICT]);
    assert_eq!(again[0]["cached"], true, "{again:?}");
    assert_eq!(log_versions(&s, "lake/preds"), 1);

    // Even forced, incremental mode only predicts ids the table does not hold.
    let forced = s.run_ok(&["--force", PREDICT]);
    assert_eq!(forced[0]["cached"], true, "{forced:?}");
    assert_eq!(log_versions(&s, "lake/preds"), 1);

    // New source version with 80 more rows: exactly those are added, in one commit.
    ingest(&s, 200);
    let more = s.run_ok(&[PREDICT]);
    assert_eq!(more[0]["rows_in"], 80, "{more:?}");
    assert_eq!(more[0]["version"], 1);
    let table = read_delta(&s, "lake/preds");
    one_row_per_id(&table, 200);
    let run_ids: HashSet<&str> = table["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .filter_map(|r| r["run_id"].as_str())
        .collect();
    assert_eq!(run_ids.len(), 2, "one run id per commit");
}

#[test]
fn overwrite_replaces_the_table_when_the_model_changes_and_only_then() {
    let s = setup(60, "      mode: overwrite\n");
    s.run_ok(&[PREDICT]);
    let before = read_delta(&s, "lake/preds");
    let again = s.run_ok(&[PREDICT]);
    assert_eq!(again[0]["cached"], true, "{again:?}");

    // Another head: a new model version, so the same source is predicted again.
    std::fs::remove_dir_all(s.path().join("model")).expect("rm model");
    make_model(&s, "model", 1);
    let redo = s.run_ok(&[PREDICT]);
    assert_eq!(redo[0]["cached"], false);
    assert_eq!(redo[0]["version"], 1);
    let after = read_delta(&s, "lake/preds");
    one_row_per_id(&after, 60);
    let version = |t: &serde_json::Value| t["rows"][0]["model_version"].clone();
    assert_ne!(version(&before), version(&after));
    // Version 0 is still readable (time travel), with the old model's rows.
    let old = python(
        "read_delta.py",
        &[
            s.path().join("lake/preds").to_str().expect("utf-8 path"),
            "0",
        ],
    );
    assert_eq!(version(&old), version(&before));
}

fn spawn_predict(s: &Scratch) -> Child {
    pipeline_command()
        .args(["run", "-q", PREDICT])
        .current_dir(s.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pipeline")
}

#[test]
fn kill_9_at_any_moment_leaves_the_last_version_and_a_rerun_completes_once() {
    // Version 0 holds the first 100 ids; the killed runs try to add 900 more.
    let s = setup(100, "      batch_rows: 64\n      batch_tokens: 1024\n");
    s.run_ok(&[PREDICT]);
    ingest(&s, 1000);
    // Kill moments spread over start-up, reading, predicting and writing.
    for delay_ms in [150, 600, 1200, 2500, 4000, 6000] {
        let mut child = spawn_predict(&s);
        std::thread::sleep(Duration::from_millis(delay_ms));
        let finished = child.try_wait().expect("try_wait").is_some();
        if !finished {
            child.kill().expect("kill -9");
        }
        child.wait().expect("wait");
        let table = read_delta(&s, "lake/preds");
        if finished || table["version"] == 1 {
            break; // the run got to commit before the kill: nothing left to interrupt
        }
        assert_eq!(table["version"], 0, "a killed run changed the table");
        one_row_per_id(&table, 100);
    }
    s.run_ok(&[PREDICT]);
    let table = read_delta(&s, "lake/preds");
    one_row_per_id(&table, 1000);
    assert_eq!(table["version"], 1, "one commit completes the job");
}

/// Starts two runs of the predict pipeline at once; checks that at least one committed and
/// that a run that did not says why.
fn race(s: &Scratch) {
    let runs: Vec<Child> = (0..2).map(|_| spawn_predict(s)).collect();
    let outputs: Vec<_> = runs
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait"))
        .collect();
    assert!(
        outputs.iter().any(|o| o.status.success()),
        "neither run committed"
    );
    for out in outputs.iter().filter(|o| !o.status.success()) {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("another run committed to table `preds` while this one was writing"),
            "unclear failure: {err}"
        );
    }
}

#[test]
fn two_runs_at_once_leave_one_row_per_id() {
    // Both create the table.
    let s = setup(200, "      batch_rows: 100\n");
    race(&s);
    let table = read_delta(&s, "lake/preds");
    one_row_per_id(&table, 200);
    assert_eq!(table["version"], 0, "the loser must not commit");

    // Both append the same new rows to it.
    ingest(&s, 400);
    race(&s);
    let table = read_delta(&s, "lake/preds");
    one_row_per_id(&table, 400);
    assert_eq!(table["version"], 1, "the loser must not commit");
    let again = s.run_ok(&[PREDICT]);
    assert_eq!(again[0]["cached"], true);
}

#[test]
fn bad_input_is_refused_clearly_and_leaves_the_table_unchanged() {
    let s = setup(30, "");
    s.run_ok(&[PREDICT]);

    // A column the query does not have.
    s.write("missing.yaml", &predict_yaml("      text: body\n"));
    let err = s.failing(&["run", "-q", "missing.yaml"]).exit(2);
    assert!(
        err.contains("stages[0].predict.text: column `body` not found")
            && err.contains("id, text, truth"),
        "{err}"
    );

    // A table that does not exist.
    s.write(
        "nosuch.yaml",
        &predict_yaml("").replace("from: reviews", "sql: SELECT * FROM reviewz"),
    );
    let err = s.failing(&["run", "-q", "nosuch.yaml"]).exit(2);
    assert!(
        err.contains("reviewz") && err.contains("not found"),
        "{err}"
    );

    // Labels that are not the model's.
    s.write(
        "labels.yaml",
        &predict_yaml("      labels: [negative, positive]\n"),
    );
    let err = s.failing(&["run", "-q", "labels.yaml"]).exit(2);
    assert!(
        err.contains("the model's labels do not match")
            && err.contains("[rotten, fresh]")
            && err.contains("[negative, positive]"),
        "{err}"
    );

    // Another model whose labels differ from those this job wrote into the table.
    make_model_with(&s, "other", "negative,positive", 0);
    s.write(
        "other.yaml",
        &predict_yaml("").replace("model: model", "model: other"),
    );
    let err = s.failing(&["run", "-q", "other.yaml"]).exit(1);
    assert!(
        err.contains("holds this job's predictions with labels [\"rotten\",\"fresh\"]")
            && err.contains("mode: overwrite"),
        "{err}"
    );
    assert_eq!(log_versions(&s, "lake/preds"), 1);

    // A base model with no trained head.
    s.write(
        "base.yaml",
        &predict_yaml("").replace("model: model", &format!("model: {}", minilm().display())),
    );
    let err = s.failing(&["run", "-q", "base.yaml"]).exit(2);
    assert!(err.contains("no id2label"), "{err}");

    // A null text, found while predicting: exit 1, the row named, the table unchanged.
    s.write(
        "nulls.yaml",
        &predict_yaml("").replace(
            "from: reviews",
            "sql: SELECT id + 1000 AS id, CASE WHEN id = 7 THEN NULL ELSE text END AS text FROM reviews",
        ),
    );
    let err = s.failing(&["run", "-q", "nulls.yaml"]).exit(1);
    assert!(err.contains("1007") && err.contains("null"), "{err}");
    assert!(err.contains("table `preds` is unchanged"), "{err}");
    assert_eq!(log_versions(&s, "lake/preds"), 1);

    // The same rows with `on_null: skip` are written, the null one counted and left out.
    s.write(
        "skip.yaml",
        &std::fs::read_to_string(s.path().join("nulls.yaml"))
            .expect("read")
            .replace(
                "      to: preds\n",
                "      to: preds\n      on_null: skip\n",
            ),
    );
    let reports = s.run_ok(&["skip.yaml"]);
    assert_eq!(reports[0]["rows_out"], 29);
    assert_eq!(reports[0]["rows_by_outcome"]["skipped_null"], 1);
}

#[test]
fn int8_predictions_stay_close_to_transformers_fp32_and_training_refuses_int8() {
    let s = setup(
        300,
        "      keep: [text, truth]\n      logits: true\n      max_length: 128\n      \
         precision: int8\n",
    );
    let reports = s.run_ok(&[PREDICT]);
    assert_eq!(reports[0]["rows_out"], 300);
    // Against transformers in fp32. int8 products (per-channel weights, per-token inputs)
    // move this model's logits by up to 0.33 (measured; the sentence-embedding MiniLM has
    // a few hidden channels far larger than the rest); 0.5 leaves room. The arithmetic
    // itself is checked tightly in `model::linear`'s unit tests, and label agreement on
    // the fine-tuned demo model by `scripts/bench.sh predict`.
    let check = check_against_transformers(&s, 128);
    assert_eq!(check["rows"], 300, "{check}");
    assert_eq!(check["consistent"], 300, "{check}");
    let diff = check["max_logit_diff"].as_f64().expect("diff");
    assert!(diff < 0.5, "{check}");
    assert!(diff > 0.0, "int8 predictions equal fp32 exactly: {check}");
    // The seeded head puts some rows within a hair of the decision boundary; the labels of
    // all but a few agree (measured: 299 of 300).
    assert!(
        check["same_label"].as_u64().expect("count") >= 297,
        "{check}"
    );

    // Training has no int8 path: refused when the file loads, naming the field.
    s.write(
        "train.yaml",
        &crate::train::minilm_yaml(40, "      precision: int8\n"),
    );
    let out = s.pipeline(&["validate", "train.yaml"]);
    let err = s.stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("precision: int8 is for inference") && err.contains("fp32 or bf16"),
        "{err}"
    );
}
