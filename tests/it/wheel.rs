//! The wheel (`pip install lakeml`, pyproject.toml): built by scripts/wheel.sh from this
//! build directory, installed into a new venv that holds nothing but torch 2.11.0 and the
//! wheel, and run from there with an empty environment.
//!
//! The new venv's torch is the test venv's torch package linked in (the `torch` directory
//! and its dist-info): the files `pip install torch==2.11.0` would write, without a second
//! ~5 GB download. The wheel is installed with `--no-deps` for the same reason; that it
//! requires exactly torch==2.11.0 is read from its metadata. A torch of another version is
//! simulated the cheap way: a `torch` directory whose `version.py` says 2.10.0 around the
//! same `lib/`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;

use crate::common::{CARGO_BUILT_BINARY, env_path, pipeline_bin, python, repo};
use crate::serving::{PREDICT, assert_same_predictions, predictions};
use crate::spark::{Job, path, setup, test_script};

/// The one wheel build of a test process, watched: while scripts/wheel.sh runs, a thread
/// runs the binary under test (`pipeline --version`) again and again, and looks at cargo's
/// own path, which the build takes away for a while.
struct WheelBuild {
    wheel: PathBuf,
    /// `pipeline --version` runs of the binary under test during the build.
    runs: usize,
    /// The runs that failed, with why.
    failures: Vec<String>,
    /// How many of those times cargo's `target/release/pipeline` was missing.
    missing: usize,
}

/// Builds the wheel once for both wheel tests (whichever comes first builds it).
fn wheel_build() -> &'static WheelBuild {
    static BUILD: OnceLock<WheelBuild> = OnceLock::new();
    BUILD.get_or_init(|| {
        // The private copy exists before maturin can touch cargo's file.
        let binary = pipeline_bin();
        let done = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let watcher = scope.spawn(|| watch(binary, &done));
            let wheel = {
                // Stops the watcher even when the build panics, or the scope would wait forever.
                struct Stop<'a>(&'a AtomicBool);
                impl Drop for Stop<'_> {
                    fn drop(&mut self) {
                        self.0.store(true, Ordering::Relaxed);
                    }
                }
                let _stop = Stop(&done);
                build_wheel()
            };
            let (runs, failures, missing) = watcher.join().expect("the watcher thread");
            WheelBuild {
                wheel,
                runs,
                failures,
                missing,
            }
        })
    })
}

/// Until `done`: runs `binary --version` and looks for cargo's binary, again and again, 20 ms
/// apart.
fn watch(binary: &Path, done: &AtomicBool) -> (usize, Vec<String>, usize) {
    let (mut runs, mut failures, mut missing) = (0, Vec::new(), 0);
    while !done.load(Ordering::Relaxed) {
        missing += usize::from(!Path::new(CARGO_BUILT_BINARY).exists());
        runs += 1;
        match Command::new(binary)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
        {
            Ok(out) if out.status.success() => {}
            Ok(out) => failures.push(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )),
            Err(e) => failures.push(e.to_string()),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (runs, failures, missing)
}

/// Builds the wheel with scripts/wheel.sh; returns its path. It runs with the environment
/// scripts/test.sh gave `cargo test`, not with the variables cargo sets for a test process
/// (`CARGO_*`, `OUT_DIR`, a longer `LD_LIBRARY_PATH`) nor the `RUSTC_BOOTSTRAP` that
/// scripts/test.sh sets for test processes alone: inherited by maturin's cargo, they change
/// fingerprints (ring's build script watches CARGO_MANIFEST_DIR), and the whole stack would
/// compile again, twice.
fn build_wheel() -> PathBuf {
    let cargo_set = |name: &str| {
        (name.starts_with("CARGO_") && name != "CARGO_HOME" && name != "CARGO_TARGET_DIR")
            || matches!(
                name,
                "CARGO" | "OUT_DIR" | "LD_LIBRARY_PATH" | "RUST_TEST_THREADS" | "RUSTC_BOOTSTRAP"
            )
    };
    let out = Command::new("bash")
        .arg(repo().join("scripts/wheel.sh"))
        .env_clear()
        .envs(std::env::vars_os().filter(|(k, _)| k.to_str().is_some_and(|k| !cargo_set(k))))
        .output()
        .expect("run scripts/wheel.sh");
    assert!(
        out.status.success(),
        "scripts/wheel.sh failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    PathBuf::from(stdout.lines().last().expect("the wheel's path").trim())
}

/// The site-packages directory of a venv's Python.
fn site_packages(python: &Path) -> PathBuf {
    let out = Command::new(python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ])
        .output()
        .expect("python");
    assert!(out.status.success(), "{python:?}");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn check(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `venv/bin/pipeline ARGS` in `dir` with nothing in the environment but a system PATH and
/// HOME (no LD_LIBRARY_PATH, no LAKEML_* variable).
fn installed_pipeline(venv: &Path, dir: &Path, args: &[&str]) -> Output {
    Command::new(venv.join("bin/pipeline"))
        .args(args)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", std::env::var_os("HOME").unwrap_or_default())
        .current_dir(dir)
        .output()
        .expect("run the installed pipeline")
}

/// Regression: `scripts/wheel.sh` (maturin over the shared target directory) removes
/// `target/release/pipeline` for ~2.5 s, and a test that ran that path beside the wheel test
/// failed with `NotFound` by chance. Every test runs a private copy ([`pipeline_bin`]); this
/// runs it throughout a real wheel build, and checks that no test runs cargo's path.
#[test]
fn the_wheel_build_never_takes_the_binary_away_from_a_running_test() {
    let build = wheel_build();
    assert!(
        build.failures.is_empty(),
        "{} of {} runs of the binary under test failed during the wheel build: {:?}",
        build.failures.len(),
        build.runs,
        build.failures
    );
    assert!(build.runs >= 3, "only {} runs during the build", build.runs);
    eprintln!(
        "the binary under test ran {} times during the wheel build, none failed; cargo's \
         target/release/pipeline was missing at {} of those runs",
        build.runs, build.missing
    );

    // No test runs cargo's path: only tests/it/common.rs names it, to copy it.
    let needle = concat!("CARGO_BIN_", "EXE_pipeline");
    let dir = repo().join("tests/it");
    for entry in std::fs::read_dir(&dir).expect("tests/it").flatten() {
        let path = entry.path();
        if path.file_name() == Some(OsStr::new("common.rs")) {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            !text.contains(needle),
            "{} names {needle}: run crate::common::pipeline_bin() instead, a copy no build \
             step can remove",
            path.display()
        );
    }
}

#[test]
fn the_wheel_installs_a_pipeline_that_finds_its_venvs_torch_and_refuses_another() {
    let wheel = wheel_build().wheel.clone();
    let contents = python("wheel_contents.py", &[wheel.to_str().expect("utf-8 path")]);
    let name = wheel
        .file_name()
        .and_then(OsStr::to_str)
        .unwrap_or_default();
    assert!(
        name.starts_with("lakeml-0.1.0-py3-none-manylinux_2_") && name.ends_with("_x86_64.whl"),
        "{name}"
    );
    let files = contents["files"].as_object().expect("files");
    for expected in [
        "lakeml-0.1.0.data/scripts/pipeline",
        "lakeml_spark/__init__.py",
        "lakeml_spark/_local.py",
        "lakeml_spark/_predict.py",
    ] {
        assert!(files.contains_key(expected), "{expected} not in {files:?}");
    }
    assert!(
        !files.keys().any(|f| f.contains("libtorch")),
        "libtorch belongs to the torch wheel, not this one: {files:?}"
    );
    assert_eq!(contents["scripts_mode"], "0o100755", "{contents}");
    let requires: Vec<&str> = contents["requires"]
        .as_array()
        .expect("requires")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(requires.contains(&"torch==2.11.0"), "{requires:?}");
    assert!(
        requires
            .iter()
            .any(|r| r.starts_with("pyspark") && r.contains("extra == 'spark'")),
        "pyspark is the `spark` extra's, not a requirement: {requires:?}"
    );
    let bytes = contents["bytes"].as_u64().expect("bytes");
    assert!(bytes < 100 << 20, "the wheel is {bytes} bytes");

    // A new venv with torch 2.11.0 (linked in, see above) and the wheel.
    let s = setup(300);
    let venv = s.path().join("venv");
    let made = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .output()
        .expect("python3 -m venv");
    check("python3 -m venv", &made);
    let site = site_packages(&venv.join("bin/python"));
    let torch_site = site_packages(&env_path("LAKEML_PYTHON"));
    assert_eq!(
        site.file_name(),
        torch_site.file_name(),
        "both venvs are site-packages of a Python"
    );
    for entry in ["torch", "torch-2.11.0.dist-info"] {
        std::os::unix::fs::symlink(torch_site.join(entry), site.join(entry))
            .unwrap_or_else(|e| panic!("link {entry}: {e}"));
    }
    let install = Command::new(venv.join("bin/python"))
        .args(["-m", "pip", "install", "-q", "--no-deps", "--no-index"])
        .arg(&wheel)
        .output()
        .expect("pip install the wheel");
    check("pip install the wheel", &install);

    // `pipeline info` with an empty environment: the venv's libtorch, found by the rpath.
    let info = installed_pipeline(&venv, s.path(), &["info", "--json"]);
    check("pipeline info", &info);
    let info: Value = serde_json::from_slice(&info.stdout).expect("info json");
    let loaded = info["libtorch_loaded"].as_str().unwrap_or_default();
    assert!(
        loaded.starts_with(venv.join("bin/../lib").to_str().expect("utf-8")),
        "libtorch must come from the venv's torch package: {info}"
    );

    // A predict pipeline run by the installed binary equals the source build's.
    s.run_ok(&[PREDICT]);
    let want = predictions(&s);
    std::fs::remove_dir_all(s.path().join("lake/preds")).expect("rm preds");
    let run = installed_pipeline(&venv, s.path(), &["run", "-q", PREDICT]);
    check("the installed pipeline run", &run);
    let got: Vec<(u64, String, f64)> = predictions(&s)
        .into_iter()
        .map(|(id, (label, score))| (id, label, score))
        .collect();
    assert_same_predictions("the wheel's pipeline", &got, &want);

    // lakeml_spark imports with nothing but the wheel (pyspark is the `spark` extra).
    let import = Command::new(venv.join("bin/python"))
        .args(["-c", "import lakeml_spark; print(lakeml_spark.__version__)"])
        .env_clear()
        .output()
        .expect("python -c import lakeml_spark");
    check("import lakeml_spark", &import);
    assert_eq!(String::from_utf8_lossy(&import.stdout).trim(), "0.1.0");

    // Another torch in the venv: the binary names both versions, exit 2.
    std::fs::remove_file(site.join("torch")).expect("unlink torch");
    std::fs::create_dir(site.join("torch")).expect("mkdir torch");
    std::fs::write(
        site.join("torch/version.py"),
        "__version__ = '2.10.0+cpu'\n",
    )
    .expect("version.py");
    std::os::unix::fs::symlink(torch_site.join("torch/lib"), site.join("torch/lib"))
        .expect("link lib");
    let refused = installed_pipeline(&venv, s.path(), &["info"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    for words in [
        "torch 2.10.0+cpu",
        "built against torch 2.11.0",
        "pip install torch==2.11.0",
    ] {
        assert!(stderr.contains(words), "{words:?} not in: {stderr}");
    }

    // The same binary as the Spark executors' worker: the task fails with its message.
    let tmp = s.path().join("tmp");
    std::fs::create_dir_all(&tmp).expect("mkdir tmp");
    let binary = venv.join("bin/pipeline");
    let (got, _) = Job::spawn_with(
        &s,
        &test_script("spark_local_worker.py"),
        &[
            "--expect-failure",
            &path(&s, "model"),
            &path(&s, "lake/reviews"),
        ],
        "other-torch",
        &[
            ("TMPDIR", tmp.as_os_str()),
            ("LAKEML_PIPELINE", binary.as_os_str()),
        ],
    )
    .finish("spark_local_worker.py --expect-failure");
    let error = got["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("could not start") && error.contains("torch 2.10.0+cpu"),
        "the Spark task must fail with the worker's own message: {got}"
    );
    assert_eq!(got["workers"], 0, "{got}");
}
