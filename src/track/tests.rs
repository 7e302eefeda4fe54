//! Tests against the real peers: TensorBoard's reader, and an `mlflow server` started here
//! and read back with MLflow's own Python client.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::*;

#[path = "../../tests/support/mlflow_server.rs"]
mod mlflow_server;
use mlflow_server::{MlflowServer, free_port};

/// Set by scripts/test.sh (scripts/env.sh); these tests need the real peers.
fn env_path(name: &str) -> PathBuf {
    PathBuf::from(std::env::var_os(name).unwrap_or_else(|| {
        panic!("{name} is not set: run the tests with scripts/test.sh, which installs and sets it")
    }))
}

fn py_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(name)
}

/// Runs a peer script that prints one JSON document.
fn run_json(mut command: Command) -> Value {
    let out = command.output().expect("start python");
    assert!(
        out.status.success(),
        "{command:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("peer prints JSON")
}

fn read_jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("read metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect()
}

/// A float a peer printed with Python's repr(), parsed exactly (serde_json's default float
/// parser may be one ulp off).
fn float(v: &Value) -> f64 {
    let text = v
        .as_str()
        .unwrap_or_else(|| panic!("a repr() string, got {v}"));
    text.parse().unwrap_or_else(|e| panic!("{text:?}: {e}"))
}

/// The exact `time` of a metrics.jsonl line, read from its text for the same reason.
fn line_time(line: &str) -> f64 {
    let rest = line.split_once(r#","time":"#).expect("time").1;
    rest[..rest.find([',', '}']).expect("end")]
        .parse()
        .expect("time")
}

fn settings(uri: &str, run_name: Option<&str>) -> MlflowSettings {
    MlflowSettings {
        uri: uri.to_string(),
        experiment: "lakeml-tests".to_string(),
        run_name: run_name.map(str::to_string),
    }
}

#[test]
fn crc32c_matches_known_vectors() {
    // The check value from the CRC catalogue and the iSCSI vectors of RFC 3720 B.4.
    assert_eq!(tensorboard::crc32c(b""), 0);
    assert_eq!(tensorboard::crc32c(b"123456789"), 0xe306_9283);
    assert_eq!(tensorboard::crc32c(&[0u8; 32]), 0x8a91_36aa);
    assert_eq!(tensorboard::crc32c(&[0xffu8; 32]), 0x62a8_ab43);
    let ascending: Vec<u8> = (0..32).collect();
    assert_eq!(tensorboard::crc32c(&ascending), 0x46dd_794e);
    let descending: Vec<u8> = (0..32).rev().collect();
    assert_eq!(tensorboard::crc32c(&descending), 0x113f_db5c);
}

#[test]
fn metrics_jsonl_keeps_call_order_and_writes_non_finite_as_null() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut tracker = Tracker::open(dir.path(), None, None).expect("open");
    let params = [("lr".to_string(), "2e-05".to_string())];
    tracker.params(&params).expect("params");
    tracker
        .scalars(
            3,
            &[("train/loss", f64::NAN), ("b", 0.1), ("a", f64::INFINITY)],
        )
        .expect("scalars");
    let lines = std::fs::read_to_string(dir.path().join("metrics.jsonl")).expect("read");
    let lines: Vec<&str> = lines.lines().collect();
    assert_eq!(lines[0], r#"{"params":{"lr":"2e-05"}}"#);
    assert!(lines[1].starts_with(r#"{"step":3,"time":"#), "{}", lines[1]);
    assert!(line_time(lines[1]) > 1.7e9);
    assert!(lines[1].ends_with(r#","train/loss":null,"b":0.1,"a":null}"#));
    assert_eq!(lines.len(), 2);
}

#[test]
fn tensorboard_reads_back_every_scalar_with_its_step_and_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run_dir = dir.path().join("run");
    let mut tracker = Tracker::open(&run_dir, None, None).expect("open");
    let mut logged: Vec<(String, u64, f64)> = Vec::new();
    let mut log = |tracker: &mut Tracker, step: u64, values: &[(&str, f64)]| {
        tracker.scalars(step, values).expect("scalars");
        logged.extend(values.iter().map(|(k, v)| (k.to_string(), step, *v)));
    };
    for step in 0..60u64 {
        let s = step as f64;
        log(
            &mut tracker,
            step,
            &[
                ("train/loss", 2.0 / (s + 1.0) + 0.1),
                ("train/lr", 2e-5 * (1.0 - s / 60.0)),
            ],
        );
        if step % 20 == 19 {
            log(&mut tracker, step, &[("eval/accuracy", 0.5 + s / 200.0)]);
        }
    }
    // A step past u32 and a value past f32's precision: both must survive the varint and
    // the float narrowing exactly as TensorBoard sees them.
    log(&mut tracker, 5_000_000_000, &[("train/loss", 1.0 / 3.0)]);

    // Read while the tracker is still open: everything must already be on disk.
    let tb_dir = run_dir.join("tensorboard");
    let mut command = Command::new(env_path("LAKEML_PYTHON"));
    command.arg(py_script("read_tensorboard.py")).arg(&tb_dir);
    let got = run_json(command);

    let files = got["files"].as_array().expect("files");
    assert_eq!(files.len(), 1, "{got}");
    let name = files[0].as_str().expect("name");
    assert!(
        name.starts_with("events.out.tfevents.") && name.ends_with(".lakeml"),
        "{name}"
    );
    assert_eq!(got["file_version"], "brain.Event:2");
    assert_eq!(got["records"], 1 + logged.len());

    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("read jsonl");
    let jsonl: Vec<(Value, &str)> = text
        .lines()
        .map(|l| (serde_json::from_str(l).expect("JSON line"), l))
        .collect();
    let scalars = got["scalars"].as_object().expect("scalars");
    let mut tags: Vec<&str> = scalars.keys().map(String::as_str).collect();
    tags.sort();
    assert_eq!(tags, ["eval/accuracy", "train/loss", "train/lr"]);
    for tag in tags {
        let want: Vec<&(String, u64, f64)> = logged.iter().filter(|(t, ..)| t == tag).collect();
        let points = scalars[tag].as_array().expect("points");
        assert_eq!(points.len(), want.len(), "{tag}");
        for (point, (_, step, value)) in points.iter().zip(want) {
            assert_eq!(point[0].as_u64(), Some(*step), "{tag}");
            // TensorBoard keeps simple_value as a 32-bit float.
            assert_eq!(float(&point[1]), *value as f32 as f64, "{tag} at {step}");
            // The event's wall time is the jsonl line's time, to the bit.
            let (_, line) = jsonl
                .iter()
                .find(|(l, _)| l["step"] == *step && l.get(tag).is_some())
                .expect("a jsonl line for every event");
            assert_eq!(float(&point[2]), line_time(line), "{tag} at {step}");
        }
    }
    tracker.finish(true).expect("finish");
}

/// Deterministic bytes that do not compress, so the upload is really 2.5 MB.
fn noise(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn loss(step: u64) -> f64 {
    3.0 / (step as f64 + 1.0).sqrt() + 0.01 * (step as f64).sin()
}

#[test]
fn mlflow_run_gets_params_metrics_artifacts_status_and_resumes() {
    let server = MlflowServer::start();
    let scratch = tempfile::tempdir().expect("tempdir");
    let run_dir = scratch.path().join("run");

    let mut tracker =
        Tracker::open(&run_dir, Some(settings(&server.uri, Some("first"))), None).expect("open");
    let run_id = tracker.mlflow_run_id().expect("an MLflow run").to_string();
    assert_eq!(server.run_info(&run_id)["status"], "RUNNING");

    // Multi-byte characters: MLflow's limit counts characters, not bytes.
    let long = "é".repeat(7000);
    let params = vec![
        ("model".to_string(), "all-MiniLM-L6-v2".to_string()),
        ("lr".to_string(), "2e-05".to_string()),
        ("notes".to_string(), long.clone()),
    ];
    tracker.params(&params).expect("params");
    for step in 0..200u64 {
        let grad_norm = match step {
            13 => f64::NAN,
            14 => f64::INFINITY,
            _ => 1.0 + step as f64 / 100.0,
        };
        let mut values = vec![
            ("train/loss", loss(step)),
            ("train/lr", 2e-5 * (1.0 - step as f64 / 200.0)),
            ("train/grad_norm", grad_norm),
        ];
        if step % 50 == 49 {
            values.push(("eval/accuracy", 0.6 + step as f64 / 1000.0));
        }
        tracker.scalars(step, &values).expect("scalars");
    }

    let model = scratch.path().join("model");
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("config.json", br#"{"model_type": "bert"}"#.to_vec()),
        ("weights/model.safetensors", noise(2_500_000)),
        ("weights/deep/er/note with space.txt", b"nested\n".to_vec()),
        ("tokenizer.json", b"{}".to_vec()),
    ];
    for (rel, bytes) in &files {
        let path = model.join(rel);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&path, bytes).expect("write artifact");
    }
    tracker.artifacts(&model, "model").expect("artifacts");
    tracker.finish(true).expect("finish");
    // 200 scalars calls (about 650 points) went out in a few batches, not one request a step.
    let batches = server
        .log_text()
        .matches("POST /api/2.0/mlflow/runs/log-batch")
        .count();
    assert!((2..=10).contains(&batches), "{batches} log-batch requests");
    let info = server.run_info(&run_id);
    assert_eq!(info["status"], "FINISHED");
    assert!(info["end_time"].as_i64().is_some(), "{info}");
    drop(tracker);

    // Resume: the same run, reopened, takes the same params again and more steps.
    let mut resumed =
        Tracker::open(&run_dir, Some(settings(&server.uri, None)), Some(&run_id)).expect("resume");
    assert_eq!(resumed.mlflow_run_id(), Some(run_id.as_str()));
    assert_eq!(server.run_info(&run_id)["status"], "RUNNING");
    resumed.params(&params).expect("same params again");
    let changed = [("lr".to_string(), "1e-3".to_string())];
    let error = resumed
        .params(&changed)
        .expect_err("MLflow refuses a changed param");
    let message = error.to_string();
    assert!(
        message.contains("HTTP 400 Bad Request: INVALID_PARAMETER_VALUE: Changing param values"),
        "{message}"
    );
    for step in 200..230u64 {
        resumed
            .scalars(step, &[("train/loss", loss(step))])
            .expect("scalars");
    }
    resumed.finish(true).expect("finish resumed");
    drop(resumed);

    let error = Tracker::open(
        &scratch.path().join("unknown"),
        Some(settings(&server.uri, None)),
        Some("0123456789abcdef0123456789abcdef"),
    )
    .err()
    .expect("an unknown run cannot be resumed");
    let message = error.to_string();
    assert!(
        message.contains(&format!(
            "cannot resume MLflow run 0123456789abcdef0123456789abcdef: {} has no such run",
            server.uri
        )),
        "{message}"
    );

    // A tracker dropped without finish (the trainer bailed out) leaves a FAILED run.
    let dropped_dir = scratch.path().join("dropped");
    let mut dropped = Tracker::open(
        &dropped_dir,
        Some(settings(&server.uri, Some("dropped"))),
        None,
    )
    .expect("open");
    let dropped_id = dropped.mlflow_run_id().expect("run").to_string();
    dropped.scalars(0, &[("train/loss", 1.5)]).expect("scalars");
    drop(dropped);

    let download = scratch.path().join("download");
    let python = env_path("LAKEML_MLFLOW").with_file_name("python");
    let mut command = Command::new(python);
    command
        .arg(py_script("mlflow_runs.py"))
        .arg(&server.uri)
        .arg(&download)
        .args([&run_id, &dropped_id])
        .env("MLFLOW_DISABLE_TELEMETRY", "true");
    let runs = run_json(command);

    let run = &runs[&run_id];
    assert_eq!(run["status"], "FINISHED");
    assert_eq!(run["run_name"], "first");
    assert_eq!(run["experiment"], "lakeml-tests");
    assert_eq!(run["params"]["model"], "all-MiniLM-L6-v2");
    assert_eq!(run["params"]["lr"], "2e-05");
    assert_eq!(run["params"]["notes"], "é".repeat(6000));

    // (step, value bits): bits compare NaN too, and exactly.
    let history = |key: &str| -> Vec<(u64, u64)> {
        let mut points: Vec<(u64, u64)> = run["history"][key]
            .as_array()
            .unwrap_or_else(|| panic!("no history for {key}: {run}"))
            .iter()
            .map(|p| (p[0].as_u64().expect("step"), float(&p[1]).to_bits()))
            .collect();
        points.sort();
        points
    };
    let want: Vec<(u64, u64)> = (0..230).map(|s| (s, loss(s).to_bits())).collect();
    assert_eq!(
        history("train/loss"),
        want,
        "train/loss, both sessions, exact values"
    );
    let grad_norm = history("train/grad_norm");
    assert_eq!(grad_norm.len(), 200);
    assert!(f64::from_bits(grad_norm[13].1).is_nan(), "{grad_norm:?}");
    // MLflow's SQL store keeps infinities as ±f64::MAX (`sanitize_metric_value` in
    // mlflow/store/tracking/sqlalchemy_store.py); what matters is that the batch was taken.
    assert_eq!(grad_norm[14], (14, f64::MAX.to_bits()));
    assert_eq!(grad_norm[15], (15, (1.0 + 15.0 / 100.0f64).to_bits()));
    let accuracy: Vec<u64> = history("eval/accuracy").iter().map(|p| p.0).collect();
    assert_eq!(accuracy, [49, 99, 149, 199]);

    let listed: Vec<&str> = run["artifacts"]
        .as_array()
        .expect("artifacts")
        .iter()
        .map(|v| v.as_str().expect("path"))
        .collect();
    let mut want_listed: Vec<String> = files
        .iter()
        .map(|(rel, _)| format!("model/{rel}"))
        .collect();
    want_listed.sort();
    assert_eq!(listed, want_listed);
    for (rel, bytes) in &files {
        let got = std::fs::read(download.join(&run_id).join("model").join(rel))
            .unwrap_or_else(|e| panic!("downloaded artifact {rel}: {e}"));
        assert!(got == *bytes, "artifact {rel} differs after the round trip");
    }

    let dropped = &runs[&dropped_id];
    assert_eq!(dropped["status"], "FAILED");
    assert!(dropped["end_time"].as_i64().is_some(), "{dropped}");
    assert_eq!(float(&dropped["history"]["train/loss"][0][1]), 1.5);

    // The local record holds both sessions: every params call (also the one MLflow refused,
    // since the local files do not depend on the server) and 200 + 30 steps.
    let jsonl = read_jsonl(&run_dir.join("metrics.jsonl"));
    let params_lines = jsonl.iter().filter(|l| l.get("params").is_some()).count();
    assert_eq!(params_lines, 3);
    assert_eq!(
        jsonl.iter().filter(|l| l.get("step").is_some()).count(),
        230
    );
    assert_eq!(
        jsonl[0]["params"]["notes"], long,
        "metrics.jsonl keeps the whole value"
    );
    drop(server);
}

#[test]
fn mlflow_uri_with_nothing_listening_fails_fast_and_says_what_to_check() {
    let dir = tempfile::tempdir().expect("tempdir");
    let uri = format!("http://127.0.0.1:{}", free_port());
    let started = Instant::now();
    let error = Tracker::open(dir.path(), Some(settings(&uri, None)), None)
        .err()
        .expect("open must fail");
    let elapsed = started.elapsed();
    let message = error.to_string();
    assert!(matches!(error, Error::Tracking(_)), "{error:?}");
    assert!(
        message.contains(&format!("is the MLflow server running at {uri}")),
        "{message}"
    );
    assert!(message.contains("Connection refused"), "{message}");
    // A refused connection is final: no retries, no waiting out the 30 s request timeout.
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
}

#[test]
fn mlflow_uri_that_is_not_http_is_refused_before_any_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    let error = Tracker::open(dir.path(), Some(settings("file:///tmp/mlruns", None)), None)
        .err()
        .expect("open must fail");
    insta::assert_snapshot!(error.to_string());
}
