//! The train stage end to end on real data (Rotten Tomatoes, MiniLM): the model it writes
//! loads in `transformers` and scores the test split as lakeml reported, a killed run
//! resumes to the weights an uninterrupted one ends with, and bad input is refused clearly.

use std::time::{Duration, Instant};

use crate::common::{Scratch, assets, minilm, pipeline_command, python, repo};

/// A pipeline: `rows` real reviews → `reviews` → tokenized (MiniLM, max_length 64) → one
/// train stage with `settings` (lines indented by six spaces), writing into `run/`.
fn train_yaml(rows: usize, model: &str, source: &str, settings: &str) -> String {
    format!(
        r#"name: t
tables:
  rt: {{ csv: {csv} }}
  reviews: {{ delta: lake/reviews }}
  tokenized: {{ delta: lake/tokenized }}
stages:
  - write:
      to: reviews
      sql: |
        SELECT CAST(row_number() OVER (ORDER BY text, movie_name) AS BIGINT) AS id, text,
               category AS label,
               CASE WHEN row_number() OVER (ORDER BY text, movie_name) % 5 = 0 THEN 'validation'
                    WHEN row_number() OVER (ORDER BY text, movie_name) % 5 = 1 THEN 'test'
                    ELSE 'train' END AS split
        FROM rt WHERE category IN ('fresh', 'rotten')
        ORDER BY text LIMIT {rows}
  - tokenize:
      from: reviews
      tokenizer: {tokenizer}
      label: label
      keep: [split]
      max_length: 64
      to: tokenized
  - train:
{source}
      model: {model}
      output: run
      batch_size: 16
      lr: 1.0e-4
      log_every: 2
{settings}"#,
        csv = assets()
            .join("rotten_tomatoes/rotten_tomatoes_corpus_full.csv.bz2")
            .display(),
        tokenizer = minilm().display(),
    )
}

pub fn minilm_yaml(rows: usize, settings: &str) -> String {
    train_yaml(
        rows,
        &minilm().display().to_string(),
        "      from: tokenized",
        settings,
    )
}

pub fn report<'a>(reports: &'a [serde_json::Value], kind: &str) -> &'a serde_json::Value {
    reports
        .iter()
        .find(|r| r["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} report in {reports:?}"))
}

#[test]
fn trained_model_loads_in_transformers_and_scores_the_test_split_as_lakeml_reported() {
    let s = Scratch::new();
    let yaml = |max_steps: u32| {
        minilm_yaml(
            320,
            &format!(
                "      max_steps: {max_steps}\n      eval_every: 6\n      checkpoint_every: 4\n      \
                 keep_checkpoints: 2\n      best_metric: accuracy\n"
            ),
        )
    };
    s.write("p.yaml", &yaml(12));
    let reports = s.run_ok(&["p.yaml"]);
    let train = report(&reports, "train");
    let m = &train["metrics"];
    assert_eq!(m["steps"], 12.0, "{train}");
    let run = s.path().join("run");
    let hf = python(
        "check_model.py",
        &[
            run.join("model").to_str().unwrap(),
            s.path().join("lake/tokenized").to_str().unwrap(),
        ],
    );
    assert_eq!(
        hf["id2label"],
        serde_json::json!({"0": "fresh", "1": "rotten"}),
        "{hf}"
    );
    assert_eq!(
        hf["label2id"],
        serde_json::json!({"fresh": 0, "rotten": 1}),
        "{hf}"
    );
    assert_eq!(
        hf["architectures"],
        serde_json::json!(["BertForSequenceClassification"])
    );
    assert_eq!(hf["rows"], 64.0, "{hf}");
    // Same weights, same logits: the test loss agrees to float32 noise, accuracy exactly.
    let (ours, theirs) = (
        m["test_loss"].as_f64().unwrap_or(f64::NAN),
        hf["loss"].as_f64().unwrap_or(f64::NAN),
    );
    assert!(
        (ours - theirs).abs() < 1e-4,
        "test loss: lakeml {ours}, transformers {theirs}"
    );
    assert_eq!(m["test_accuracy"], hf["accuracy"], "{m} vs {hf}");

    // Logs: JSON lines with training and eval metrics, TensorBoard events, checkpoints.
    let jsonl = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics.jsonl");
    assert!(
        jsonl.contains("\"train/loss\"") && jsonl.contains("\"eval/f1_macro\""),
        "{jsonl}"
    );
    let tb = std::fs::read_dir(run.join("tensorboard"))
        .expect("tensorboard dir")
        .count();
    assert_eq!(tb, 1);
    let mut checkpoints: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .expect("checkpoints")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    checkpoints.sort();
    assert_eq!(checkpoints, vec!["best", "step-00000008", "step-00000012"]);

    // Unchanged inputs and settings: the stage is skipped.
    let again = s.run_ok(&["p.yaml"]);
    assert_eq!(report(&again, "train")["cached"], true, "{again:?}");

    // Other settings: the checkpoints are not resumed, and the run says why in one line
    // before it starts over.
    s.write("p.yaml", &yaml(1));
    let out = s.pipeline(&["run", "-q", "p.yaml"]);
    let stderr = s.stderr(&out);
    assert!(out.status.success(), "{stderr}");
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("checkpoint step-00000012"))
        .collect();
    assert_eq!(said.len(), 1, "{stderr}");
    assert!(
        said[0].contains("(step 12) was written for other inputs (changed: settings.max_steps)")
            && said[0].contains("starts from step 0"),
        "{stderr}"
    );
}

/// Waits until `path` exists, for at most `limit`.
fn wait_for(path: &std::path::Path, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn a_killed_run_resumes_to_the_same_weights_as_an_uninterrupted_run() {
    let settings = "      max_steps: 10\n      eval_every: none\n      checkpoint_every: 3\n      \
                    save: final\n      threads: 1\n";
    let whole = Scratch::new();
    whole.write("p.yaml", &minilm_yaml(240, settings));
    whole.run_ok(&["p.yaml"]);

    let cut = Scratch::new();
    cut.write("p.yaml", &minilm_yaml(240, settings));
    let mut child = pipeline_command()
        .args(["run", "-q", "p.yaml"])
        .current_dir(cut.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let checkpoint = cut.path().join("run/checkpoints/step-00000006/state.json");
    let reached = wait_for(&checkpoint, Duration::from_secs(300));
    child.kill().expect("kill -9"); // SIGKILL: no chance to clean up
    let _ = child.wait();
    assert!(reached, "the run never wrote its step-6 checkpoint");
    assert!(
        !cut.path().join("run/model/model.safetensors").exists(),
        "killed before the end, yet a model directory looks complete"
    );

    let reports = cut.run_ok(&["p.yaml"]);
    let train = report(&reports, "train");
    let resumed = train["resumed_from"].as_u64().unwrap_or_default();
    assert!(resumed >= 6, "{train}");
    let cmp = python(
        "compare_weights.py",
        &[
            whole
                .path()
                .join("run/model/model.safetensors")
                .to_str()
                .unwrap(),
            cut.path()
                .join("run/model/model.safetensors")
                .to_str()
                .unwrap(),
        ],
    );
    assert_eq!(cmp["names_equal"], true, "{cmp}");
    assert_eq!(
        cmp["max_abs_diff"], 0.0,
        "resumed from step {resumed}: {cmp}"
    );
}

#[test]
fn null_labels_and_a_single_class_are_refused_and_leave_no_model() {
    let s = Scratch::new();
    let null = train_yaml(
        120,
        &minilm().display().to_string(),
        "      sql: SELECT id, input_ids, CASE WHEN id = 7 THEN NULL ELSE label END AS label, split FROM tokenized",
        "      max_steps: 2\n",
    );
    s.write("null.yaml", &null);
    let (code, err) = s.failing(&["run", "-q", "null.yaml"]).outcome();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("row id 7: `label` is null"), "{err}");
    assert!(!s.path().join("run/model").exists(), "{err}");

    let one = train_yaml(
        120,
        &minilm().display().to_string(),
        "      sql: SELECT * FROM tokenized WHERE label = 0",
        "      max_steps: 2\n",
    );
    s.write("one.yaml", &one);
    let (code, err) = s.failing(&["run", "-q", "one.yaml"]).outcome();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("only one class (fresh)"), "{err}");
    assert!(!s.path().join("run/model").exists(), "{err}");
}

/// A model directory `name` in the scratch dir: the tiny BERT fixture's weights, its
/// config.json changed by `patch`, and MiniLM's tokenizer.
fn fixture_model(s: &Scratch, name: &str, patch: impl FnOnce(&mut serde_json::Value)) {
    let model = s.path().join(name);
    std::fs::create_dir_all(&model).expect("mkdir");
    let fixture = repo().join("tests/fixtures/models/bert");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture.join("config.json")).expect("read"))
            .expect("json");
    patch(&mut config);
    std::fs::write(model.join("config.json"), config.to_string()).expect("write");
    std::fs::copy(
        fixture.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .expect("copy");
    std::fs::copy(
        minilm().join("tokenizer.json"),
        model.join("tokenizer.json"),
    )
    .expect("copy");
}

#[test]
fn a_tokenizer_that_does_not_match_the_model_is_refused() {
    // The tiny BERT fixture has a 512-token vocabulary; MiniLM's tokenizer goes to 30,521.
    let s = Scratch::new();
    fixture_model(&s, "tiny", |_| {});
    s.write(
        "p.yaml",
        &train_yaml(120, "tiny", "      from: tokenized", "      max_steps: 2\n"),
    );
    let (code, err) = s.failing(&["run", "-q", "p.yaml"]).outcome();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("is outside the model's vocabulary (vocab_size 512)")
            && err.contains("tokenizer that does not match the model"),
        "{err}"
    );
}

#[test]
fn a_model_without_tokenizer_and_cuda_without_a_gpu_fail_validation() {
    let s = Scratch::new();
    let fixture = repo().join("tests/fixtures/models/bert");
    s.write(
        "p.yaml",
        &train_yaml(
            120,
            &fixture.display().to_string(),
            "      from: tokenized",
            "",
        ),
    );
    let (code, err) = s.failing(&["run", "-q", "p.yaml"]).outcome();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("stages[2].train.model") && err.contains("has no tokenizer.json"),
        "{err}"
    );

    s.write("cuda.yaml", &minilm_yaml(120, "      device: cuda\n"));
    let (code, err) = s.failing(&["run", "-q", "cuda.yaml"]).outcome();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(
            "stages[2].train.device: `cuda` asks for CUDA, but libtorch finds no CUDA GPU"
        ),
        "{err}"
    );
}

#[test]
fn early_stopping_stops_when_the_metric_stalls() {
    // A min_delta no loss change can beat: the second evaluation already counts as stale.
    let s = Scratch::new();
    s.write(
        "p.yaml",
        &minilm_yaml(
            240,
            "      max_steps: 12\n      eval_every: 2\n      checkpoint_every: none\n      \
             early_stopping: { metric: loss, patience: 1, min_delta: 100.0 }\n",
        ),
    );
    let reports = s.run_ok(&["p.yaml"]);
    let train = report(&reports, "train");
    assert_eq!(train["stopped_early"], true, "{train}");
    assert_eq!(train["metrics"]["steps"], 4.0, "{train}");
    let jsonl = std::fs::read_to_string(s.path().join("run/metrics.jsonl")).expect("jsonl");
    assert_eq!(jsonl.matches("\"eval/loss\"").count(), 2, "{jsonl}");
}

#[test]
fn running_out_of_memory_is_a_clear_error_not_a_crash() {
    // A config whose feed-forward layers need ~256 GB: the allocation fails in libtorch.
    let s = Scratch::new();
    fixture_model(&s, "huge", |config| {
        config["vocab_size"] = 30522.into();
        config["intermediate_size"] = 2_000_000_000i64.into();
    });
    s.write(
        "p.yaml",
        &train_yaml(120, "huge", "      from: tokenized", "      max_steps: 2\n"),
    );
    let (code, err) = s.failing(&["run", "-q", "p.yaml"]).outcome();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("out of memory") && err.contains("lower `batch_size`"),
        "{err}"
    );
    assert!(
        !err.contains("panicked"),
        "a raw panic reached the user:\n{err}"
    );
    assert!(!s.path().join("run/model").exists());
}

/// Stages: `rows` Rotten Tomatoes reviews into `reviews` with the id column `{id_sql} AS
/// {id}` (`n`: the review's number, by text) and a split by `n`, then tokenized with MiniLM
/// into `tokenized`, keyed by `id`. Tables `rt`, `reviews` and `tokenized` come from
/// [`TABLES`].
fn reviews_tokenized(rows: usize, id_sql: &str, id: &str) -> String {
    format!(
        r#"  - write:
      to: reviews
      sql: |
        SELECT {id_sql} AS {id}, text, label,
               CASE WHEN n % 5 = 0 THEN 'validation' WHEN n % 5 = 1 THEN 'test'
                    ELSE 'train' END AS split
        FROM (SELECT CAST(row_number() OVER (ORDER BY text, movie_name) AS BIGINT) AS n,
                     text, category AS label
              FROM rt WHERE category IN ('fresh', 'rotten') ORDER BY text LIMIT {rows})
  - tokenize:
      from: reviews
      tokenizer: {tokenizer}
      id: {id}
      label: label
      keep: [split]
      max_length: 64
      to: tokenized
"#,
        tokenizer = minilm().display(),
    )
}

/// The tables of [`reviews_tokenized`], and `more` (entries indented by two spaces).
fn tables(more: &str) -> String {
    format!(
        "tables:\n  rt: {{ csv: {csv} }}\n  reviews: {{ delta: lake/reviews }}\n  \
         tokenized: {{ delta: lake/tokenized }}\n{more}",
        csv = assets()
            .join("rotten_tomatoes/rotten_tomatoes_corpus_full.csv.bz2")
            .display()
    )
}

/// A train stage named `name` reading `from` into `output`, a few exact steps.
fn short_train(name: &str, from: &str, output: &str) -> String {
    format!(
        "  - train:\n      name: {name}\n      from: {from}\n      model: {model}\n      \
         output: {output}\n      batch_size: 8\n      max_steps: 4\n      eval_every: none\n      \
         save: final\n      threads: 1\n",
        model = minilm().display()
    )
}

/// A Delta table as tests/py/read_delta.py reads it.
fn read_table(s: &Scratch, table: &str) -> serde_json::Value {
    python(
        "read_delta.py",
        &[s.path().join(table).to_str().expect("utf-8 path")],
    )
}

/// The first column of a Delta table as stored (files in the log's order, then rows).
fn stored_ids(s: &Scratch, table: &str) -> Vec<serde_json::Value> {
    read_table(s, table)["stored_order"]
        .as_array()
        .expect("stored_order")
        .clone()
}

#[test]
fn the_same_rows_in_another_file_and_row_order_train_the_same_weights() {
    let s = Scratch::new();
    // `in_order`: the tokenized rows by id, one file. `shuffled`: the same rows in two
    // files, odd ids descending, then even ids by length.
    let file = format!(
        "name: order\n{tables}stages:\n{prep}{copies}{a}{b}",
        tables =
            tables("  in_order: { delta: lake/in_order }\n  shuffled: { delta: lake/shuffled }\n"),
        prep = reviews_tokenized(96, "n", "id"),
        copies = "  - write:\n      to: in_order\n      sql: SELECT * FROM tokenized ORDER BY id\n  \
                  - write:\n      name: odd\n      to: shuffled\n      sql: SELECT * FROM \
                  tokenized WHERE id % 2 = 1 ORDER BY id DESC\n  - write:\n      name: even\n      \
                  to: shuffled\n      mode: append\n      sql: SELECT * FROM tokenized WHERE id % 2 \
                  = 0 ORDER BY length, id DESC\n",
        a = short_train("a", "in_order", "run_a"),
        b = short_train("b", "shuffled", "run_b"),
    );
    s.write("order.yaml", &file);
    s.run_ok(&["order.yaml"]);
    let (a, b) = (
        stored_ids(&s, "lake/in_order"),
        stored_ids(&s, "lake/shuffled"),
    );
    let sorted = |v: &[serde_json::Value]| {
        let mut ids: Vec<u64> = v.iter().map(|i| i.as_u64().expect("id")).collect();
        ids.sort_unstable();
        ids
    };
    assert_eq!(sorted(&a), sorted(&b), "not the same rows");
    assert_ne!(a, b, "the two tables hold their rows in the same order");
    let weights = |run: &str| {
        s.path()
            .join(run)
            .join("model/model.safetensors")
            .to_str()
            .expect("utf-8 path")
            .to_string()
    };
    let cmp = python(
        "compare_weights.py",
        &[&weights("run_a"), &weights("run_b")],
    );
    assert_eq!(cmp["names_equal"], true, "{cmp}");
    assert_eq!(cmp["max_abs_diff"], 0.0, "{cmp}");
}

#[test]
fn string_ids_tokenize_train_and_predict_end_to_end() {
    let s = Scratch::new();
    let id_sql = "'review-' || CAST(n AS VARCHAR)";
    // Tokenized in one file: `tokenized` records `doc_id` as its id column...
    s.write(
        "prep.yaml",
        &format!(
            "name: prep\n{}stages:\n{}",
            tables(""),
            reviews_tokenized(80, id_sql, "doc_id")
        ),
    );
    s.run_ok(&["prep.yaml"]);
    // ...which a train stage in another file reads without being told; the predict stage
    // keys its rows by the same strings.
    let fit = format!(
        "name: fit\n{tables}stages:\n{train}  - predict:\n      from: reviews\n      \
         model: run/model\n      id: doc_id\n      to: preds\n",
        tables = tables("  preds: { delta: lake/preds }\n"),
        train = short_train("train", "tokenized", "run"),
    );
    s.write("fit.yaml", &fit);
    let reports = s.run_ok(&["fit.yaml"]);
    assert_eq!(
        report(&reports, "train")["metrics"]["steps"],
        4.0,
        "{reports:?}"
    );
    let ids: Vec<String> = read_table(&s, "lake/preds")["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| r["doc_id"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(ids.len(), 80, "{ids:?}");
    assert!(ids.iter().all(|i| i.starts_with("review-")), "{ids:?}");
    // In one file, the tokenize stage that writes the table names the id column.
    s.write(
        "both.yaml",
        &format!(
            "name: both\n{}stages:\n{}{}",
            tables(""),
            reviews_tokenized(80, id_sql, "doc_id"),
            short_train("train", "tokenized", "run2")
        ),
    );
    let out = s.pipeline(&["validate", "both.yaml"]);
    assert!(out.status.success(), "{}", s.stderr(&out));
    // Anything else is refused when the file loads, naming `id:`.
    s.write(
        "wrong.yaml",
        &format!(
            "name: wrong\n{}stages:\n{}",
            tables(""),
            short_train("train", "reviews", "run3")
        ),
    );
    let out = s.pipeline(&["validate", "wrong.yaml"]);
    let err = s.stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("column `id` not found") && err.contains("`id:` names the id column"),
        "{err}"
    );
}
