//! An `mlflow server` for tests, on 127.0.0.1 and a free port, stopped with its process
//! group when dropped. Shared by the tracker's unit tests (src/track/tests.rs) and the
//! train stage's integration tests (tests/it/mlflow.rs) through `#[path]`.
// Each of the two test crates uses a different subset of these helpers.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// An `mlflow server` on a free port with its own SQLite store and artifact directory,
/// stopped with its whole process group (uvicorn and job workers) when dropped, also when
/// a test fails.
pub struct MlflowServer {
    child: Child,
    pub uri: String,
    port: u16,
    log: PathBuf,
    /// Store and artifacts; removed after the server is stopped (fields drop after `drop`).
    _dir: tempfile::TempDir,
}

impl MlflowServer {
    pub fn start() -> Self {
        let mlflow = PathBuf::from(std::env::var_os("LAKEML_MLFLOW").unwrap_or_else(|| {
            panic!("LAKEML_MLFLOW is not set: run the tests with scripts/test.sh, which installs mlflow and sets it")
        }));
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let log = dir.path().join("server.log");
        let log_file = std::fs::File::create(&log).expect("create server log");
        let err_file = log_file.try_clone().expect("clone log handle");
        let store = format!("sqlite:///{}", dir.path().join("mlflow.db").display());
        let child = Command::new(&mlflow)
            .args(["server", "--host", "127.0.0.1", "--port", &port.to_string()])
            // One worker: the default four would compete with the build for the test
            // machine's cores, and one request at a time is all the tracker sends.
            .args(["--workers", "1", "--backend-store-uri", &store])
            .arg("--artifacts-destination")
            .arg(dir.path().join("artifacts"))
            .current_dir(dir.path())
            .env("MLFLOW_DISABLE_TELEMETRY", "true")
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(err_file)
            // Its own process group, so that Drop can stop the workers it forks too.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", mlflow.display()));
        let mut server = Self {
            child,
            uri: format!("http://127.0.0.1:{port}"),
            port,
            log,
            _dir: dir,
        };
        server.wait_healthy();
        server
    }

    fn wait_healthy(&mut self) {
        // Creating the SQLite schema and importing mlflow take ~20 s on an idle machine.
        let deadline = Instant::now() + Duration::from_secs(180);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("mlflow server exited with {status}:\n{}", self.log_text());
            }
            if self.get("/health").is_some_and(|(status, _)| status == 200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        panic!(
            "mlflow server not healthy after 180 s:\n{}",
            self.log_text()
        );
    }

    /// A plain HTTP/1.0 GET (no chunked answers), independent of the client under test.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .ok()?;
        write!(
            stream,
            "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{}\r\n\r\n",
            self.port
        )
        .ok()?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).ok()?;
        let status = answer.split(' ').nth(1)?.parse().ok()?;
        let body = answer.split_once("\r\n\r\n")?.1.to_string();
        Some((status, body))
    }

    pub fn run_info(&self, run_id: &str) -> Value {
        let (status, body) = self
            .get(&format!("/api/2.0/mlflow/runs/get?run_id={run_id}"))
            .expect("runs/get answers");
        assert_eq!(status, 200, "{body}");
        let run: Value = serde_json::from_str(&body).expect("runs/get JSON");
        run["run"]["info"].clone()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let signal = |sig: &str| {
            let _ = Command::new("kill")
                .args([sig, "--", &group])
                .stderr(Stdio::null())
                .status();
        };
        signal("-TERM");
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(100));
        }
        // Whatever ignored TERM, including workers that outlived the main process.
        signal("-KILL");
        let _ = self.child.wait();
    }
}
