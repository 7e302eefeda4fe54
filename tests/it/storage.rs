//! Tables and models in object stores, against real S3 and Azure Blob API servers (moto's
//! `moto_server` and Azurite, installed by scripts/test.sh) on 127.0.0.1: stages write and
//! read Delta tables there, predictions equal the local run's and read back in delta-rs's
//! Python reader, concurrent writers commit once, models are copied once into the cache, and
//! bad locations or options are refused with exit 2 before anything is written.
//!
//! Each server is started once, by the one test that uses it, and stopped with its process
//! group when that test ends.

use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{
    INGEST, Scratch, env_path, ingest, ingest_yaml, ingest_yaml_with_split, make_model_with,
    minilm, pipeline_command, repo,
};
use crate::mlflow_server::free_port;

/// A test server on 127.0.0.1, stopped with its process group when dropped.
pub(crate) struct Server {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Server {
    /// Starts `program ARGS` with `{port}` in ARGS replaced by a free port.
    pub(crate) fn start(program: PathBuf, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let args: Vec<String> = args
            .iter()
            .map(|a| a.replace("{port}", &port.to_string()))
            .collect();
        let log = std::fs::File::create(dir.path().join("server.log")).expect("log");
        let child = Command::new(&program)
            .args(&args)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
        let server = Self { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "{} did not listen within 60 s",
                program.display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        server
    }

    /// moto's S3 server.
    pub(crate) fn moto() -> Self {
        Self::start(
            env_path("LAKEML_MOTO"),
            &["-H", "127.0.0.1", "-p", "{port}"],
        )
    }

    /// Azurite's Blob server, in memory.
    pub(crate) fn azurite() -> Self {
        Self::start(
            env_path("LAKEML_AZURITE"),
            &[
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                "{port}",
                "--inMemoryPersistence",
                "--disableTelemetry",
                "--skipApiVersionCheck",
            ],
        )
    }

    pub(crate) fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Its output so far: moto logs one line per request.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signalling our own child's process group.
        unsafe { libc::killpg(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// Overwrites the Delta table `url` with the local reviews whose id is at most `max_id`.
fn copy_reviews(s: &Scratch, storage: &str, url: &str, max_id: usize) {
    s.write(
        "copy.yaml",
        &format!(
            "name: copy\n{storage}tables:\n  local_reviews: {{ delta: lake/reviews }}\n  \
             out: {{ delta: '{url}' }}\n\
             stages:\n  - write: {{ sql: 'SELECT * FROM local_reviews WHERE id <= {max_id}', \
             to: out, mode: overwrite }}\n"
        ),
    );
    run_json(s, "copy.yaml", &[("S3_SECRET", S3_SECRET)]);
}

/// tests/py/object_store.py: buckets, uploads and Delta reads with pyarrow and delta-rs.
pub(crate) fn store_py(kind: &str, server: &Server, args: &[&str]) -> serde_json::Value {
    let out = Command::new(env_path("LAKEML_PYTHON"))
        .arg(repo().join("tests/py/object_store.py"))
        .args([kind, &server.endpoint()])
        .args(args)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "object_store.py {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

/// `pipeline ARGS` in the scratch directory with `env` set.
pub(crate) fn pipeline(s: &Scratch, args: &[&str], env: &[(&str, &str)]) -> Output {
    pipeline_command()
        .args(args)
        .envs(env.iter().copied())
        .env("LAKEML_CACHE", s.path().join("cache"))
        .current_dir(s.path())
        .output()
        .expect("run pipeline")
}

pub(crate) fn run_json(
    s: &Scratch,
    file: &str,
    env: &[(&str, &str)],
) -> (Vec<serde_json::Value>, String) {
    let out = pipeline(s, &["run", "--json", "--quiet", file], env);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{file} failed:\n{stderr}");
    let reports = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("report json"))
        .collect();
    (reports, stderr)
}

/// Runs `file` with `env` and the scratch directory's cache, which must fail with exit 2
/// (within the builder's 60 s); returns stderr.
fn refused(s: &Scratch, file: &str, env: &[(&str, &str)]) -> String {
    s.failing(&["run", file])
        .env("LAKEML_CACHE", s.path().join("cache"))
        .envs(env)
        .exit(2)
}

/// `label` and `score` by id.
fn predictions(rows: &serde_json::Value) -> Vec<(i64, String, f64)> {
    rows.as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            (
                r["id"].as_i64().expect("id"),
                r["label"].as_str().expect("label").to_string(),
                r["score"].as_f64().expect("score"),
            )
        })
        .collect()
}

pub(crate) fn assert_same_predictions(
    remote: &serde_json::Value,
    local: &serde_json::Value,
    n: usize,
) {
    let (remote, local) = (predictions(remote), predictions(local));
    assert_eq!(remote.len(), n);
    assert_eq!(remote.len(), local.len());
    for (r, l) in remote.iter().zip(&local) {
        assert_eq!((r.0, &r.1), (l.0, &l.1), "label of id {}", l.0);
        assert!(
            (r.2 - l.2).abs() < 1e-5,
            "score of id {}: {} vs {}",
            l.0,
            r.2,
            l.2
        );
    }
}

const ROWS: usize = 40;

/// A scratch directory with a MiniLM classifier (`model/`), `ROWS` reviews in the local
/// Delta table `lake/reviews`, and their predictions in `lake/preds` (a local run).
fn local_baseline() -> (Scratch, serde_json::Value) {
    let s = Scratch::new();
    make_model_with(&s, "model", "rotten,fresh", 0);
    s.write(INGEST, &ingest_yaml());
    ingest(&s, ROWS);
    s.write(
        "local.yaml",
        "name: local\ntables:\n  reviews: { delta: lake/reviews }\n  preds: { delta: lake/preds }\n\
         stages:\n  - predict: { from: reviews, model: model, to: preds }\n",
    );
    run_json(&s, "local.yaml", &[]);
    let local = crate::common::python(
        "read_delta.py",
        &[s.path().join("lake/preds").to_str().expect("utf-8")],
    );
    (s, local)
}

pub(crate) const S3_SECRET: &str = "lakeml-test-secret";

pub(crate) fn s3_storage(endpoint: &str) -> String {
    format!(
        "storage:\n  s3: {{ endpoint: 'http://{endpoint}', allow_http: true, region: us-east-1, \
         access_key_id: lakeml-test, secret_access_key: '${{S3_SECRET}}' }}\n"
    )
}

#[test]
fn s3_tables_match_local_commit_once_and_bad_input_is_refused() {
    let moto = Server::moto();
    let (s, local) = local_baseline();
    store_py("s3", &moto, &["mkdir", "lake"]);
    let env = [("S3_SECRET", S3_SECRET)];
    let storage = s3_storage(&moto.endpoint());

    // write → tokenize → predict, every output on S3; the model is local.
    s.write(
        "s3.yaml",
        &format!(
            "name: s3\n{storage}tables:\n  local_reviews: {{ delta: lake/reviews }}\n  \
             reviews: {{ delta: s3://lake/reviews }}\n  tok: {{ delta: s3://lake/tok }}\n  \
             preds: {{ delta: 's3a://lake/preds' }}\n\
             stages:\n  - write: {{ from: local_reviews, to: reviews }}\n  \
             - tokenize: {{ from: reviews, tokenizer: {minilm}, to: tok }}\n  \
             - predict: {{ from: reviews, model: model, to: preds }}\n",
            minilm = minilm().display()
        ),
    );
    let (reports, stderr) = run_json(&s, "s3.yaml", &env);
    assert_eq!(reports.len(), 3);
    assert!(reports.iter().all(|r| r["cached"] == false), "{reports:?}");
    let remote = store_py("s3", &moto, &["read", "s3://lake/preds"]);
    assert_same_predictions(&remote["rows"], &local["rows"], ROWS);
    let tok = store_py("s3", &moto, &["read", "s3://lake/tok"]);
    assert_eq!(tok["num_rows"], ROWS as u64);
    // Nothing was written to a local directory named after the URL.
    assert!(!s.path().join("s3:").exists() && !s.path().join("s3a:").exists());
    // The secret is in no report, message or commit.
    let everything = format!("{reports:?}{stderr}{remote}{tok}");
    assert!(!everything.contains(S3_SECRET), "the secret leaked");

    // A rerun finds every output up to date on S3.
    let (again, _) = run_json(&s, "s3.yaml", &env);
    assert!(again.iter().all(|r| r["cached"] == true), "{again:?}");

    // File tables: a glob of Parquet objects, read with `pipeline sql`.
    store_py(
        "s3",
        &moto,
        &[
            "upload",
            s.path().join("lake/reviews").to_str().expect("utf-8"),
            "lake/raw",
            ".parquet",
        ],
    );
    s.write(
        "files.yaml",
        &format!(
            "name: files\n{storage}tables:\n  raw: {{ parquet: 's3://lake/raw/*.parquet' }}\n  \
             dir: {{ parquet: 's3://lake/raw/' }}\nserve: {{}}\n"
        ),
    );
    let out = pipeline(
        &s,
        &[
            "sql",
            "files.yaml",
            "SELECT (SELECT count(*) FROM raw) AS a, (SELECT count(*) FROM dir) AS b",
        ],
        &env,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&format!("| {ROWS} | {ROWS} |")), "{stdout}");

    // Two runs of one predict job at once: the table ends with one row per id.
    s.write(
        "race.yaml",
        &format!(
            "name: race\n{storage}tables:\n  reviews: {{ delta: s3://lake/reviews }}\n  \
             preds: {{ delta: s3://lake/race }}\n\
             stages:\n  - predict: {{ from: reviews, model: model, to: preds }}\n"
        ),
    );
    let spawn = || {
        pipeline_command()
            .args(["run", "--quiet", "race.yaml"])
            .envs(env)
            .current_dir(s.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn")
    };
    let (a, b) = (spawn(), spawn());
    let (a, b) = (
        a.wait_with_output().expect("a"),
        b.wait_with_output().expect("b"),
    );
    assert!(
        a.status.success() || b.status.success(),
        "both racers failed:\n{}\n{}",
        String::from_utf8_lossy(&a.stderr),
        String::from_utf8_lossy(&b.stderr)
    );
    let raced = store_py("s3", &moto, &["read", "s3://lake/race"]);
    assert_eq!(raced["num_rows"], ROWS as u64, "{}", raced["history"]);
    assert_same_predictions(&raced["rows"], &local["rows"], ROWS);

    // kill -9 during predict runs on S3: the table stays at its last committed version, and
    // a rerun completes the job in one commit.
    s.write(
        "killed.yaml",
        &format!(
            "name: killed\n{storage}tables:\n  reviews: {{ delta: s3://lake/kreviews }}\n  \
             preds: {{ delta: s3://lake/killed }}\n\
             stages:\n  - predict: {{ from: reviews, model: model, to: preds }}\n"
        ),
    );
    copy_reviews(&s, &storage, "s3://lake/kreviews", 10);
    run_json(&s, "killed.yaml", &env);
    copy_reviews(&s, &storage, "s3://lake/kreviews", ROWS);
    for delay_ms in [200, 700, 1500, 3000] {
        let mut child = pipeline_command()
            .args(["run", "--quiet", "killed.yaml"])
            .envs(env)
            .current_dir(s.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        std::thread::sleep(Duration::from_millis(delay_ms));
        let finished = child.try_wait().expect("try_wait").is_some();
        if !finished {
            child.kill().expect("kill -9");
        }
        child.wait().expect("wait");
        let table = store_py("s3", &moto, &["read", "s3://lake/killed"]);
        if finished || table["version"] == 1 {
            break; // the run committed before the kill: nothing left to interrupt
        }
        assert_eq!(table["version"], 0, "a killed run changed the table");
        assert_eq!(table["num_rows"], 10);
    }
    run_json(&s, "killed.yaml", &env);
    let table = store_py("s3", &moto, &["read", "s3://lake/killed"]);
    assert_eq!(
        (table["version"].as_u64(), table["num_rows"].as_u64()),
        (Some(1), Some(ROWS as u64))
    );
    assert_same_predictions(&table["rows"], &local["rows"], ROWS);

    // `pipeline serve` over the S3 tables, through ADBC's Flight SQL driver: a write while it
    // runs shows in the next query, without a restart.
    s.write(
        "serve.yaml",
        &format!(
            "name: served\n{}tables:\n  reviews: {{ delta: s3://lake/reviews }}\n  \
             preds: {{ delta: s3://lake/preds }}\n\
             serve:\n  listen: 127.0.0.1:0\n  auth: {{ tokens: ['${{LAKEML_TOKEN}}'] }}\n",
            storage.replace("${S3_SECRET}", S3_SECRET)
        ),
    );
    let served = crate::serving::Server::start(&s, "serve.yaml");
    let count = |table: &str| {
        let sql = format!("SELECT count(*) FROM {table}");
        let out = crate::common::python(
            "flight_query.py",
            &[&served.uri, "--token", crate::serving::TOKEN, &sql],
        );
        out["results"][0]["rows"][0][0]
            .as_u64()
            .unwrap_or_else(|| panic!("{sql}: {out}"))
    };
    assert_eq!(
        (count("reviews"), count("preds")),
        (ROWS as u64, ROWS as u64)
    );
    copy_reviews(&s, &storage, "s3://lake/reviews", 10);
    assert_eq!(count("reviews"), 10, "the new S3 commit is not seen");
    assert!(!served.stderr().contains(S3_SECRET));
    served.stop();

    // lakeml_spark on S3, no JVM jars: executors write Parquet to S3, the driver commits
    // once; a rerun of the job version commits nothing; Spark and delta-rs read it back.
    let spark = spark_object_store(&moto, "s3://lake/spark", 200);
    assert_eq!(spark["first"]["committed"], true, "{spark}");
    assert_eq!(spark["rerun"]["committed"], false, "{spark}");
    let ids: Vec<u64> = (1..=200).collect();
    assert_eq!(spark["spark_ids"], serde_json::json!(ids));
    assert_eq!(spark["delta"]["ids"], serde_json::json!(ids));
    assert_eq!(spark["delta"]["version"], 0, "one commit: {spark}");

    // Bad input: exit 2, the table named, nothing written.
    let bad = |name: &str, table: &str, storage: &str| {
        s.write(
            name,
            &format!(
                "name: bad\n{storage}tables:\n  reviews: {{ delta: lake/reviews }}\n  \
                 out: {table}\nstages:\n  - write: {{ from: reviews, to: out }}\n"
            ),
        );
        refused(&s, name, &env)
    };
    let e = bad(
        "nobucket.yaml",
        "{ delta: s3://no-such-bucket/out }",
        &storage,
    );
    assert!(
        e.contains("tables.out") && e.contains("no-such-bucket") && e.contains("does not exist"),
        "{e}"
    );
    let closed = s3_storage(&format!("127.0.0.1:{}", free_port()));
    let e = bad("refused.yaml", "{ delta: s3://lake/out }", &closed);
    assert!(
        e.contains("tables.out") && e.contains("cannot reach"),
        "{e}"
    );
    let typo = storage.replace("secret_access_key", "secret_acess_key");
    let e = bad("typo.yaml", "{ delta: s3://lake/out }", &typo);
    assert!(
        e.contains("secret_acess_key") && e.contains("did you mean `secret_access_key`"),
        "{e}"
    );
    let e = bad(
        "lock.yaml",
        "{ delta: s3://lake/out, storage_options: { aws_s3_locking_provider: dynamodb } }",
        &storage,
    );
    assert!(
        e.contains("tables.out") && e.contains("conditional puts"),
        "{e}"
    );
    let e = bad("scheme.yaml", "{ delta: 'hdfs://namenode/out' }", &storage);
    assert!(
        e.contains("tables.out") && e.contains("does not read `hdfs://`"),
        "{e}"
    );
    assert!(!e.contains(S3_SECRET));
    assert!(!s.path().join("hdfs:").exists() && !s.path().join("s3:").exists());
    let listed = store_py("s3", &moto, &["read", "s3://lake/preds"]);
    assert_eq!(
        listed["version"], remote["version"],
        "a refused run changed a table"
    );
}

/// The demo's chain with its training on S3: `reviews` (with splits) → tokenized → train →
/// predict, `settings` (lines indented by six spaces) for the train stage; `lake` is the
/// tables' root and `run` the train stage's output.
/// write → tokenize → train (from the base model at `model`) → predict, into `lake`.
fn train_chain(storage: &str, lake: &str, run: &str, model: &str, settings: &str) -> String {
    format!(
        "name: chain\n{storage}tables:\n  local_reviews: {{ delta: lake/reviews }}\n  \
         reviews: {{ delta: '{lake}/reviews' }}\n  tokenized: {{ delta: '{lake}/tokenized' }}\n  \
         preds: {{ delta: '{lake}/preds' }}\n\
         stages:\n  - write: {{ from: local_reviews, to: reviews }}\n  \
         - tokenize: {{ from: reviews, tokenizer: {minilm}, label: truth, keep: [split], \
         max_length: 64, to: tokenized }}\n  \
         - train:\n      from: tokenized\n      model: '{model}'\n      output: '{run}'\n      \
         batch_size: 16\n      lr: 1.0e-4\n{settings}  \
         - predict: {{ from: reviews, model: '{run}/model', to: preds }}\n",
        minilm = minilm().display()
    )
}

/// The only file `dir` holds that is named `name`, at any depth.
fn find_file(dir: &std::path::Path, name: &str) -> PathBuf {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.file_name().is_some_and(|n| n == name) {
                found.push(path);
            }
        }
    }
    assert_eq!(found.len(), 1, "{name} under {}: {found:?}", dir.display());
    found.remove(0)
}

#[test]
fn training_to_s3_resumes_on_another_machine_and_publishes_a_stamped_model() {
    let moto = Server::moto();
    store_py("s3", &moto, &["mkdir", "lake"]);
    let env = [("S3_SECRET", S3_SECRET)];
    let storage = s3_storage(&moto.endpoint());
    let settings = "      max_steps: 8\n      eval_every: none\n      checkpoint_every: 2\n      \
                    save: final\n      threads: 1\n";
    let s = Scratch::new();
    s.write(INGEST, &ingest_yaml_with_split());
    ingest(&s, 160);
    // The whole chain on local disk, uninterrupted: the reference.
    let minilm = minilm().display().to_string();
    s.write(
        "local.yaml",
        &train_chain("", "lake/l", "run", &minilm, settings),
    );
    run_json(&s, "local.yaml", &[]);
    let local = crate::common::python(
        "read_delta.py",
        &[s.path().join("lake/l/preds").to_str().expect("utf-8")],
    );

    // Machine A trains on S3, from the same base model in the store, and is killed -9 once
    // its step-2 checkpoint is there.
    store_py("s3", &moto, &["upload", &minilm, "lake/minilm"]);
    s.write(
        "s3.yaml",
        &train_chain(
            &storage,
            "s3://lake",
            "s3://lake/run",
            "s3://lake/minilm/",
            settings,
        ),
    );
    let machine = |name: &str| s.path().join(name);
    let mut child = pipeline_command()
        .args(["run", "--quiet", "s3.yaml"])
        .envs(env)
        .env("LAKEML_CACHE", machine("a"))
        .current_dir(s.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let marker = "PUT /lake/run/checkpoints/step-00000002/state.json";
    let started = Instant::now();
    while !moto.log().contains(marker) && started.elapsed() < Duration::from_secs(300) {
        assert!(
            child.try_wait().expect("try_wait").is_none(),
            "the run ended early"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("kill -9");
    child.wait().expect("wait");
    assert!(
        moto.log().contains(marker),
        "no step-2 checkpoint reached S3"
    );
    assert!(
        !moto
            .log()
            .contains("PUT /lake/run/model/_lakeml_model.json"),
        "killed before the end, yet a model was stamped"
    );

    // Machine B, with an empty cache (another copy of the base model, other modification
    // times), resumes from the store's checkpoint, not from step 0, and ends with the weights
    // of the uninterrupted run, bit for bit; its predictions equal the local ones.
    let b = |file: &str| {
        let out = pipeline_command()
            .args(["run", "--json", "--quiet", file])
            .envs(env)
            .env("LAKEML_CACHE", machine("b"))
            .current_dir(s.path())
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{file}: {stderr}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect::<Vec<serde_json::Value>>()
    };
    let reports = b("s3.yaml");
    let train = &reports[2];
    assert!(
        train["resumed_from"].as_u64().is_some_and(|step| step >= 2),
        "{train}"
    );
    assert_eq!(train["table"], "s3://lake/run/model");
    // The run's parameters (logged by machine A, which started it) name the base model by
    // its URL, not by a machine's cache.
    let jsonl = std::fs::read_to_string(find_file(&machine("a").join("runs"), "metrics.jsonl"))
        .expect("metrics.jsonl");
    let params: serde_json::Value = jsonl
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l.get("params").is_some())
        .expect("a params line");
    assert_eq!(params["params"]["model"], "s3://lake/minilm/", "{params}");
    let cmp = crate::common::python(
        "compare_weights.py",
        &[
            s.path()
                .join("run/model/model.safetensors")
                .to_str()
                .expect("utf-8"),
            find_file(&machine("b").join("runs"), "model.safetensors")
                .to_str()
                .expect("utf-8"),
        ],
    );
    assert_eq!(cmp["names_equal"], true, "{cmp}");
    assert_eq!(cmp["max_abs_diff"], 0.0, "{cmp}");
    let remote = store_py("s3", &moto, &["read", "s3://lake/preds"]);
    assert_same_predictions(&remote["rows"], &local["rows"], 160);
    let log = moto.log();
    assert!(
        log.contains("PUT /lake/run/model/_lakeml_model.json"),
        "no stamp"
    );
    assert!(log.contains("PUT /lake/run/run.json"), "no run.json");

    // Machine C finds the training done in the store (it fetches the model for the stage
    // after it), and a pipeline that only predicts reads the stamped model from S3.
    let out = pipeline_command()
        .args(["run", "--json", "--quiet", "s3.yaml"])
        .envs(env)
        .env("LAKEML_CACHE", machine("c"))
        .current_dir(s.path())
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let train: serde_json::Value =
        serde_json::from_str(stdout.lines().nth(2).expect("train report")).expect("json");
    assert_eq!(train["cached"], true, "{train}");
    s.write(
        "score.yaml",
        &format!(
            "name: score\n{storage}tables:\n  reviews: {{ delta: s3://lake/reviews }}\n  \
             scored: {{ delta: s3://lake/scored }}\n\
             stages:\n  - predict: {{ from: reviews, model: s3://lake/run/model, to: scored }}\n"
        ),
    );
    run_json(&s, "score.yaml", &env);
    let scored = store_py("s3", &moto, &["read", "s3://lake/scored"]);
    assert_same_predictions(&scored["rows"], &local["rows"], 160);

    // A model directory whose stamp says `writing` (a run publishing, or killed while it
    // did) is refused by its readers.
    let half = s.path().join("half");
    std::fs::create_dir_all(&half).expect("mkdir");
    for name in ["config.json", "tokenizer.json"] {
        std::fs::copy(s.path().join("run/model").join(name), half.join(name)).expect("copy");
    }
    std::fs::write(
        half.join("_lakeml_model.json"),
        r#"{"state": "writing", "by": "elsewhere:1", "at": "2026-11-25T00:00:00Z"}"#,
    )
    .expect("stamp");
    store_py(
        "s3",
        &moto,
        &["upload", half.to_str().expect("utf-8"), "lake/half"],
    );
    s.write(
        "half.yaml",
        &format!(
            "name: half\n{storage}tables:\n  reviews: {{ delta: s3://lake/reviews }}\n  \
             out: {{ delta: s3://lake/out }}\n\
             stages:\n  - predict: {{ from: reviews, model: s3://lake/half, to: out }}\n"
        ),
    );
    let e = refused(&s, "half.yaml", &env);
    assert!(
        e.contains("still writing this model") && e.contains("elsewhere:1"),
        "{e}"
    );
}

/// tests/py/spark_object_store.py: lakeml_spark (from the checkout) writing `rows` rows to
/// the S3 Delta table `url` and reading them back.
fn spark_object_store(server: &Server, url: &str, rows: usize) -> serde_json::Value {
    let out = Command::new(env_path("LAKEML_PYTHON"))
        .arg(repo().join("tests/py/spark_object_store.py"))
        .args([&server.endpoint(), url, &rows.to_string()])
        .env("PYTHONPATH", repo().join("python/src"))
        .output()
        .expect("run spark_object_store.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "spark_object_store.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("no JSON ({e}): {stdout}"))
}

/// Azurite's account with `key` (its well-known key is [`AZ_KEY`]).
pub(crate) fn azure_storage(endpoint: &str, key: &str) -> String {
    format!(
        "storage:\n  azure: {{ account_name: devstoreaccount1, account_key: '{key}', \
         endpoint: 'http://{endpoint}/devstoreaccount1', allow_http: true }}\n"
    )
}

pub(crate) const AZ_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

#[test]
fn azure_tables_and_a_model_read_from_a_container_match_local() {
    let azurite = Server::azurite();
    let (s, local) = local_baseline();
    store_py("azure", &azurite, &["mkdir", "lake"]);
    store_py("azure", &azurite, &["mkdir", "models"]);
    store_py(
        "azure",
        &azurite,
        &[
            "upload",
            s.path().join("model").to_str().expect("utf-8"),
            "models/cls",
        ],
    );
    let storage = |key: &str| azure_storage(&azurite.endpoint(), key);
    let yaml = |key: &str| {
        format!(
            "name: az\n{}tables:\n  local_reviews: {{ delta: lake/reviews }}\n  \
             reviews: {{ delta: 'abfss://lake@devstoreaccount1.dfs.core.windows.net/reviews' }}\n  \
             preds: {{ delta: az://lake/preds }}\n\
             stages:\n  - write: {{ from: local_reviews, to: reviews }}\n  \
             - predict: {{ from: reviews, model: 'az://models/cls', to: preds }}\n",
            storage(key)
        )
    };
    s.write("az.yaml", &yaml(AZ_KEY));
    let (reports, stderr) = run_json(&s, "az.yaml", &[]);
    assert_eq!(reports.len(), 2, "{reports:?}");
    assert!(!stderr.contains(AZ_KEY) && !format!("{reports:?}").contains(AZ_KEY));
    let remote = store_py("azure", &azurite, &["read", "az://lake/preds"]);
    assert_same_predictions(&remote["rows"], &local["rows"], ROWS);

    // The model was copied once into the cache; a rerun reuses the copy.
    let manifests: Vec<PathBuf> = std::fs::read_dir(s.path().join("cache/models"))
        .expect("model cache")
        .flatten()
        .map(|e| e.path().join(".lakeml-remote.json"))
        .collect();
    assert_eq!(manifests.len(), 1, "{manifests:?}");
    let copied = std::fs::metadata(&manifests[0])
        .and_then(|m| m.modified())
        .expect("manifest");
    let (again, _) = run_json(&s, "az.yaml", &[]);
    assert!(again.iter().all(|r| r["cached"] == true), "{again:?}");
    let reused = std::fs::metadata(&manifests[0])
        .and_then(|m| m.modified())
        .expect("manifest");
    assert_eq!(copied, reused, "the cached model was downloaded again");

    // A wrong account key is refused before any work, naming the table.
    let wrong = AZ_KEY.replace("Eby8", "Xby8");
    s.write("wrong.yaml", &yaml(&wrong));
    let e = refused(&s, "wrong.yaml", &[]);
    assert!(
        e.contains("access denied") || e.contains("AuthorizationFailure"),
        "{e}"
    );
    assert!(!e.contains(&wrong), "the key leaked: {e}");
}
