//! The train stage with `tracking.mlflow` against a real `mlflow server` on 127.0.0.1,
//! read back with MLflow's own Python client.

use std::process::Command;

use crate::common::{Scratch, env_path, repo};
use crate::mlflow_server::MlflowServer;
use crate::train::{minilm_yaml, report};

#[test]
fn train_logs_params_metrics_and_the_model_to_mlflow() {
    let server = MlflowServer::start();
    let s = Scratch::new();
    s.write(
        "p.yaml",
        &minilm_yaml(
            240,
            &format!(
                "      max_steps: 6\n      eval_every: 3\n      checkpoint_every: none\n      \
                 tracking:\n        mlflow: {{ uri: \"{}\", experiment: reviews, run_name: it }}\n",
                server.uri
            ),
        ),
    );
    let reports = s.run_ok(&["p.yaml"]);
    let train = report(&reports, "train");
    let run_id = train["mlflow_run_id"]
        .as_str()
        .expect("an MLflow run id")
        .to_string();

    let mlflow_python = env_path("LAKEML_MLFLOW").with_file_name("python");
    let out = Command::new(mlflow_python)
        .arg(repo().join("tests/py/mlflow_runs.py"))
        .arg(&server.uri)
        .arg(s.path().join("downloads"))
        .arg(&run_id)
        .output()
        .expect("run mlflow_runs.py");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let runs: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let run = &runs[&run_id];
    assert_eq!(run["status"], "FINISHED", "{run}");
    assert_eq!(run["experiment"], "reviews");
    assert_eq!(run["run_name"], "it");
    assert_eq!(run["params"]["lr"], "0.0001", "{}", run["params"]);
    assert_eq!(run["params"]["batch_size"], "16");
    assert_eq!(run["params"]["model_type"], "bert");
    assert_eq!(run["params"]["labels"], "fresh,rotten");
    let steps = |key: &str| -> Vec<u64> {
        run["history"][key]
            .as_array()
            .unwrap_or_else(|| panic!("no history for {key}: {}", run["history"]))
            .iter()
            .filter_map(|p| p[0].as_u64())
            .collect()
    };
    assert_eq!(steps("train/loss"), vec![2, 4, 6]);
    assert_eq!(steps("eval/accuracy"), vec![3, 6]);
    let test_accuracy: f64 = run["history"]["test/accuracy"][0][1]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN);
    assert_eq!(
        Some(test_accuracy),
        train["metrics"]["test_accuracy"].as_f64()
    );
    let artifacts: Vec<&str> = run["artifacts"]
        .as_array()
        .expect("artifacts")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    for file in [
        "model/config.json",
        "model/model.safetensors",
        "model/tokenizer.json",
    ] {
        assert!(artifacts.contains(&file), "{file} not in {artifacts:?}");
    }
    let uploaded = std::fs::read(
        s.path()
            .join("downloads")
            .join(&run_id)
            .join("model/config.json"),
    )
    .expect("downloaded config.json");
    let written = std::fs::read(s.path().join("run/model/config.json")).expect("config.json");
    assert_eq!(uploaded, written);
}
