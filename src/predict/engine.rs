//! The model side of prediction and embedding: `replicas` libtorch threads, each with its own
//! copy of the model, take windows of tokenized rows from one bounded queue, run the encoder
//! and hand its output to a [`Head`]: the classifier's logits, or pooled sentence vectors.
//!
//! The batch `predict` and `embed` stages and `pipeline serve` (SQL functions and
//! DoExchange) share this engine. A replica that finds several windows waiting merges them into one, so rows from
//! concurrent queries are sorted by length together and packed under the same token budget;
//! a window whose caller has gone away (a client that disconnected) is dropped unrun, and
//! one whose callers all go away mid-run stops at its next forward pass.
//!
//! Dropping the engine closes the queue and waits for the replicas to finish their current
//! forward pass: a process must not exit (and tear libtorch down) under a running one.

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use arrow::array::{Array, AsArray, ListArray};
use arrow::datatypes::Int32Type;
use tch::{Device, Kind, Tensor};

use super::PredictSettings;
use super::pooling::{Pooling, normalized};
use crate::config::Precision;
use crate::error::{Error, Result};
use crate::model::{Model, ModelConfig, thread};

/// What to lower when prediction runs out of memory.
const OOM_HINT: &str = "lower `batch_tokens` (padded tokens per forward pass), or `replicas`";

/// Windows waiting for the model: callers wait for room beyond this (back-pressure).
const QUEUE_WINDOWS: usize = 64;

/// Rows a replica merges from waiting windows into one.
const MERGE_ROWS: usize = 8192;

/// A window of tokenized rows waiting for the model, and the head it wants.
struct Job {
    ids: ListArray,
    head: Arc<Head>,
    reply: tokio::sync::oneshot::Sender<Result<Vec<f32>>>,
}

type Queue = Arc<Mutex<tokio::sync::mpsc::Receiver<Job>>>;

/// How long dropping the engine waits for the replicas to stop.
const STOP_WAIT: Duration = Duration::from_secs(60);

/// Model replicas behind one queue.
pub(crate) struct Engine {
    queue: Mutex<Option<tokio::sync::mpsc::Sender<Job>>>,
    running: Running,
    /// The head [`Engine::run`] uses.
    head: Arc<Head>,
}

/// The number of replica threads still running, and a signal when it changes.
#[derive(Clone, Default)]
struct Running(Arc<(Mutex<usize>, Condvar)>);

/// Counts one replica thread as running until dropped (also when the thread panics).
struct RunningGuard(Running);

impl Running {
    fn enter(&self) -> RunningGuard {
        if let Ok(mut n) = self.0.0.lock() {
            *n += 1;
        }
        RunningGuard(self.clone())
    }

    /// Waits until no replica runs, or `limit` has passed.
    fn wait_idle(&self, limit: Duration) {
        let (count, changed) = &*self.0;
        if let Ok(n) = count.lock() {
            let _ = changed.wait_timeout_while(n, limit, |n| *n > 0);
        }
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        let (count, changed) = &*self.0.0;
        if let Ok(mut n) = count.lock() {
            *n = n.saturating_sub(1);
        }
        changed.notify_all();
    }
}

/// What the engine makes of the encoder's output, per row.
#[derive(Debug, Clone)]
pub(crate) enum Head {
    /// The classifier's logits, one per class.
    Classify { classes: usize },
    /// A sentence vector: pooled, cut to its first `dims` values (Matryoshka) and then
    /// L2-normalized when `normalize`.
    Embed {
        pooling: Arc<Pooling>,
        dims: usize,
        normalize: bool,
    },
}

impl Head {
    /// Values per row.
    pub(crate) fn width(&self) -> usize {
        match self {
            Head::Classify { classes } => *classes,
            Head::Embed { dims, .. } => *dims,
        }
    }

    /// `[rows, width]` (fp32) for a forward pass's inputs.
    fn run(&self, model: &Model, input: &Tensor, mask: &Tensor) -> Tensor {
        match self {
            Head::Classify { .. } => model.net.forward_t(input, mask, false),
            Head::Embed {
                pooling,
                dims,
                normalize,
            } => {
                let pooled = pooling.pool(&model.net.encode(input, mask), mask);
                let cut = pooled.narrow(1, 0, *dims as i64);
                if *normalize { normalized(&cut) } else { cut }
            }
        }
    }
}

/// How a replica runs its forward passes.
#[derive(Clone, Copy)]
struct Pass {
    device: Device,
    pad_id: i64,
    batch_tokens: usize,
}

impl Engine {
    /// Loads `replicas` copies of the model in `dir` for `head` (a classifier head needs
    /// trained weights; an embedding reads the encoder only) and waits until each is ready,
    /// so a bad model fails before any row is read.
    pub(crate) async fn start(
        dir: &Path,
        config: &ModelConfig,
        head: Head,
        device: Device,
        settings: &PredictSettings,
    ) -> Result<Self> {
        let (tx, rx) = tokio::sync::mpsc::channel::<Job>(QUEUE_WINDOWS);
        let rx: Queue = Arc::new(Mutex::new(rx));
        let replicas = if device.is_cuda() {
            1
        } else {
            settings.replicas
        };
        let threads = (settings.threads / replicas).max(1);
        let pass = Pass {
            device,
            pad_id: config.arch.pad_token_id(),
            batch_tokens: settings.batch_tokens,
        };
        let head = Arc::new(head);
        let running = Running::default();
        let mut ready = Vec::new();
        for i in 0..replicas {
            let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
            let (rx, config, dir, head) =
                (rx.clone(), config.clone(), dir.to_path_buf(), head.clone());
            let precision = settings.precision;
            let guard = running.enter();
            // The thread's own result only matters for loading, which is reported on `ready`.
            drop(thread::spawn(
                &format!("predict-{i}"),
                OOM_HINT,
                move || {
                    let _running = guard;
                    tch::set_num_threads(threads as i32);
                    let loaded =
                        thread::catch(OOM_HINT, || load(config, &dir, &head, device, precision));
                    let model = match loaded {
                        Ok(model) => {
                            let _ = ready_tx.send(Ok(()));
                            model
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return Ok(());
                        }
                    };
                    serve(&model, &rx, pass);
                    Ok(())
                },
            )?);
            ready.push(ready_rx);
        }
        for r in ready {
            r.await
                .map_err(|_| Error::Internal("a model replica vanished while loading".into()))??;
        }
        Ok(Self {
            queue: Mutex::new(Some(tx)),
            running,
            head,
        })
    }

    /// The head's output `[rows, width]`, row-major, of the rows of `ids` (each a list of
    /// token ids): logits, or sentence vectors. Waits for room in the queue; dropping the
    /// future before it resolves withdraws the window.
    pub(crate) async fn run(&self, ids: ListArray) -> Result<Vec<f32>> {
        self.run_head(ids, self.head.clone()).await
    }

    /// As [`Engine::run`], with another head over the same encoder (sentence vectors of a
    /// classifier's encoder, say).
    pub(crate) async fn run_head(&self, ids: ListArray, head: Arc<Head>) -> Result<Vec<f32>> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let tx = self.queue.lock().ok().and_then(|q| q.clone());
        let sent = match tx {
            Some(tx) => tx.send(Job { ids, head, reply }).await.is_ok(),
            None => false,
        };
        if !sent {
            return Err(Error::Internal("the model replicas have stopped".into()));
        }
        answer
            .await
            .map_err(|_| Error::Internal("a model replica stopped mid-window".into()))?
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the queue ends the replicas' loops once their current window is done (or
        // abandoned: nobody is left to wait for it).
        if let Ok(mut q) = self.queue.lock() {
            q.take();
        }
        self.running.wait_idle(STOP_WAIT);
    }
}

/// Loads the model for inference: weights in `precision`, and for a classifier a trained
/// head (an embedding model reads the encoder only).
fn load(
    config: ModelConfig,
    dir: &Path,
    head: &Head,
    device: Device,
    precision: Precision,
) -> Result<Model> {
    let classes = match head {
        Head::Classify { classes } => *classes,
        Head::Embed { .. } => config.labels()?.map_or(2, |l| l.len()),
    };
    let mut model = Model::load(config, dir, classes as i64, device)?;
    if matches!(head, Head::Classify { .. }) && !model.fresh.is_empty() {
        return Err(Error::Model(format!(
            "{}: the weights have no trained classification head for the {classes} labels of \
             config.json's id2label (missing or another size: {}); predict needs a fine-tuned \
             model, such as the `model/` directory a train stage writes",
            dir.display(),
            model.fresh.join(", ")
        )));
    }
    if precision == Precision::Bf16 {
        model.vs.set_kind(Kind::BFloat16);
    }
    model.vs.freeze();
    if precision == Precision::Int8 {
        model.net.quantize_int8();
    } else if device == Device::Cpu {
        model.net.fuse_qkv();
    }
    Ok(model)
}

/// A replica's loop until the queue closes: takes the next window and whatever else is
/// waiting (up to [`MERGE_ROWS`] rows), runs those that want the same head as one, and
/// answers each caller.
fn serve(model: &Model, queue: &Queue, pass: Pass) {
    loop {
        let jobs = match queue.lock() {
            Ok(mut rx) => {
                let Some(first) = rx.blocking_recv() else {
                    return;
                };
                let mut rows = first.ids.len();
                let mut jobs = vec![first];
                while rows < MERGE_ROWS {
                    let Ok(next) = rx.try_recv() else { break };
                    rows += next.ids.len();
                    jobs.push(next);
                }
                jobs
            }
            Err(_) => return,
        };
        // Callers that went away (a cancelled query) need no answer.
        let mut jobs: Vec<Job> = jobs.into_iter().filter(|j| !j.reply.is_closed()).collect();
        while !jobs.is_empty() {
            let head = jobs[0].head.clone();
            let (same, rest): (Vec<Job>, Vec<Job>) =
                jobs.into_iter().partition(|j| Arc::ptr_eq(&j.head, &head));
            jobs = rest;
            run_jobs(model, same, &head, pass);
        }
    }
}

/// Runs windows that want one head as one, and answers each caller.
fn run_jobs(model: &Model, mut jobs: Vec<Job>, head: &Head, pass: Pass) {
    if jobs.len() == 1 {
        let job = jobs.remove(0);
        let gone = || job.reply.is_closed();
        let result = thread::catch(OOM_HINT, || {
            window_outputs(model, &job.ids, head, pass, &gone)
        });
        let _ = job.reply.send(result);
        return;
    }
    let windows: Vec<&dyn Array> = jobs.iter().map(|j| &j.ids as &dyn Array).collect();
    let result = arrow::compute::concat(&windows)
        .map_err(|e| Error::Internal(format!("merging windows: {e}")))
        .and_then(|merged| {
            let ids = merged.as_list::<i32>();
            let gone = || jobs.iter().all(|j| j.reply.is_closed());
            thread::catch(OOM_HINT, || window_outputs(model, ids, head, pass, &gone))
        });
    let mut start = 0;
    for job in jobs {
        let n = job.ids.len() * head.width();
        let answer = match &result {
            Ok(values) => Ok(values[start..start + n].to_vec()),
            Err(e) => Err(Error::Model(e.to_string())),
        };
        start += n;
        let _ = job.reply.send(answer);
    }
}

/// Sorts a window's rows by length (longest first) and runs them in forward passes of at
/// most `batch_tokens` padded tokens; returns the head's output in the window's row order. Stops
/// before a pass once `gone()` says no caller waits for the answer any more.
fn window_outputs(
    model: &Model,
    ids: &ListArray,
    head: &Head,
    pass: Pass,
    gone: &dyn Fn() -> bool,
) -> Result<Vec<f32>> {
    let width = head.width();
    let _no_grad = tch::no_grad_guard();
    let offsets = ids.value_offsets();
    let values = ids.values().as_primitive::<Int32Type>().values();
    let len = |r: usize| (offsets[r + 1] - offsets[r]) as usize;
    let rows = ids.len();
    let mut order: Vec<usize> = (0..rows).collect();
    order.sort_by_key(|&r| std::cmp::Reverse(len(r)));
    let mut out = vec![0f32; rows * width];
    let mut start = 0;
    while start < rows {
        if gone() {
            return Err(Error::Internal(
                "window abandoned: its callers went away".into(),
            ));
        }
        let longest = len(order[start]).max(1);
        let take = (pass.batch_tokens / longest).clamp(1, rows - start);
        let chunk = &order[start..start + take];
        let mut input = vec![pass.pad_id; take * longest];
        let mut mask = vec![0i64; take * longest];
        for (i, &r) in chunk.iter().enumerate() {
            let row = &values[offsets[r] as usize..offsets[r + 1] as usize];
            for (j, &t) in row.iter().enumerate() {
                input[i * longest + j] = i64::from(t);
                mask[i * longest + j] = 1;
            }
        }
        let shape = [take as i64, longest as i64];
        let output = head
            .run(
                model,
                &Tensor::from_slice(&input)
                    .view(shape)
                    .to_device(pass.device),
                &Tensor::from_slice(&mask).view(shape).to_device(pass.device),
            )
            .to_device(Device::Cpu)
            .contiguous();
        let flat = Vec::<f32>::try_from(output.view([-1]))
            .map_err(|e| Error::Model(format!("reading the model's output back: {e}")))?;
        for (i, &r) in chunk.iter().enumerate() {
            out[r * width..(r + 1) * width].copy_from_slice(&flat[i * width..(i + 1) * width]);
        }
        start += take;
    }
    Ok(out)
}
