//! Helpers: a scratch directory with pipeline files, the binary, and the Python peers.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Set by scripts/test.sh (scripts/env.sh); the tests need the real assets and peers.
pub fn env_path(name: &str) -> PathBuf {
    PathBuf::from(std::env::var_os(name).unwrap_or_else(|| {
        panic!("{name} is not set: run the tests with scripts/test.sh, which installs and sets it")
    }))
}

pub fn assets() -> PathBuf {
    env_path("LAKEML_ASSETS")
}

pub fn minilm() -> PathBuf {
    assets().join("all-MiniLM-L6-v2")
}

/// A pipeline with one table `src` (`source`, a table entry such as `{ json: d.jsonl }`) and
/// one stage that tokenizes it with MiniLM into the Delta table `out`; `extra` holds more
/// settings of that stage, each line indented by six spaces.
pub fn tokenize_yaml(source: &str, extra: &str) -> String {
    format!(
        "name: t\ntables:\n  src: {source}\n  out: {{ delta: lake/out }}\n\
         stages:\n  - tokenize:\n      from: src\n      tokenizer: {}\n      to: out\n{extra}",
        minilm().display()
    )
}

/// Cargo's path of the binary it built (`target/release/pipeline`): to copy or look at, never
/// to run, since the wheel build removes it for a while (see [`pipeline_bin`]).
pub const CARGO_BUILT_BINARY: &str = env!("CARGO_BIN_EXE_pipeline");

/// The `pipeline` binary every test runs: a private copy of the one cargo built, made once
/// per test process under `target/tmp/pipeline-under-test/PID/`.
///
/// Cargo's own path (`CARGO_BIN_EXE_pipeline`, `target/release/pipeline`) is not safe to
/// exec while the suite runs: the wheel test's maturin build re-links it, and for about
/// 2.5 s it does not exist, so a test beside it failed with `NotFound` by chance. Nothing
/// but this function knows the copy's path, so no build step can take it away. The wheel
/// test calls this before it builds; a copy made while cargo's file is briefly missing
/// (another build in another terminal) waits for it to come back, at most 60 s.
pub fn pipeline_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pipeline-under-test");
        prune_dead_copies(&root);
        let dir = root.join(std::process::id().to_string());
        std::fs::create_dir_all(&dir).expect("mkdir for the binary under test");
        let copy = dir.join("pipeline");
        let built = Path::new(CARGO_BUILT_BINARY);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match std::fs::copy(built, &copy) {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("copying {} to {}: {e}", built.display(), copy.display()),
            }
        }
        copy
    })
}

/// Removes the copies of test processes that have ended (each is ~the binary's size).
fn prune_dead_copies(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let alive = name
            .to_str()
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_some_and(|pid| Path::new("/proc").join(pid.to_string()).exists());
        if !alive {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A `Command` for [`pipeline_bin`].
pub fn pipeline_command() -> Command {
    Command::new(pipeline_bin())
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A scratch directory; pipeline files in it refer to tables by relative paths.
pub struct Scratch {
    pub dir: tempfile::TempDir,
}

impl Scratch {
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.path().join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::write(&path, contents).expect("write");
        path
    }

    /// Runs `pipeline ARGS` in the scratch directory.
    pub fn pipeline(&self, args: &[&str]) -> Output {
        pipeline_command()
            .args(args)
            .current_dir(self.path())
            .output()
            .expect("run pipeline")
    }

    /// stderr with the scratch path replaced, for snapshots.
    pub fn stderr(&self, out: &Output) -> String {
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        let real = std::fs::canonicalize(self.path()).expect("canonicalize");
        text.replace(&real.display().to_string(), "[SCRATCH]")
            .replace(&self.path().display().to_string(), "[SCRATCH]")
            .replace(&minilm().display().to_string(), "[MINILM]")
    }

    /// Runs a pipeline that must succeed; returns its stage reports.
    pub fn run_ok(&self, args: &[&str]) -> Vec<serde_json::Value> {
        let mut all = vec!["run", "--json", "--quiet"];
        all.extend_from_slice(args);
        let out = self.pipeline(&all);
        assert!(
            out.status.success(),
            "pipeline {all:?} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).expect("report json"))
            .collect()
    }
}

/// A `pipeline` command in a scratch directory that must fail, as a builder:
/// `s.failing(&["run", "-q", "p.yaml"]).env("K", "v").exit(2)` runs it and returns its
/// stderr, paths replaced as in snapshots. A command still running after `within` (60 s
/// unless set) is killed, and the test fails: it did not refuse.
#[must_use]
pub struct Failing<'a> {
    scratch: &'a Scratch,
    args: Vec<String>,
    env: Vec<(String, std::ffi::OsString)>,
    within: Duration,
}

impl Scratch {
    /// `pipeline ARGS` here, expected to fail (see [`Failing`]).
    pub fn failing(&self, args: &[&str]) -> Failing<'_> {
        Failing {
            scratch: self,
            args: args.iter().map(|a| a.to_string()).collect(),
            env: Vec::new(),
            within: Duration::from_secs(60),
        }
    }
}

impl Failing<'_> {
    pub fn env(mut self, key: &str, value: impl AsRef<std::ffi::OsStr>) -> Self {
        self.env
            .push((key.to_string(), value.as_ref().to_os_string()));
        self
    }

    pub fn envs(self, pairs: &[(&str, &str)]) -> Self {
        pairs.iter().fold(self, |f, (k, v)| f.env(k, v))
    }

    /// Runs it; returns its exit code (-1 for a signal) and stderr.
    pub fn outcome(self) -> (i32, String) {
        let s = self.scratch;
        // Files, not pipes: a command that writes much cannot block while it is watched.
        let (stdout, stderr) = (
            s.path().join(".failing.stdout"),
            s.path().join(".failing.stderr"),
        );
        let mut child = pipeline_command()
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(s.path())
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(&stdout).expect("stdout file"))
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("spawn pipeline");
        let deadline = Instant::now() + self.within;
        let status = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let out = Output {
            status: status.unwrap_or_default(),
            stdout: std::fs::read(&stdout).unwrap_or_default(),
            stderr: std::fs::read(&stderr).unwrap_or_default(),
        };
        let err = s.stderr(&out);
        assert!(
            status.is_some(),
            "pipeline {:?} still ran after {:?} instead of failing:\n{}\n{err}",
            self.args,
            self.within,
            String::from_utf8_lossy(&out.stdout)
        );
        (out.status.code().unwrap_or(-1), err)
    }

    /// Runs it; it must exit with `code`; returns stderr.
    pub fn exit(self, code: i32) -> String {
        let args = self.args.clone();
        let (got, err) = self.outcome();
        assert_eq!(got, code, "pipeline {args:?}: {err}");
        err
    }
}

/// Runs a script from tests/py with the venv's Python; returns its stdout as JSON.
pub fn python(script: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new(env_path("LAKEML_PYTHON"))
        .arg(repo().join("tests/py").join(script))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "{script} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Reviews `1..=ROWS` (env) of the Rotten Tomatoes corpus into the Delta table `reviews`
/// (`id`, `text`, `truth`): the pipeline [`ingest_yaml`] writes, run by [`ingest`].
pub const INGEST: &str = "ingest.yaml";

pub fn ingest_yaml() -> String {
    format!(
        r#"name: ingest
tables:
  rt: {{ csv: {csv} }}
  reviews: {{ delta: lake/reviews }}
stages:
  - write:
      to: reviews
      sql: |
        SELECT CAST(row_number() OVER (ORDER BY text, movie_name) AS BIGINT) AS id, text,
               category AS truth
        FROM rt WHERE category IN ('fresh', 'rotten')
        ORDER BY id LIMIT ${{ROWS}}
"#,
        csv = assets()
            .join("rotten_tomatoes/rotten_tomatoes_corpus_full.csv.bz2")
            .display()
    )
}

/// [`ingest_yaml`] with a `split` column for training: every fifth review (by id)
/// 'validation', the others 'train'.
pub fn ingest_yaml_with_split() -> String {
    ingest_yaml().replace(
        "category AS truth",
        "category AS truth, \
         CASE WHEN row_number() OVER (ORDER BY text, movie_name) % 5 = 0 THEN 'validation' \
         ELSE 'train' END AS split",
    )
}

/// A MiniLM classifier directory `name` (labels comma-separated, head drawn with `seed`),
/// made by transformers (tests/py/make_classifier.py).
pub fn make_model_with(s: &Scratch, name: &str, labels: &str, seed: u32) {
    python(
        "make_classifier.py",
        &[
            minilm().to_str().expect("utf-8 path"),
            s.path().join(name).to_str().expect("utf-8 path"),
            labels,
            &seed.to_string(),
        ],
    );
}

/// Runs [`INGEST`] in the scratch directory with `rows` reviews.
pub fn ingest(s: &Scratch, rows: usize) {
    run_quiet(s, INGEST, &[("ROWS", rows.to_string())]);
}

/// `pipeline run -q FILE` in the scratch directory with `env` set; it must succeed.
pub fn run_quiet(s: &Scratch, file: &str, env: &[(&str, String)]) {
    let out = pipeline_command()
        .args(["run", "-q", file])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .current_dir(s.path())
        .output()
        .expect("run pipeline");
    assert!(
        out.status.success(),
        "{file}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
