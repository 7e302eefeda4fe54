//! What the serve and Spark tests share: the classifier's labels, the predict stage whose
//! table they compare with, the workers' token, and a running `pipeline serve`.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{Scratch, pipeline_command, python};

/// The static Bearer token, given to the server as `LAKEML_TOKEN`.
pub const TOKEN: &str = "lakeml-serve-test-token";
/// The model's labels by id (make_classifier.py).
pub const LABELS: [&str; 2] = ["rotten", "fresh"];
/// A predict stage over `reviews` into `preds` (incremental).
pub const PREDICT: &str = "predict.yaml";
pub const PREDICT_YAML: &str = "name: p\ntables:\n  reviews: { delta: lake/reviews }\n  \
    preds: { delta: lake/preds }\nstages:\n  - predict:\n      from: reviews\n      \
    model: model\n      to: preds\n";
/// What `pipeline serve` prints once it accepts connections, before its URI.
const LISTENING: &str = "listening on ";

/// (id, label, score) of a Delta table read by tests/py/read_delta.py.
pub fn delta_id_label_score(table: &Value) -> Vec<(u64, String, f64)> {
    table["rows"]
        .as_array()
        .unwrap_or_else(|| panic!("no rows: {table}"))
        .iter()
        .map(|r| {
            (
                r["id"].as_u64().unwrap_or_else(|| panic!("id in {r}")),
                r["label"]
                    .as_str()
                    .unwrap_or_else(|| panic!("label in {r}"))
                    .to_string(),
                r["score"]
                    .as_f64()
                    .unwrap_or_else(|| panic!("score in {r}")),
            )
        })
        .collect()
}

/// The predict stage's rows in `lake/preds`: id → (label, score), read back with deltalake.
pub fn predictions(s: &Scratch) -> BTreeMap<u64, (String, f64)> {
    let table = python(
        "read_delta.py",
        &[s.path().join("lake/preds").to_str().expect("utf-8 path")],
    );
    delta_id_label_score(&table)
        .into_iter()
        .map(|(id, label, score)| (id, (label, score)))
        .collect()
}

/// Asserts that `got` holds exactly the predict stage's rows: every id once, the same label,
/// the score within 1e-5 (fp32 on both sides, batched differently).
pub fn assert_same_predictions(
    what: &str,
    got: &[(u64, String, f64)],
    want: &BTreeMap<u64, (String, f64)>,
) {
    let ids: HashSet<u64> = got.iter().map(|r| r.0).collect();
    assert_eq!(ids.len(), got.len(), "{what}: duplicate ids");
    assert_eq!(
        ids,
        want.keys().copied().collect::<HashSet<u64>>(),
        "{what}: not the predictions table's ids"
    );
    let mut worst = 0f64;
    for (id, label, score) in got {
        let (want_label, want_score) = &want[id];
        assert_eq!(label, want_label, "{what}: the label of id {id}");
        worst = worst.max((score - want_score).abs());
    }
    assert!(worst <= 1e-5, "{what}: scores differ by up to {worst}");
}
/// A running `pipeline serve FILE`; killed (SIGKILL) when dropped if still running.
pub struct Server {
    child: Child,
    /// `grpc://127.0.0.1:PORT` (`grpc+tls://` with TLS), from the line the server prints
    /// when ready.
    pub uri: String,
    /// Everything the server wrote on stderr so far.
    stderr: Arc<Mutex<String>>,
    /// The thread that copies stderr into `stderr`; it ends when the server has exited.
    stderr_copier: Option<JoinHandle<()>>,
}

impl Server {
    /// Starts `pipeline serve FILE` in the scratch directory (with `LAKEML_TOKEN` set) and
    /// waits for its `listening on grpc://...` line, at most 120 s.
    pub fn start(s: &Scratch, file: &str) -> Self {
        let mut child = pipeline_command()
            .args(["serve", file])
            .env("LAKEML_TOKEN", TOKEN)
            .current_dir(s.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn pipeline serve");
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        // Constructed first, so a failure below still kills the child (Drop).
        let mut server = Self {
            child,
            uri: String::new(),
            stderr: Arc::new(Mutex::new(String::new())),
            stderr_copier: None,
        };
        // Both pipes are drained for the server's whole life, so it never blocks on them.
        let sink = Arc::clone(&server.stderr);
        server.stderr_copier = Some(std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let mut text = sink.lock().expect("stderr lock");
                text.push_str(&line);
                text.push('\n');
            }
        }));
        let (lines, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // nobody listens once the address is known: keep draining
                let _ = lines.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut printed = Vec::new();
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) => {
                    if let Some(at) = line.find(LISTENING) {
                        server.uri = line[at + LISTENING.len()..]
                            .split_whitespace()
                            .next()
                            .unwrap_or_default()
                            .to_string();
                        return server;
                    }
                    printed.push(line);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    // stdout closed: the server exited (or is exiting)
                    let status = server.wait_exit(Duration::from_secs(10));
                    panic!(
                        "pipeline serve {file} exited ({status:?}) before listening\n\
                         stdout:\n{}\nstderr:\n{}",
                        printed.join("\n"),
                        server.final_stderr()
                    );
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "pipeline serve {file} printed no `{LISTENING}` line in 120 s\n\
                     stdout:\n{}\nstderr:\n{}",
                    printed.join("\n"),
                    server.stderr()
                );
            }
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().expect("stderr lock").clone()
    }

    /// All of stderr, once the server has exited (else what it wrote so far).
    pub fn final_stderr(&mut self) -> String {
        if matches!(self.child.try_wait(), Ok(Some(_)))
            && let Some(copier) = self.stderr_copier.take()
        {
            let _ = copier.join();
        }
        self.stderr()
    }

    /// The server's PID, for kill(1).
    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// Sends a signal (`-TERM`, `-INT`) with kill(1), by the child's PID.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid();
        let status = Command::new("kill")
            .arg(signal)
            .arg(&pid)
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }

    /// The exit status, if the server exits within `within`.
    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM with no query running: the server must exit 0, promptly.
    pub fn stop(mut self) {
        self.signal("-TERM");
        let status = self.wait_exit(Duration::from_secs(30));
        let stderr = self.final_stderr();
        match status {
            Some(status) => assert!(status.success(), "exit {status} on SIGTERM:\n{stderr}"),
            None => panic!("still running 30 s after SIGTERM, idle:\n{stderr}"),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
