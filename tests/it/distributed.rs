//! Data-parallel training on libtorch's c10d (gloo, 127.0.0.1): N ranks × batch B train the
//! weights one process trains with batch N·B; `--nproc` and torchrun (a real launcher, with
//! its agent store) give bitwise the same model; a rank killed with -9 stops the others
//! with a message naming it, the rerun resumes to the uninterrupted run's weights, and one
//! process resumes the same checkpoint too; bad launches fail before anything is written;
//! Spark barrier tasks (lakeml_spark.train) train what `--nproc` trains.

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{Scratch, assets, env_path, minilm, pipeline_bin, pipeline_command, python};
use crate::spark::{Job, test_script};

/// MiniLM with dropout off: N ranks draw other dropout masks than one process does (masks
/// follow each rank's own tensor), so the equivalence is shown without dropout.
fn dropout_free_minilm(s: &Scratch) {
    let dir = s.path().join("minilm");
    std::fs::create_dir_all(&dir).expect("mkdir");
    for entry in std::fs::read_dir(minilm()).expect("read minilm") {
        let path = entry.expect("entry").path();
        if path.is_file() {
            std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
        }
    }
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
    config["hidden_dropout_prob"] = 0.0.into();
    config["attention_probs_dropout_prob"] = 0.0.into();
    std::fs::write(&path, config.to_string()).expect("write");
}

/// 600 real reviews (a fifth for validation), tokenized, then one train stage with
/// `batch_size` and `settings` (lines indented by six spaces), writing `run/`.
fn dp_yaml(batch_size: usize, settings: &str) -> String {
    format!(
        r#"name: dp
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
               CASE WHEN row_number() OVER (ORDER BY text, movie_name) % 5 = 0
                    THEN 'validation' ELSE 'train' END AS split
        FROM rt WHERE category IN ('fresh', 'rotten')
        ORDER BY text LIMIT 600
  - tokenize:
      from: reviews
      tokenizer: minilm
      label: label
      keep: [split]
      max_length: 64
      to: tokenized
  - train:
      from: tokenized
      model: minilm
      output: run
      batch_size: {batch_size}
      lr: 1.0e-4
      log_every: 5
      save: final
      threads: 1
{settings}"#,
        csv = assets()
            .join("rotten_tomatoes/rotten_tomatoes_corpus_full.csv.bz2")
            .display(),
    )
}

fn scratch(batch_size: usize, settings: &str) -> Scratch {
    let s = Scratch::new();
    dropout_free_minilm(&s);
    s.write("p.yaml", &dp_yaml(batch_size, settings));
    s
}

fn weights(s: &Scratch) -> String {
    s.path()
        .join("run/model/model.safetensors")
        .display()
        .to_string()
}

fn train_report(reports: &[serde_json::Value]) -> serde_json::Value {
    crate::train::report(reports, "train").clone()
}

/// `pipeline run -q p.yaml` as rank `rank` of `world`, by torchrun's environment.
fn rank(s: &Scratch, file: &str, rank: usize, world: usize, port: u16) -> Child {
    pipeline_command()
        .args(["run", "-q", file])
        .current_dir(s.path())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn a rank")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

fn finish(child: Child) -> (Output, Duration) {
    let start = Instant::now();
    let out = child.wait_with_output().expect("wait");
    (out, start.elapsed())
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn two_ranks_train_what_one_process_trains_with_the_global_batch() {
    let settings = "      max_steps: 30\n      eval_every: 15\n      checkpoint_every: 10\n";
    // 2 ranks × 16 through `--nproc 2`.
    let two = scratch(16, settings);
    let reports = two.run_ok(&["p.yaml", "--nproc", "2"]);
    let report = train_report(&reports);
    assert_eq!(report["metrics"]["world"], 2.0, "{report}");
    assert_eq!(report["metrics"]["steps"], 30.0, "{report}");
    assert_eq!(
        reports.len(),
        3,
        "rank 0 alone prints the reports: {reports:?}"
    );
    // Rank 0 alone wrote the logs: one loss line per logged step, not one per rank.
    let log = std::fs::read_to_string(two.path().join("run/metrics.jsonl")).expect("log");
    let losses = log.lines().filter(|l| l.contains("train/loss")).count();
    assert_eq!(losses, 6, "{log}");

    // The same job under torchrun (its agent hosts the store): bitwise the same model.
    let torchrun = scratch(16, settings);
    let out = Command::new(env_path("LAKEML_PYTHON"))
        .args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
        ])
        .arg("--no-python")
        .arg(pipeline_bin())
        .args(["run", "-q", "p.yaml"])
        .current_dir(torchrun.path())
        .output()
        .expect("torchrun");
    assert!(out.status.success(), "torchrun: {}", stderr(&out));
    let same = python("compare_weights.py", &[&weights(&two), &weights(&torchrun)]);
    assert_eq!(same["names_equal"], true, "{same}");
    assert_eq!(same["max_abs_diff"], 0.0, "two 2-rank runs differ: {same}");

    // 1 process × 32 sees the same global batches: the same weights up to float rounding
    // (the sums over 32 rows are split into two sums of 16; measured 4e-6 after 30 steps).
    let one = scratch(32, settings);
    let reports = one.run_ok(&["p.yaml"]);
    let single = train_report(&reports);
    let cmp = python("compare_weights.py", &[&weights(&one), &weights(&two)]);
    assert_eq!(cmp["names_equal"], true, "{cmp}");
    let diff = cmp["max_abs_diff"].as_f64().unwrap_or(f64::MAX);
    assert!(diff <= 1e-4, "1 × 32 against 2 × 16: {cmp}");
    // Sharded evaluation, reduced: the same validation loss.
    let loss = |r: &serde_json::Value| r["metrics"]["best_eval_loss"].as_f64().unwrap_or(-1.0);
    assert!(
        (loss(&single) - loss(&report)).abs() < 1e-4,
        "{single}\n{report}"
    );
    // The global batch is the unit: both count the same samples per step.
    assert_eq!(single["rows_in"], report["rows_in"]);

    // A rerun with the same number of ranks is up to date.
    let again = two.run_ok(&["p.yaml", "--nproc", "2"]);
    assert_eq!(train_report(&again)["cached"], true, "{again:?}");
}

#[test]
fn a_killed_rank_stops_the_other_and_the_rerun_resumes_to_the_same_weights() {
    let settings = "      max_steps: 24\n      eval_every: none\n      checkpoint_every: 6\n";
    let whole = scratch(16, settings);
    whole.run_ok(&["p.yaml", "--nproc", "2"]);

    let cut = scratch(16, settings);
    let port = free_port();
    let rank0 = rank(&cut, "p.yaml", 0, 2, port);
    let mut rank1 = rank(&cut, "p.yaml", 1, 2, port);
    let checkpoint = cut.path().join("run/checkpoints/step-00000012/state.json");
    let start = Instant::now();
    while !checkpoint.exists() && start.elapsed() < Duration::from_secs(300) {
        std::thread::sleep(Duration::from_millis(20));
    }
    rank1.kill().expect("kill -9 rank 1");
    let _ = rank1.wait();
    let (out, waited) = finish(rank0);
    assert!(
        checkpoint.exists(),
        "the run never wrote its step-12 checkpoint"
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("rank 1 is lost"), "{err}");
    assert!(err.contains("resumes from the last checkpoint"), "{err}");
    assert!(
        waited < Duration::from_secs(30),
        "rank 0 took {waited:?} to stop"
    );
    assert!(
        !cut.path().join("run/model/model.safetensors").exists(),
        "killed before the end, yet a model directory looks complete"
    );

    // The same checkpoint, resumed by one process: another number of ranks goes on from it
    // (its global batch is then 16 rows, so its weights are its own). The cut run directory
    // is kept aside for the 2-rank resume below.
    let (run, kept) = (cut.path().join("run"), cut.path().join("run-cut"));
    let copied = Command::new("cp").arg("-a").arg(&run).arg(&kept).status();
    assert!(copied.is_ok_and(|s| s.success()), "copying the cut run");
    let report = train_report(&cut.run_ok(&["p.yaml"]));
    assert_eq!(report["metrics"]["world"], 1.0, "{report}");
    assert_eq!(report["metrics"]["steps"], 24.0, "{report}");
    assert!(
        report["resumed_from"].as_u64().unwrap_or_default() >= 12,
        "{report}"
    );
    std::fs::remove_dir_all(&run).expect("remove the 1-process run");
    std::fs::rename(&kept, &run).expect("put the cut run back");

    let reports = cut.run_ok(&["p.yaml", "--nproc", "2"]);
    let report = train_report(&reports);
    let resumed = report["resumed_from"].as_u64().unwrap_or_default();
    assert!(resumed >= 12, "{report}");
    let cmp = python("compare_weights.py", &[&weights(&whole), &weights(&cut)]);
    assert_eq!(cmp["names_equal"], true, "{cmp}");
    assert_eq!(
        cmp["max_abs_diff"], 0.0,
        "resumed from step {resumed}: {cmp}"
    );
}

#[test]
fn bad_launches_fail_clearly_and_write_nothing() {
    let s = Scratch::new();
    dropout_free_minilm(&s);
    let short = "      max_steps: 2\n      distributed: { timeout: 5s }\n";
    s.write("p.yaml", &dp_yaml(16, short));
    let written = || s.path().join("lake").exists() || s.path().join("run").exists();

    // WORLD_SIZE 3 with only 2 ranks started: both give up after the timeout.
    let port = free_port();
    let (r0, r1) = (
        rank(&s, "p.yaml", 0, 3, port),
        rank(&s, "p.yaml", 1, 3, port),
    );
    let ((out0, _), (out1, _)) = (finish(r0), finish(r1));
    let err = stderr(&out0);
    assert_eq!(out0.status.code(), Some(1), "{err}");
    assert!(
        err.contains("not every one of the 3 ranks joined within 5s"),
        "{err}"
    );
    assert!(!out1.status.success(), "{}", stderr(&out1));
    assert!(!written(), "a failed rendezvous wrote output");

    // Ranks running different pipeline files are refused.
    s.write(
        "other.yaml",
        &dp_yaml(16, short).replace("lr: 1.0e-4", "lr: 2.0e-4"),
    );
    let port = free_port();
    let (r0, r1) = (
        rank(&s, "p.yaml", 0, 2, port),
        rank(&s, "other.yaml", 1, 2, port),
    );
    let ((out0, _), (out1, _)) = (finish(r0), finish(r1));
    for out in [&out0, &out1] {
        let err = stderr(out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("rank(s) 1 differ from rank 0"), "{err}");
    }
    assert!(!written(), "mismatched ranks wrote output");

    // The rendezvous port is taken.
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let (out, _) = finish(rank(&s, "p.yaml", 0, 2, port));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("port {port} is in use")), "{err}");
    assert!(!written(), "a rank that could not bind wrote output");

    // NCCL on a CPU stage, and the old `world` key, are refused by validation.
    s.write(
        "nccl.yaml",
        &dp_yaml(16, "      distributed: { backend: nccl }\n"),
    );
    s.write("world.yaml", &dp_yaml(16, "      world: 2\n"));
    for (file, needle) in [
        ("nccl.yaml", "nccl runs on CUDA GPUs"),
        ("world.yaml", "--nproc N"),
    ] {
        let out = s.pipeline(&["validate", file]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{file}: {err}");
        assert!(err.contains(needle), "{file}: {err}");
    }
}

#[test]
fn spark_barrier_tasks_and_torch_distributor_train_what_nproc_trains() {
    // lakeml_spark.train: 2 ranks as the barrier tasks of Spark local[2] (rank 0 picks the
    // port and shares it with allGather), against `--nproc 2`.
    let settings = "      max_steps: 6\n      eval_every: none\n      checkpoint_every: none\n";
    let nproc = scratch(16, settings);
    nproc.run_ok(&["p.yaml", "--nproc", "2"]);

    // One Spark job on a fresh copy of the data: its JSON, its stderr, and how its model
    // compares with the `--nproc` run's.
    let spark_job = |script: &str, tag: &str| {
        let s = scratch(16, settings);
        let binary = pipeline_bin().as_os_str();
        let (got, stderr) = Job::spawn_with(
            &s,
            &test_script(script),
            &["p.yaml"],
            tag,
            &[("LAKEML_PIPELINE", binary)],
        )
        .finish(script);
        let cmp = python("compare_weights.py", &[&weights(&nproc), &weights(&s)]);
        (got, stderr, cmp)
    };

    let (got, stderr, cmp) = spark_job("spark_train.py", "train");
    let report = &got["train"];
    assert_eq!(report["metrics"]["world"], 2.0, "{got}\n{stderr}");
    assert_eq!(report["metrics"]["steps"], 6.0, "{got}\n{stderr}");
    assert_eq!(cmp["names_equal"], true, "{cmp}");
    assert_eq!(cmp["max_abs_diff"], 0.0, "Spark against --nproc: {cmp}");

    // PySpark's TorchDistributor (local mode: torchrun on the driver) through the two-line
    // script the docs show.
    let (got, stderr, cmp) = spark_job("spark_torch_distributor.py", "distributor");
    assert_eq!(got["done"], true, "{got}\n{stderr}");
    assert_eq!(
        cmp["max_abs_diff"], 0.0,
        "TorchDistributor against --nproc: {cmp}"
    );
}
