//! A small MLflow REST client: experiments, runs, batched logging and artifact uploads.
//!
//! Only the endpoints the tracker needs, from the MLflow REST API
//! (<https://mlflow.org/docs/latest/api_reference/rest-api.html>), checked against
//! mlflow 3.17. Artifacts go through the tracking server's artifact proxy
//! (`mlflow/server/artifact_router.py`), so lakeml needs no credentials for the store behind
//! it. The client is async (see Cargo.toml for why) and is driven by a runtime it owns;
//! it must live on one thread that is not inside another tokio runtime (src/track/sender.rs).

use std::path::Path;
use std::time::Duration;

use reqwest::{Method, StatusCode, Url};
use serde_json::{Value, json};

use crate::error::{Error, Result};

/// No request waits longer than this unless it carries a file (see `upload`).
const TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// MLflow's limits (`mlflow/utils/validation.py`): a batch above them is refused whole.
const MAX_METRICS_PER_BATCH: usize = 1000;
const MAX_PARAMS_PER_BATCH: usize = 100;
const MAX_PARAM_VAL_LENGTH: usize = 6000;
/// Where the server's artifact proxy lives, relative to the tracking URI.
const ARTIFACTS_ROUTE: &str = "api/2.0/mlflow-artifacts/artifacts";

/// What the tracker keeps of an MLflow run.
#[derive(Debug, Clone)]
pub(super) struct RunInfo {
    pub(super) run_id: String,
    /// Where the run's artifacts live, e.g. `mlflow-artifacts:/1/<run_id>/artifacts`.
    pub(super) artifact_uri: String,
}

/// One metric point; `value` may be NaN or infinite (a diverged loss is worth recording).
#[derive(Debug, Clone)]
pub(super) struct Metric {
    pub(super) key: String,
    pub(super) value: f64,
    pub(super) timestamp_ms: i64,
    pub(super) step: u64,
}

/// A failed call, with MLflow's `error_code` when the server gave one, so callers can tell
/// "not found" from real failures without reading messages.
struct Failure {
    code: Option<String>,
    error: Error,
}

impl Failure {
    fn is(&self, code: &str) -> bool {
        self.code.as_deref() == Some(code)
    }
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Self { code: None, error }
    }
}

impl From<Failure> for Error {
    fn from(f: Failure) -> Self {
        f.error
    }
}

enum Auth {
    None,
    Basic { user: String, password: String },
    Bearer(String),
}

pub(super) struct Client {
    runtime: tokio::runtime::Runtime,
    http: reqwest::Client,
    /// The tracking URI as the user gave it, for messages.
    uri: String,
    /// The tracking URI with a trailing `/`, so `join` keeps any path prefix (`/mlflow/`).
    base: Url,
    auth: Auth,
}

impl Client {
    /// Checks the URI and builds the client; nothing is sent yet.
    pub(super) fn new(uri: &str) -> Result<Self> {
        let base = Url::parse(&format!("{}/", uri.trim_end_matches('/')))
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
            .ok_or_else(|| {
                Error::Tracking(format!(
                    "MLflow tracking URI `{uri}` is not an http:// or https:// URL: lakeml \
                     talks to an MLflow tracking server (start one with `mlflow server`) and \
                     cannot write to a local mlruns directory or a database directly"
                ))
            })?;
        // Our own single-threaded runtime: the training loop is a plain thread, and one
        // connection at a time is all a metrics stream needs.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the MLflow client's runtime", e))?;
        let http = {
            let _entered = runtime.enter();
            reqwest::Client::builder()
                .timeout(TIMEOUT)
                .connect_timeout(CONNECT_TIMEOUT)
                // No idle keep-alive connections: the server (uvicorn) closes idle ones on
                // its own clock, and a request sent on one just as it closes fails with
                // "connection closed before message completed". Requests come every few
                // seconds at most, so a fresh connection each time costs nothing.
                .pool_max_idle_per_host(0)
                .build()
                .map_err(|e| Error::Internal(format!("building the HTTP client: {e}")))?
        };
        Ok(Self {
            runtime,
            http,
            uri: uri.to_string(),
            base,
            auth: auth_from_env(),
        })
    }

    /// The experiment's id, creating the experiment if it does not exist yet.
    pub(super) fn experiment_id(&self, name: &str) -> Result<String> {
        if let Some(id) = self.get_experiment_id(name)? {
            return Ok(id);
        }
        let body = json!({ "name": name });
        match self.call(Method::POST, "mlflow/experiments/create", &[], Some(body)) {
            Ok(reply) => string_field(&reply, &["experiment_id"], "experiments/create"),
            // Another process created it between our two calls.
            Err(f) if f.is("RESOURCE_ALREADY_EXISTS") => {
                self.get_experiment_id(name)?.ok_or(f.error)
            }
            Err(f) => Err(f.error),
        }
    }

    fn get_experiment_id(&self, name: &str) -> Result<Option<String>> {
        let query = [("experiment_name", name)];
        let reply = match self.call(Method::GET, "mlflow/experiments/get-by-name", &query, None) {
            Ok(reply) => reply,
            Err(f) if f.is("RESOURCE_DOES_NOT_EXIST") => return Ok(None),
            Err(f) => return Err(f.error),
        };
        let id = string_field(
            &reply,
            &["experiment", "experiment_id"],
            "experiments/get-by-name",
        )?;
        if reply["experiment"]["lifecycle_stage"].as_str() == Some("deleted") {
            return Err(Error::Tracking(format!(
                "MLflow experiment `{name}` (id {id}) at {} is deleted: restore it \
                 (`mlflow experiments restore --experiment-id {id}`) or pick another \
                 experiment name",
                self.uri
            )));
        }
        Ok(Some(id))
    }

    pub(super) fn create_run(
        &self,
        experiment_id: &str,
        run_name: Option<&str>,
        start_time_ms: i64,
    ) -> Result<RunInfo> {
        let mut body = json!({
            "experiment_id": experiment_id,
            "start_time": start_time_ms,
            "tags": [{ "key": "mlflow.source.name", "value": "lakeml" }],
        });
        if let Some(name) = run_name {
            body["run_name"] = json!(name);
        }
        if let Some(user) = std::env::var("USER").ok().filter(|u| !u.is_empty()) {
            body["user_id"] = json!(user);
        }
        let reply = self.call(Method::POST, "mlflow/runs/create", &[], Some(body))?;
        run_info(&reply["run"]["info"], "runs/create")
    }

    /// Reopens a run so a resumed training keeps logging into it.
    pub(super) fn reopen_run(&self, run_id: &str) -> Result<RunInfo> {
        let reply = match self.call(Method::GET, "mlflow/runs/get", &[("run_id", run_id)], None) {
            Ok(reply) => reply,
            Err(f) if f.is("RESOURCE_DOES_NOT_EXIST") => {
                return Err(Error::Tracking(format!(
                    "cannot resume MLflow run {run_id}: {} has no such run; was the checkpoint \
                     trained against another tracking server? ({})",
                    self.uri, f.error
                )));
            }
            Err(f) => return Err(f.error),
        };
        let info = &reply["run"]["info"];
        if info["lifecycle_stage"].as_str() == Some("deleted") {
            return Err(Error::Tracking(format!(
                "cannot resume MLflow run {run_id} at {}: it is deleted; restore it \
                 (`mlflow runs restore --run-id {run_id}`) or start a fresh run",
                self.uri
            )));
        }
        let run = run_info(info, "runs/get")?;
        // MLflow keeps the old end_time (the REST API cannot clear it); finish() overwrites it.
        self.update_run(run_id, "RUNNING", None)?;
        Ok(run)
    }

    pub(super) fn update_run(
        &self,
        run_id: &str,
        status: &str,
        end_time_ms: Option<i64>,
    ) -> Result<()> {
        let mut body = json!({ "run_id": run_id, "status": status });
        if let Some(end) = end_time_ms {
            body["end_time"] = json!(end);
        }
        self.call(Method::POST, "mlflow/runs/update", &[], Some(body))?;
        Ok(())
    }

    /// Sends metrics in as many batches as MLflow's per-request limit needs.
    pub(super) fn log_metrics(&self, run_id: &str, metrics: &[Metric]) -> Result<()> {
        for chunk in metrics.chunks(MAX_METRICS_PER_BATCH) {
            let metrics: Vec<Value> = chunk
                .iter()
                .map(|m| {
                    json!({
                        "key": m.key,
                        "value": metric_value(m.value),
                        "timestamp": m.timestamp_ms,
                        "step": m.step,
                    })
                })
                .collect();
            let body = json!({ "run_id": run_id, "metrics": metrics });
            self.call(Method::POST, "mlflow/runs/log-batch", &[], Some(body))?;
        }
        Ok(())
    }

    /// Logs params, each value cut to MLflow's 6000-character limit (the server refuses
    /// longer ones; metrics.jsonl keeps the whole value). Logging the same value again, as a
    /// resumed run does, is accepted; a different value for a logged key is refused by MLflow.
    pub(super) fn log_params(&self, run_id: &str, params: &[(String, String)]) -> Result<()> {
        for chunk in params.chunks(MAX_PARAMS_PER_BATCH) {
            let params: Vec<Value> = chunk
                .iter()
                .map(|(k, v)| json!({ "key": k, "value": truncate_chars(v, MAX_PARAM_VAL_LENGTH) }))
                .collect();
            let body = json!({ "run_id": run_id, "params": params });
            self.call(Method::POST, "mlflow/runs/log-batch", &[], Some(body))?;
        }
        Ok(())
    }

    /// The proxy URL of the run's artifact root, as the Python client resolves it
    /// (`MlflowArtifactsRepository.resolve_uri` in mlflow/store/artifact/mlflow_artifacts_repo.py).
    pub(super) fn artifact_root(&self, run: &RunInfo) -> Result<Url> {
        let uri = &run.artifact_uri;
        let url = if let Some(rest) = uri.strip_prefix("mlflow-artifacts:") {
            // `mlflow-artifacts:/1/<run>/artifacts` or `mlflow-artifacts://host:port/1/...`:
            // the path goes under the proxy route of the tracking server (or of that host).
            let (host, path) = match rest.strip_prefix("//") {
                Some(hosted) => hosted.split_at(hosted.find('/').unwrap_or(hosted.len())),
                None => ("", rest),
            };
            let mut url = self.base.join(ARTIFACTS_ROUTE).ok();
            if let Some(u) = url.as_mut().filter(|_| !host.is_empty()) {
                let (name, port) = match host.rsplit_once(':') {
                    Some((n, p)) => (n, p.parse::<u16>().ok()),
                    None => (host, None),
                };
                if u.set_host(Some(name)).is_err() || u.set_port(port).is_err() {
                    url = None;
                }
            }
            url.map(|mut u| {
                if let Ok(mut segments) = u.path_segments_mut() {
                    segments
                        .pop_if_empty()
                        .extend(path.split('/').filter(|s| !s.is_empty()));
                }
                u
            })
        } else if (uri.starts_with("http://") || uri.starts_with("https://"))
            && uri.contains(ARTIFACTS_ROUTE)
        {
            Url::parse(uri).ok()
        } else {
            None
        };
        url.ok_or_else(|| {
            Error::Tracking(format!(
                "MLflow run {} stores artifacts at `{uri}`, which lakeml can only reach through \
                 the tracking server's artifact proxy: run `mlflow server` with artifact serving \
                 on (the default; no --no-serve-artifacts) and --artifacts-destination, and use \
                 an experiment created under it (its artifact location starts with \
                 mlflow-artifacts:/)",
                run.run_id
            ))
        })
    }

    /// PUTs one file, streamed from disk, to `url`.
    pub(super) fn upload(&self, url: Url, file: &Path) -> Result<()> {
        let size = std::fs::metadata(file)
            .map_err(|e| Error::io(format!("reading {}", file.display()), e))?
            .len();
        let reader = std::fs::File::open(file)
            .map_err(|e| Error::io(format!("reading {}", file.display()), e))?;
        let body = reqwest::Body::wrap_stream(file_chunks(reader));
        // Checkpoints are large: allow the usual 30 s plus one second per MiB (1 MiB/s).
        let timeout = TIMEOUT + Duration::from_secs(size >> 20);
        let request = self
            .authorize(self.http.put(url.clone()))
            .timeout(timeout)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            // A known length spares the server a chunked upload.
            .header(reqwest::header::CONTENT_LENGTH, size)
            .body(body);
        let what = format!("PUT {url} (uploading {})", file.display());
        self.send(request, &url, &what)
            .map(drop)
            .map_err(|f| f.error)
    }

    fn call(
        &self,
        method: Method,
        endpoint: &str,
        query: &[(&str, &str)],
        body: Option<Value>,
    ) -> Result<Value, Failure> {
        let mut url = self
            .base
            .join("api/2.0/")
            .and_then(|u| u.join(endpoint))
            .map_err(|e| Error::Internal(format!("MLflow endpoint `{endpoint}`: {e}")))
            .map_err(Failure::from)?;
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        let mut request = self.authorize(self.http.request(method.clone(), url.clone()));
        if let Some(body) = body {
            request = request
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.to_string());
        }
        let text = self.send(request, &url, &format!("{method} {url}"))?;
        if text.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&text).map_err(|e| {
            Failure::from(Error::Tracking(format!(
                "MLflow {endpoint} at {url} answered something that is not JSON ({e}): is \
                 {} an MLflow tracking server?",
                self.uri
            )))
        })
    }

    /// Sends a request; turns transport failures and error statuses into messages that say
    /// what to check.
    fn send(
        &self,
        request: reqwest::RequestBuilder,
        url: &Url,
        what: &str,
    ) -> Result<String, Failure> {
        let result = self.runtime.block_on(async {
            let response = request.send().await?;
            let status = response.status();
            let text = response.text().await?;
            Ok::<_, reqwest::Error>((status, text))
        });
        let (status, text) = result.map_err(|e| {
            Failure::from(Error::Tracking(format!(
                "MLflow request {what} failed: {}; is the MLflow server running at {} \
                 and reachable from here?",
                // The URL is in `what` already.
                error_chain(&e.without_url()),
                self.uri
            )))
        })?;
        if status.is_success() {
            return Ok(text);
        }
        // MLflow answers errors as {"error_code": .., "message": ..}; anything else is shown raw.
        let parsed = serde_json::from_str::<Value>(&text).ok();
        let code = parsed
            .as_ref()
            .and_then(|v| v["error_code"].as_str())
            .map(str::to_string);
        let detail = match (&code, &parsed) {
            (Some(code), Some(v)) => format!("{code}: {}", v["message"].as_str().unwrap_or("")),
            _ => truncate_chars(text.trim(), 500).to_string(),
        };
        let hint = match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                " (set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or \
                 MLFLOW_TRACKING_TOKEN)"
            }
            StatusCode::NOT_FOUND if code.is_none() => {
                " (is this URI an MLflow tracking server, and new enough for this endpoint?)"
            }
            StatusCode::SERVICE_UNAVAILABLE if url.path().contains("mlflow-artifacts") => {
                " (start `mlflow server` with artifact serving on: drop --no-serve-artifacts)"
            }
            _ => "",
        };
        Err(Failure {
            code,
            error: Error::Tracking(format!(
                "MLflow request {what} failed with HTTP {status}: {detail}{hint}"
            )),
        })
    }

    fn authorize(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.auth {
            Auth::None => request,
            Auth::Basic { user, password } => request.basic_auth(user, Some(password)),
            Auth::Bearer(token) => request.bearer_auth(token),
        }
    }
}

/// The same variables the Python client reads (mlflow/environment_variables.py).
fn auth_from_env() -> Auth {
    let var = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
    if let Some(token) = var("MLFLOW_TRACKING_TOKEN") {
        Auth::Bearer(token)
    } else if let (Some(user), Some(password)) = (
        var("MLFLOW_TRACKING_USERNAME"),
        var("MLFLOW_TRACKING_PASSWORD"),
    ) {
        Auth::Basic { user, password }
    } else {
        Auth::None
    }
}

/// Reads a file in 1 MiB chunks as the request body streams out.
fn file_chunks(
    reader: std::fs::File,
) -> impl futures::Stream<Item = std::io::Result<Vec<u8>>> + Send + 'static {
    use std::io::Read;
    futures::stream::try_unfold(reader, |mut reader| async move {
        let mut chunk = vec![0u8; 1 << 20];
        let n = reader.read(&mut chunk)?;
        if n == 0 {
            return Ok(None);
        }
        chunk.truncate(n);
        Ok(Some((chunk, reader)))
    })
}

/// MLflow's JSON (protobuf's JSON mapping) takes non-finite doubles as strings.
fn metric_value(v: f64) -> Value {
    if v.is_nan() {
        json!("NaN")
    } else if v == f64::INFINITY {
        json!("Infinity")
    } else if v == f64::NEG_INFINITY {
        json!("-Infinity")
    } else {
        json!(v)
    }
}

fn truncate_chars(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

fn string_field(body: &Value, path: &[&str], endpoint: &str) -> Result<String> {
    let mut v = body;
    for key in path {
        v = &v[key];
    }
    v.as_str().map(str::to_string).ok_or_else(|| {
        Error::Tracking(format!(
            "MLflow {endpoint} answered without `{}`: is the server an MLflow tracking server \
             of a supported version (2.x or 3.x)? Answer: {}",
            path.join("."),
            truncate_chars(&body.to_string(), 500)
        ))
    })
}

fn run_info(info: &Value, endpoint: &str) -> Result<RunInfo> {
    let get = |key| string_field(info, &[key], endpoint);
    Ok(RunInfo {
        run_id: get("run_id")?,
        artifact_uri: get("artifact_uri")?,
    })
}

/// reqwest's own message is only "error sending request"; the cause (connection refused,
/// timed out, DNS) is further down the chain.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}
