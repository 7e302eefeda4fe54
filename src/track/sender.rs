//! The MLflow thread: every MLflow request runs here, off the training loop.
//!
//! Metrics are queued through a channel and sent in batches (every ~2 s, or as soon as 500
//! are waiting), so logging every step costs the loop a channel send, not an HTTP round
//! trip. Params, artifacts and finish wait for their answer, so their errors reach the
//! caller directly; a failed background batch is reported by the tracker's next call.

use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::MlflowSettings;
use super::mlflow::{Client, Metric, RunInfo};
use crate::error::{Error, Result};

/// Send metrics at least this often while some are waiting...
const FLUSH_EVERY: Duration = Duration::from_secs(2);
/// ...or as soon as this many are waiting (half of MLflow's per-request limit).
const FLUSH_AT: usize = 500;

type Reply = mpsc::SyncSender<Result<()>>;

enum Request {
    Metrics(Vec<Metric>),
    Params(Vec<(String, String)>, Reply),
    /// Files to upload: (local file, path segments under the run's artifact root).
    Artifacts(Vec<(PathBuf, Vec<String>)>, Reply),
    Flush(Reply),
    Finish {
        status: &'static str,
        end_time_ms: i64,
        reply: Reply,
    },
}

/// The caller's end of the MLflow thread.
pub(super) struct MlflowThread {
    tx: Option<mpsc::Sender<Request>>,
    thread: Option<JoinHandle<()>>,
    run: RunInfo,
    /// The first error of a background batch, not yet reported.
    failed: Arc<Mutex<Option<Error>>>,
}

impl MlflowThread {
    /// Starts the thread, which creates the run (or reopens `resume_run_id`) before anything
    /// else; returns once the run exists, or with the reason it could not be made.
    pub(super) fn start(settings: MlflowSettings, resume_run_id: Option<&str>) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let failed = Arc::new(Mutex::new(None));
        let worker_failed = Arc::clone(&failed);
        let resume = resume_run_id.map(str::to_string);
        let thread = std::thread::Builder::new()
            .name("lakeml-mlflow".to_string())
            .spawn(move || {
                let started = Client::new(&settings.uri).and_then(|client| {
                    let run = match &resume {
                        Some(run_id) => client.reopen_run(run_id)?,
                        None => {
                            let experiment_id = client.experiment_id(&settings.experiment)?;
                            client.create_run(
                                &experiment_id,
                                settings.run_name.as_deref(),
                                now_ms(),
                            )?
                        }
                    };
                    Ok((client, run))
                });
                let (client, run) = match started {
                    Ok(ok) => ok,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                if ready_tx.send(Ok(run.clone())).is_err() {
                    return;
                }
                Worker {
                    client,
                    run,
                    pending: Vec::new(),
                    oldest: None,
                    failed: worker_failed,
                }
                .serve(rx);
            })
            .map_err(|e| Error::io("starting the MLflow thread", e))?;
        let run = ready_rx.recv().map_err(|_| {
            Error::Internal("the MLflow thread ended before creating the run".into())
        })??;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            run,
            failed,
        })
    }

    pub(super) fn run_id(&self) -> &str {
        &self.run.run_id
    }

    /// Queues metrics; returns the error of an earlier background batch, if any.
    pub(super) fn metrics(&mut self, metrics: Vec<Metric>) -> Result<()> {
        self.send(Request::Metrics(metrics))?;
        self.take_failure()
    }

    pub(super) fn params(&mut self, params: Vec<(String, String)>) -> Result<()> {
        self.call(|reply| Request::Params(params, reply))
    }

    pub(super) fn artifacts(&mut self, files: Vec<(PathBuf, Vec<String>)>) -> Result<()> {
        self.call(|reply| Request::Artifacts(files, reply))
    }

    /// Sends every queued metric now.
    pub(super) fn flush(&mut self) -> Result<()> {
        self.call(Request::Flush)
    }

    /// Sends what is queued, sets the run's final status and stops the thread.
    pub(super) fn finish(&mut self, ok: bool) -> Result<()> {
        let status = if ok { "FINISHED" } else { "FAILED" };
        let end_time_ms = now_ms();
        let result = self.call(|reply| Request::Finish {
            status,
            end_time_ms,
            reply,
        });
        self.stop();
        result
    }

    fn call(&mut self, request: impl FnOnce(Reply) -> Request) -> Result<()> {
        let (reply_tx, reply_rx) = mpsc::sync_channel(1);
        self.send(request(reply_tx))?;
        reply_rx.recv().map_err(|_| Self::gone())??;
        // An earlier background failure comes next; after a failed answer it waits for the
        // following call, so neither error is lost.
        self.take_failure()
    }

    fn send(&self, request: Request) -> Result<()> {
        self.tx
            .as_ref()
            .ok_or_else(|| Error::Internal("MLflow tracking used after finish".into()))?
            .send(request)
            .map_err(|_| Self::gone())
    }

    fn take_failure(&self) -> Result<()> {
        match self.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn gone() -> Error {
        Error::Internal("the MLflow thread stopped unexpectedly (it panicked)".into())
    }

    /// Closing the channel lets the thread send what is left and end.
    fn stop(&mut self) {
        self.tx = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for MlflowThread {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Worker {
    client: Client,
    run: RunInfo,
    pending: Vec<Metric>,
    /// When the oldest pending metric was queued.
    oldest: Option<Instant>,
    failed: Arc<Mutex<Option<Error>>>,
}

impl Worker {
    fn serve(mut self, rx: mpsc::Receiver<Request>) {
        loop {
            let request = match self.oldest {
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(t) => rx.recv_timeout(FLUSH_EVERY.saturating_sub(t.elapsed())),
            };
            match request {
                Ok(Request::Metrics(metrics)) => {
                    self.oldest.get_or_insert_with(Instant::now);
                    self.pending.extend(metrics);
                    if self.pending.len() >= FLUSH_AT {
                        self.send_in_background();
                    }
                }
                Ok(Request::Params(params, reply)) => {
                    let _ = reply.send(self.client.log_params(&self.run.run_id, &params));
                }
                Ok(Request::Artifacts(files, reply)) => {
                    let _ = reply.send(self.upload(&files));
                }
                Ok(Request::Flush(reply)) => {
                    let _ = reply.send(self.send_pending());
                }
                Ok(Request::Finish {
                    status,
                    end_time_ms,
                    reply,
                }) => {
                    // Set the status even when the last metrics failed, then report the first
                    // error.
                    let sent = self.send_pending();
                    let updated =
                        self.client
                            .update_run(&self.run.run_id, status, Some(end_time_ms));
                    let _ = reply.send(sent.and(updated));
                }
                Err(RecvTimeoutError::Timeout) => self.send_in_background(),
                Err(RecvTimeoutError::Disconnected) => {
                    self.send_in_background();
                    return;
                }
            }
        }
    }

    fn send_pending(&mut self) -> Result<()> {
        self.oldest = None;
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch = std::mem::take(&mut self.pending);
        self.client.log_metrics(&self.run.run_id, &batch)
    }

    /// Sends pending metrics; a failure waits for the caller's next call. The batch is
    /// dropped rather than retried: metrics.jsonl and the event file still hold it, and a
    /// growing backlog would only delay the error.
    fn send_in_background(&mut self) {
        if let Err(e) = self.send_pending() {
            let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
            failed.get_or_insert(e);
        }
    }

    fn upload(&self, files: &[(PathBuf, Vec<String>)]) -> Result<()> {
        if files.is_empty() {
            return Ok(());
        }
        let root = self.client.artifact_root(&self.run)?;
        for (file, segments) in files {
            let mut url = root.clone();
            url.path_segments_mut()
                .map_err(|()| Error::Internal(format!("artifact root {root} has no path")))?
                .pop_if_empty()
                .extend(segments);
            self.client.upload(url, file)?;
        }
        Ok(())
    }
}

pub(super) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
